"""Kubernetes discovery (``router.discovery.kubernetes.PodWatch``) against the fake API server over real
HTTP on 127.0.0.1, through a kubeconfig file: list then watch with resourceVersion, label selectors,
Ready/NotReady/terminating/deleted pods, bookmarks, 410 Gone (as an event and as a status), errors with
backoff, and the API going away and coming back (the set found before is kept meanwhile)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import ssl
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio.config import incluster_config

from router.config.schema import KubernetesDiscoveryConfig
from router.discovery.backoff import Backoff
from router.discovery.kubernetes import Pod, PodWatch, api_client, backend_url
from router.discovery.metrics import DiscoveryMetrics
from bench.fake_kube import TOKEN, FakeKubeAPI, pod
from tests.support import eventually

logger = logging.getLogger(__name__)

A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"
#: a generous bound for convergence in these unit tests (the measured figure is bench/discovery.py's)
BOUND_S = 10.0


@dataclass
class Watched:
    """A running PodWatch and every set it reported, with the time of each report."""

    watch: PodWatch
    metrics: DiscoveryMetrics
    reports: list[tuple[float, frozenset[str]]] = field(default_factory=list)

    @property
    def current(self) -> frozenset[str] | None:
        return self.reports[-1][1] if self.reports else None

    async def converge(self, expected: set[str], what: str) -> float:
        """Wait (bounded) until the reported set is ``expected``; returns the seconds it took."""
        start = time.monotonic()
        await eventually(lambda: self.current == frozenset(expected), timeout=BOUND_S, what=what)
        took = time.monotonic() - start
        logger.info("kubernetes discovery converged (%s) in %.1f ms", what, took * 1000)
        return took

    def errors(self, reason: str | None = None) -> int:
        return sum(n for (_, _, r), n in self.metrics.errors.items() if reason is None or r == reason)


@pytest.fixture
async def fake() -> AsyncIterator[FakeKubeAPI]:
    api = FakeKubeAPI()
    await api.start()
    try:
        yield api
    finally:
        await api.stop()


@contextlib.asynccontextmanager
async def watching(kubeconfig: str, *, selector: str = "app=vllm", port_name: str = "http",
                   watch_timeout_s: tuple[int, int] = (300, 300)) -> AsyncIterator[Watched]:
    settings = KubernetesDiscoveryConfig(namespace="inference", label_selector=selector, port_name=port_name)
    clients: list[k8s_client.ApiClient] = []

    async def client() -> k8s_client.ApiClient:
        clients.append(await api_client(kubeconfig))
        return clients[-1]

    metrics = DiscoveryMetrics()
    watched: Watched
    reports: list[tuple[float, frozenset[str]]] = []
    watch = PodWatch("default", settings, client, lambda urls: reports.append((time.monotonic(), urls)), metrics,
                     Backoff(0.02, 0.2), watch_timeout_s=watch_timeout_s)
    watched = Watched(watch, metrics, reports)
    task = asyncio.create_task(watch.run())
    try:
        yield watched
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for made in clients:
            await made.close()


async def test_lists_only_ready_matching_pods_then_follows_readiness(fake: FakeKubeAPI, tmp_path: Path) -> None:
    await fake.put(pod("a", "10.0.0.1"))
    await fake.put(pod("b", "10.0.0.2", ready=False))
    await fake.put(pod("other-app", "10.0.0.9", labels={"app": "web"}))
    await fake.put(pod("going", "10.0.0.8", deleting=True))
    await fake.put(pod("other-ns", "10.0.0.7", namespace="elsewhere"))
    await fake.put(pod("no-port", "10.0.0.6", port_name="grpc"))
    async with watching(fake.kubeconfig(str(tmp_path))) as w:
        await w.converge({A}, "the first list")
        listed = fake.requests[0]
        assert not listed.watch and listed.selector == "app=vllm"
        await eventually(lambda: fake.open_watches == 1, timeout=BOUND_S, what="the watch")
        assert fake.watches()[0].resource_version == str(fake.rv)  # from the list's version
        await fake.put(pod("b", "10.0.0.2"))
        await w.converge({A, B}, "b Ready")
        await fake.put(pod("a", "10.0.0.1", ready=False))
        await w.converge({B}, "a NotReady")
        await fake.put(pod("b", "10.0.0.2", deleting=True))
        await w.converge(set(), "b terminating")
        await fake.put(pod("c", "10.0.0.3"))
        await fake.delete("b")
        await w.converge({C}, "c added, b deleted")
        await fake.put(pod("c", "10.0.0.3", labels={"app": "vllm-old"}))
        await w.converge(set(), "c relabelled out of the selector")
        assert fake.lists() == 1 and len(fake.watches()) == 1  # one list, one watch: nothing re-listed
        assert w.errors() == 0
        assert w.metrics.backends[("default", "kubernetes")] == 0
        assert w.metrics.last_sync[("default", "kubernetes")] > 0


async def test_selector_requirements_reach_the_api(fake: FakeKubeAPI, tmp_path: Path) -> None:
    await fake.put(pod("a", "10.0.0.1", labels={"app": "vllm", "role": "decode"}))
    await fake.put(pod("b", "10.0.0.2", labels={"app": "vllm", "role": "prefill"}))
    await fake.put(pod("c", "10.0.0.3", labels={"app": "vllm", "role": "decode", "canary": "1"}))
    async with watching(fake.kubeconfig(str(tmp_path)), selector="app=vllm,role!=prefill,!canary") as w:
        await w.converge({A}, "the selector's pods")


async def test_the_named_port_makes_the_url_and_ipv6_is_bracketed() -> None:
    assert backend_url(_pod(pod("a", "10.0.0.1", port=8123)), "http") == "http://10.0.0.1:8123"
    assert backend_url(_pod(pod("a", "fd00::5", port=8000)), "http") == "http://[fd00::5]:8000"
    assert backend_url(_pod(pod("a", "10.0.0.1")), "metrics") == "http://10.0.0.1:9000"
    assert backend_url(_pod(pod("a", "10.0.0.1")), "grpc") is None
    assert backend_url(_pod(pod("a", "")), "http") is None  # no IP yet
    assert backend_url(_pod(pod("a", "10.0.0.1", ready=False)), "http") is None
    assert backend_url(_pod(pod("a", "10.0.0.1", deleting=True)), "http") is None


def _pod(body: dict[str, object]) -> Pod:
    import msgspec

    return msgspec.convert(body, Pod)


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_lists_again(tmp_path: Path, gone_as_http: bool) -> None:
    fake = FakeKubeAPI(gone_as_http=gone_as_http)
    await fake.start()
    try:
        await fake.put(pod("a", "10.0.0.1"))
        # watches end after 1 s, as the API server ends them at their timeout; then they resume
        async with watching(fake.kubeconfig(str(tmp_path)), watch_timeout_s=(1, 1)) as w:
            await w.converge({A}, "the first list")
            await eventually(lambda: fake.open_watches == 1, timeout=BOUND_S, what="the watch")
            await fake.put(pod("b", "10.0.0.2"))  # seen by the open watch ...
            await w.converge({A, B}, "b Ready")
            await fake.advance(10)
            fake.compact()  # ... whose version is history now: its resumption gets 410
            await eventually(lambda: fake.lists() == 2, timeout=BOUND_S, what="a list after 410 Gone")
            await w.converge({A, B}, "the re-list")
            assert w.errors("gone") >= 1
            gone = [r for r in fake.requests if r.status == 410]
            assert gone or not gone_as_http
            await fake.put(pod("a", "10.0.0.1", ready=False))
            await w.converge({B}, "a NotReady after the resync")
    finally:
        await fake.stop()


async def test_bookmarks_move_the_version_the_watch_resumes_from(fake: FakeKubeAPI, tmp_path: Path) -> None:
    await fake.put(pod("a", "10.0.0.1"))
    async with watching(fake.kubeconfig(str(tmp_path)), watch_timeout_s=(1, 1)) as w:
        await w.converge({A}, "the first list")
        await eventually(lambda: fake.open_watches == 1, timeout=BOUND_S, what="the watch")
        reports = len(w.reports)
        version = await fake.advance(500)  # other objects changed: nothing for this selector
        await fake.bookmark()
        await eventually(lambda: w.watch.resource_version == str(version), timeout=BOUND_S, what="the bookmark")
        assert len(w.reports) == reports  # a bookmark changes no backend
        await eventually(lambda: any(r.resource_version == str(version) for r in fake.watches()),
                         timeout=BOUND_S, what="a watch resumed from the bookmark's version")
        assert fake.lists() == 1
        assert all(r.selector == "app=vllm" for r in fake.requests)


async def test_api_going_away_keeps_the_backends_and_recovers(fake: FakeKubeAPI, tmp_path: Path) -> None:
    await fake.put(pod("a", "10.0.0.1"))
    await fake.put(pod("b", "10.0.0.2"))
    async with watching(fake.kubeconfig(str(tmp_path))) as w:
        await w.converge({A, B}, "the first list")
        await eventually(lambda: fake.open_watches == 1, timeout=BOUND_S, what="the watch")
        await fake.stop()
        await eventually(lambda: w.errors("connect") >= 3, timeout=BOUND_S, what="failed reconnections")
        assert w.current == frozenset({A, B})  # nothing dropped while the API is away
        assert w.watch.backoff.failures >= 3
        # while it is away, a pod turns NotReady and another one joins; the API comes back with a new
        # history (like a restored etcd): the old version is gone, so the watcher lists again
        await fake.put(pod("a", "10.0.0.1", ready=False))
        await fake.put(pod("c", "10.0.0.3"))
        await fake.start(forget=True)
        await w.converge({B, C}, "the API back")
        assert w.watch.backoff.failures == 0


async def test_server_errors_are_retried_with_backoff_keeping_the_set(fake: FakeKubeAPI, tmp_path: Path) -> None:
    await fake.put(pod("a", "10.0.0.1"))
    async with watching(fake.kubeconfig(str(tmp_path)), watch_timeout_s=(1, 1)) as w:
        await w.converge({A}, "the first list")
        fake.fail_with = 500
        await eventually(lambda: w.errors("status_5xx") >= 3, timeout=BOUND_S, what="5xx answers")
        assert w.current == frozenset({A})
        started = [r for r in fake.requests if r.status == 500]
        assert len(started) >= 3
        fake.fail_with = None
        await fake.put(pod("b", "10.0.0.2"))
        await w.converge({A, B}, "the API answering again")


async def test_a_wrong_token_is_an_error_that_names_the_rbac_need(fake: FakeKubeAPI, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    await fake.put(pod("a", "10.0.0.1"))
    caplog.set_level(logging.WARNING, "router.discovery.kubernetes")
    async with watching(fake.kubeconfig(str(tmp_path), token="wrong")) as w:
        await eventually(lambda: w.errors("status_4xx") >= 1, timeout=BOUND_S, what="a 401")
        assert w.current is None
    assert "get, list and watch on pods" in caplog.text


async def test_in_cluster_credentials_are_the_service_account_token_and_ca(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod's service account: its token and CA files, the API at KUBERNETES_SERVICE_HOST/PORT over
    TLS (a certificate made for 127.0.0.1 here, which the client verifies against that CA)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make the fake API's certificate")
    key, cert, token = tmp_path / "key.pem", tmp_path / "ca.crt", tmp_path / "token"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=kubernetes",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    token.write_text(TOKEN)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert), str(key))
    fake = FakeKubeAPI(ssl_context=context)
    await fake.start()
    try:
        await fake.put(pod("a", "10.0.0.1"))
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(fake.port))
        monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
        monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(cert))
        async with watching("") as w:  # "" = in-cluster
            await w.converge({A}, "in-cluster list")
            await fake.put(pod("b", "10.0.0.2"))
            await w.converge({A, B}, "in-cluster watch")
        assert all(r.status == 200 for r in fake.requests)
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
        with pytest.raises(Exception, match="Service host/port is not set"):
            await api_client("")
    finally:
        await fake.stop()


async def test_a_list_whose_version_is_gone_at_once_backs_off(fake: FakeKubeAPI, tmp_path: Path) -> None:
    """An API that answers 410 to every watch (a version expired as soon as listed) is not hammered
    with lists: after the first resync, each next one waits a backoff; the set listed stays."""
    await fake.put(pod("a", "10.0.0.1"))
    fake.oldest = 10**9  # every version is "too old"
    async with watching(fake.kubeconfig(str(tmp_path))) as w:
        await w.converge({A}, "the first list")
        await eventually(lambda: w.watch.backoff.failures >= 3, timeout=BOUND_S, what="backoff after 410s")
        assert w.errors("gone") >= 3
        lists, started = fake.lists(), time.monotonic()
        await asyncio.sleep(0.3)
        assert fake.lists() - lists <= 0.3 / 0.01 / 2  # spaced by the backoff, not a busy loop
        assert w.current == frozenset({A})
        fake.oldest = 0
        await fake.put(pod("b", "10.0.0.2"))
        await w.converge({A, B}, "watching again")
        assert time.monotonic() - started < BOUND_S

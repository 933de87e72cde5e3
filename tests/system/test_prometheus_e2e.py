"""A real Prometheus server scrapes the real topology (2 backends + the router, as processes on
127.0.0.1 ephemeral ports) while multi-turn traffic runs, and its HTTP query API shows the
router's per-session series and the backends' prefix-cache hits with the expected values.

Needs the ``prometheus`` binary (Debian's package; ``.ci/run`` installs it). Without it the test
is skipped locally and FAILS under CI (``CI`` set), so a broken install cannot pass silently.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.traffic import TrafficConfig, run
from contract.ids import session_hash
from tests.support import LOOPBACK, Proc, free_port, http_status, start_backend, start_router, wait_until
from tests.system.test_compose_stack import DASHBOARDS, concrete, dashboard_queries
from tests.router.test_metrics_sessions import parse_exposition

pytestmark = [pytest.mark.slow, pytest.mark.prometheus]

SESSIONS = 3
TURNS = 4
PREFIX = "prom"


@pytest.fixture
def prometheus_binary() -> str:
    """Checked before the topology starts, so a missing binary costs nothing."""
    path = shutil.which("prometheus")
    if path is None:
        message = ("the prometheus binary is not on PATH; install Debian's package "
                   "(`apt-get install prometheus`, as .ci/run does) to run the real-Prometheus test")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


class Prometheus:
    """A Prometheus server on a loopback port with its own config and storage; stopped by PID."""

    def __init__(self, binary: str, workdir: Path, jobs: dict[str, list[str]]) -> None:
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                               for job, targets in jobs.items()],
        }
        config_path = workdir / "prometheus.yml"
        config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [binary, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address={LOOPBACK}:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
            )

    def wait_ready(self) -> None:
        try:
            wait_until(lambda: self.popen.poll() is not None or http_status(self.url + "/-/ready") == 200,
                       timeout=30, what="prometheus /-/ready")
        except AssertionError:
            raise AssertionError(f"prometheus did not get ready:\n{self.log()}") from None
        assert self.popen.poll() is None, f"prometheus exited with {self.popen.returncode}:\n{self.log()}"

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as resp:
            payload = json.load(resp)
        assert payload["status"] == "success", payload
        return list(payload["data"]["result"])

    def values(self, promql: str, key: str) -> dict[str, float]:
        """Instant vector -> {label ``key``: value}."""
        return {r["metric"].get(key, ""): float(r["value"][1]) for r in self.query(promql)}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[tuple[list[Proc], Proc]]:
    procs: list[Proc] = []
    try:
        backends = [start_backend(str(tmp_path)) for _ in range(2)]
        procs += backends
        router = start_router(str(tmp_path), *[arg for b in backends for arg in ("--backend", b.url)])
        procs.append(router)
        yield backends, router
    finally:
        for proc in reversed(procs):
            proc.stop()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


def scrape_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return resp.read().decode()


def target(proc: Proc) -> str:
    return f"{LOOPBACK}:{proc.port}"


def test_prometheus_scrapes_session_series_and_prefix_cache_hits(
        prometheus_binary: str, topology: tuple[list[Proc], Proc], tmp_path: Path) -> None:
    backends, router = topology
    prom = Prometheus(prometheus_binary, tmp_path, {"router": [target(router)], "backends": [target(b) for b in backends]})
    try:
        prom.wait_ready()
        stats = asyncio.run(run(TrafficConfig(
            router=router.url, sessions=SESSIONS, turns=TURNS, conversations=1, think_s=0.0,
            header_share=1.0, stream_share=0.5, session_prefix=PREFIX, report_s=0)))
        assert stats.failed == 0, stats.last_error
        assert stats.ok == SESSIONS * TURNS
        sessions = [f"{PREFIX}-{i}-0" for i in range(SESSIONS)]
        assert sorted(stats.session_turns) == sessions

        # the truth, read from the processes themselves after the traffic stopped
        truth = {sid: get_json(f"{router.url}/v1/sessions/{sid}") for sid in sessions}
        for sid, view in truth.items():
            assert view["requests"] == TURNS
            assert view["cached_tokens"] > 0, f"{sid}: multi-turn chat should hit the prefix cache: {view}"
        label = {sid: view["session_hash"] for sid, view in truth.items()}
        assert label == {sid: session_hash(sid) for sid in sessions}
        hits_truth: dict[str, float] = {}
        for b in backends:
            exp = parse_exposition(scrape_text(b.url))
            hits_truth[target(b)] = sum(v for _, v in exp.values("vllm:prefix_cache_hits_total"))
        assert sum(hits_truth.values()) > 0

        def scraped() -> bool:
            requests = prom.values('session_router_session_requests_total{job="router"}', "session")
            cached = prom.values('session_router_session_tokens_total{job="router",kind="cached"}', "session")
            prompt = prom.values('session_router_session_tokens_total{job="router",kind="prompt"}', "session")
            hits = prom.values('sum by (instance) (vllm:prefix_cache_hits_total{job="backends"})', "instance")
            # the router labels its series with the id's hash (session_label = "hash", the default)
            return (all(requests.get(label[sid]) == TURNS for sid in sessions)
                    and all(cached.get(label[sid]) == truth[sid]["cached_tokens"] for sid in sessions)
                    and all(prompt.get(label[sid]) == truth[sid]["prompt_tokens"] for sid in sessions)
                    and hits == hits_truth)

        try:
            wait_until(scraped, timeout=30, interval=0.25, what="Prometheus to scrape the final values")
        except AssertionError:
            raise AssertionError(
                "Prometheus never showed the expected values.\n"
                f"router sessions: {truth}\nbackend hits: {hits_truth}\n"
                f"prometheus requests: {prom.query('session_router_session_requests_total')}\n"
                f"prometheus hits: {prom.query('vllm:prefix_cache_hits_total')}\n"
                f"targets: {get_json(prom.url + '/api/v1/targets')['data']['activeTargets']}\n"
                f"log:\n{prom.log()}") from None

        up = prom.values("up", "instance")
        assert up == {target(router): 1.0, **{target(b): 1.0 for b in backends}}
        ratio = prom.query('sum(vllm:prefix_cache_hits_total{job="backends"}) '
                           '/ sum(vllm:prefix_cache_queries_total{job="backends"})')
        assert 0 < float(ratio[0]["value"][1]) < 1
        # the backends' own per-session counters agree with the router's view of each session
        backend_cached = prom.values(
            'sum by (session) (session_backend_session_cached_tokens_total{job="backends"})', "session")
        for sid in sessions:
            assert backend_cached.get(sid) == truth[sid]["cached_tokens"], (sid, backend_cached)
        # a session's last backend is exported as an info-style series with the backend's URL
        info = prom.query('session_router_session_backend_info{job="router"}')
        by_session = {r["metric"]["session"]: r["metric"]["backend"] for r in info}
        for sid in sessions:
            assert by_session[label[sid]] == truth[sid]["last_backend"]
        check_dashboard_queries(prom)
    finally:
        prom.stop()


#: dashboard panels that must show data once multi-turn traffic went through the router
MUST_SHOW_DATA = ("Requests/s by backend and status class", "Request latency by backend (p50 / p99, engine end-to-end)",
                  "Placement outcomes/s", "Prefix-cache hit ratio by backend",
                  "Top sessions (the K most recently active)")


def check_dashboard_queries(prom: Prometheus) -> None:
    """Every query of the Grafana dashboard runs on a real Prometheus; the main panels have data."""
    dashboard = json.loads((DASHBOARDS / "session-router.json").read_text())
    queries = dashboard_queries(dashboard)
    titles = {title for title, _ in queries}
    assert set(MUST_SHOW_DATA) <= titles
    for title, expr in queries:
        try:
            prom.query(concrete(expr))
        except urllib.error.HTTPError as exc:  # 400 = the expression does not parse
            raise AssertionError(f"panel {title!r}: {exc.read().decode(errors='replace')}\n{expr}") from None

    def panels_have_data() -> bool:  # rate() needs two scrapes after the traffic
        return all(prom.query(concrete(expr)) for title, expr in queries if title in MUST_SHOW_DATA)

    wait_until(panels_have_data, timeout=20, interval=0.25, what="the dashboard's main panels to show data")

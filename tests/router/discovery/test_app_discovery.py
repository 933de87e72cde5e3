"""Discovery in the router app: configured by the command line's flags, started and stopped by the app's
lifecycle, filling the pool that requests are placed on, and exported on ``/metrics``; against the fake
Kubernetes API and DNS server and backends served over real HTTP on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from contract.errors import ConfigError
from router.app import DISCOVERY, create_app
from router.config import build_config
from router.state import ROUTER_STATE
from tests.fakes import EchoBackend
from tests.router.discovery.fake_dns import FakeDNS
from bench.fake_kube import FakeKubeAPI, pod
from tests.support import eventually, metric_sum

BOUND_S = 10.0
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def backends(aiohttp_server: Any, *names: str) -> list[tuple[EchoBackend, int]]:
    served = []
    for name in names:
        fake = EchoBackend(name)
        server = await aiohttp_server(fake.app(), host="127.0.0.1")
        served.append((fake, server.port))
    return served


async def test_kubernetes_discovery_fills_the_pool_requests_use(tmp_path: Path, aiohttp_server: Any,
                                                                aiohttp_client: Any) -> None:
    (a, a_port), (b, b_port) = await backends(aiohttp_server, "a", "b")
    fake = FakeKubeAPI()
    await fake.start()
    try:
        await fake.put(pod("a", "127.0.0.1", port=a_port))
        await fake.put(pod("b", "127.0.0.1", port=b_port, ready=False))
        config = build_config(["--discovery", "kubernetes", "--kubernetes-selector", "app=vllm",
                               "--kubernetes-port-name", "http", "--kubernetes-namespace", "inference",
                               "--kubeconfig", fake.kubeconfig(str(tmp_path)), "--policy", "round_robin"])
        assert config.backends == []
        app = create_app(config, registry=CollectorRegistry())
        state = app[ROUTER_STATE]
        pool = state.pools["default"]
        client = await aiohttp_client(app)
        a_url, b_url = f"http://127.0.0.1:{a_port}", f"http://127.0.0.1:{b_port}"
        await eventually(lambda: [m.url for m in pool.members] == [a_url], timeout=BOUND_S, what="pod a")
        for _ in range(4):
            assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
        assert len(a.seen) == 4 and not b.seen
        await fake.put(pod("b", "127.0.0.1", port=b_port))  # b turns Ready
        await eventually(lambda: pool.get(b_url) is not None, timeout=BOUND_S, what="pod b")
        for _ in range(4):
            assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
        assert b.seen
        metrics = await (await client.get("/metrics")).text()
        assert metric_sum(metrics, "session_router_discovery_backends", pool="default", source="kubernetes") == 2
        assert metric_sum(metrics, "session_router_discovery_changes_total", pool="default", change="added") == 2
        assert metric_sum(metrics, "session_router_discovery_last_sync_timestamp_seconds", pool="default") > 0
        await fake.stop()  # the API goes away: the router keeps its backends
        await eventually(lambda: sum(app[DISCOVERY].metrics.errors.values()) >= 1, timeout=BOUND_S,
                         what="a discovery error")
        assert {m.url for m in pool.members} == {a_url, b_url}
        assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert metric_sum(metrics, "session_router_discovery_errors_total", pool="default", source="kubernetes") >= 1
    finally:
        await fake.stop()


async def test_dns_discovery_fills_a_pd_pool(tmp_path: Path, aiohttp_server: Any, aiohttp_client: Any) -> None:
    (_, prefill_port), (decode, decode_port) = await backends(aiohttp_server, "p", "d")
    server = FakeDNS()
    await server.start()
    try:
        server.set("prefill.test", "A", "127.0.0.1")
        server.set("_http._tcp.decode.test", "SRV", f"0 0 {decode_port} d.test.")
        server.set("d.test", "A", "127.0.0.1")
        path = tmp_path / "router.toml"  # the servers and interval in the file, the rest as flags
        path.write_text("".join(f'[discovery.{pool}.dns]\nnameservers = ["{server.nameserver}"]\ninterval_s = 0.1\n'
                                for pool in ("prefill", "decode")))
        config = build_config(["--config", str(path), "--discovery", "prefill:dns", "--dns-name", "prefill:prefill.test",
                               "--dns-port", f"prefill:{prefill_port}", "--discovery", "decode:dns",
                               "--dns-name", "decode:_http._tcp.decode.test"])
        assert config.pd_mode and not (config.prefill or config.decode)
        app = create_app(config, registry=CollectorRegistry())
        pools = app[ROUTER_STATE].pools
        client = await aiohttp_client(app)
        await eventually(lambda: len(pools["prefill"]) == 1 and len(pools["decode"]) == 1, timeout=BOUND_S,
                         what="both pools")
        assert pools["prefill"].members[0].url == f"http://127.0.0.1:{prefill_port}"
        assert pools["decode"].members[0].url == f"http://127.0.0.1:{decode_port}"
        assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
        assert decode.seen
    finally:
        server.stop()


@pytest.mark.parametrize(("argv", "message"), [
    (["--discovery", "kubernetes"], "label selector"),
    (["--discovery", "kubernetes", "--kubernetes-selector", "app=vllm"], "port_name"),
    (["--discovery", "kubernetes", "--kubernetes-selector", "app vllm", "--kubernetes-port-name", "http"],
     "is not a label selector requirement"),
    (["--kubernetes-selector", "app=vllm", "--backend", "http://127.0.0.1:8100"], "--discovery default:kubernetes"),
    (["--discovery", "dns"], "--dns-name"),
    (["--discovery", "backends:dns"], "names pool 'backends'"),
    (["--discovery", "decode:dns", "--dns-name", "decode:d.test", "--backend", "http://127.0.0.1:8100"],
     "P/D mode"),
    (["--discovery", "prefill:dns", "--dns-name", "prefill:p.test"], "decode"),
    (["--discovery", "render:dns", "--dns-name", "render:r.test", "--backend", "http://127.0.0.1:8100"],
     "tokens mode"),
    (["--discovery", "dns", "--dns-name", "x.test", "--dns-port", "http"], "the port must be a number"),
    (["--discovery", "kubernetes", "--kubernetes-selector", "a=b", "--kubernetes-port-name", "http",
      "--kubeconfig", "/nonexistent/kubeconfig"], "is not a file"),
])
def test_discovery_flags_are_checked(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(argv)
    assert message in info.value.message


def test_discovery_config_file(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text('[discovery.decode]\nsource = "dns"\n[discovery.decode.dns]\nname = "d.test"\nport = 8000\n'
                    '[discovery.prefill]\nsource = "kubernetes"\n[discovery.prefill.kubernetes]\n'
                    'label_selector = "role in (prefill, both)"\nport_name = "http"\n')
    config = build_config(["--config", str(path)])
    assert config.pd_mode and set(config.discovery.pools()) == {"prefill", "decode"}
    path.write_text('[discovery.decode.dns]\nnam = "d.test"\n')
    with pytest.raises(ConfigError, match=r"discovery.decode.dns: unknown key 'nam' \(did you mean 'name'\?\)"):
        build_config(["--config", str(path)])
    path.write_text('[discovery.decode]\nsource = "dns"\n[discovery.decode.dns]\nname = "d.test"\ninterval_s = 0\n')
    with pytest.raises(ConfigError, match="discovery.decode.dns.interval_s: must be a positive number of seconds"):
        build_config(["--config", str(path)])


async def test_render_servers_discovered_in_tokens_mode(tmp_path: Path, aiohttp_server: Any,
                                                        aiohttp_client: Any) -> None:
    """The ``render`` role: tokens mode's render pool, filled from DNS, is the one the remote renderer uses."""
    from router.app import TOKENS
    from router.tokens.render_client import POOL_RENDER, RemoteRenderer

    (_, render_port), = await backends(aiohttp_server, "r")
    server = FakeDNS()
    await server.start()
    try:
        server.set("render.test", "A", "127.0.0.1")
        path = tmp_path / "router.toml"
        path.write_text(f'[discovery.render.dns]\nnameservers = ["{server.nameserver}"]\ninterval_s = 0.1\n')
        model = str(Path(__file__).resolve().parents[3] / "models" / "tiny-llama")
        config = build_config(["--config", str(path), "--upstream-api", "tokens", "--model-dir", model,
                               "--backend", "http://127.0.0.9:1", "--discovery", "render:dns",
                               "--dns-name", "render:render.test", "--dns-port", f"render:{render_port}"])
        app = create_app(config, registry=CollectorRegistry())
        render_pool = app[ROUTER_STATE].pools[POOL_RENDER]
        renderer = app[TOKENS].renderer
        assert isinstance(renderer, RemoteRenderer) and renderer.pool is render_pool
        assert len(render_pool) == 0
        await aiohttp_client(app)
        await eventually(lambda: [b.url for b in render_pool.members] == [f"http://127.0.0.1:{render_port}"],
                         timeout=BOUND_S, what="the render server")
    finally:
        server.stop()

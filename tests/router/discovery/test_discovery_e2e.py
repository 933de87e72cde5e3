"""End to end: a real router process with Kubernetes discovery against the fake API server (in this test's
event loop, over real HTTP), two real backend processes as the pods; the pods flip NotReady -> Ready in
turn while a client sends requests without pause: no request fails, and both backends serve."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

import aiohttp
import pytest

from bench.fake_kube import FakeKubeAPI, pod
from tests.support import Proc, eventually, kill_alive, metric_sum, start_backend, start_router

logger = logging.getLogger(__name__)

BOUND_S = 20.0
CYCLES = 2


async def _metrics(http: aiohttp.ClientSession, router: Proc) -> str:
    async with http.get(router.url + "/metrics") as resp:
        return await resp.text()


async def _changes(http: aiohttp.ClientSession, router: Proc, change: str) -> float:
    return metric_sum(await _metrics(http, router), "session_router_discovery_changes_total", change=change)


@pytest.mark.slow
async def test_pods_flipping_ready_while_requests_flow_fail_no_request(tmp_path: Path) -> None:
    fake = FakeKubeAPI()
    await fake.start()
    procs: list[Proc] = []
    try:
        # speed 1: each answer takes a while, so a pod that turns NotReady has requests in flight to finish
        backends = [await asyncio.to_thread(start_backend, str(tmp_path), speed="1") for _ in range(2)]
        procs += backends
        names = [f"vllm-{i}" for i in range(len(backends))]
        for name, backend in zip(names, backends):
            await fake.put(pod(name, "127.0.0.1", port=backend.port))
        router = await asyncio.to_thread(
            start_router, str(tmp_path), "--discovery", "kubernetes", "--kubernetes-selector", "app=vllm",
            "--kubernetes-port-name", "http", "--kubernetes-namespace", "inference",
            "--kubeconfig", fake.kubeconfig(str(tmp_path)), "--log-level", "info")
        procs.append(router)
        async with aiohttp.ClientSession() as http:
            async def added() -> bool:
                return await _changes(http, router, "added") >= 2

            await eventually(added, timeout=BOUND_S, what="both pods discovered", interval=0.05)
            statuses: list[int] = []
            stop = asyncio.Event()

            async def client(worker: int) -> None:
                session = f"e2e-{worker}-{uuid.uuid4().hex[:8]}"
                turn = 0
                while not stop.is_set():
                    turn += 1
                    body = {"model": "session-sim", "max_tokens": 16,
                            "messages": [{"role": "user", "content": f"turn {turn} of {session}"}]}
                    async with http.post(router.url + "/v1/chat/completions", json=body,
                                         headers={"X-Session-ID": session}) as resp:
                        await resp.read()
                        statuses.append(resp.status)

            clients = [asyncio.create_task(client(i)) for i in range(4)]
            try:
                for cycle in range(CYCLES):
                    for name, backend in zip(names, backends):
                        removed = await _changes(http, router, "removed")
                        flipped = time.monotonic()
                        await fake.put(pod(name, "127.0.0.1", port=backend.port, ready=False))

                        async def left(before: float = removed) -> bool:
                            return await _changes(http, router, "removed") > before

                        await eventually(left, timeout=BOUND_S, what=f"{name} NotReady: removed", interval=0.02)
                        logger.info("cycle %d: %s NotReady -> out of the pool (drained) in %.0f ms", cycle, name,
                                    (time.monotonic() - flipped) * 1000)
                        served = len(statuses)
                        await eventually(lambda n=served: len(statuses) >= n + 8, timeout=BOUND_S,
                                         what="requests while one pod is out")
                        adds = await _changes(http, router, "added")
                        flipped = time.monotonic()
                        await fake.put(pod(name, "127.0.0.1", port=backend.port))

                        async def back(before: float = adds) -> bool:
                            return await _changes(http, router, "added") > before

                        await eventually(back, timeout=BOUND_S, what=f"{name} Ready: added", interval=0.02)
                        logger.info("cycle %d: %s Ready -> in the pool in %.0f ms", cycle, name,
                                    (time.monotonic() - flipped) * 1000)
                        served = len(statuses)
                        await eventually(lambda n=served: len(statuses) >= n + 8, timeout=BOUND_S,
                                         what="requests with both pods in")
            finally:
                stop.set()
                await asyncio.gather(*clients, return_exceptions=True)
            for task in clients:
                assert task.exception() is None, task.exception()
            failed = [s for s in statuses if s != 200]
            assert not failed, f"{len(failed)} of {len(statuses)} requests failed: {sorted(set(failed))}"
            metrics = await _metrics(http, router)
            for backend in backends:
                assert metric_sum(metrics, "session_router_requests_total", backend=backend.url) > 0
            assert metric_sum(metrics, "session_router_discovery_changes_total", change="removed") == 2 * CYCLES
            assert metric_sum(metrics, "session_router_discovery_backends", source="kubernetes") == 2
            logger.info("%d requests, none failed, across %d NotReady -> Ready flips", len(statuses), 2 * CYCLES)
    finally:
        for proc in procs:
            proc.stop()
        kill_alive(*procs)
        await fake.stop()

"""Router replicas agree on a session through the KV index, without shared state: two router
processes in front of the same two real backends publishing KV events (``--kv-events-config``,
engine-bound ipc:// endpoints, found through ``GET /kv_event_sources``). A session's first turn
goes through router A (or straight to an engine, as a restarted router would find it); its next
turn through router B, which has never seen it, lands where its KV is, with reason ``cached``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.membership import Backend, BackendPool
from router.placement import SessionPolicy, make_policy
from tests.support import Proc, eventually, kill_alive, metric_sum, start_backend, start_router

QUESTION = "Tell me about the weather in the mountains in spring and in autumn, please, in detail. " * 4


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    kill_alive(*started)


def events_flag(tmp_path: Path, name: str) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/{name}.sock",
                       "replay_endpoint": f"ipc://{tmp_path}/{name}-replay.sock", "topic": "kv@test"})


def body(history: list[str]) -> dict[str, Any]:
    return {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
                         for i, text in enumerate(history)], "max_tokens": 8, "ignore_eos": True}


async def turn(http: aiohttp.ClientSession, url: str, sid: str, history: list[str]) -> str:
    """One chat turn at ``url`` (a router or an engine); appends the answer and a next question."""
    async with http.post(url + "/v1/chat/completions", json=body(history), headers={"X-Session-ID": sid}) as answer:
        assert answer.status == 200, await answer.text()
        decision = answer.headers.get("X-Session-Router-Decision", "")
        history += [(await answer.json())["choices"][0]["message"]["content"], "And what about winter?"]
    return decision


async def events_seen(http: aiohttp.ClientSession, router: Proc, backend_url: str) -> float:
    async with http.get(router.url + "/metrics") as answer:
        return metric_sum(await answer.text(), "session_router_kv_events_total", backend=backend_url)


async def pin_of(http: aiohttp.ClientSession, router: Proc, sid: str) -> str:
    async with http.get(f"{router.url}/v1/sessions/{sid}") as answer:
        assert answer.status == 200, await answer.text()
        pin: str = (await answer.json())["pins"]["default"]
    return pin


#: the routers' ``[kv_events] idle_read_interval_s`` here: with no placement, queued batches are applied this often
IDLE_READ_S = 0.02


async def quiet_counts(http: aiohttp.ClientSession, routers: list[Proc], engines: list[Proc]) -> dict[tuple[str, str], float]:
    """Each router's applied-event count per engine once nothing is left to apply: unchanged over 10 of the
    routers' idle reads in a row (the caller publishes nothing meanwhile), within a bound. The resets that
    confirmed the subscriptions may still be queued at one router but applied at the other; counts taken
    before they are all applied would make one router's later increase look larger than the other's."""
    deadline = time.monotonic() + 10.0
    last: dict[tuple[str, str], float] | None = None
    same = 0
    while True:
        now = {(r.url, e.url): await events_seen(http, r, e.url) for r in routers for e in engines}
        same = same + 1 if now == last else 0
        if same >= 10:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"the routers' KV-event counts did not settle within 10 s: {now}")
        last = now
        await asyncio.sleep(IDLE_READ_S)


def reason_of(decision: str) -> str:
    return dict(part.split("=", 1) for part in decision.split(";")[1:]).get("reason", "")


@pytest.mark.slow
async def test_a_replica_meeting_a_session_places_it_where_the_index_holds_its_kv(
        tmp_path: Path, procs: list[Proc]) -> None:
    engines = [start_backend(str(tmp_path), "--kv-events-config", events_flag(tmp_path, f"e{i}")) for i in range(2)]
    procs += engines
    config = tmp_path / "router.toml"
    config.write_text("[health]\ninterval_s = 0.2\n[placement]\ndecision_header = true\n[kv_events]\nenabled = true\n"
                      f"idle_read_interval_s = {IDLE_READ_S}\n")
    backend_args = [arg for engine in engines for arg in ("--backend", engine.url)]
    router_a = start_router(str(tmp_path), "--config", str(config), *backend_args)
    procs.append(router_a)
    router_b = start_router(str(tmp_path), "--config", str(config), *backend_args)
    procs.append(router_b)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        # both routers subscribed to both engines: an AllBlocksCleared batch reaches each of them
        for engine in engines:
            async def heard(engine: Proc = engine) -> bool:
                async with http.post(engine.url + "/reset_prefix_cache") as answer:
                    assert answer.status == 200
                return all([await events_seen(http, r, engine.url) > 0 for r in (router_a, router_b)])

            await eventually(heard, timeout=20, what=f"both routers hearing {engine.url}'s KV events")

        async def b_heard(engine_url: str, before: float, at_least: float) -> None:
            async def check() -> bool:
                return await events_seen(http, router_b, engine_url) - before >= at_least

            await eventually(check, timeout=10, what="router B applying the session's KV events")

        # 1. first turn through A, second through B: B follows the KV to A's backend
        history = [QUESTION + "One."]
        counts = await quiet_counts(http, [router_a, router_b], engines)
        seen_a = {e.url: counts[(router_a.url, e.url)] for e in engines}
        seen_b = {e.url: counts[(router_b.url, e.url)] for e in engines}
        await turn(http, router_a.url, "via-a", history)
        served = await pin_of(http, router_a, "via-a")

        async def a_heard() -> bool:
            return await events_seen(http, router_a, served) > seen_a[served]

        await eventually(a_heard, timeout=10, what="router A applying the turn's KV events")
        await b_heard(served, seen_b[served], await events_seen(http, router_a, served) - seen_a[served])
        decision = await turn(http, router_b.url, "via-a", history)
        assert decision.startswith("new;") and reason_of(decision) == "cached", decision
        assert int(decision.split(";")[1].removeprefix("cached=")) > 0, decision
        assert await pin_of(http, router_b, "via-a") == served

        # 2. a session whose rendezvous choice is the other engine: its KV, not the hash, decides
        pool = BackendPool("default", [Backend(e.url) for e in engines])
        ranking = make_policy("session", load_factor=1.25, reported_load_weight=0.0)
        assert isinstance(ranking, SessionPolicy)
        holder, other = engines
        sid = next(s for s in (f"elsewhere-{i}" for i in range(100))
                   if ranking.candidates(pool, s)[0].url == other.url)
        history = [QUESTION + "Two."]
        before = await events_seen(http, router_b, holder.url)
        await turn(http, holder.url, sid, history)  # straight to the engine: no router has met it
        await b_heard(holder.url, before, 1)
        decision = await turn(http, router_b.url, sid, history)
        assert decision.startswith("new;") and reason_of(decision) == "cached", decision
        assert await pin_of(http, router_b, sid) == holder.url

"""3 real router processes (and a ``--workers 2`` router) in front of the same 2 real backends, sharing one
real redis-server: pin moves made on one replica reach the others, ``previous_response_id`` follow-ups
sent to another replica (or worker) reach the backend that stored the response, and Redis killed or
slow mid-run fails no request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.router.shared.conftest import RedisServer
from tests.support import (LOOPBACK, Proc, eventually, free_port, http_status, kill_alive, metric_sum,
                           start_backend, start_process, wait_until)

pytestmark = pytest.mark.slow

MODEL = "session-sim"
TOKEN = "t0ken"


@dataclass
class Fleet:
    backends: list[Proc]
    routers: list[Proc]
    redis: RedisServer


@pytest.fixture
def backends(tmp_path: Path) -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    try:
        for _ in range(2):
            procs.append(start_backend(str(tmp_path)))
        yield procs
    finally:
        kill_alive(*procs)


def routers_for(tmp_path: Path, backends: list[Proc], redis_url: str | None, count: int, *extra: str,
                shared_state: str = "", write_timeout_s: float = 2.0) -> list[Proc]:
    """``count`` routers before ``backends``, each ready (a healthy backend, and with ``--workers`` every
    worker listening) when this returns; reconnects to Redis are retried within 0.5 s (the test waits
    for them; the default backoff goes up to 5 s). ``shared_state``: more lines of the
    ``[shared_state]`` table."""
    config = tmp_path / f"router-{write_timeout_s}.toml"
    config.write_text(f"[shared_state]\nbackoff_max_s = 0.5\nwrite_timeout_s = {write_timeout_s}\n" + shared_state)
    args = ["--config", str(config), *(arg for b in backends for arg in ("--backend", b.url))]
    if redis_url is not None:
        args += ["--shared-state", redis_url]
    routers: list[Proc] = []
    try:
        for _ in range(count):
            port = free_port()  # a generous start-up bound: the shared 2-core machine may be busy
            routers.append(start_process("router", ["--host", LOOPBACK, "--port", str(port), *args, "--admin-token",
                                                    TOKEN, *extra], port, str(tmp_path), timeout=60))
        for router in routers:
            wait_until(lambda r=router: http_status(r.url + "/health") == 200, timeout=30, what="a healthy backend")
            # the line comes once every worker listens (/health answers from the first one)
            wait_until(lambda r=router: "listening on" in r.log(), timeout=30, what="every worker listening")
    except BaseException:
        kill_alive(*routers)
        raise
    return routers


@pytest.fixture
def fleet(tmp_path: Path, backends: list[Proc], redis_server: RedisServer) -> Iterator[Fleet]:
    routers: list[Proc] = []
    try:
        routers = routers_for(tmp_path, backends, redis_server.url, 3)
        yield Fleet(backends, routers, redis_server)
    finally:
        kill_alive(*routers)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # a new connection per request: the kernel spreads them over SO_REUSEPORT workers
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def chat(http: aiohttp.ClientSession, router: Proc, session_id: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"hello from {session_id}"}], "max_tokens": 4}
    async with http.post(router.url + "/v1/chat/completions", json=body, headers={"X-Session-ID": session_id}) as r:
        await r.read()
        return r.status


async def session_view(http: aiohttp.ClientSession, router: Proc, session_id: str) -> dict[str, Any]:
    async with http.get(f"{router.url}/v1/sessions/{session_id}") as r:
        return await r.json() if r.status == 200 else {}


async def metrics(http: aiohttp.ClientSession, router: Proc) -> str:
    async with http.get(router.url + "/metrics") as r:
        return await r.text()


async def responses_round_trips(http: aiohttp.ClientSession, first: list[Proc], follow: list[Proc],
                                count: int) -> list[int]:
    """``count`` conversations without a session header: each first turn on ``first[i % len]``, its
    ``previous_response_id`` follow-up on ``follow[i % len]``; the follow-ups' statuses."""
    statuses = []
    for i in range(count):
        response_id = await first_turn(http, first[i % len(first)], i)
        statuses.append(await follow_up(http, follow[i % len(follow)], response_id))
    return statuses


async def first_turn(http: aiohttp.ClientSession, router: Proc, i: int) -> str:
    """Conversation ``i``'s first Responses turn through ``router`` (stored); its response id."""
    body = {"model": MODEL, "input": f"conversation {i}: tell me something", "max_output_tokens": 4}
    async with http.post(router.url + "/v1/responses", json=body) as r:
        assert r.status == 200, await r.text()
        return str((await r.json())["id"])


async def follow_up(http: aiohttp.ClientSession, router: Proc, response_id: str) -> int:
    """A ``previous_response_id`` follow-up through ``router``; its status."""
    body = {"model": MODEL, "input": "and then?", "previous_response_id": response_id, "max_output_tokens": 4}
    async with http.post(router.url + "/v1/responses", json=body) as r:
        await r.read()
        return r.status


async def test_a_pin_moved_on_one_replica_is_followed_by_the_others_and_responses_follow_ups_reach_their_backend(
        fleet: Fleet, http: aiohttp.ClientSession) -> None:
    a, b, c = fleet.routers
    session = "moved-session"
    assert await chat(http, a, session) == 200 and await chat(http, b, session) == 200
    first = (await session_view(http, a, session))["pins"]["default"]
    assert (await session_view(http, b, session))["pins"]["default"] == first
    other = next(p.url for p in fleet.backends if p.url != first)
    # on replica A only, the session's backend leaves: its next request re-pins it there
    async with http.delete(f"{a.url}/admin/backends/{first}", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status == 200, await r.text()
    assert await chat(http, a, session) == 200
    assert (await session_view(http, a, session))["pins"]["default"] == other
    # B knew the session: the move is pushed to it (no read), and its next request goes there
    await eventually(lambda: _pinned(http, b, session, other), timeout=10, what="the move pushed to B")
    assert await chat(http, b, session) == 200
    assert (await session_view(http, b, session))["last_backend"] == other
    assert metric_sum(await metrics(http, b), "session_router_shared_state_pushes_total") >= 1
    # C never saw it: its first request reads the pins once and goes there too
    assert await chat(http, c, session) == 200
    view = await session_view(http, c, session)
    assert view["pins"]["default"] == other and view["last_backend"] == other
    text = await metrics(http, c)
    assert metric_sum(text, "session_router_shared_state_reads_total", kind="pins", result="hit") == 1
    assert metric_sum(text, "session_router_shared_state_up") == 1
    # a session known locally costs no Redis read: C's next requests read nothing
    for _ in range(3):
        assert await chat(http, c, session) == 200
    assert metric_sum(await metrics(http, c), "session_router_shared_state_reads_total", kind="pins") == 1
    # B and C (which still have its first choice) count its requests as off it, by A's reason; for A,
    # without that backend, the new pin is the first choice
    assert metric_sum(await metrics(http, a), "session_router_off_first_choice_total") == 0
    for router in (b, c):
        assert metric_sum(await metrics(http, router), "session_router_off_first_choice_total", reason="repin") >= 1
    # Responses: each follow-up on another replica than its first turn reaches the backend that stored it
    statuses = await responses_round_trips(http, [b, c], [c, b], 12)
    assert statuses == [200] * 12
    text = await metrics(http, c)
    assert metric_sum(text, "session_router_shared_state_reads_total", kind="response", result="hit") + metric_sum(
        text, "session_router_shared_state_reads_total", kind="response", result="late") == 6


async def test_a_router_started_while_redis_is_slow_follows_the_others_from_its_first_request(
        tmp_path: Path, fleet: Fleet, http: aiohttp.ClientSession) -> None:
    # Responses stored through replica A, their ids written to Redis
    a = fleet.routers[0]
    ids = [await first_turn(http, a, i) for i in range(6)]
    await eventually(lambda: _written(http, a, "resp", 6), timeout=10, what="the ids written")
    # a new replica starts while Redis stalls: it listens only once its first PING is answered, so its
    # very first requests read the ids (without that wait they were placed blind: half to the wrong backend)
    stall = fleet.redis.send("DEBUG", "SLEEP", "3")
    try:
        (late,) = routers_for(tmp_path, fleet.backends, fleet.redis.url, 1, write_timeout_s=8.0)
    finally:
        stall.close()
    try:
        statuses = [await follow_up(http, late, response_id) for response_id in ids]
        assert statuses == [200] * 6
        text = await metrics(http, late)
        assert metric_sum(text, "session_router_shared_state_reads_total", kind="response", result="skipped") == 0
    finally:
        kill_alive(late)


async def _written(http: aiohttp.ClientSession, router: Proc, kind: str, count: int) -> bool:
    return metric_sum(await metrics(http, router), "session_router_shared_state_writes_total", kind=kind) >= count


async def _pinned(http: aiohttp.ClientSession, router: Proc, session: str, url: str) -> bool:
    return (await session_view(http, router, session)).get("pins", {}).get("default") == url


async def test_redis_killed_mid_run_fails_no_request_and_the_routers_recover_when_it_is_back(
        fleet: Fleet, http: aiohttp.ClientSession) -> None:
    routers = fleet.routers
    stop = asyncio.Event()
    statuses: list[int] = []

    async def client(k: int) -> None:
        i = 0
        while not stop.is_set():  # new sessions (first-sight reads) and known ones, over every replica
            statuses.append(await chat(http, routers[i % 3], f"c{k}-s{i % 7}-{i // 21}"))
            i += 1

    clients = [asyncio.create_task(client(k)) for k in range(3)]
    try:
        await eventually(lambda: len(statuses) >= 30, timeout=20, what="traffic")
        fleet.redis.kill()
        for router in routers:
            await eventually(lambda r=router: _up(http, r, 0), timeout=10, what="the routers see Redis down")
        seen = len(statuses)
        await eventually(lambda: len(statuses) >= seen + 30, timeout=20, what="traffic while Redis is down")
        fleet.redis.start()
        for router in routers:
            await eventually(lambda r=router: _up(http, r, 1), timeout=30, what="the routers reconnected")
        seen = len(statuses)
        await eventually(lambda: len(statuses) >= seen + 30, timeout=20, what="traffic after Redis came back")
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert set(statuses) == {200}
    text = await metrics(http, routers[0])
    assert metric_sum(text, "session_router_shared_state_errors_total") >= 1
    # and the fleet agrees again: a move made now reaches the others
    assert await _responses_ok(http, routers)


async def _responses_ok(http: aiohttp.ClientSession, routers: list[Proc]) -> bool:
    return await responses_round_trips(http, routers, routers[1:] + routers[:1], 6) == [200] * 6


async def _up(http: aiohttp.ClientSession, router: Proc, value: int) -> bool:
    return metric_sum(await metrics(http, router), "session_router_shared_state_up") == value


async def test_a_slow_redis_delays_no_request_beyond_the_read_timeout(fleet: Fleet,
                                                                      http: aiohttp.ClientSession) -> None:
    router = fleet.routers[0]
    assert await chat(http, router, "warm-up") == 200
    conn = fleet.redis.send("DEBUG", "SLEEP", "3")  # Redis stalls for 3 s
    try:
        await asyncio.sleep(0.1)
        for i in range(5):  # new sessions: each would read its pins on first sight
            started = time.monotonic()
            assert await chat(http, router, f"slow-{i}") == 200
            assert time.monotonic() - started < 1.0  # read_timeout_s 0.05 (+ the request itself)
        text = await metrics(http, router)
        assert metric_sum(text, "session_router_shared_state_read_timeouts_total") >= 1
    finally:
        conn.close()
    await eventually(lambda: _up(http, router, 1), timeout=15, what="up again after the stall")


async def test_workers_of_one_router_agree_through_redis(tmp_path: Path, backends: list[Proc],
                                                         redis_server: RedisServer,
                                                         http: aiohttp.ClientSession) -> None:
    # A follow-up that reaches the other worker reads the id its sibling wrote off the request path, for
    # up to read_timeout_s. The default 50 ms is a latency bound (``test_a_slow_redis_delays_*`` holds it
    # to that); here it is 1 s, so a busy machine that delays the sibling's write is not a failure.
    (router,) = routers_for(tmp_path, backends, redis_server.url, 1, "--workers", "2",
                            shared_state="read_timeout_s = 1.0\n")
    try:
        # every request on a new connection: the kernel spreads them over both workers
        statuses = await responses_round_trips(http, [router], [router], 16)
        assert statuses == [200] * 16
    finally:
        kill_alive(router)

"""Backend health: active checks against real loopback servers, passive ejection, half-open recovery."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.config import config_from_mapping
from router.health import HealthChecker
from router.membership import Backend, BackendPool
from tests.support import eventually


@dataclass
class FakeBackend:
    """A real HTTP server on 127.0.0.1 whose /health and /load answers a test controls."""

    health_status: int = 200
    load_status: int = 200
    load_body: bytes = b'{"server_load": 7}'
    #: /health never answers while set
    stall: bool = False
    health_hits: int = 0
    load_hits: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/load", self._load)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        self.health_hits += 1
        if self.stall:
            await self.released.wait()
        return web.Response(status=self.health_status)

    async def _load(self, request: web.Request) -> web.Response:
        self.load_hits += 1
        return web.Response(status=self.load_status, body=self.load_body, content_type="application/json")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    checker: HealthChecker
    pool: BackendPool
    fakes: list[FakeBackend]
    servers: list[TestServer]
    changes: list[tuple[str, bool]]
    clock: Clock

    @property
    def backends(self) -> list[Backend]:
        return self.pool.members


MakeHarness = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def make_harness() -> AsyncIterator[MakeHarness]:
    servers: list[TestServer] = []
    sessions: list[aiohttp.ClientSession] = []
    checkers: list[HealthChecker] = []

    async def make(n: int = 2, *, eject_after_failures: int = 3, eject_s: float = 5.0, timeout_s: float = 2.0,
                   interval_s: float = 60.0, scrape_load: bool = False) -> Harness:  # fmt: skip
        fakes = [FakeBackend() for _ in range(n)]
        own: list[TestServer] = []
        for fake in fakes:
            server = TestServer(fake.app(), host="127.0.0.1")
            await server.start_server()
            own.append(server)
        servers.extend(own)
        pool = BackendPool("default", [Backend(f"http://127.0.0.1:{s.port}") for s in own])
        session = aiohttp.ClientSession()
        sessions.append(session)
        changes: list[tuple[str, bool]] = []
        clock = Clock()
        checker = HealthChecker(
            [pool], interval_s=interval_s, timeout_s=timeout_s, eject_after_failures=eject_after_failures,
            eject_s=eject_s, session=session, on_change=lambda b, healthy: changes.append((b.url, healthy)),
            scrape_load=scrape_load, clock=clock,
        )  # fmt: skip
        checkers.append(checker)
        return Harness(checker, pool, fakes, own, changes, clock)

    yield make
    for checker in checkers:
        await checker.stop()
    for fake_server in servers:
        await fake_server.close()
    for session in sessions:
        await session.close()


wait_for = functools.partial(eventually, timeout=5.0)


# --------------------------------------------------------------------- active checks


async def test_check_now_follows_the_health_answer(make_harness: MakeHarness) -> None:
    h = await make_harness(2)
    a, b = h.backends
    await h.checker.check_now()
    assert a.healthy and b.healthy and h.changes == []
    assert [f.health_hits for f in h.fakes] == [1, 1]

    h.fakes[1].health_status = 503
    await h.checker.check_now()
    assert a.healthy and not b.healthy
    assert not b.available
    assert h.changes == [(b.url, False)]

    await h.checker.check_now()  # no transition, no callback
    assert h.changes == [(b.url, False)]

    h.fakes[1].health_status = 200  # the half-open probe: a good check brings it back
    await h.checker.check_now()
    assert b.healthy and h.changes == [(b.url, False), (b.url, True)]
    assert h.checker.rounds == 4


async def test_a_stopped_server_is_unhealthy_and_recovers_when_it_returns(make_harness: MakeHarness) -> None:
    h = await make_harness(2)
    a, b = h.backends
    port = h.servers[1].port
    await h.servers[1].close()
    await h.checker.check_now()
    assert a.healthy and not b.healthy and h.changes == [(b.url, False)]

    revived = FakeBackend()
    server = TestServer(revived.app(), host="127.0.0.1", port=port)
    await server.start_server()
    h.servers.append(server)
    try:
        await h.checker.check_now()
        assert b.healthy and revived.health_hits == 1
    finally:
        await server.close()


async def test_a_stalled_health_endpoint_fails_after_the_timeout(make_harness: MakeHarness) -> None:
    h = await make_harness(1, timeout_s=0.2)
    (backend,) = h.backends
    h.fakes[0].stall = True
    loop = asyncio.get_running_loop()
    started = loop.time()
    await h.checker.check_now()
    elapsed = loop.time() - started
    h.fakes[0].released.set()
    assert not backend.healthy
    assert 0.15 <= elapsed < 5.0


async def test_every_backend_of_every_pool_is_checked_concurrently(make_harness: MakeHarness) -> None:
    h = await make_harness(3, timeout_s=30.0)
    for fake in h.fakes:
        fake.stall = True
    round_ = asyncio.create_task(h.checker.check_now())
    # all three checks are in flight at once (one at a time, the 2nd would wait 30 s for the 1st)
    await wait_for(lambda: all(f.health_hits == 1 for f in h.fakes))
    assert not round_.done()
    for fake in h.fakes:
        fake.stall = False
        fake.health_status = 503
        fake.released.set()
    await round_
    assert not any(b.healthy for b in h.backends)

    other = BackendPool("decode", [Backend(h.backends[0].url)])
    h.checker.pools.append(other)
    for fake in h.fakes:
        fake.health_status = 200
    await h.checker.check_now()
    assert all(b.healthy for b in h.backends) and other.members[0].healthy
    assert h.fakes[0].health_hits == 3  # once for the default pool, once for the decode pool


async def test_members_added_later_are_checked(make_harness: MakeHarness) -> None:
    h = await make_harness(2)
    moved = h.pool.remove(h.backends[1].url)
    assert moved is not None
    await h.checker.check_now()
    assert [f.health_hits for f in h.fakes] == [1, 0]
    h.pool.add(Backend(moved.url))
    await h.checker.check_now()
    assert [f.health_hits for f in h.fakes] == [2, 1]


# ------------------------------------------------------------------ passive signals


async def test_consecutive_failures_eject_and_a_success_resets_the_count(make_harness: MakeHarness) -> None:
    h = await make_harness(1, eject_after_failures=3, eject_s=5.0)
    (backend,) = h.backends
    h.checker.record_failure(backend, connect_error=False)
    h.checker.record_failure(backend, connect_error=False)
    assert backend.healthy and backend.consecutive_failures == 2
    h.checker.record_success(backend)
    assert backend.consecutive_failures == 0
    h.checker.record_failure(backend, connect_error=False)
    h.checker.record_failure(backend, connect_error=False)
    assert backend.healthy
    h.checker.record_failure(backend, connect_error=False)
    assert not backend.healthy
    assert backend.ejected_until == h.clock.now + 5.0
    assert h.changes == [(backend.url, False)]
    h.checker.record_failure(backend, connect_error=False)  # already out: no second transition
    assert h.changes == [(backend.url, False)]


async def test_an_ejected_backend_stays_out_until_the_window_ends(make_harness: MakeHarness) -> None:
    h = await make_harness(1, eject_after_failures=2, eject_s=5.0)
    (backend,) = h.backends
    for _ in range(2):
        h.checker.record_failure(backend, connect_error=False)
    assert not backend.healthy

    await h.checker.check_now()  # /health answers 200, but the window is not over
    assert not backend.healthy and h.fakes[0].health_hits == 1
    h.checker.record_success(backend)  # a late success of an older request: still out
    assert not backend.healthy

    h.clock.now += 5.0  # window over: the next good check is the half-open probe
    await h.checker.check_now()
    assert backend.healthy and backend.consecutive_failures == 0 and backend.ejected_until == 0.0
    assert h.changes == [(backend.url, False), (backend.url, True)]


async def test_after_the_window_a_failing_probe_keeps_it_out(make_harness: MakeHarness) -> None:
    h = await make_harness(1, eject_after_failures=1, eject_s=1.0)
    (backend,) = h.backends
    h.checker.record_failure(backend, connect_error=False)
    h.clock.now += 2.0
    h.fakes[0].health_status = 500
    await h.checker.check_now()
    assert not backend.healthy
    h.fakes[0].health_status = 200
    await h.checker.check_now()
    assert backend.healthy


async def test_a_request_success_after_the_window_is_a_half_open_success(make_harness: MakeHarness) -> None:
    h = await make_harness(1, eject_after_failures=1, eject_s=3.0)
    (backend,) = h.backends
    h.checker.record_failure(backend, connect_error=False)
    assert not backend.healthy
    h.clock.now += 3.0
    h.checker.record_success(backend)
    assert backend.healthy and h.changes == [(backend.url, False), (backend.url, True)]


async def test_a_connect_error_downs_the_backend_at_once(make_harness: MakeHarness) -> None:
    h = await make_harness(2, eject_after_failures=3)
    a, b = h.backends
    h.checker.record_failure(b, connect_error=True)
    assert a.healthy and not b.healthy and b.ejected_until == 0.0
    assert h.changes == [(b.url, False)]
    await h.checker.check_now()  # it answers again: back at the next check, no window to wait for
    assert b.healthy and h.changes == [(b.url, False), (b.url, True)]


async def test_a_good_check_does_not_hide_failing_requests(make_harness: MakeHarness) -> None:
    """/health can answer 200 while requests fail: the passive count survives active checks."""
    h = await make_harness(1, eject_after_failures=3)
    (backend,) = h.backends
    h.checker.record_failure(backend, connect_error=False)
    h.checker.record_failure(backend, connect_error=False)
    await h.checker.check_now()
    assert backend.consecutive_failures == 2
    h.checker.record_failure(backend, connect_error=False)
    assert not backend.healthy


async def test_transitions_log_one_warning_each(make_harness: MakeHarness, caplog: pytest.LogCaptureFixture) -> None:
    h = await make_harness(1)
    (backend,) = h.backends
    caplog.set_level(logging.DEBUG, logger="router.health")
    await h.checker.check_now()
    h.checker.record_success(backend)
    assert [r for r in caplog.records if r.name == "router.health"] == []
    h.fakes[0].health_status = 503
    await h.checker.check_now()
    await h.checker.check_now()
    h.fakes[0].health_status = 200
    await h.checker.check_now()
    records = [r for r in caplog.records if r.name == "router.health"]
    assert [r.levelno for r in records] == [logging.WARNING, logging.WARNING]
    assert "unhealthy: GET /health answered 503" in records[0].getMessage()
    assert backend.url in records[0].getMessage()
    assert "is now healthy" in records[1].getMessage()


async def test_a_failing_callback_does_not_break_health_tracking(make_harness: MakeHarness) -> None:
    h = await make_harness(1)
    (backend,) = h.backends

    def broken(b: Backend, healthy: bool) -> None:
        raise RuntimeError("metrics are broken")

    h.checker._on_change = broken
    h.checker.record_failure(backend, connect_error=True)
    assert not backend.healthy
    await h.checker.check_now()
    assert backend.healthy


# ---------------------------------------------------------------------- load scraping


async def test_load_is_scraped_only_when_asked(make_harness: MakeHarness) -> None:
    off = await make_harness(1)
    await off.checker.check_now()
    assert off.backends[0].reported_load == 0.0 and off.fakes[0].load_hits == 0

    on = await make_harness(2, scrape_load=True)
    on.fakes[1].load_body = b'{"server_load": 3}'
    await on.checker.check_now()
    assert [b.reported_load for b in on.backends] == [7.0, 3.0]

    on.fakes[0].load_status = 404  # a backend without /load keeps its last value and stays healthy
    on.fakes[1].load_body = b"not json"
    await on.checker.check_now()
    assert [b.reported_load for b in on.backends] == [7.0, 3.0]
    assert all(b.healthy for b in on.backends)

    on.fakes[1].health_status = 503  # an unhealthy backend is not scraped
    hits = on.fakes[1].load_hits
    await on.checker.check_now()
    assert on.fakes[1].load_hits == hits


# ------------------------------------------------------------------------- lifecycle


async def test_start_runs_rounds_until_stop(make_harness: MakeHarness) -> None:
    h = await make_harness(1, interval_s=0.02)
    (backend,) = h.backends
    h.checker.start()
    h.checker.start()  # idempotent: still one task
    assert h.checker.running
    await wait_for(lambda: h.checker.rounds >= 2)
    h.fakes[0].health_status = 503
    await wait_for(lambda: not backend.healthy)
    h.fakes[0].health_status = 200
    await wait_for(lambda: backend.healthy)
    await h.checker.stop()
    assert not h.checker.running
    await h.checker.stop()  # twice is fine
    hits, rounds = h.fakes[0].health_hits, h.checker.rounds
    h.fakes[0].health_status = 503
    await asyncio.sleep(0.1)  # five intervals: a still-running loop would have checked by now
    assert (h.fakes[0].health_hits, h.checker.rounds) == (hits, rounds) and backend.healthy
    await h.checker.check_now()  # a manual round still works
    assert not backend.healthy


async def test_from_config_takes_the_health_settings() -> None:
    config = config_from_mapping(
        {
            "backends": [{"url": "http://127.0.0.1:1"}],
            "health_interval_s": 0.5,
            "health_timeout_s": 0.25,
            "eject_after_failures": 4,
            "eject_s": 9.0,
            "reported_load_weight": 0.5,
        }
    )
    async with aiohttp.ClientSession() as session:
        checker = HealthChecker.from_config(config, [BackendPool("default")], session)
        assert (checker.interval_s, checker.eject_after_failures, checker.eject_s) == (0.5, 4, 9.0)
        assert checker.scrape_load
        assert checker._timeout.total == 0.25
        config_no_load = config_from_mapping({"backends": [{"url": "http://127.0.0.1:1"}]})
        assert not HealthChecker.from_config(config_no_load, [], session).scrape_load

"""``PoolReconciler`` and ``BackendChanges``: the discovered set applied to a pool through the admin API's
path, against backends served over real HTTP on 127.0.0.1 (a joiner health-checked before it enters, a
leaver drained, a returning one kept, configured ones left alone, listeners told)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.backend_changes import BackendChanges
from router.discovery.metrics import DiscoveryMetrics
from router.discovery.reconcile import PoolReconciler
from router.health import HealthChecker
from router.membership import Backend, BackendPool
from tests.fakes import EchoBackend
from tests.support import eventually, free_port

BOUND_S = 10.0


@dataclass
class Listener:
    events: list[tuple[str, str]] = field(default_factory=list)

    def backend_added(self, backend: Backend) -> None:
        self.events.append(("added", backend.url))

    def backend_removed(self, backend: Backend) -> None:
        self.events.append(("removed", backend.url))


@dataclass
class Setup:
    pool: BackendPool
    changes: BackendChanges
    reconciler: PoolReconciler
    metrics: DiscoveryMetrics
    listener: Listener


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    pool = BackendPool("default", [Backend("http://127.0.0.9:1", name="static")])
    async with aiohttp.ClientSession() as http:
        health = HealthChecker([pool], interval_s=3600, timeout_s=0.5, eject_after_failures=3, eject_s=5,
                               session=http)
        changes = BackendChanges({"default": pool}, health, drain_timeout_s=30)
        listener = Listener()
        changes.subscribe(listener)
        metrics = DiscoveryMetrics()
        reconciler = PoolReconciler("default", changes, metrics)
        reconciler.start()
        try:
            yield Setup(pool, changes, reconciler, metrics, listener)
        finally:
            await reconciler.stop()


async def serve(aiohttp_server: Any, backend: EchoBackend | web.Application) -> str:
    app = backend if isinstance(backend, web.Application) else backend.app()
    server = await aiohttp_server(app, host="127.0.0.1")
    return f"http://127.0.0.1:{server.port}"


async def test_joiners_are_health_checked_before_they_enter(setup: Setup, aiohttp_server: Any) -> None:
    gate = asyncio.Event()

    async def slow_health(request: web.Request) -> web.Response:
        await gate.wait()
        return web.Response(status=200)

    slow_app = web.Application()
    slow_app.router.add_get("/health", slow_health)
    slow = await serve(aiohttp_server, slow_app)
    good = await serve(aiohttp_server, EchoBackend("good"))
    sick_backend = EchoBackend("sick", healthy=False)
    sick = await serve(aiohttp_server, sick_backend)
    dead = f"http://127.0.0.9:{free_port()}"  # nothing listens there
    setup.reconciler.update(frozenset({slow, good, sick, dead}))
    await eventually(lambda: setup.pool.get(good) is not None and setup.pool.get(dead) is not None,
                     timeout=BOUND_S, what="the joiners")
    assert setup.pool.get(slow) is None  # its check has not answered: it takes no traffic yet
    assert setup.pool.get(good).healthy and setup.pool.get(good).models is not None  # type: ignore[union-attr]
    assert setup.pool.for_model("model-good") is not None  # entered with its models known
    assert not setup.pool.get(sick).healthy  # type: ignore[union-attr]
    assert not setup.pool.get(dead).healthy  # type: ignore[union-attr]
    gate.set()
    await eventually(lambda: setup.pool.get(slow) is not None, timeout=BOUND_S, what="the slow joiner")
    assert setup.pool.get(slow).healthy  # type: ignore[union-attr]
    assert sorted(url for event, url in setup.listener.events if event == "added") == sorted({slow, good, sick, dead})
    assert setup.metrics.changes[("default", "added")] == 4
    assert setup.reconciler.owned == {slow, good, sick, dead}


async def test_a_leaver_drains_then_leaves(setup: Setup, aiohttp_server: Any) -> None:
    url = await serve(aiohttp_server, EchoBackend("a"))
    setup.reconciler.update(frozenset({url}))
    await eventually(lambda: setup.pool.get(url) is not None, timeout=BOUND_S, what="the joiner")
    backend = setup.pool.get(url)
    assert backend is not None
    backend.in_flight = 1  # a request is running on it
    setup.reconciler.update(frozenset())
    await eventually(lambda: backend.draining, timeout=BOUND_S, what="the drain")
    assert setup.pool.get(url) is backend and not backend.available  # no new requests; the running one ends
    await asyncio.sleep(0.2)
    assert setup.pool.get(url) is backend
    backend.in_flight = 0
    await eventually(lambda: setup.pool.get(url) is None, timeout=BOUND_S, what="the removal")
    assert setup.listener.events[-1] == ("removed", url)
    assert setup.metrics.changes[("default", "removed")] == 1
    assert setup.pool.get("http://127.0.0.9:1") is not None  # the configured backend stays


async def test_a_backend_back_before_its_drain_ended_stays(setup: Setup, aiohttp_server: Any) -> None:
    url = await serve(aiohttp_server, EchoBackend("a"))
    setup.reconciler.update(frozenset({url}))
    await eventually(lambda: setup.pool.get(url) is not None, timeout=BOUND_S, what="the joiner")
    backend = setup.pool.get(url)
    assert backend is not None
    backend.in_flight = 1
    setup.reconciler.update(frozenset())
    await eventually(lambda: backend.draining, timeout=BOUND_S, what="the drain")
    setup.reconciler.update(frozenset({url}))  # Ready again
    await eventually(lambda: not backend.draining, timeout=BOUND_S, what="the drain cancelled")
    backend.in_flight = 0
    await eventually(lambda: setup.reconciler.idle, timeout=BOUND_S, what="the reconciler idle")
    assert setup.pool.get(url) is backend and backend.available
    assert ("removed", url) not in setup.listener.events
    assert [e for e in setup.listener.events if e[1] == url] == [("added", url)]


async def test_discovery_removes_only_what_it_added(setup: Setup, aiohttp_server: Any) -> None:
    static = "http://127.0.0.9:1"
    admin_added = await serve(aiohttp_server, EchoBackend("admin"))
    found = await serve(aiohttp_server, EchoBackend("found"))
    await setup.changes.add("default", Backend(admin_added))  # as POST /admin/backends does
    setup.reconciler.update(frozenset({static, admin_added, found}))
    await eventually(lambda: setup.pool.get(found) is not None, timeout=BOUND_S, what="the joiner")
    assert setup.reconciler.owned == {found}
    setup.reconciler.update(frozenset())
    await eventually(lambda: setup.pool.get(found) is None, timeout=BOUND_S, what="the leaver")
    assert setup.pool.get(static) is not None and setup.pool.get(admin_added) is not None


async def test_a_discovered_backend_removed_by_the_admin_api_comes_back_with_the_next_change(
        setup: Setup, aiohttp_server: Any) -> None:
    one = await serve(aiohttp_server, EchoBackend("one"))
    two = await serve(aiohttp_server, EchoBackend("two"))
    setup.reconciler.update(frozenset({one}))
    await eventually(lambda: setup.pool.get(one) is not None, timeout=BOUND_S, what="the joiner")
    backend = setup.pool.get(one)
    assert backend is not None
    assert await setup.changes.remove(backend)  # DELETE /admin/backends/{name}
    assert setup.pool.get(one) is None
    setup.reconciler.update(frozenset({one, two}))
    await eventually(lambda: setup.pool.get(one) is not None and setup.pool.get(two) is not None,
                     timeout=BOUND_S, what="both in the pool")


async def test_a_failing_listener_is_logged_not_raised(setup: Setup, aiohttp_server: Any,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def backend_added(self, backend: Backend) -> None:
            raise RuntimeError("listener bug")

        def backend_removed(self, backend: Backend) -> None:
            raise RuntimeError("listener bug")

    unsubscribe = setup.changes.subscribe(Broken())
    url = await serve(aiohttp_server, EchoBackend("a"))
    added = await setup.changes.add("default", Backend(url))
    assert setup.pool.get(url) is added
    assert "listener bug" in caplog.text
    unsubscribe()
    assert setup.listener.events == [("added", url)]

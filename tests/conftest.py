"""Shared fixtures: ``make_router``, a router in front of fake backends, served in-process.

The router is served as ``router.serve.serve`` assembles it, on 127.0.0.1 ephemeral ports:
``create_app`` on a ``CappedAppRunner`` listener, and for ``front = "raw"`` a ``RawFront`` before
it on its own port; ``front = "client"`` serves the app with pytest-aiohttp's ``aiohttp_client``
instead (a ``TestClient`` to call it with). The fakes (``tests.fakes.EchoBackend`` unless given)
are served with ``aiohttp_server``. Everything started is stopped when the test ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from router.app import PROXY, create_admin_app, create_app
from router.config import BackendConfig, RouterConfig
from router.front.server import RawFront
from router.http_server import CappedAppRunner
from router.state import ROUTER_STATE, RouterState
from tests.fakes import EchoBackend
from tests.support import free_port, router_config

#: the settings every in-process router starts from (a test's overrides win)
BASE_SETTINGS: dict[str, Any] = {"health_interval_s": 3600.0, "retry_backoff_s": 0.001}


@dataclass
class RouterUnderTest:
    """A router served in-process, and the fake backends before which it stands."""

    app: web.Application
    config: RouterConfig
    state: RouterState
    #: the fakes in ``config.backends`` order (then prefill, then decode)
    fakes: list[Any]
    #: the fakes' servers, in the same order
    servers: list[TestServer]
    #: the port clients use: the raw front's, or the aiohttp app's
    port: int
    #: the aiohttp app's own listener (behind the raw front for ``front = "raw"``)
    aiohttp_port: int
    #: ``front = "client"``: the app's test client (and the admin app's, when served)
    client: TestClient | None = None
    admin_client: TestClient | None = None
    runner: web.AppRunner | None = None
    raw: RawFront | None = None
    #: the admin app's listener, when served (``admin=True`` and ``admin_port`` set)
    admin_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str | None:
        return None if self.admin_port is None else f"http://127.0.0.1:{self.admin_port}"


MakeRouter = Callable[..., Awaitable[RouterUnderTest]]


@pytest.fixture
async def make_router(aiohttp_server: Any, aiohttp_client: Any) -> AsyncIterator[MakeRouter]:
    """``await make_router(front="raw", *, n=1, fakes=None, prefill=(), decode=(), urls=(), dead=0,
    named=False, admin=False, shutdown_timeout=60.0, **config_overrides)``.

    ``front``: ``"raw"``, ``"aiohttp"`` or ``"client"``. Backends, in this order: ``fakes`` (or ``n``
    new ``EchoBackend("b<i>")``), then ``urls`` as given, then ``dead`` loopback URLs nothing
    listens on. ``named``: the fakes' backends are named after them (and dead ones ``dead<i>``).
    ``prefill``/``decode``: fakes for the P/D pools (always named). ``admin``: serve the admin app
    on its own listener when ``admin_port`` is set. Config: ``BASE_SETTINGS`` then the overrides.
    """
    stack = contextlib.AsyncExitStack()

    async def listen(app: web.Application, *, max_connections: int | None = None,
                     shutdown_timeout: float = 60.0, **server: Any) -> tuple[web.AppRunner, int]:
        runner = CappedAppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                                    max_connections=max_connections, shutdown_timeout=shutdown_timeout, **server)
        await runner.setup()

        async def cleanup() -> None:
            if runner.server is not None:  # a test may have drained it already
                await runner.cleanup()

        stack.push_async_callback(cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site.port

    async def make(front: str = "raw", *, n: int = 1, fakes: Sequence[Any] | None = None,
                   prefill: Sequence[Any] = (), decode: Sequence[Any] = (), urls: Sequence[str] = (),
                   dead: int = 0, named: bool = False, admin: bool = False, shutdown_timeout: float = 60.0,
                   **overrides: Any) -> RouterUnderTest:
        assert front in ("raw", "aiohttp", "client"), front
        main = list(fakes) if fakes is not None else [EchoBackend(f"b{i}") for i in range(n)]
        servers: list[TestServer] = []
        served: dict[int, str] = {}
        for fake in [*main, *prefill, *decode]:
            server = await aiohttp_server(fake.app(), host="127.0.0.1")
            servers.append(server)
            served[id(fake)] = f"http://127.0.0.1:{server.port}"

        def configs(group: Sequence[Any], name: bool) -> list[BackendConfig]:
            return [BackendConfig(served[id(f)], name=f.name) if name else BackendConfig(served[id(f)]) for f in group]

        backends = configs(main, named) + [BackendConfig(u) for u in urls]
        for i in range(dead):  # nothing listens there
            dead_url = f"http://127.0.0.1:{free_port()}"
            backends.append(BackendConfig(dead_url, name=f"dead{i}") if named else BackendConfig(dead_url))
        settings = dict(BASE_SETTINGS)
        settings.update(overrides)
        pd: dict[str, Any] = {}
        if prefill or decode:
            pd = {"prefill": configs(prefill, True), "decode": configs(decode, True)}
        config = router_config(backends=backends, **pd, **settings)
        app = create_app(config)
        result_fakes = [*main, *prefill, *decode]
        if front == "client":
            client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
            admin_client = None
            if admin and config.admin.port:
                admin_client = await aiohttp_client(create_admin_app(app))
            return RouterUnderTest(app, config, app[ROUTER_STATE], result_fakes, servers, client.port, client.port,
                                   client=client, admin_client=admin_client,
                                   admin_port=None if admin_client is None else admin_client.port)
        facing: dict[str, Any] = {}
        if front == "aiohttp":  # as router.serve: the client-facing listener's bounds
            facing = {"max_connections": config.front.max_connections,
                      "keepalive_timeout": config.front.keepalive_timeout_s}
        runner, app_port = await listen(app, shutdown_timeout=shutdown_timeout, **facing)
        port, raw = app_port, None
        if front == "raw":
            raw = RawFront(app[PROXY], "127.0.0.1", app_port, max_body_bytes=config.front.max_body_bytes,
                           body_timeout_s=config.front.body_timeout_s, max_connections=config.front.max_connections,
                           max_head_bytes=config.front.max_head_bytes,
                           keepalive_timeout_s=config.front.keepalive_timeout_s)
            port = await raw.start("127.0.0.1", 0)
            stack.push_async_callback(raw.shutdown, 0)
        admin_port = None
        if admin and config.admin.port:
            admin_port = (await listen(create_admin_app(app)))[1]
        return RouterUnderTest(app, config, app[ROUTER_STATE], result_fakes, servers, port, app_port,
                               runner=runner, raw=raw, admin_port=admin_port)

    async with stack:
        yield make

"""The raw front's listening socket, its connections, the idle sweeper and the graceful drain.

``RawFront`` serves the router's port: the hot POST routes (``router.routes.ROUTES``) and the
routes the router forwards without naming them (``router.routes.OTHER``: ``Proxy.forwards``) go
straight to the app's ``Proxy``; everything else (the router's own routes, wrong methods, denied
paths, non-canonical spellings of the hot paths) is relayed to the aiohttp app on its internal
listener (``router.front.relay``), which answers exactly as the aiohttp front would.
Drain (``shutdown``): stop accepting, close idle keep-alive connections, let exchanges in flight
finish for up to the drain timeout (each connection closes after its answer), then cancel what is
left.
Connections get the front's settings (``ConnectionSettings``) and what they call back
(``ConnectionHooks``), made once here, never the front itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import TYPE_CHECKING

from router.exchange import DROP_REQUEST, RequestView, ResponseWriter
from router.front.connection import ConnectionHooks, FrontConnection
from router.front.relay import Relay
from router.front.settings import FRONT_DEFAULTS, ConnectionSettings
from router.front.wire import DateServer
from router.http_server import RateLimitedLog, refuse_message
from contract.ids import IdGenerator
from router.routes import OTHER, ROUTES, Route
from contract.session import SESSION_HEADER

if TYPE_CHECKING:
    from router.proxy import Proxy

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 1.0
#: after the drain timeout, how long cancelled exchanges get to unwind
CANCEL_GRACE_S = 5.0


class RawFront:
    """The router's port on an ``asyncio.Protocol`` + httptools (uvloop's loop when running on it)."""

    def __init__(self, proxy: "Proxy | None", app_host: str, app_port: int, *, max_body_bytes: int,
                 body_timeout_s: float = FRONT_DEFAULTS.body_timeout_s,
                 max_connections: int = FRONT_DEFAULTS.max_connections,
                 max_head_bytes: int = FRONT_DEFAULTS.max_head_bytes,
                 keepalive_timeout_s: float = FRONT_DEFAULTS.keepalive_timeout_s) -> None:
        """``proxy``: the app's (None: relay everything); ``app_host:app_port``: the aiohttp app's
        internal listener; ``max_body_bytes``: larger request bodies get a 413; ``body_timeout_s``:
        a body not whole this long after its head gets a 408; ``max_connections``: with this many
        open, a new connection is closed as soon as it is accepted; ``max_head_bytes``: a larger
        request head gets a 400; ``keepalive_timeout_s``: an idle keep-alive connection is closed
        after this long (checked once a second)."""
        self.proxy = proxy
        self.max_connections = max_connections
        self.keepalive_timeout_s = keepalive_timeout_s
        self.refusals = RateLimitedLog(log)
        #: request ids for the answers the front makes itself (the proxy's, when there is one)
        self.ids = proxy.request_ids if proxy is not None else IdGenerator()
        #: the header clients send their session in (``session_header``); the relay passes it on under that name
        session_header = proxy.session_header if proxy is not None else SESSION_HEADER
        session_header_b = session_header.lower().encode()
        #: what every connection reads (fixed at start-up)
        self.settings = ConnectionSettings(
            max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s, max_head_bytes=max_head_bytes,
            session_header_b=session_header_b,
            drop_request_b=frozenset(h.encode() for h in DROP_REQUEST) | {session_header_b},
        )
        self.relay = Relay(app_host, app_port, self.ids, session_header)
        #: POST path -> route, for the routes served natively (none without a proxy: all relayed)
        self.hot: dict[bytes, Route] = {r.path.encode(): r for r in ROUTES} if proxy is not None else {}
        self.dates = DateServer()
        self.connections: set[FrontConnection] = set()
        self.draining = False
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._empty: asyncio.Event | None = None
        #: what every connection calls back
        self.hooks = ConnectionHooks(
            route_for=self.route_for, handle=proxy.handle if proxy is not None else _no_proxy,
            relay=self.relay.forward, opened=self._opened, closed=self.forget, ids=self.ids, dates=self.dates,
        )

    async def start(self, host: str, port: int, *, backlog: int = 1024, reuse_port: bool = False) -> int:
        """Listen on ``host:port``; return the bound port. Raises ``OSError`` (e.g. the port is taken)."""
        server = await self.loop.create_server(lambda: FrontConnection(self.settings, self.hooks, self.loop), host, port, backlog=backlog,
                                               reuse_port=reuse_port or None)
        self._server = server
        self._sweeper = self.loop.create_task(self._sweep(), name="raw-front-sweeper")
        sockets = server.sockets or ()
        for sock in sockets:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                return int(sock.getsockname()[1])
        return port

    def route_for(self, method: bytes, url: bytes, target: str) -> Route | None:
        """The route the front serves natively for this request line (None: relay it to the app)."""
        if method == b"POST":
            route = self.hot.get(url.partition(b"?")[0])
            if route is not None:
                return route
        proxy = self.proxy
        return OTHER if proxy is not None and proxy.forwards(target) else None

    def _opened(self, conn: FrontConnection) -> bool:
        if len(self.connections) >= self.max_connections:
            self.refusals.warning(refuse_message(self.max_connections))
            return False
        self.connections.add(conn)
        if self.draining:
            conn.closing = True
        return True

    def forget(self, conn: FrontConnection) -> None:
        self.connections.discard(conn)
        if not self.connections and self._empty is not None:
            self._empty.set()

    def stop_accepting(self) -> None:
        """Close the listening socket (new connections are refused)."""
        if self._server is not None:
            self._server.close()

    async def shutdown(self, drain_timeout_s: float) -> None:
        """Drain: stop accepting, close idle connections, give exchanges in flight up to
        ``drain_timeout_s``, cancel the rest, then close the relay's pool."""
        self.stop_accepting()
        self.draining = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for conn in list(self.connections):
            conn.shutdown()
        if self.connections:
            self._empty = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._empty.wait(), drain_timeout_s)
        tasks = [t for conn in self.connections if (t := conn.task) is not None and not t.done()]
        if self.connections:
            log.warning("drain timeout (%gs): cutting %d connection(s) still busy", drain_timeout_s,
                        sum(1 for c in self.connections if c.busy()))
        for conn in list(self.connections):
            conn.abort()
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_GRACE_S)
        await self.relay.close()
        if self._server is not None:
            self._server.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            deadline = self.loop.time() - self.keepalive_timeout_s
            for conn in list(self.connections):
                if not conn.busy() and conn.idle_since < deadline:
                    conn.shutdown()


async def _no_proxy(request: RequestView, writer: ResponseWriter, route: Route) -> None:
    raise AssertionError("a front without a proxy serves no route natively (route_for relays everything)")

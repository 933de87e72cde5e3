"""The upstream keep-alive connection pool: connection reuse, timeouts by one sweeper, retries of
the keep-alive race. See DESIGN.md §9 for why this is not aiohttp's client."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Iterable

from contract.errors import UpstreamConnectError
from router.upstream.config import UpstreamLimits, UpstreamTimeouts
from router.upstream.connection import StaleConnectionError, UpstreamConnection
from router.upstream.response import UpstreamResponse

log = logging.getLogger(__name__)

#: request bodies below this size are written together with the head (one send, one segment)
_COALESCE_BODY = 64 * 1024


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to backends, one request per connection at a time.

    ``request`` writes a prebuilt head (``build_request_head``) and the body, and returns once the
    response head is parsed. Timeouts need no per-request timer: one sweeper task per pool checks
    every connection each ``limits.sweep_interval_s``. Use it from one event loop.
    """

    def __init__(self, timeouts: UpstreamTimeouts, limits: UpstreamLimits = UpstreamLimits(), *,
                 drop_headers: Iterable[str] = ()) -> None:
        """``drop_headers``: response headers (names, any case) left out of every response's ``headers``
        besides the hop-by-hop ones: those the consumer sets itself, dropped as the head is parsed
        instead of by a pass of its own over every response."""
        self.timeouts = timeouts
        self.limits = limits
        #: the lower-case names of ``drop_headers``
        self.drop_headers = frozenset(name.lower() for name in drop_headers)
        self._drop_b = frozenset(name.encode("latin-1") for name in self.drop_headers)
        self._idle: dict[tuple[str, int], list[UpstreamConnection]] = {}
        self._conns: set[UpstreamConnection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False
        # the connections' callbacks, bound once
        self._on_release = self._put_idle
        self._on_lost = self._forget
        #: connections opened, and requests retried after the keep-alive race (for metrics)
        self.connects = 0
        self.stale_retries = 0

    async def request(
        self,
        host: str,
        port: int,
        head: bytes,
        body: bytes,
        *,
        timeouts: UpstreamTimeouts | None = None,
    ) -> UpstreamResponse:
        """Send one request and return its response once the head has arrived.

        Raises ``UpstreamConnectError`` (refused, unreachable, connect timeout),
        ``UpstreamTimeoutError`` (no head within ``first_byte_s``, or past ``total_s``) or
        ``UpstreamProtocolError`` (invalid response, or the connection closed before a full head).
        A reused idle connection that the backend closed before sending any byte is retried once on
        a fresh connection. Cancelling the call closes the connection (the backend sees the client go).
        """
        if self._closed:
            raise UpstreamConnectError(f"cannot send to backend {host}:{port}: the upstream pool is closed")
        loop = self._loop
        if loop is None:
            loop = self._start()
        t = timeouts or self.timeouts
        start = loop.time()
        total_deadline = start + t.total_s
        key = (host, port)
        conn: UpstreamConnection | None = None
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                break
            conn = None
        if conn is None:
            conn = await self._connect(key, t.connect_s)
        data = head + body if len(body) < _COALESCE_BODY else None
        fut = self._send(conn, head, body, data, t, total_deadline)
        try:
            return await fut
        except StaleConnectionError:
            pass
        except asyncio.CancelledError:
            conn.cancel(fut)  # still our exchange: the backend must see us go
            raise
        # the keep-alive race: the backend closed the idle connection as we wrote; it saw nothing
        self.stale_retries += 1
        conn = await self._connect(key, t.connect_s)
        fut = self._send(conn, head, body, data, t, total_deadline)
        try:
            return await fut
        except asyncio.CancelledError:
            conn.cancel(fut)
            raise

    async def control(self, host: str, port: int, head: bytes, body: bytes, *, bound_s: float) -> int:
        """Send a small control request (a P/D release, an engine abort) with every timeout capped at
        ``bound_s``; read its answer, drop it and return its status. Raises as ``request``."""
        upstream = await self.request(host, port, head, body, timeouts=self.timeouts.capped(bound_s))
        try:
            await upstream.read()
            return upstream.status
        finally:
            upstream.close()

    def _send(
        self,
        conn: UpstreamConnection,
        head: bytes,
        body: bytes,
        data: bytes | None,
        t: UpstreamTimeouts,
        total_deadline: float,
    ) -> "asyncio.Future[UpstreamResponse]":
        fb_deadline = conn.loop.time() + t.first_byte_s
        if data is not None:
            return conn.send(data, fb_deadline, total_deadline, t.first_byte_s, t.total_s)
        fut = conn.send(head, fb_deadline, total_deadline, t.first_byte_s, t.total_s)
        if conn.busy and conn.transport is not None:
            conn.transport.write(body)
        return fut

    async def _connect(self, key: tuple[str, int], connect_s: float) -> UpstreamConnection:
        loop = self._loop
        assert loop is not None
        host, port = key
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(key, loop, self.limits, self._on_release, self._on_lost, self._drop_b),
                    host, port)
        except TimeoutError:
            raise UpstreamConnectError(
                f"cannot connect to backend {host}:{port}: no answer within {connect_s:g} s"
            ) from None
        except OSError as exc:
            if isinstance(exc, ConnectionRefusedError) or exc.errno == errno.ECONNREFUSED:
                reason = "connection refused (is it running?)"
            elif exc.errno:
                reason = os.strerror(exc.errno).lower()
            else:
                reason = str(exc)
            raise UpstreamConnectError(f"cannot connect to backend {host}:{port}: {reason}") from None
        self.connects += 1
        if self._closed:
            conn.abort()
            raise UpstreamConnectError(f"cannot send to backend {host}:{port}: the upstream pool is closed")
        self._conns.add(conn)
        return conn

    # ------------------------------------------------------------------ connections' callbacks
    def _put_idle(self, conn: UpstreamConnection) -> None:
        """``on_release``: keep ``conn`` for reuse, or close it (pool closed, or enough idle)."""
        idle = self._idle.get(conn.key)
        if idle is None:
            idle = self._idle[conn.key] = []
        if self._closed or len(idle) >= self.limits.max_idle_per_host:
            conn.close()
            return
        conn.idle_since = conn.loop.time()
        idle.append(conn)

    def _forget(self, conn: UpstreamConnection) -> None:
        """``on_lost``: ``conn`` closed."""
        self._conns.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> asyncio.AbstractEventLoop:
        loop = self._loop = asyncio.get_running_loop()
        self._sweeper = loop.create_task(self._sweep(), name="upstream-pool-sweeper")
        return loop

    async def _sweep(self) -> None:
        loop = self._loop
        assert loop is not None
        interval = self.limits.sweep_interval_s
        idle_timeout = self.limits.idle_timeout_s
        while True:
            await asyncio.sleep(interval)
            if not self._conns:
                continue
            now = loop.time()
            for conn in list(self._conns):
                try:
                    conn.check(now, idle_timeout)
                except Exception:  # a bug here must not stop every timeout of the pool
                    log.exception("upstream sweeper failed on a connection to %s", conn.label)

    async def close(self) -> None:
        """Close every connection (in-flight exchanges fail) and stop the sweeper."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
            self._sweeper = None
        waiters: list[asyncio.Future[None]] = []
        for conn in list(self._conns):
            lost = conn.shut_down(f"the request to backend {conn.label} was cut: the router is shutting down")
            if lost is not None:
                waiters.append(lost)
        self._idle.clear()
        if waiters:
            await asyncio.wait(waiters, timeout=1.0)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per backend ``host:port``: open connections, idle ones and busy ones."""
        out: dict[str, dict[str, int]] = {}
        for conn in self._conns:
            if conn.closed:  # closing; connection_lost will drop it
                continue
            entry = out.get(conn.label)
            if entry is None:
                entry = out[conn.label] = {"open": 0, "idle": 0, "busy": 0}
            entry["open"] += 1
            entry["busy" if conn.busy else "idle"] += 1
        return out

"""One client connection of the raw front: an ``asyncio.Protocol`` that runs its requests in order.

Its ``RequestParser`` (``router.front.request_parser``) turns the bytes read into exchanges; the
connection queues them, runs them one at a time, and holds back reading and running while the
client does not read its answers.

Life of a connection::

    data_received ─> parser ─ on_headers_complete ─> Exchange queued; the first one runs:
                                                     Proxy.handle (hot POST routes) or the relay
                   on_body / on_message_complete ──> the exchange's body (bounded by max_body_bytes)
    response written ──> next queued exchange (pipelining: one at a time, in order),
                         or idle (keep-alive), or close (Connection: close, HTTP/1.0, unread body)

Pipelined requests are parsed as they arrive, but only the first one runs; while a second one
is queued the socket is not read, and input is parsed ``FEED_BYTES`` at a time: once
``MAX_QUEUED`` requests wait, the rest of a read waits unparsed until answers make room. The next
request starts only while the client reads its answers: with the transport's write buffer over
its high-water mark (``pause_writing``), nothing new runs and the socket is not read until it
drains (``resume_writing``), so a client that pipelines and never reads holds one answer's worth
of the router's memory, not all of them. A client
that goes away cancels the running exchange at once (its upstream connection is closed, so the
backend aborts). A slow reader pauses the stream relay (``pause_writing``). Requests the parser
rejects get a 400 in OpenAI's error shape with ``Connection: close`` (one pipelined behind valid
requests: those are answered, the last with ``Connection: close``, then the connection closes);
a connection closed before
its request body was read is closed "lingering" (write side first, input discarded for a
bounded time) so the client reads the answer instead of a reset.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from contract.errors import error_body
from router.exchange import RequestView, ResponseWriter
from router.front.raw_exchange import Exchange
from router.front.request_parser import Rejected, RequestParser
from router.front.settings import ConnectionSettings
from router.front.wire import DateServer, error_headers
from contract.ids import IdGenerator

if TYPE_CHECKING:
    from router.routes import Route

log = logging.getLogger(__name__)

#: how long a connection closed with unread input keeps discarding it (so the client reads the answer)
LINGER_S = 5.0
#: pipelined requests parsed ahead of the one running: past this many, the rest of a read waits
#: unparsed (and the socket is not read) until answers make room
MAX_QUEUED = 32
#: input is parsed this many bytes at a time, so that one read full of small pipelined requests
#: does not all turn into queued requests at once
FEED_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True)
class ConnectionHooks:
    """What a connection calls on the front that accepted it (``router.front.server``)."""

    #: the route served natively for a request line ``(method, url, target)``; None: relay it
    route_for: Callable[[bytes, bytes, str], Route | None]
    #: answer a request of a native route (``Proxy.handle``)
    handle: Callable[[RequestView, ResponseWriter, Route], Awaitable[None]]
    #: answer any other request (``Relay.forward``: the aiohttp app answers it)
    relay: Callable[[Exchange], Awaitable[None]]
    #: a connection was accepted: register it (False: refused, it closes at once)
    opened: Callable[[FrontConnection], bool]
    #: a connection closed: forget it
    closed: Callable[[FrontConnection], None]
    #: request ids for the answers the connection makes itself
    ids: IdGenerator
    #: the Date/Server lines every answer carries
    dates: DateServer


class FrontConnection(asyncio.Protocol):
    """One client connection; created by ``RawFront`` for every accepted socket."""

    __slots__ = (
        "settings", "hooks", "dates", "loop", "transport", "closed", "closing", "write_paused", "idle_since",
        "_parser", "_queue", "task", "_reading_paused", "_drain", "_stopped", "_linger", "_backlog",
    )  # fmt: skip

    def __init__(self, settings: ConnectionSettings, hooks: ConnectionHooks, loop: asyncio.AbstractEventLoop) -> None:
        self.settings = settings
        self.hooks = hooks
        self.dates = hooks.dates
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        #: no request after the current one (drain, Connection: close, an error)
        self.closing = False
        self.write_paused = False
        self.idle_since = self.loop.time()
        #: parsed exchanges in order; the first one is running
        self._queue: deque[Exchange] = deque()
        self._parser = RequestParser(self, settings, hooks.route_for, self._request)
        self.task: asyncio.Task[None] | None = None
        self._reading_paused = False
        self._drain: asyncio.Future[None] | None = None
        #: the parser stopped (an error, or the connection closes): input is discarded
        self._stopped = False
        self._linger: asyncio.TimerHandle | None = None
        #: input read but not parsed yet: MAX_QUEUED requests wait already
        self._backlog = b""

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport subclasses
        if not self.hooks.opened(self):
            self._stopped = True
            transport.close()  # refused at once: nothing was read, nothing is answered

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.hooks.closed(self)
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        task = self.task
        if task is not None and not task.done():
            task.cancel()  # the client went away: the upstream request is closed at once
        self._queue.clear()
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._stopped or self.closed:
            return  # lingering, or the parser gave up: discard
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        """Parse ``data`` a piece at a time; once MAX_QUEUED requests wait, keep the rest for later."""
        size = len(data)
        pos = 0
        while pos < size:
            if self._backlog or len(self._queue) >= MAX_QUEUED:
                self._backlog += data[pos:] if pos else data
                self._pause_reading()
                return
            try:
                rest = self._parser.feed(data if size <= FEED_BYTES else data[pos:pos + FEED_BYTES])
            except Rejected as rejected:
                self._parse_error(rejected)
                return
            if rest:  # after an upgrade offer: what followed its head in this piece
                self._feed(rest)
            pos += FEED_BYTES
            if self._stopped or self.closed:
                return

    def eof_received(self) -> bool:
        # The client's FIN counts as going away (as on aiohttp's server): the transport closes and
        # connection_lost cancels the exchange in flight, so the backend aborts it. A client that
        # only half-closes loses its answer; HTTP/1.1 clients do not do that.
        return False

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)
        if not self.closed and self._linger is None:
            self._go_on()  # held back while the client was not reading its answers

    # ------------------------------------------------------------------ running exchanges
    def _request(self, ex: Exchange) -> None:
        """The parser has a whole head: queue the exchange, run it if it is the only one."""
        if self.closing:
            ex.keep_alive = False
        queue = self._queue
        queue.append(ex)
        if len(queue) == 1 and not self.write_paused:
            self._start(ex)
        else:  # a request is in flight, or the client is not reading its answers: read no more until then
            self._pause_reading()

    def _start(self, ex: Exchange) -> None:
        self.task = self.loop.create_task(self._run(ex))

    async def _run(self, ex: Exchange) -> None:
        hooks = self.hooks
        try:
            route = ex.route
            if route is not None:
                await hooks.handle(ex, ex, route)
            else:
                await hooks.relay(ex)
        except asyncio.CancelledError:
            self.abort()  # the client left, or the drain gave up: never a truncated-but-framed answer
            raise
        except Exception:  # never a traceback to the client; keep serving
            log.exception("unexpected error on %s %s", ex.method, ex.route.path if ex.route else "(relayed)")
            if not ex.started and not ex.finished:
                request_id = ex.request_id or hooks.ids.next()
                ex.respond(500, error_headers(request_id), error_body(500, "internal router error; see the router's log"))
            else:
                self.abort()
        self._done(ex)

    def _done(self, ex: Exchange) -> None:
        if self.closed:
            return
        if not ex.finished:
            if ex.started:
                self.abort()  # a stream that never ended
                return
            log.error("no answer for %s %s; closing the connection", ex.method, ex.raw_path[:64])
            self.abort()
            return
        queue = self._queue
        if queue and queue[0] is ex:
            queue.popleft()
        self.task = None
        if not ex.keep_alive or self.closing:
            if ex.complete and not queue and self._parser.parsing is None:
                self._close()
            else:
                self._linger_close()  # input we will not read may follow: let the client read the answer
            return
        if not queue:
            self.idle_since = self.loop.time()
        if self.write_paused:
            return  # the client is not reading its answers: resume_writing goes on from here
        self._go_on()

    def _go_on(self) -> None:
        """After an answer: parse input that waited, run the next request, read again."""
        queue = self._queue
        if self._backlog and not self._stopped and len(queue) < MAX_QUEUED:
            data, self._backlog = self._backlog, b""
            self._feed(data)
            if self.closed:
                return
        if self.task is None and queue:
            self._start(queue[0])
        if len(queue) <= 1 and not self._backlog:
            self.resume_reading()

    # ------------------------------------------------------------------ errors
    def _parse_error(self, rejected: Rejected) -> None:
        self._stopped = True
        ex = self._parser.parsing
        if ex is not None and ex in self._queue:
            # the head was fine, the body is not (bad chunking): its read fails with a 400
            ex.bad = rejected.message
            ex.keep_alive = False
            ex.wake()
            return
        log.debug("rejected a malformed request from %s", self.peer())
        if self._queue:
            # requests before it are answered (the last with Connection: close), then the
            # connection closes without a second answer, as aiohttp's server does
            self.closing = True
        else:
            self._reject_now(rejected.message)

    def _reject_now(self, message: str) -> None:
        ex = Exchange(self)
        ex.keep_alive = False
        ex.respond(400, error_headers(self.hooks.ids.next()), error_body(400, message))
        self._linger_close()

    # ------------------------------------------------------------------ transport helpers
    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    async def drained(self) -> None:
        """Wait until the client reads again (``resume_writing``) or goes away."""
        if not self.write_paused or self.closed:
            return
        drain = self._drain = self.loop.create_future()
        try:
            await drain
        finally:
            self._drain = None

    def _pause_reading(self) -> None:
        if not self._reading_paused and not self.closed and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and not self.closed and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()

    def busy(self) -> bool:
        """An exchange is queued or running."""
        return bool(self._queue)

    def shutdown(self) -> None:
        """The front is draining: close now when idle, else after the answer in flight."""
        self.closing = True
        if not self._queue:
            self._close()

    def _close(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.close()

    def _linger_close(self) -> None:
        """Close after the client had time to read the answer, discarding its unread input."""
        transport = self.transport
        if self.closed or transport is None or self._linger is not None:
            return
        self._stopped = True
        self.closing = True
        self._queue.clear()
        if transport.can_write_eof():
            transport.write_eof()
        self.resume_reading()
        self._linger = self.loop.call_later(LINGER_S, self.abort)

    def abort(self) -> None:
        """Close at once (no flush); the running exchange is cancelled by ``connection_lost``."""
        if self.transport is not None and not self.closed:
            self.transport.abort()
        task = self.task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()

    def peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"

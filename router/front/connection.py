"""One client connection of the raw front: an ``asyncio.Protocol`` fed to ``httptools``.

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

HTTP/1.x rules kept here (aiohttp's front keeps the same, see ``contract.aiohttp_json_errors``): trailer
fields after a chunked body are discarded (never headers, never forwarded, never a session id);
the headers a ``Connection`` header names are not forwarded (``drop_connection_options``); an
HTTP/1.1 request needs exactly one valid ``Host`` (else 400); an HTTP/1.0 request with
``Transfer-Encoding`` closes the connection after its answer; an ``Upgrade`` offer (h2c,
websocket) is ignored and the request served; the head limit (``max_head_bytes``) counts the
request line, every header line and the blank line.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httptools

from contract.errors import error_body
from router.exchange import REQUEST_ID_HEADER, RequestView, ResponseWriter
from router.front.raw_exchange import Exchange
from router.front.settings import ConnectionSettings
from router.front.wire import DateServer, error_headers
from contract.aiohttp_json_errors import HOST_MESSAGE, MALFORMED_MESSAGE, MAX_LINE_BYTES, valid_host
from contract.ids import IdGenerator

if TYPE_CHECKING:
    from router.routes import Route

log = logging.getLogger(__name__)

#: header fields in one head (and trailer fields after a chunked body)
MAX_HEADERS = 256


def head_too_large(max_head_bytes: int) -> str:
    """The 400's message for a head over ``max_head_bytes`` (request line + headers + the blank line)."""
    return (f"request head too large: the request line and headers together may not exceed {max_head_bytes} "
            f"bytes (nor {MAX_HEADERS} header fields); send fewer or shorter headers")


#: bytes of a request line beyond its method and target: " " + " HTTP/1.1" + CRLF
_REQUEST_LINE_EXTRA = 12
#: how long a connection closed with unread input keeps discarding it (so the client reads the answer)
LINGER_S = 5.0
#: pipelined requests parsed ahead of the one running: past this many, the rest of a read waits
#: unparsed (and the socket is not read) until answers make room
MAX_QUEUED = 32
#: input is parsed this many bytes at a time, so that one read full of small pipelined requests
#: does not all turn into queued requests at once
FEED_BYTES = 16 * 1024

_REQUEST_ID_B = REQUEST_ID_HEADER.lower().encode()


class _Rejected(Exception):
    """Raised from a parser callback: the request is malformed (answered 400, then closed)."""

    def __init__(self, message: str = MALFORMED_MESSAGE) -> None:
        super().__init__(message)
        self.message = message


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
        "_parser", "_queue", "_parsing", "task", "_in_head", "_head_bytes", "_head_read", "_head_tail",
        "_begun", "_reading_paused",
        "_drain", "_stopped", "_linger", "_body_only", "_backlog", "_session_b", "_drop_b", "_max_head",
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
        self._parser = httptools.HttpRequestParser(self)
        #: parsed exchanges in order; the first one is running
        self._queue: deque[Exchange] = deque()
        #: the exchange whose bytes are being parsed (may be queued already, waiting for its body)
        self._parsing: Exchange | None = None
        self.task: asyncio.Task[None] | None = None
        self._in_head = False
        #: bytes of the head being parsed, counted from what the parser reports (exact for a head
        #: written with one space after each colon), and read since the head began (a bound on
        #: what the parser buffers for a header that is not whole yet)
        self._head_bytes = 0
        self._head_read = 0
        #: the last bytes of the head's previous piece (its blank line may straddle two pieces)
        self._head_tail = b""
        #: messages begun in the piece being parsed
        self._begun = 0
        self._reading_paused = False
        self._drain: asyncio.Future[None] | None = None
        #: the parser stopped (an error, or the connection closes): input is discarded
        self._stopped = False
        self._linger: asyncio.TimerHandle | None = None
        #: the session header's name (lower case) and the request headers not forwarded as received
        self._session_b = settings.session_header_b
        self._drop_b = settings.drop_request_b
        #: a head over this many bytes is refused (``max_head_bytes``)
        self._max_head = settings.max_head_bytes
        #: the parser is reading a made-up head that frames the body of an upgrade offer (``_upgrade``)
        self._body_only = False
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
            self._feed_piece(data if size <= FEED_BYTES else data[pos:pos + FEED_BYTES])
            pos += FEED_BYTES
            if self._stopped or self.closed:
                return

    def _feed_piece(self, data: bytes) -> None:
        if self._in_head:  # a head continues: count its bytes in this piece (up to its end, if here)
            tail = self._head_tail
            end = (tail + data).find(b"\r\n\r\n") if tail else data.find(b"\r\n\r\n")
            self._head_read += len(data) if end < 0 else max(end + 4 - len(tail), 0)
            if self._head_read > self._max_head:
                self._parse_error(_Rejected(head_too_large(self._max_head)))
                return
            idle = False
        else:  # no message under way: one that begins here begins at this piece's first byte
            idle = self._parsing is None
        self._begun = 0
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._upgrade(data, exc.args[0] if exc.args else len(data))
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            self._parse_error(cause if isinstance(cause, _Rejected) else _Rejected())
        else:
            if self._in_head:  # the head goes on in the next piece
                self._head_tail = data[-3:]
                if idle and self._begun == 1:
                    # it began with this piece: all of it is head (a head that began after another
                    # request's end is counted from what the parser reports, whitespace aside)
                    self._head_read = len(data)

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

    # ------------------------------------------------------------------ httptools callbacks
    def on_message_begin(self) -> None:
        if self._body_only:
            return
        self._parsing = Exchange(self)
        self._in_head = True
        self._head_bytes = self._head_read = 0
        self._head_tail = b""
        self._begun += 1

    def on_url(self, url: bytes) -> None:
        if self._body_only:
            return
        ex = self._parsing
        assert ex is not None
        ex.url += url
        if len(ex.url) > MAX_LINE_BYTES:
            raise _Rejected()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._body_only:
            return
        ex = self._parsing
        assert ex is not None
        if len(value) + len(name) > MAX_LINE_BYTES:
            raise _Rejected()
        ex.fields += 1
        if ex.fields > MAX_HEADERS:
            raise _Rejected(head_too_large(self._max_head))
        if not self._in_head:
            return  # a trailer field (after a chunked body): never a header, never forwarded (RFC 9110 §6.5)
        self._head_bytes += len(name) + len(value) + 4  # name ": " value CRLF
        if self._head_bytes > self._max_head:
            raise _Rejected(head_too_large(self._max_head))
        value = value.strip(b" \t")
        if b"\r" in value or b"\n" in value or b"\x00" in value:  # never reaches a backend
            raise _Rejected()
        lname = name.lower()
        if lname not in self._drop_b:
            ex.lines.append(b"%b: %b\r\n" % (name, value))
        elif lname == self._session_b:
            ex.session_headers.append(value.decode("utf-8", "surrogateescape"))
        elif lname == _REQUEST_ID_B:
            if ex.request_id is None:
                ex.request_id = value.decode("utf-8", "surrogateescape")
        elif lname == b"content-length":
            ex.content_length = int(value)  # llhttp checked the digits and refused duplicates
        elif lname == b"connection":
            options = False
            for token in value.lower().split(b","):
                token = token.strip(b" \t")
                if token == b"close":
                    ex.conn_close = True
                elif token == b"keep-alive":
                    ex.conn_keep_alive = True
                elif token:
                    options = True
            if options:
                ex.connection.append(value.decode("latin-1"))
        elif lname == b"host":
            ex.hosts += 1
            if not valid_host(value.decode("latin-1")):
                ex.bad_host = True
        elif lname == b"transfer-encoding":
            ex.transfer_encoding = True
        elif lname == b"expect":
            ex.expect_continue = value.lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        if self._body_only:
            self._body_only = False
            return
        ex = self._parsing
        assert ex is not None
        self._in_head = False
        parser = self._parser
        method = parser.get_method()
        url = ex.url
        self._head_bytes += len(method) + len(url) + _REQUEST_LINE_EXTRA + 2  # the request line, the blank line
        if self._head_bytes > self._max_head:
            raise _Rejected(head_too_large(self._max_head))
        version = parser.get_http_version()
        if version == "1.1":
            ex.keep_alive = not ex.conn_close
            if ex.hosts != 1:
                raise _Rejected(HOST_MESSAGE)
        elif version == "1.0":
            ex.http10 = True
            # RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing: close after it
            ex.keep_alive = ex.conn_keep_alive and not ex.conn_close and not ex.transfer_encoding
            if ex.hosts > 1:
                raise _Rejected(HOST_MESSAGE)
        else:
            raise _Rejected(f"HTTP/{version} is not supported: send HTTP/1.1 (or HTTP/1.0)")
        if ex.bad_host:
            raise _Rejected(HOST_MESSAGE)
        if url[:1] != b"/":
            raise _Rejected(
                "the request target must be a path starting with '/' (origin-form): this router is a "
                "reverse proxy, not a forward proxy; send e.g. POST /v1/completions with the router's "
                "address in the Host header"
            )
        if method == b"CONNECT":  # even with a path target: tunnels are a forward proxy's business
            raise _Rejected("CONNECT is not supported: this router is a reverse proxy, not a forward proxy")
        ex.method = method.decode("ascii")
        ex.head_only = method == b"HEAD"
        ex.raw_path = ex.path_qs = url.decode("utf-8", "surrogateescape")
        ex.route = self.hooks.route_for(method, url, ex.raw_path)
        if ex.content_length is not None and ex.content_length > self.settings.max_body_bytes:
            ex.too_large = True  # decided before the body: it is discarded, not buffered
        if self.closing:
            ex.keep_alive = False
        queue = self._queue
        queue.append(ex)
        if len(queue) == 1 and not self.write_paused:
            self._start(ex)
        else:  # a request is in flight, or the client is not reading its answers: read no more until then
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        ex = self._parsing
        if ex is None or ex.too_large:
            return
        ex.size += len(body)
        if ex.size > self.settings.max_body_bytes:
            ex.too_large = True  # stop buffering: the answer is a 413
            ex.chunks.clear()
            ex.wake()
            return
        ex.chunks.append(body)

    def on_message_complete(self) -> None:
        ex = self._parsing
        self._parsing = None
        if ex is not None:
            ex.complete = True
            ex.wake()

    # ------------------------------------------------------------------ running exchanges
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
            if ex.complete and not queue and self._parsing is None:
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
    def _parse_error(self, rejected: _Rejected) -> None:
        self._stopped = True
        ex = self._parsing
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

    def _upgrade(self, data: bytes, offset: int) -> None:
        """A request offered a protocol upgrade (``Upgrade`` with ``Connection: upgrade``, e.g.
        h2c): the router speaks HTTP/1.1 only, so it ignores the offer (RFC 9110 §7.8) and serves
        the request as any other, as aiohttp does. httptools ends such a message at its head and
        hands back the rest of the input at ``offset``: a made-up head with the request's own
        framing lets the parser read the body into the request, then parsing goes on as usual.
        (CONNECT never gets here: its head is refused.)"""
        ex = self._queue[-1] if self._queue else None
        if ex is None or not ex.complete:
            self._parse_error(_Rejected("protocol upgrades (Upgrade, CONNECT) are not supported by this router"))
            return
        if ex.transfer_encoding or ex.content_length:
            ex.complete = False  # set by the parser at the end of the head: the body is still to come
            self._parsing = ex
            framing = b"Transfer-Encoding: chunked" if ex.transfer_encoding else b"Content-Length: %d" % ex.content_length
            self._body_only = True
            self._parser.feed_data(b"POST / HTTP/1.1\r\n%b\r\n\r\n" % framing)
        rest = data[offset:]
        if rest:
            self._feed(rest)

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

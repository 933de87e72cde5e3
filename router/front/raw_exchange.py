"""One request of the raw front and its answer: the proxy's ``RequestView`` and ``ResponseWriter``
(``router.exchange``) over a client connection (``router.front.connection``).

The connection's parser callbacks fill the exchange (its head fields, then its body: ``chunks``,
``size``, ``complete``, ``too_large``, ``bad``, and ``wake`` for a reader waiting on it); the
proxy or the relay reads and answers it. It knows the connection only through
``ExchangeConnection``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from contract.errors import BadRequestError, PayloadTooLargeError, RequestTimeoutError
from router.exchange import Headers, drop_connection_options
from router.front.settings import ConnectionSettings
from router.front.wire import CONTINUE, LAST_CHUNK, DateServer, chunk, header_lines, status_line

if TYPE_CHECKING:
    from router.routes import Route

_NO_BODY_STATUSES = frozenset((204, 304))


class ExchangeConnection(Protocol):
    """What an exchange uses of its client connection."""

    loop: asyncio.AbstractEventLoop
    settings: ConnectionSettings
    #: the client's transport (its peer address); None before the connection is made
    transport: asyncio.Transport | None
    dates: DateServer
    #: no request after the current one (drain, Connection: close, an error)
    closing: bool
    #: the client is not reading its answers (the transport's buffer is over its high-water mark)
    write_paused: bool

    def write(self, data: bytes) -> None: ...

    def abort(self) -> None: ...

    async def drained(self) -> None: ...


class Exchange:
    """One request and its answer: the proxy's ``RequestView`` and ``ResponseWriter`` on the raw
    front (one object for both: one allocation per request)."""

    __slots__ = (
        "conn", "method", "raw_path", "path_qs", "route", "http10", "keep_alive", "head_only",
        "lines", "session_headers", "request_id", "content_length", "expect_continue", "agent_headers",
        "authorization_b",
        "conn_close", "conn_keep_alive", "url", "connection", "hosts", "bad_host", "transfer_encoding",
        "fields",
        "complete", "too_large", "bad", "chunks", "size", "_waiter",
        "started", "finished", "_pending", "_chunked",
    )  # fmt: skip

    def __init__(self, conn: ExchangeConnection) -> None:
        self.conn = conn
        self.method = ""
        self.raw_path = ""
        self.path_qs = ""
        self.route: Route | None = None
        self.http10 = False
        self.keep_alive = True
        self.head_only = False
        #: end-to-end header lines as received (``name: value\r\n``), DROP_REQUEST left out
        self.lines: list[bytes] = []
        self.session_headers: list[str] = []
        self.request_id: str | None = None
        #: agent session headers and x-parent-session-id, (lower-case name, value): ``capture``
        self.agent_headers: Sequence[tuple[str, str]] = ()
        #: the first Authorization value as received (forwarded as received too; see ``authorization``)
        self.authorization_b: bytes | None = None
        self.content_length: int | None = None
        self.expect_continue = False
        self.conn_close = False
        self.conn_keep_alive = False
        self.url = b""
        #: the Connection header values (their options are dropped from the forwarded headers)
        self.connection: list[str] = []
        #: Host header fields seen, and whether one was not a valid Host value
        self.hosts = 0
        self.bad_host = False
        self.transfer_encoding = False
        #: header fields seen (trailer fields included)
        self.fields = 0
        #: the whole body arrived
        self.complete = False
        self.too_large = False
        #: the body could not be parsed (bad chunking): why
        self.bad: str | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self._waiter: asyncio.Future[None] | None = None
        self.started = False
        self.finished = False
        self._pending = b""
        self._chunked = False

    def capture(self, lname: bytes, value: bytes) -> None:
        """Keep an agent header (the parser calls this; the first one makes the list)."""
        pair = (lname.decode("latin-1"), value.decode("utf-8", "surrogateescape"))
        kept = self.agent_headers
        if isinstance(kept, list):
            kept.append(pair)
        else:
            self.agent_headers = [pair]

    # ------------------------------------------------------------------ RequestView
    @property
    def authorization(self) -> str | None:
        raw = self.authorization_b
        return None if raw is None else raw.decode("utf-8", "surrogateescape")

    @property
    def peer(self) -> str | None:
        transport = self.conn.transport
        if transport is None:
            return None
        name = transport.get_extra_info("peername")
        if isinstance(name, (tuple, list)) and name:
            return str(name[0])
        return name if isinstance(name, str) and name else None  # a unix socket's path, if named

    def forward_headers(self) -> str:
        # names were checked by the parser (tokens), values in on_header (no CR, LF or NUL)
        rendered = b"".join(self.lines).decode("utf-8", "surrogateescape")
        return drop_connection_options(rendered, self.connection) if self.connection else rendered

    async def read_body(self) -> bytes:
        if not self.complete and not self.too_large and self.bad is None:
            conn = self.conn
            if self.expect_continue and not self.http10:
                self.expect_continue = False
                conn.write(CONTINUE)
            waiter = self._waiter = conn.loop.create_future()
            timeout = conn.settings.body_timeout_s
            try:
                async with asyncio.timeout(timeout):
                    await waiter
            except TimeoutError:
                raise RequestTimeoutError(
                    f"the request body did not arrive within {timeout:g} s (body_timeout_s); send the whole "
                    "body right after the head"
                ) from None
            finally:
                self._waiter = None
        if self.too_large:
            raise PayloadTooLargeError(
                f"request body exceeds the limit of {self.conn.settings.max_body_bytes} bytes (max_body_bytes)"
            )
        if self.bad is not None:
            raise BadRequestError(self.bad)
        chunks = self.chunks
        if not chunks:
            return b""
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ------------------------------------------------------------------ ResponseWriter
    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        if self.finished:
            return
        self.finished = True
        conn = self.conn
        if self.started:  # a stream is under way: cutting the connection is the only honest end
            conn.abort()
            return
        close = self._decide_close()
        if status in _NO_BODY_STATUSES or status < 200:
            framing = b""
            body = b""
        else:
            framing = b"Content-Length: %d\r\n" % len(body)
        head = b"".join((status_line(status, self.http10), conn.dates.lines(), header_lines(headers),
                         framing, self._connection_line(close), b"\r\n"))
        if self.head_only or not body:
            conn.write(head)
        elif len(body) < 65536:
            conn.write(head + body)
        else:
            conn.write(head)
            conn.write(body)

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        if self.http10:
            self.keep_alive = False  # close-delimited
        close = self._decide_close()
        self._chunked = not self.http10 and not self.head_only
        framing = b"Transfer-Encoding: chunked\r\n" if self._chunked else b""
        # sent with the first chunk (one write instead of two)
        self._pending = b"".join((status_line(status, self.http10), self.conn.dates.lines(),
                                  header_lines(headers), framing, self._connection_line(close), b"\r\n"))

    async def write(self, data: bytes) -> None:
        if not data or self.head_only:
            return
        conn = self.conn
        if self._chunked:
            data = chunk(data)
        if self._pending:
            data = self._pending + data
            self._pending = b""
        conn.write(data)
        if conn.write_paused:
            await conn.drained()

    async def end(self, last: bytes = b"") -> None:
        if self.finished:
            return
        self.finished = True
        if self.head_only:
            last = b""
        if self._chunked:
            tail = chunk(last) + LAST_CHUNK if last else LAST_CHUNK
        else:
            tail = last
        if self._pending or tail:
            self.conn.write(self._pending + tail)
            self._pending = b""

    def _decide_close(self) -> bool:
        """Whether the connection closes after this answer (fixed once the head is rendered)."""
        close = not self.keep_alive or not self.complete or self.conn.closing
        self.keep_alive = not close
        return close

    def _connection_line(self, close: bool) -> bytes:
        if close:
            return b"Connection: close\r\n"
        return b"Connection: keep-alive\r\n" if self.http10 else b""

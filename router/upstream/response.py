"""The response an upstream connection delivers: its head, and its body as the consumer reads it.

The consumer reads the body whole (``read``, bounded by ``max_body_bytes``) or as it arrives
(iteration); the connection (``router.upstream.connection``) feeds it through ``feed``, ``finish``
and ``fail``, and the response calls back only through ``BodySource``: resume or slow down
reading (back-pressure), or close the connection when the consumer gives up.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Protocol

from contract.errors import UpstreamProtocolError


class BodySource(Protocol):
    """What a response needs from the connection its body arrives on."""

    loop: asyncio.AbstractEventLoop
    #: ``host:port`` of the backend, for messages
    label: str
    #: a body read whole may not exceed this (``max_upstream_body_bytes``)
    max_body: int
    #: reading is paused because the consumer is behind
    paused: bool

    def resume(self) -> None:
        """Resume reading (the consumer takes the body whole)."""

    def consumed(self, buffered: int) -> None:
        """The consumer took bytes; ``buffered`` remain."""

    def abort(self) -> None:
        """Close the connection now: the consumer gave up on the body."""

    def fail(self, exc: BaseException) -> None:
        """End the exchange with ``exc`` and drop the connection."""


class UpstreamResponse:
    """A response whose head has been parsed; the body arrives through ``read`` or iteration.

    ``headers`` are as received minus hop-by-hop headers, ``Content-Length`` (framing is in
    ``content_length`` / ``chunked``; the proxy frames its own response) and the pool's
    ``drop_headers``. Names and values are decoded as UTF-8 with ``surrogateescape``: encoding them
    back the same way gives the exact bytes the backend sent (non-ASCII and non-UTF-8 bytes included).
    """

    __slots__ = (
        "status",
        "headers",
        "content_type",
        "content_length",
        "chunked",
        "_conn",
        "_loop",
        "_chunks",
        "_buffered",
        "_eof",
        "_exc",
        "_waiter",
        "_read_all",
        "_label",
        "_max_body",
    )

    def __init__(
        self,
        conn: BodySource,
        status: int,
        headers: list[tuple[str, str]],
        content_type: str,
        content_length: int | None,
        chunked: bool,
    ) -> None:
        self.status = status
        self.headers = headers
        self.content_type = content_type
        self.content_length = content_length
        self.chunked = chunked
        #: the connection while the body is incomplete; None once complete, failed or closed
        self._conn: BodySource | None = conn
        self._loop = conn.loop
        self._label = conn.label
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._read_all = False
        self._max_body = conn.max_body

    # ------------------------------------------------------------------ consumer side
    @property
    def buffered(self) -> int:
        """Body bytes received and not yet consumed."""
        return self._buffered

    @property
    def reading_paused(self) -> bool:
        """Whether the socket is paused because the consumer is behind (back-pressure)."""
        conn = self._conn
        return conn is not None and conn.paused

    @property
    def complete(self) -> bool:
        """The whole body has arrived (it may still be buffered here)."""
        return self._eof

    def header(self, name: str, default: str | None = None) -> str | None:
        """First value of a header, case-insensitive (a scan: for occasional look-ups)."""
        lname = name.lower()
        for key, value in self.headers:
            if key.lower() == lname:
                return value
        return default

    async def read(self) -> bytes:
        """The whole body. Raises ``UpstreamProtocolError`` if the backend broke off mid-body or the
        body exceeds the pool's ``max_body_bytes`` (the connection is closed then), and
        ``UpstreamTimeoutError`` past the total timeout. Cancelling it aborts the connection."""
        if not self._eof and self._exc is None:
            length = self.content_length
            if (length is not None and length > self._max_body) or self._buffered > self._max_body:
                self._too_large(length)
            else:
                self._read_all = True
                conn = self._conn
                if conn is not None and conn.paused:
                    conn.resume()
                while not self._eof and self._exc is None:
                    await self._wait()
        elif self._exc is None and self._buffered > self._max_body:
            self._too_large(self._buffered)
        if self._exc is not None:
            raise self._exc
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        return data

    def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (de-chunked; all bytes buffered so far are joined into one)."""
        return self

    def __aiter__(self) -> "UpstreamResponse":
        return self

    async def __anext__(self) -> bytes:
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                conn = self._conn
                if conn is not None and conn.paused:
                    conn.consumed(0)
                return data
            if self._exc is not None:
                raise self._exc
            if self._eof:
                raise StopAsyncIteration
            await self._wait()

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        except asyncio.CancelledError:
            self.close()
            raise
        finally:
            self._waiter = None

    def close(self) -> None:
        """Abort: if the body is not complete, close the connection now (the backend sees the
        disconnect and aborts its request). Idempotent; a no-op after a complete body."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.abort()
        if not self._eof and self._exc is None:
            self._exc = UpstreamProtocolError(f"response from backend {self._label} was closed before its end")
            self._wake()
        self._chunks.clear()
        self._buffered = 0

    async def __aenter__(self) -> "UpstreamResponse":
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<UpstreamResponse {self.status} from {self._label} eof={self._eof} buffered={self._buffered}>"

    # ------------------------------------------------------------------ producer side (the connection)
    def feed(self, body: bytes) -> int:
        """Body bytes arrived. Returns the bytes now buffered for the consumer to take (0 while
        ``read`` takes the body whole: never a reason to pause reading)."""
        self._chunks.append(body)
        buffered = self._buffered = self._buffered + len(body)
        if self._read_all:
            if buffered > self._max_body:
                self._too_large(None)
            return 0
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return buffered

    def finish(self) -> None:
        """The body is complete (the connection is done with this response)."""
        self._conn = None
        self._eof = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """The body cannot complete: ``exc`` is raised to the consumer (unless it was complete)."""
        self._conn = None
        if not self._eof and self._exc is None:
            self._exc = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _too_large(self, size: int | None) -> None:
        """The body is (or would be) over ``max_body_bytes``: fail the read, close the connection."""
        told = f" ({size} bytes)" if size is not None else ""
        exc = UpstreamProtocolError(
            f"backend {self._label} sent a response body larger than {self._max_body} bytes{told}, the "
            "router's bound on an answer it buffers whole (max_upstream_body_bytes)"
        )
        conn = self._conn
        if conn is not None:
            conn.fail(exc)  # closes the connection; fails this response through it
        self._exc = exc
        self._eof = False
        self._chunks.clear()
        self._buffered = 0
        self._wake()

"""One keep-alive upstream connection (an asyncio ``Protocol``): one exchange at a time.

The connection parses only what the proxy needs with ``httptools`` (llhttp, in C): the status
line and headers, then it relays body bytes (de-chunked) as they arrive. It carries one request
at a time. It holds no timers: the pool's sweeper calls ``check`` periodically.

Life of an exchange::

    send() ──> [waiting for head] ──on_headers_complete──> UpstreamResponse handed to the caller
                      │                                      │ on_body: buffer (pause reading above high water)
                      │                                      │ on_message_complete: back to the pool
                      └─ close/garbage/timeout: error        └─ close/timeout mid-body: error in the response
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import httptools

from contract.errors import UpstreamProtocolError, UpstreamTimeoutError
from router.upstream.config import UpstreamLimits
from router.upstream.head import HOP_BY_HOP
from router.upstream.response import UpstreamResponse

_HOP_BY_HOP_B = frozenset(h.encode() for h in HOP_BY_HOP)


class StaleConnectionError(UpstreamProtocolError):
    """A reused keep-alive connection was closed by the backend before any response byte.

    Internal: the pool retries once on a fresh connection; callers never see it.
    """


class UpstreamConnection(asyncio.Protocol):
    """One TCP connection to one backend; created by ``UpstreamPool``, which it calls back through
    ``on_release`` (a clean end of an exchange on a keep-alive connection: reuse it or close it)
    and ``on_lost`` (the connection closed)."""

    __slots__ = (
        "on_release",
        "on_lost",
        "max_body",
        "key",
        "label",
        "loop",
        "transport",
        "closed",
        "busy",
        "reused",
        "paused",
        "idle_since",
        "_parser",
        "_high",
        "_low",
        "_head_waiter",
        "_raw",
        "_drop",
        "_resp",
        "_got_data",
        "_complete",
        "_informational",
        "_until_close",
        "_keep_alive",
        "_poisoned",
        "_fb_deadline",
        "_total_deadline",
        "_fb_s",
        "_total_s",
        "_lost_waiter",
        "_max_head",
        "_head_left",
    )

    def __init__(self, key: tuple[str, int], loop: asyncio.AbstractEventLoop, limits: UpstreamLimits,
                 on_release: Callable[["UpstreamConnection"], None],
                 on_lost: Callable[["UpstreamConnection"], None], drop: frozenset[bytes] = frozenset()) -> None:
        """``drop``: lower-case names of response headers left out of ``UpstreamResponse.headers``
        besides the hop-by-hop ones (the pool's ``drop_headers``)."""
        self.on_release = on_release
        self.on_lost = on_lost
        #: a response body read whole may not exceed this (``max_upstream_body_bytes``)
        self.max_body = limits.max_body_bytes
        self.key = key
        self.label = f"{key[0]}:{key[1]}"
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.busy = False
        #: has completed an exchange before (so a silent close may be the keep-alive race)
        self.reused = False
        self.paused = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._high = limits.read_high_water
        self._low = limits.read_low_water
        self._head_waiter: asyncio.Future[UpstreamResponse] | None = None
        self._raw: list[tuple[bytes, bytes]] = []
        self._drop = drop
        self._resp: UpstreamResponse | None = None
        self._got_data = False
        self._complete = False
        self._informational = False
        self._until_close = False
        self._keep_alive = False
        self._poisoned = False
        self._fb_deadline = 0.0
        self._total_deadline = 0.0
        self._fb_s = 0.0
        self._total_s = 0.0
        self._lost_waiter: asyncio.Future[None] | None = None
        self._max_head = limits.max_head_bytes
        #: bytes the response head of the current exchange may still take
        self._head_left = 0

    # ------------------------------------------------------------------ the exchange
    def send(
        self, data: bytes, fb_deadline: float, total_deadline: float, fb_s: float, total_s: float
    ) -> "asyncio.Future[UpstreamResponse]":
        """Write one request; the future resolves with the response once its head is parsed."""
        waiter: asyncio.Future[UpstreamResponse] = self.loop.create_future()
        if self.closed or self.transport is None or self.transport.is_closing():
            if self.reused:
                waiter.set_exception(StaleConnectionError(f"backend {self.label} closed the idle connection"))
            else:
                waiter.set_exception(
                    UpstreamProtocolError(f"backend {self.label} closed the connection right after accepting it")
                )
            return waiter
        self.busy = True
        self._head_waiter = waiter
        self._raw = []
        self._resp = None
        self._got_data = False
        self._complete = False
        self._informational = False
        self._poisoned = False
        self._fb_deadline = fb_deadline
        self._total_deadline = total_deadline
        self._fb_s = fb_s
        self._total_s = total_s
        self._head_left = self._max_head
        self.transport.write(data)
        return waiter

    def abort(self) -> None:
        """Close the socket at once (no flush); the exchange in progress, if any, fails."""
        if self.busy:
            self.fail(UpstreamProtocolError(f"request to backend {self.label} was aborted"))
        elif not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()

    def close(self) -> None:
        """Close the socket (flushing what was written); only for a connection with no exchange."""
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def cancel(self, waiter: "asyncio.Future[UpstreamResponse]") -> None:
        """The caller of the exchange ``waiter`` (what ``send`` returned) gave up: if it is still
        this connection's exchange, abort it, so that the backend sees the client go."""
        if self.busy and self._head_waiter is waiter:
            self.abort()

    def shut_down(self, message: str) -> "asyncio.Future[None] | None":
        """The pool closes: fail the exchange in flight with ``UpstreamProtocolError(message)``, or
        close an idle connection. Returns a future done once the connection is lost (None: no socket)."""
        lost: asyncio.Future[None] | None = None
        if self.transport is not None:
            lost = self._lost_waiter = self.loop.create_future()
        if self.busy:
            self.fail(UpstreamProtocolError(message))
        elif self.transport is not None:
            self.closed = True
            self.transport.close()
        return lost

    def consumed(self, buffered: int) -> None:
        """The consumer took bytes; ``buffered`` remain. Resume reading at or below low water."""
        if self.paused and buffered <= self._low:
            self.resume()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def check(self, now: float, idle_timeout_s: float) -> None:
        """Called by the pool's sweeper: enforce deadlines and the idle timeout."""
        if self.busy:
            waiter = self._head_waiter
            if waiter is not None and not waiter.done() and now >= self._fb_deadline:
                self.fail(
                    UpstreamTimeoutError(f"backend {self.label} sent no response head within {self._fb_s:g} s")
                )
            elif now >= self._total_deadline:
                self.fail(
                    UpstreamTimeoutError(f"backend {self.label} did not finish its response within {self._total_s:g} s")
                )
        elif not self.closed and now - self.idle_since >= idle_timeout_s:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def fail(self, exc: BaseException) -> None:
        """End the current exchange with ``exc`` and drop the connection."""
        self.busy = False
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        resp = self._resp
        if resp is not None:
            self._resp = None
            resp.fail(exc)
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()

    def _release(self) -> None:
        """A clean end of message: hand the connection back to the pool (or close it)."""
        self.busy = False
        self._resp = None
        self._head_waiter = None
        if self.paused:
            self.resume()
        if self._keep_alive and not self._poisoned and not self.closed:
            self.reused = True
            self.on_release(self)
        else:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):  # not TCP (tests with unix sockets) or unsupported
                pass

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            # bytes on an idle connection: the backend is confused; never reuse this connection
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
            return
        self._got_data = True
        if self._resp is None and not self._complete:  # still in the response head
            left = self._head_left
            if len(data) > left:
                # feed only what the head may still take: the parser buffers nothing past the bound
                if left and not self._feed(data[:left]):
                    return
                if not self.busy:
                    return
                if self._resp is None and not self._complete:
                    self.fail(UpstreamProtocolError(
                        f"backend {self.label} sent a response head larger than {self._max_head} bytes "
                        "(max_upstream_head_bytes)"
                    ))
                    return
                data = data[left:]
            else:
                self._head_left = left - len(data)
        if self._feed(data) and self._complete and self.busy:
            self._release()

    def _feed(self, data: bytes) -> bool:
        """Parse ``data``; False when the exchange failed (the connection is closed)."""
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if isinstance(exc, httptools.HttpParserUpgrade):
                exc = httptools.HttpParserError("the backend switched protocols, which the router does not support")
            if self._complete:  # junk after a complete response: keep the response, drop the connection
                self._poisoned = True
            else:
                self.fail(UpstreamProtocolError(f"backend {self.label} sent an invalid HTTP response: {exc}"))
                return False
        return True

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.on_lost(self)
        lost = self._lost_waiter
        if lost is not None and not lost.done():
            lost.set_result(None)
        if not self.busy:
            return
        self.busy = False
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            if self.reused and not self._got_data:
                err: UpstreamProtocolError = StaleConnectionError(
                    f"backend {self.label} closed the reused connection before answering"
                )
            else:
                err = UpstreamProtocolError(
                    f"backend {self.label} closed the connection before sending a complete response head"
                )
            waiter.set_exception(err)
            return
        resp = self._resp
        if resp is None:
            return
        self._resp = None
        if self._until_close and exc is None:
            # a response framed by connection close: an orderly close (not a reset) is its clean end
            resp.finish()
        else:
            resp.fail(
                UpstreamProtocolError(
                    f"backend {self.label} closed the connection in the middle of the response body"
                    + (f" ({exc})" if exc is not None else "")
                )
            )

    def pause_writing(self) -> None:  # request bodies are in memory already; nothing to throttle
        pass

    def resume_writing(self) -> None:
        pass

    # ------------------------------------------------------------------ httptools callbacks
    def on_message_begin(self) -> None:
        if self._complete:
            # a second response to one request: never reuse this connection
            self._poisoned = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw.append((name, value))

    def on_headers_complete(self) -> None:
        if self._complete:
            return
        status = self._parser.get_status_code()
        if not 100 <= status <= 599:  # llhttp takes any three digits
            self.fail(UpstreamProtocolError(
                f"backend {self.label} answered with status {status:03d}, which is not an HTTP status (100-599)"
            ))
            return
        if status < 200:  # 1xx: skip it, the real response follows
            self._informational = True
            self._raw = []
            return
        headers: list[tuple[str, str]] = []
        content_type = ""
        content_length: int | None = None
        chunked = False
        named: list[bytes] | None = None
        drop = self._drop
        for name, value in self._raw:
            lname = name.lower()
            if lname in _HOP_BY_HOP_B:
                if lname == b"transfer-encoding":
                    chunked = value.rsplit(b",", 1)[-1].strip().lower() == b"chunked"
                elif lname == b"connection":
                    tokens = [t.strip() for t in value.lower().split(b",")]
                    extra = [t for t in tokens if t not in (b"keep-alive", b"close", b"")]
                    if extra:
                        named = (named or []) + extra
                continue
            if lname == b"content-length":
                content_length = int(value)  # llhttp validated it
                continue
            if lname == b"content-type":
                content_type = value.decode("latin-1")
            if lname in drop:
                continue
            headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))
        if named:
            listed = {n.decode("latin-1") for n in named}
            headers = [h for h in headers if h[0].lower() not in listed]
        self._raw = []
        waiter = self._head_waiter
        if waiter is None or waiter.done():  # the caller was cancelled meanwhile: drop the exchange
            self.fail(UpstreamProtocolError(f"request to backend {self.label} was cancelled"))
            return
        self._until_close = content_length is None and not chunked
        resp = UpstreamResponse(self, status, headers, content_type, content_length, chunked)
        self._resp = resp
        waiter.set_result(resp)

    def on_body(self, body: bytes) -> None:
        resp = self._resp
        if resp is None:
            return
        if resp.feed(body) > self._high and not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        if self._complete:
            return
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()
        resp = self._resp
        if resp is not None:
            self._resp = None  # bytes after this message are not its body
            resp.finish()

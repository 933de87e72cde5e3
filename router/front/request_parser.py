"""The raw front's request parser: bytes from a client connection into ``Exchange`` objects.

``httptools`` (llhttp) calls back here; the callbacks check each head and bound it, and fill the
exchange (its head fields, then its body). Each whole head is handed to the connection
(``on_request``); the connection (``router.front.connection``) runs the exchanges, in order.

HTTP/1.x rules kept here (aiohttp's front keeps the same, see ``contract.aiohttp_json_errors``):
trailer fields after a chunked body are discarded (never headers, never forwarded, never a
session id); the headers a ``Connection`` header names are not forwarded
(``drop_connection_options``); an HTTP/1.1 request needs exactly one valid ``Host`` (else 400);
an HTTP/1.0 request with ``Transfer-Encoding`` closes the connection after its answer; an
``Upgrade`` offer (h2c, websocket) is ignored and the request served; the head limit
(``max_head_bytes``) counts the request line, every header line and the blank line. A malformed
request raises ``Rejected`` out of ``feed`` (answered 400 by the connection).

Besides the headers it drops, the parser keeps a few forwarded ones for the proxy
(``ConnectionSettings.capture_b``): agent clients' session headers (``router.sessions.agents``) and
``Authorization`` (its raw value, hashed by the proxy only when it derives a session id). A header
that is neither costs the one set lookup every header always cost (``watch_b``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import httptools

from contract.aiohttp_json_errors import HOST_MESSAGE, MALFORMED_MESSAGE, MAX_LINE_BYTES, valid_host
from router.exchange import REQUEST_ID_HEADER
from router.front.raw_exchange import Exchange, ExchangeConnection
from router.front.settings import ConnectionSettings

if TYPE_CHECKING:
    from router.routes import Route

#: header fields in one head (and trailer fields after a chunked body)
MAX_HEADERS = 256
#: bytes of a request line beyond its method and target: " " + " HTTP/1.1" + CRLF
_REQUEST_LINE_EXTRA = 12

_REQUEST_ID_B = REQUEST_ID_HEADER.lower().encode()


def head_too_large(max_head_bytes: int) -> str:
    """The 400's message for a head over ``max_head_bytes`` (request line + headers + the blank line)."""
    return (f"request head too large: the request line and headers together may not exceed {max_head_bytes} "
            f"bytes (nor {MAX_HEADERS} header fields); send fewer or shorter headers")


class Rejected(Exception):
    """The request is malformed (answered 400, then the connection closes)."""

    def __init__(self, message: str = MALFORMED_MESSAGE) -> None:
        super().__init__(message)
        self.message = message


class RequestParser:
    """The ``httptools`` callbacks of one client connection; made by the connection, fed by it."""

    __slots__ = (
        "parsing", "_conn", "_on_request", "_route_for", "_parser", "_last", "_in_head", "_head_bytes",
        "_head_read", "_head_tail", "_begun", "_body_only", "_session_b", "_watch_b", "_capture_b", "_max_head",
        "_max_body", "_host_ok",
    )  # fmt: skip

    def __init__(self, conn: ExchangeConnection, settings: ConnectionSettings,
                 route_for: Callable[[bytes, bytes, str], Route | None],
                 on_request: Callable[[Exchange], None]) -> None:
        """``conn``: what the exchanges answer on; ``route_for``: the route served natively for a
        request line (None: relayed); ``on_request``: a whole head was parsed (its body may follow)."""
        self._conn = conn
        self._route_for = route_for
        self._on_request = on_request
        self._parser = httptools.HttpRequestParser(self)
        #: the exchange whose bytes are being parsed (may be queued already, waiting for its body)
        self.parsing: Exchange | None = None
        #: the exchange whose head was parsed last in this message (an upgrade offer's, see ``_upgrade``)
        self._last: Exchange | None = None
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
        #: the parser is reading a made-up head that frames the body of an upgrade offer (``_upgrade``)
        self._body_only = False
        #: the session header's name (lower case); the headers looked at (the ones not forwarded as
        #: received, and the forwarded ones kept for the proxy: ``capture_b``); any other header is
        #: forwarded after one set lookup
        self._session_b = settings.session_header_b
        self._watch_b = settings.watch_b
        self._capture_b = settings.capture_b
        #: a head over this many bytes is refused (``max_head_bytes``)
        self._max_head = settings.max_head_bytes
        #: a larger body gets a 413 (``max_body_bytes``)
        self._max_body = settings.max_body_bytes
        #: the last ``Host`` value found valid on this connection (None: none yet)
        self._host_ok: bytes | None = None

    def feed(self, data: bytes) -> bytes:
        """Parse ``data``: each whole head goes to ``on_request``, body bytes into its exchange.
        Returns input the parser handed back unparsed (after a protocol upgrade offer: parse it
        next); raises ``Rejected`` for a malformed request (the parser is of no use after it)."""
        if self._in_head:  # a head continues: count its bytes in this piece (up to its end, if here)
            tail = self._head_tail
            end = (tail + data).find(b"\r\n\r\n") if tail else data.find(b"\r\n\r\n")
            self._head_read += len(data) if end < 0 else max(end + 4 - len(tail), 0)
            if self._head_read > self._max_head:
                raise Rejected(head_too_large(self._max_head))
            idle = False
        else:  # no message under way: one that begins here begins at this piece's first byte
            idle = self.parsing is None
        self._begun = 0
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            return self._upgrade(data, exc.args[0] if exc.args else len(data))
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            raise (cause if isinstance(cause, Rejected) else Rejected()) from None
        else:
            if self._in_head:  # the head goes on in the next piece
                self._head_tail = data[-3:]
                if idle and self._begun == 1:
                    # it began with this piece: all of it is head (a head that began after another
                    # request's end is counted from what the parser reports, whitespace aside)
                    self._head_read = len(data)
        return b""

    def _upgrade(self, data: bytes, offset: int) -> bytes:
        """A request offered a protocol upgrade (``Upgrade`` with ``Connection: upgrade``, e.g.
        h2c): the router speaks HTTP/1.1 only, so it ignores the offer (RFC 9110 §7.8) and serves
        the request as any other, as aiohttp does. httptools ends such a message at its head and
        hands back the rest of the input at ``offset``: a made-up head with the request's own
        framing lets the parser read the body into the request, then parsing goes on as usual with the rest (returned).
        (CONNECT never gets here: its head is refused.)"""
        ex = self._last
        if ex is None or not ex.complete:
            raise Rejected("protocol upgrades (Upgrade, CONNECT) are not supported by this router")
        if ex.transfer_encoding or ex.content_length:
            ex.complete = False  # set by the parser at the end of the head: the body is still to come
            self.parsing = ex
            framing = b"Transfer-Encoding: chunked" if ex.transfer_encoding else b"Content-Length: %d" % ex.content_length
            self._body_only = True
            self._parser.feed_data(b"POST / HTTP/1.1\r\n%b\r\n\r\n" % framing)
        return data[offset:]

    # ------------------------------------------------------------------ httptools callbacks
    def on_message_begin(self) -> None:
        if self._body_only:
            return
        self.parsing = Exchange(self._conn)
        self._last = None
        self._in_head = True
        self._head_bytes = self._head_read = 0
        self._head_tail = b""
        self._begun += 1

    def on_url(self, url: bytes) -> None:
        if self._body_only:
            return
        ex = self.parsing
        assert ex is not None
        ex.url += url
        if len(ex.url) > MAX_LINE_BYTES:
            raise Rejected()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._body_only:
            return
        ex = self.parsing
        assert ex is not None
        size = len(name) + len(value)
        if size > MAX_LINE_BYTES:
            raise Rejected()
        fields = ex.fields = ex.fields + 1
        if fields > MAX_HEADERS:
            raise Rejected(head_too_large(self._max_head))
        if not self._in_head:
            return  # a trailer field (after a chunked body): never a header, never forwarded (RFC 9110 §6.5)
        head = self._head_bytes = self._head_bytes + size + 4  # name ": " value CRLF
        if head > self._max_head:
            raise Rejected(head_too_large(self._max_head))
        # llhttp (strict) refuses CR, LF and NUL in a value, so none reaches a backend (the bad-input
        # corpus, tests/contract/corpus/headers.json, pins it); it does leave trailing spaces and tabs in
        # the value, stripped here
        value = value.strip(b" \t")
        lname = name.lower()
        if lname not in self._watch_b:
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
            if value != self._host_ok:  # a keep-alive client sends the same Host on every request
                if valid_host(value.decode("latin-1")):
                    self._host_ok = value
                else:
                    ex.bad_host = True
        elif lname == b"transfer-encoding":
            ex.transfer_encoding = True
        elif lname == b"expect":
            ex.expect_continue = value.lower() == b"100-continue"
        elif lname in self._capture_b:  # forwarded, and kept for the proxy (agent sessions, the sender)
            ex.lines.append(b"%b: %b\r\n" % (name, value))
            if lname == b"authorization":
                if ex.authorization_b is None:
                    ex.authorization_b = value
            else:
                ex.capture(lname, value)

    def on_headers_complete(self) -> None:
        if self._body_only:
            self._body_only = False
            return
        ex = self.parsing
        assert ex is not None
        self._in_head = False
        parser = self._parser
        method = parser.get_method()
        url = ex.url
        self._head_bytes += len(method) + len(url) + _REQUEST_LINE_EXTRA + 2  # the request line, the blank line
        if self._head_bytes > self._max_head:
            raise Rejected(head_too_large(self._max_head))
        version = parser.get_http_version()
        if version == "1.1":
            ex.keep_alive = not ex.conn_close
            if ex.hosts != 1:
                raise Rejected(HOST_MESSAGE)
        elif version == "1.0":
            ex.http10 = True
            # RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing: close after it
            ex.keep_alive = ex.conn_keep_alive and not ex.conn_close and not ex.transfer_encoding
            if ex.hosts > 1:
                raise Rejected(HOST_MESSAGE)
        else:
            raise Rejected(f"HTTP/{version} is not supported: send HTTP/1.1 (or HTTP/1.0)")
        if ex.bad_host:
            raise Rejected(HOST_MESSAGE)
        if url[:1] != b"/":
            raise Rejected(
                "the request target must be a path starting with '/' (origin-form): this router is a "
                "reverse proxy, not a forward proxy; send e.g. POST /v1/completions with the router's "
                "address in the Host header"
            )
        if method == b"CONNECT":  # even with a path target: tunnels are a forward proxy's business
            raise Rejected("CONNECT is not supported: this router is a reverse proxy, not a forward proxy")
        ex.method = method.decode("ascii")
        ex.head_only = method == b"HEAD"
        ex.raw_path = ex.path_qs = url.decode("utf-8", "surrogateescape")
        ex.route = self._route_for(method, url, ex.raw_path)
        if ex.content_length is not None and ex.content_length > self._max_body:
            ex.too_large = True  # decided before the body: it is discarded, not buffered
        self._last = ex
        self._on_request(ex)

    def on_body(self, body: bytes) -> None:
        ex = self.parsing
        if ex is None or ex.too_large:
            return
        ex.size += len(body)
        if ex.size > self._max_body:
            ex.too_large = True  # stop buffering: the answer is a 413
            ex.chunks.clear()
            ex.wake()
            return
        ex.chunks.append(body)

    def on_message_complete(self) -> None:
        ex = self.parsing
        self.parsing = None
        if ex is not None:
            ex.complete = True
            ex.wake()

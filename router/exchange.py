"""The proxy's seam: what it needs from a front, a request view and a response writer.

``Proxy.handle(request, writer, route)`` reads the request through ``RequestView`` and answers
through ``ResponseWriter``; it never touches a server framework. The proxy owns this seam; the
fronts implement it: ``router.front.aiohttp_adapter`` (aiohttp's ``web.Request``) and
``router.front.raw_exchange`` (the raw ``asyncio.Protocol`` + httptools front).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from contract.session import SESSION_HEADER
from router.upstream import HOP_BY_HOP
from router.upstream.head import drop_connection_options

__all__ = ["DROP_REQUEST", "REQUEST_ID_HEADER", "Headers", "RequestView", "ResponseWriter", "drop_connection_options"]

REQUEST_ID_HEADER = "X-Request-Id"

#: request headers never forwarded as received (lower case): hop-by-hop ones, the framing the
#: upstream head sets itself, and the ones the router sets
DROP_REQUEST = frozenset(
    {h.lower() for h in ("Host", "Content-Length", "Expect", SESSION_HEADER, REQUEST_ID_HEADER)} | HOP_BY_HOP
)

#: response header pairs: (name, value), in order
Headers = Sequence[tuple[str, str]]


class RequestView(Protocol):
    """One client request, as far as the proxy reads it."""

    @property
    def method(self) -> str: ...

    @property
    def raw_path(self) -> str:
        """The request target as received (origin-form starts with "/")."""
        ...

    @property
    def path_qs(self) -> str:
        """The target forwarded upstream: path and query."""
        ...

    @property
    def session_headers(self) -> Sequence[str]:
        """Every value of the session header (``X-Session-ID``, or the configured ``session_header``),
        as received (surrounding whitespace removed); that header is never forwarded as received."""
        ...

    @property
    def request_id(self) -> str | None:
        """The client's ``X-Request-Id``, if any."""
        ...

    @property
    def agent_headers(self) -> Sequence[tuple[str, str]]:
        """(lower-case name, value) of every agent session header and ``x-parent-session-id``
        received (``router.sessions.agents.CAPTURED_HEADERS``; the configured session header is
        never one of them), in order; empty when none. They are forwarded as received too."""
        ...

    @property
    def authorization(self) -> str | None:
        """The ``Authorization`` header's value (the first one), if any: read only to derive a
        session id (``router.sessions.derive.sender_key`` hashes it); never stored or logged."""
        ...

    @property
    def peer(self) -> str | None:
        """The client's address (IP, no port) as the connection shows it; None when unknown."""
        ...

    @property
    def content_length(self) -> int | None:
        """The declared ``Content-Length`` (None for chunked or no body)."""
        ...

    def forward_headers(self) -> str:
        """The end-to-end header lines for the backend, rendered once (``name: value\\r\\n`` each):
        every header except ``DROP_REQUEST``, validated (no CR, LF or NUL in a value, token names)."""
        ...

    async def read_body(self) -> bytes:
        """The whole body. Raises ``PayloadTooLargeError`` once it exceeds ``max_body_bytes``."""
        ...


class ResponseWriter(Protocol):
    """The answer to one request: either one whole response, or a stream."""

    @property
    def started(self) -> bool:
        """A stream's head was committed: a whole response can no longer be sent."""
        ...

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        """Send a whole response (the front adds the framing: Content-Length, Date, Server)."""
        ...

    async def start(self, status: int, headers: Headers) -> None:
        """Begin a streamed response (chunked on HTTP/1.1, close-delimited on HTTP/1.0)."""
        ...

    async def write(self, chunk: bytes) -> None:
        """Send one piece of the stream; waits while the client is not reading (back-pressure)."""
        ...

    async def end(self, last: bytes = b"") -> None:
        """Finish the stream; ``last``: its final piece, sent with the end (``write(last)`` then ``end()``
        in one send)."""
        ...

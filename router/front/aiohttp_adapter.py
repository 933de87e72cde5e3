"""The proxy's request view and response writer over aiohttp (``web.Request`` / ``web.StreamResponse``).

``proxy_handler(proxy, route)`` is the aiohttp handler of a proxied route: it wraps the request,
lets ``Proxy.handle`` answer through the writer, and returns the response aiohttp sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from aiohttp import web

from contract.errors import PayloadTooLargeError, RequestTimeoutError
from router.exchange import DROP_REQUEST, REQUEST_ID_HEADER, Headers, drop_connection_options
from router.sessions.agents import CAPTURED_HEADERS
from router.upstream import render_headers

if TYPE_CHECKING:
    from router.proxy import Proxy
    from router.routes import Route


class AiohttpRequest:
    """``RequestView`` over ``web.Request``."""

    __slots__ = ("_request", "_body_timeout_s", "_session_header", "_drop", "_agent_names")

    def __init__(self, request: web.Request, body_timeout_s: float, session_header: str,
                 drop: frozenset[str] = DROP_REQUEST, agent_names: tuple[str, ...] = CAPTURED_HEADERS) -> None:
        """``agent_names``: the agent headers to read (``CAPTURED_HEADERS`` without the configured
        session header, which is the vLLM channel whatever its name)."""
        self._request = request
        self._body_timeout_s = body_timeout_s
        self._session_header = session_header
        self._drop = drop
        self._agent_names = agent_names

    @property
    def method(self) -> str:
        return self._request.method

    @property
    def raw_path(self) -> str:
        return self._request.raw_path

    @property
    def path_qs(self) -> str:
        return self._request.path_qs

    @property
    def session_headers(self) -> Sequence[str]:
        return self._request.headers.getall(self._session_header, ())

    @property
    def request_id(self) -> str | None:
        return self._request.headers.get(REQUEST_ID_HEADER)

    @property
    def agent_headers(self) -> Sequence[tuple[str, str]]:
        headers = self._request.headers
        return [(name, value.strip(" \t")) for name in self._agent_names for value in headers.getall(name, ())]

    @property
    def authorization(self) -> str | None:
        return self._request.headers.get("Authorization")

    @property
    def peer(self) -> str | None:
        return self._request.remote

    @property
    def content_length(self) -> int | None:
        return self._request.content_length

    def forward_headers(self) -> str:
        headers = self._request.headers
        rendered = render_headers((k, v) for k, v in headers.items() if k.lower() not in self._drop)
        return drop_connection_options(rendered, headers.getall("Connection", ()))

    async def read_body(self) -> bytes:
        request = self._request
        if request.content.is_eof():  # the whole body arrived with the head: no timer needed
            return await request.read()
        timeout = self._body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await request.read()
        except TimeoutError:
            raise RequestTimeoutError(
                f"the request body did not arrive within {timeout:g} s (body_timeout_s); send the whole "
                "body right after the head"
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLargeError(
                f"request body exceeds the limit of {self._request.client_max_size} bytes (max_body_bytes)"
            ) from None


class AiohttpWriter:
    """``ResponseWriter`` building the ``web.StreamResponse`` the handler returns."""

    __slots__ = ("_request", "response")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None and self.response.prepared

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        if self.started:
            # a stream is under way: the only honest answer is to cut the connection
            raise ConnectionResetError("cannot send a whole response after a stream started")
        self.response = web.Response(status=status, body=body, headers=list(headers))

    async def start(self, status: int, headers: Headers) -> None:
        response = web.StreamResponse(status=status, headers=list(headers))
        self.response = response
        await response.prepare(self._request)  # aiohttp sets TCP_NODELAY on every connection

    async def write(self, chunk: bytes) -> None:
        assert self.response is not None
        await self.response.write(chunk)

    async def end(self, last: bytes = b"") -> None:
        assert self.response is not None
        await self.response.write_eof(last)


def proxy_handler(proxy: "Proxy", route: "Route") -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The aiohttp handler of one proxied route."""

    body_timeout = proxy.config.front.body_timeout_s
    session_header = proxy.session_header
    drop = DROP_REQUEST | {session_header.lower()}
    agent_names = tuple(name for name in CAPTURED_HEADERS if name not in drop)

    async def handle(request: web.Request) -> web.StreamResponse:
        writer = AiohttpWriter(request)
        await proxy.handle(AiohttpRequest(request, body_timeout, session_header, drop, agent_names), writer, route)
        assert writer.response is not None, "Proxy.handle always answers"
        return writer.response

    return handle

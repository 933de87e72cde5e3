"""aiohttp's parser-level error pages in OpenAI's error shape, for the router and the backends.

Errors that aiohttp's HTTP parser raises before any handler runs (a control character or bare
CR/LF in a header, a line over the size limit, a malformed request line) are answered in OpenAI's
error shape too. aiohttp answers those with a ``text/plain`` body built in
``RequestHandler.handle_error`` and logs the raw request bytes with a traceback.
``JsonErrorAppRunner`` makes the server create ``JsonErrorRequestHandler``s instead, which answer
``{"error": {...}}`` with a generic message (never echoing the offending bytes: they may hold
session ids) and log one line at DEBUG.

The handler also keeps HTTP/1.x the way the router's raw front (``router.front.connection``)
keeps it (that front answers with the same messages, ``HOST_MESSAGE`` and ``MALFORMED_MESSAGE``):

- a request whose ``Host`` is not a valid host (RFC 9110 §7.2) is a 400, as a missing or
  duplicated one already is (aiohttp checks those);
- an HTTP/1.0 request with ``Transfer-Encoding`` closes the connection after its answer
  (RFC 9112 §6.1);
- a request that closes the connection (``Connection: close``, HTTP/1.0 without keep-alive) is
  answered, and whatever the client sent after it is discarded, not answered with a 400: the
  parser reads one request at a time (it stops after each; the next is parsed once the handler
  takes this one), so it never reads past the request that ends the connection;
- during a drain (``Server.pre_shutdown``) every answer says ``Connection: close``.

This overrides PRIVATE aiohttp hooks and attributes (``AppRunner._make_server``,
``Server._kwargs``/``_loop``, ``RequestHandler._parser``/``_messages``/``_manager``/
``_max_msg_queue_size``, ``web_protocol._ErrInfo``), which aiohttp may change in any release:
pyproject.toml pins aiohttp below the next minor version for that reason. Before raising the
pin, run tests/router/front/test_front_http.py, tests/router/test_security_defaults.py and
tests/backends/test_backend_errors.py against the new version.

A server with a cap on open connections (the router's) builds on this: ``JsonErrorServer`` has a
``handler_class`` and ``JsonErrorAppRunner`` a ``server_class`` to override.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import secrets
from typing import Any

from aiohttp import web
from aiohttp.http import HttpRequestParser, HttpVersion10
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo
from aiohttp.web_request import BaseRequest

from contract.errors import error_body

log = logging.getLogger(__name__)

#: longest request line / header line accepted (aiohttp's default is 8190). Longer session ids
#: are still rejected, by the session contract, in OpenAI's shape.
MAX_LINE_BYTES = 32 * 1024

MALFORMED_MESSAGE = (
    "malformed HTTP request: the request line or a header is invalid (control characters, bare CR "
    f"or LF, and lines over {MAX_LINE_BYTES} bytes are not accepted); fix the request and send it again"
)


#: RFC 9110 §7.2: ``Host = uri-host [ ":" port ]`` (an IP literal in brackets, or a reg-name of
#: unreserved, sub-delims and pct-encoded characters; possibly empty)
_HOST = re.compile(r"(?:\[[0-9A-Za-z:._~!$&'()*+,;=%-]+\]|[0-9A-Za-z._~!$&'()*+,;=%-]*)(?::[0-9]*)?")

HOST_MESSAGE = (
    "invalid Host header: an HTTP/1.1 request needs exactly one Host header whose value is a host name "
    "or address with an optional port (e.g. Host: router.example:8000); fix the request and send it again"
)


def valid_host(value: str) -> bool:
    """A ``Host`` value of the RFC 9110 grammar (ASCII, no whitespace, userinfo or path)."""
    return _HOST.fullmatch(value) is not None


#: RequestHandler's parser settings and their defaults (the handler builds its own parser with them)
_PARSER_DEFAULTS = {
    name: param.default for name, param in inspect.signature(RequestHandler.__init__).parameters.items()
    if name in ("read_bufsize", "max_line_size", "max_field_size", "max_headers", "auto_decompress")
}


class JsonErrorRequestHandler(RequestHandler):
    """aiohttp's request handler answering parser-level errors in OpenAI's shape (see the module)."""

    def __init__(self, manager: web.Server, *, loop: asyncio.AbstractEventLoop, **kwargs: Any) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        settings = {**_PARSER_DEFAULTS, **{k: v for k, v in kwargs.items() if k in _PARSER_DEFAULTS}}
        # one request at a time: the parser pauses after each message (max_msg_queue_size=1) and
        # is fed again once the handler took it, so it never parses past a request that closes
        self._parser = HttpRequestParser(
            self, loop, settings["read_bufsize"], max_line_size=settings["max_line_size"],
            max_field_size=settings["max_field_size"], max_headers=settings["max_headers"],
            payload_exception=RequestPayloadError, auto_decompress=settings["auto_decompress"],
            max_msg_queue_size=1,
        )
        self._max_msg_queue_size = 1
        self._msg_queue_resume_size = 0
        #: the body of the last request that closes the connection: once it is whole, input is discarded
        self._closing_payload: StreamReader | None = None
        #: the server drains: every answer says Connection: close
        self.draining = False

    def data_received(self, data: bytes) -> None:
        closing = self._closing_payload
        if closing is not None and closing.is_eof():
            return  # after the request that closes the connection: not read (as on the raw front)
        queued = len(self._messages)
        super().data_received(data)
        if len(self._messages) > queued:
            self._check(len(self._messages) - 1)

    def _check(self, index: int) -> None:
        message, payload = self._messages[index]
        if isinstance(message, _ErrInfo):
            return
        host = message.headers.get("Host")
        if host is not None and not valid_host(host):
            exc = BadHttpMessage(HOST_MESSAGE)
            self._messages[index] = (_ErrInfo(status=400, exc=exc, message=HOST_MESSAGE), EMPTY_PAYLOAD)
            self._closing_payload = payload
            return
        if message.version == HttpVersion10 and "Transfer-Encoding" in message.headers and not message.should_close:
            message = message._replace(should_close=True)  # RFC 9112 §6.1: faulty framing, close after it
            self._messages[index] = (message, payload)
        if message.should_close:
            self._closing_payload = payload

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send the error")
        if status >= 500:
            self.log_exception("error handling request", exc_info=exc)
            text = "internal server error; see the server's log"
        else:
            log.debug("rejected a malformed request from %s: %s", request.remote, type(exc).__name__)
            host = isinstance(exc, BadHttpMessage) and (exc.message == HOST_MESSAGE or "'Host' header" in exc.message)
            text = HOST_MESSAGE if host else MALFORMED_MESSAGE
        resp = web.Response(status=status, body=error_body(status, text), content_type="application/json",
                            headers={"X-Request-Id": secrets.token_hex(8)})
        resp.force_close()
        return resp


class JsonErrorServer(web.Server):
    """``web.Server`` whose connections are ``handler_class`` handlers (set on aiohttp's own
    server by ``JsonErrorAppRunner``: same layout, only the handler factory differs)."""

    handler_class: type[JsonErrorRequestHandler] = JsonErrorRequestHandler

    def __call__(self) -> RequestHandler:
        return self.handler_class(self, loop=self._loop, **self._kwargs)

    def pre_shutdown(self) -> None:
        for conn in self.connections:
            if isinstance(conn, JsonErrorRequestHandler):
                conn.draining = True
        super().pre_shutdown()


async def _close_when_draining(request: web.Request, response: web.StreamResponse) -> None:
    if getattr(request.protocol, "draining", False):
        response.force_close()
        response.headers["Connection"] = "close"  # (the hook runs after aiohttp chose the header)


class JsonErrorAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer parser-level errors in OpenAI's shape, with
    request and header lines up to ``MAX_LINE_BYTES`` unless given otherwise."""

    server_class: type[JsonErrorServer] = JsonErrorServer

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        kwargs.setdefault("max_line_size", MAX_LINE_BYTES)
        kwargs.setdefault("max_field_size", MAX_LINE_BYTES)
        super().__init__(app, **kwargs)
        if not app.frozen:
            app.on_response_prepare.append(_close_when_draining)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        if type(server) is web.Server:  # same layout: only the handler factory differs
            server.__class__ = self.server_class
        return server

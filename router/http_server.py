"""aiohttp server plumbing shared by the router and the backends: errors that aiohttp's HTTP
parser raises before any handler runs (a control character or bare CR/LF in a header, a line
over the size limit, a malformed request line) are answered in OpenAI's error shape too.

aiohttp answers those with a ``text/plain`` body built in ``RequestHandler.handle_error`` and
logs the raw request bytes with a traceback. ``JsonErrorAppRunner`` makes the server create
``JsonErrorRequestHandler``s instead, which answer ``{"error": {...}}`` with a generic message
(never echoing the offending bytes: they may hold session ids) and log one line at DEBUG.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from router.errors import error_body

log = logging.getLogger(__name__)

#: longest request line / header line accepted (aiohttp's default is 8190). Longer session ids
#: are still rejected, by the session contract, in OpenAI's shape.
MAX_LINE_BYTES = 32 * 1024

MALFORMED_MESSAGE = (
    "malformed HTTP request: the request line or a header is invalid (control characters, bare CR "
    f"or LF, and lines over {MAX_LINE_BYTES} bytes are not accepted); fix the request and send it again"
)


class JsonErrorRequestHandler(RequestHandler):
    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send the error")
        if status >= 500:
            self.log_exception("error handling request", exc_info=exc)
            text = "internal server error; see the server's log"
        else:
            log.debug("rejected a malformed request from %s: %s", request.remote, type(exc).__name__)
            text = MALFORMED_MESSAGE
        resp = web.Response(status=status, body=error_body(status, text), content_type="application/json",
                            headers={"X-Request-Id": secrets.token_hex(8)})
        resp.force_close()
        return resp


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer parser-level errors in OpenAI's shape."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        kwargs.setdefault("max_line_size", MAX_LINE_BYTES)
        kwargs.setdefault("max_field_size", MAX_LINE_BYTES)
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        if type(server) is web.Server:  # same layout: only the handler factory differs
            server.__class__ = _JsonErrorServer
        return server

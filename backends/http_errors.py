"""Every error answer of session-backend, made in one place.

``error_middleware`` turns what a handler raises into vLLM's JSON
``{"error": {"message", "type", "param", "code"}}``: the ``contract.errors`` tree, the engine's
plain exceptions (``backends.engine.errors``, mapped by ``http_error``: the engine knows no
HTTP), aiohttp's 404/405/413, and anything unexpected (500, logged, no traceback in the body).
A stream whose headers are out puts the same body in the stream (``backends.generation``).
Every answer carries ``X-Request-Id``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from backends.engine.errors import DuplicateRequestIdError, EngineDeadError, EngineError
from backends.frontend import REQUEST_ID_HEADER, REQUEST_ID_KEY, REQUEST_IDS
from contract.errors import BadRequestError, SessionRouterError, error_body

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ClientDisconnected(Exception):
    """The client went away while its request was running; nothing more is sent."""


class EngineUnavailableError(SessionRouterError):
    """503: the engine loop is not running (``EngineDeadError``)."""

    status = 503
    error_type = "ServiceUnavailableError"


def http_error(exc: EngineError) -> SessionRouterError:
    """The HTTP answer of an engine exception: a dead engine is a 503, a duplicate request id a
    400 (param ``request_id``); one not mapped here is a 500."""
    if isinstance(exc, EngineDeadError):
        return EngineUnavailableError(exc.message, param=exc.param)
    if isinstance(exc, DuplicateRequestIdError):
        return BadRequestError(exc.message, param=exc.param)
    return SessionRouterError(exc.message, param=exc.param)


def _error_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json", headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        resp = await handler(request)
    except SessionRouterError as exc:
        resp = _error_response(exc.status, exc.body())
    except EngineError as exc:
        error = http_error(exc)
        resp = _error_response(error.status, error.body())
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        resp = _http_error(request, exc)
    except ClientDisconnected:
        resp = web.Response(status=499)  # never sent: the client is gone
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        resp = _error_response(
            500, error_body(500, "The server had an unexpected error while processing the request; see its log.")
        )
    if not resp.prepared and REQUEST_ID_HEADER not in resp.headers:
        rid = request.get(REQUEST_ID_KEY) or request.headers.get(REQUEST_ID_HEADER)
        if rid is None:
            rid = request.app[REQUEST_IDS].next()
        resp.headers[REQUEST_ID_HEADER] = rid
    return resp


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    status = exc.status
    headers: dict[str, str] = {}
    if status == 404:
        message = f"Not Found: no route for {request.method} {request.path}."
    elif status == 405:
        allowed = sorted(getattr(exc, "allowed_methods", ()) or ())
        message = f"Method Not Allowed: {request.method} {request.path}; use {', '.join(allowed) or 'another method'}."
        if allowed:
            headers["Allow"] = ", ".join(allowed)
    elif status == 413:
        message = f"Request body too large. {exc.text} Send a smaller body."
    else:
        message = exc.reason or exc.text or "HTTP error"
    return _error_response(status, error_body(status, message), headers)

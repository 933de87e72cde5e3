"""The router's aiohttp server: ``CappedAppRunner`` is ``contract.aiohttp_json_errors``'
``JsonErrorAppRunner`` (parser-level errors answered in OpenAI's shape, drains close connections)
plus a cap on open connections (``max_connections``: over it, a new connection is closed as soon
as it is accepted, logged at a bounded rate). Also the bounded-rate log (``RateLimitedLog``) the
raw front shares, and the loop's accept-error logging (``limit_accept_error_logs``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from typing import Any

from aiohttp import web

from contract.aiohttp_json_errors import JsonErrorAppRunner, JsonErrorRequestHandler, JsonErrorServer

log = logging.getLogger(__name__)


#: accept() failures that mean "out of resources" (file descriptors, memory): they recur on every
#: connection attempt until something is freed, so they are logged at a bounded rate
ACCEPT_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
#: at most one line per this many seconds for one recurring condition
LOG_INTERVAL_S = 10.0


class RateLimitedLog:
    """A warning that may recur many times a second (refused connections, accept failures): at
    most one line per ``interval_s``, saying how many were left out since the last line."""

    def __init__(self, logger: logging.Logger, interval_s: float = LOG_INTERVAL_S) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.suppressed = 0
        self._next = 0.0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self.suppressed += 1
            return
        self._next = now + self.interval_s
        if self.suppressed:
            message += f" ({self.suppressed} more like it in the last {self.interval_s:g} s not logged)"
            self.suppressed = 0
        self.logger.warning(message, *args)


def limit_accept_error_logs(loop: asyncio.AbstractEventLoop, interval_s: float = LOG_INTERVAL_S) -> None:
    """Make ``loop`` log accept() failures for lack of resources (EMFILE, ENFILE, ...) at most once
    per ``interval_s`` (asyncio's loop logs each with a traceback, many times a second while the
    process is out of file descriptors; uvloop's drops them); other errors go where they went."""
    limited = RateLimitedLog(log, interval_s)
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in ACCEPT_ERRNOS:
            limited.warning("cannot accept connections: %s; raise the open-files limit (ulimit -n) or lower "
                            "max_connections", exc.strerror or exc)
        elif isinstance(exc, (ValueError, OSError)) and _retried_accept(context.get("handle")):
            # asyncio retries accept() 1 s after such a failure, even when the listening socket was
            # closed meanwhile (a drain): nothing is lost, nothing to report
            log.debug("accept retry on a closed listening socket: %s", exc)
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def _retried_accept(handle: object) -> bool:
    callback = getattr(handle, "_callback", None)
    return getattr(callback, "__name__", "") == "_start_serving"


def refuse_message(max_connections: int) -> str:
    return (f"refusing new connections: {max_connections} are open (max_connections); raise max_connections "
            "or add router workers")


class CappedRequestHandler(JsonErrorRequestHandler):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        manager = self._manager
        if isinstance(manager, CappedServer) and len(manager.connections) > manager.max_connections:
            manager.refusals.warning(refuse_message(manager.max_connections))
            transport.close()  # refused at once (nothing was read): connection_lost cleans up


class CappedServer(JsonErrorServer):
    handler_class = CappedRequestHandler
    #: more open connections than this: new ones are closed at once (set by CappedAppRunner)
    max_connections: int = 1 << 62
    refusals: RateLimitedLog


class CappedAppRunner(JsonErrorAppRunner):
    """``JsonErrorAppRunner`` whose server closes connections over ``max_connections`` open ones
    as soon as they are accepted (logged at a bounded rate); None: no cap."""

    server_class = CappedServer

    def __init__(self, app: web.Application, *, max_connections: int | None = None, **kwargs: Any) -> None:
        self._max_connections = max_connections
        # request bodies are forwarded as sent, with their Content-Encoding (as the raw front does);
        # decompressing them here would send the backend plain bytes labelled gzip
        kwargs.setdefault("auto_decompress", False)
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        if isinstance(server, CappedServer):
            server.refusals = RateLimitedLog(log)
            if self._max_connections is not None:
                server.max_connections = self._max_connections
        return server

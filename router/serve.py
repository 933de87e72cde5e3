"""Serving one process: the listeners (the raw front or aiohttp on the main port, the admin
listener beside it), SIGTERM/SIGINT and the supervisor's lifeline, and the drain.

- ``front = "raw"`` (the default): the port is served by ``router.front.RawFront`` (the hot
  POST routes natively, everything else relayed to the aiohttp app, which listens on an
  internal 127.0.0.1 ephemeral port); ``front = "aiohttp"``: aiohttp serves the port itself.
- On SIGTERM or SIGINT the process stops accepting (the listening socket closes, so new
  connections are refused), closes idle keep-alive connections, lets in-flight requests and
  streams finish for up to ``drain_timeout_s``, cancels what is left, closes the app's
  resources (its ``cleanup_ctx``) and returns.

``router.supervisor`` runs this in each worker process; ``router.cli`` runs it directly for
``workers = 1``.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from router.app import PROXY
from router.config import RouterConfig
from contract.errors import ConfigError
from router.front.server import RawFront
from router.front.settings import FRONT_DEFAULTS
from router.http_server import CappedAppRunner, limit_accept_error_logs

logger = logging.getLogger("router.serve")

PROG = "session-router"
#: ``module:function`` building the app from the configuration
DEFAULT_APP_FACTORY = "router.app:create_app"
#: ``module:function`` building the admin app from the main app (served when ``admin_port`` is set)
DEFAULT_ADMIN_FACTORY = "router.app:create_admin_app"
#: where the raw front reaches the aiohttp app (an ephemeral port)
INTERNAL_HOST = "127.0.0.1"

AppFactory = Callable[[RouterConfig], web.Application]


class StartupError(Exception):
    """The server could not start (e.g. the port is taken); exit code 1."""


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def listening_line(host: str, port: int) -> str:
    """The one line printed once the server listens (tests and scripts read it)."""
    shown = f"[{host}]" if ":" in host else host
    return f"{PROG} listening on http://{shown}:{port}"


def run_worker(
    config: RouterConfig,
    *,
    app_factory: str = DEFAULT_APP_FACTORY,
    admin_factory: str = DEFAULT_ADMIN_FACTORY,
    reuse_port: bool = False,
    on_ready: Callable[[int], None] | None = None,
    lifeline: int | None = None,
    ignore_late_signals: bool = False,
) -> int:
    """Build the app and serve it in this process until SIGTERM/SIGINT; return the exit code.

    With ``config.admin.port`` set, ``admin_factory(main_app)`` is served on ``admin_host:admin_port`` too.
    ``on_ready(port)`` is called once listening (default: print the listening line).
    ``lifeline`` and ``ignore_late_signals``: see ``serve``.
    """
    factory = load_factory(app_factory)
    if on_ready is None:

        def on_ready(port: int) -> None:
            print(listening_line(config.host, port), flush=True)

    announce = on_ready

    def settled_and_ready(port: int) -> None:
        settle_heap()
        announce(port)

    async def _main() -> None:
        app = factory(config)
        admin = None
        if config.admin.port:
            admin = (load_factory(admin_factory)(app), config.admin.host, config.admin.port)
        await serve(
            app,
            config.host,
            config.port,
            drain_timeout_s=config.drain_timeout_s,
            front=config.front.kind,
            max_body_bytes=config.front.max_body_bytes,
            body_timeout_s=config.front.body_timeout_s,
            max_connections=config.front.max_connections,
            max_head_bytes=config.front.max_head_bytes,
            keepalive_timeout_s=config.front.keepalive_timeout_s,
            listen_backlog=config.front.listen_backlog,
            reuse_port=reuse_port,
            on_ready=settled_and_ready,
            admin=admin,
            lifeline=lifeline,
            ignore_late_signals=ignore_late_signals,
        )

    raise_open_files_limit(config.front.max_connections)
    try:
        run_async(_main())
    except ConfigError as exc:
        complain(exc.message)
        return 2
    except StartupError as exc:
        complain(str(exc))
        return 1
    return 0


async def serve(
    app: web.Application,
    host: str,
    port: int,
    *,
    drain_timeout_s: float,
    front: str = "raw",
    max_body_bytes: int = FRONT_DEFAULTS.max_body_bytes,
    body_timeout_s: float = FRONT_DEFAULTS.body_timeout_s,
    max_connections: int = FRONT_DEFAULTS.max_connections,
    max_head_bytes: int = FRONT_DEFAULTS.max_head_bytes,
    keepalive_timeout_s: float = FRONT_DEFAULTS.keepalive_timeout_s,
    listen_backlog: int = FRONT_DEFAULTS.listen_backlog,
    reuse_port: bool = False,
    on_ready: Callable[[int], None] | None = None,
    admin: tuple[web.Application, str, int] | None = None,
    lifeline: int | None = None,
    ignore_late_signals: bool = False,
) -> None:
    """Serve ``app`` on ``host:port`` (and ``admin = (app, host, port)`` beside it) until SIGTERM/SIGINT,
    then drain and clean up.

    ``front``: ``"raw"`` serves the port with ``router.front.RawFront`` (request bodies over
    ``max_body_bytes`` get a 413 there, bodies not whole ``body_timeout_s`` after their head a 408), the app then listening on an internal loopback port for
    the requests the raw front relays; ``"aiohttp"`` serves the port with aiohttp itself.
    ``max_connections``: on each port, a connection over this many open ones is closed as soon
    as it is accepted; refusals and accept() failures (out of file descriptors) are logged at
    most once per 10 s. ``max_head_bytes``: the raw front answers a larger request head with a 400.
    ``keepalive_timeout_s``: an idle keep-alive client connection closes after this long (either
    front). ``listen_backlog``: the accept backlog of every listening socket.
    Draining: the listening sockets close at once, in-flight requests (streams included) get up
    to ``drain_timeout_s`` to finish, then are cancelled; the app's cleanup runs last.
    ``lifeline``: a file descriptor that turns readable (EOF) when the supervisor dies; it
    stops the server like a signal. ``ignore_late_signals``: once drained, ignore SIGTERM and
    SIGINT for the rest of the process instead of restoring their default action, so that a
    duplicate signal (the supervisor's forward racing a process-group or cgroup-wide one)
    cannot turn a clean exit into a death by signal. Only for a process that exits next.
    """
    loop = asyncio.get_running_loop()
    limit_accept_error_logs(loop)
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:  # before anything else: a signal during start-up also drains
        loop.add_signal_handler(signum, stop.set)
    if lifeline is not None:
        def supervisor_gone() -> None:
            # the pipe stays readable at EOF: once is enough (left registered, it spun the loop at
            # 100% CPU for as long as the drain took)
            loop.remove_reader(lifeline)
            stop.set()
            # nobody waits for an orphan: its drain and clean-up are bounded (a clean-up stuck on a
            # peer that went with the supervisor, e.g. a shared-state store, kept one alive for good)
            limit = drain_timeout_s + LIFELINE_GRACE_S
            watchdog = threading.Timer(limit, _exit_unfinished, args=(limit,))
            watchdog.daemon = True
            watchdog.start()

        loop.add_reader(lifeline, supervisor_gone)
    # aiohttp reads a shutdown timeout of 0 as "no timeout": 0 here means "do not wait"
    shutdown_timeout = max(drain_timeout_s, 0.001)
    runners: list[web.AppRunner] = []
    raw: RawFront | None = None
    internal: web.TCPSite | None = None
    try:
        bound_port = port
        for served, served_host, served_port in [(app, host, port)] + ([admin] if admin is not None else []):
            # handler_cancellation: a client that disconnects cancels its handler at once, which closes
            # the upstream connection so the backend aborts the request (streams and non-streams).
            # the data port's keep-alive timeout, when aiohttp serves it (the raw front applies its own;
            # the app's internal listener behind it and the admin listener keep aiohttp's 75 s)
            keepalive = {"keepalive_timeout": keepalive_timeout_s} if served is app and front != "raw" else {}
            runner = CappedAppRunner(served, access_log=None, handle_signals=False, shutdown_timeout=shutdown_timeout,
                                   handler_cancellation=True, max_connections=max_connections, **keepalive)
            await runner.setup()
            runners.append(runner)
            if served is app and front == "raw":
                where = f"{INTERNAL_HOST}:0"
                internal = site = web.TCPSite(runner, INTERNAL_HOST, 0, backlog=listen_backlog)
            else:
                where = f"{served_host}:{served_port}"
                site = web.TCPSite(runner, served_host, served_port, backlog=listen_backlog,
                                   reuse_port=reuse_port or None)
            try:
                await site.start()
            except OSError as exc:
                raise StartupError(f"cannot listen on {where}: {exc.strerror or exc}") from None
            if served is app:
                bound_port = site.port
        if internal is not None:
            raw = RawFront(app.get(PROXY), INTERNAL_HOST, internal.port, max_body_bytes=max_body_bytes,
                           body_timeout_s=body_timeout_s, max_connections=max_connections,
                           max_head_bytes=max_head_bytes, keepalive_timeout_s=keepalive_timeout_s)
            try:
                bound_port = await raw.start(host, port, backlog=listen_backlog, reuse_port=reuse_port)
            except OSError as exc:
                raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        if on_ready is not None:
            on_ready(bound_port)
        await stop.wait()
        logger.info("stopping: draining in-flight requests for up to %gs", drain_timeout_s)
    finally:
        try:
            # Stop accepting everywhere first, then drain: the raw front first (what it relays
            # still needs the app's internal listener), the main app last (its cleanup closes
            # what the admin app shares).
            if raw is not None:
                raw.stop_accepting()
            for runner in runners:
                for site in list(runner.sites):
                    if site is not internal:
                        await site.stop()
            if raw is not None:
                await raw.shutdown(drain_timeout_s)
            for runner in reversed(runners):
                await runner.cleanup()
        finally:
            if lifeline is not None:
                loop.remove_reader(lifeline)
            for signum in signals:
                loop.remove_signal_handler(signum)
                if ignore_late_signals:
                    signal.signal(signum, signal.SIG_IGN)


#: seconds beyond ``drain_timeout_s`` a worker whose supervisor died gets to drain and clean up
LIFELINE_GRACE_S = 10.0


def _exit_unfinished(seconds: float) -> None:
    """The watchdog of a worker whose supervisor died: its drain and clean-up took longer than
    ``seconds``; end the process now (written to stderr directly: a stuck thread may hold the logging lock)."""
    os.write(2, f"{PROG}: the supervisor is gone and this worker's drain and clean-up did not finish in "
                f"{seconds:g}s: exiting\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up left to run: it is the one that hung


def raise_open_files_limit(max_connections: int) -> None:
    """Raise this process's soft open-files limit (RLIMIT_NOFILE) so that ``max_connections``
    client connections fit with room for backend connections, as far as the hard limit allows.
    Past the limit, accept() fails (EMFILE) and new connections are dropped; that is logged at a
    bounded rate."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections * 2 + 256  # each proxied request also holds an upstream connection
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            return
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < max_connections + 256:
        logger.warning("the open-files limit (%d) is below max_connections (%d) + room for backends: past "
                       "it new connections fail; raise it (ulimit -n) or lower max_connections",
                       soft, max_connections)


def settle_heap() -> None:
    """Take what start-up built (modules, the app, its tables and tokenizers) out of the garbage
    collector's passes: it lives as long as the process, yet every full collection would walk all
    of it again, a cost each request shares. What requests create is collected as before."""
    gc.collect()
    gc.freeze()


def run_async(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` on a new event loop: uvloop's when it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is in the test extras
        loop_factory = None
    else:
        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(coro)


def load_factory(spec: str) -> AppFactory:
    """Import ``module:function``."""
    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr or "create_app")
    return factory  # type: ignore[no-any-return]


def complain(message: str) -> None:
    """Print ``session-router: <message>`` on stderr (configuration and start-up errors)."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


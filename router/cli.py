"""``session-router``: parse the configuration, then serve until SIGTERM/SIGINT, draining first.

Process model:

- ``workers = 1`` (the default): this process serves. On SIGTERM or SIGINT it stops accepting
  (the listening socket closes, so new connections are refused), closes idle keep-alive
  connections, lets in-flight requests and streams finish for up to ``drain_timeout_s``,
  cancels what is left, closes the app's resources (its ``cleanup_ctx``) and exits 0.
- ``front = "raw"`` (the default): the port is served by ``router.front.RawFront`` (the hot
  POST routes natively, everything else relayed to the aiohttp app, which listens on an
  internal 127.0.0.1 ephemeral port); ``front = "aiohttp"``: aiohttp serves the port itself.
- ``workers = N > 1``: this process becomes a supervisor. It reserves the port (a socket bound
  with SO_REUSEPORT that never listens, so ``--port 0`` resolves once for everybody), starts N
  worker processes that each listen on that port with SO_REUSEPORT (the kernel spreads new
  connections over them), prints the listening line once all are up, forwards SIGTERM/SIGINT
  to them and exits 0 when every worker drained and exited 0. A worker that dies after it was
  up is restarted; one that fails to start stops the whole group. Workers leave the
  supervisor's process group (a terminal's Ctrl-C or a group-wide kill reaches the supervisor
  alone, which forwards exactly one SIGTERM) and hold a lifeline pipe to it: if the supervisor
  is killed outright, they drain and exit instead of living on as orphans.

Placement across workers: the session policy's rendezvous hash depends only on the session id
and the configured backends, so every worker sends a session's first request to the same
backend and keeps it there. Each worker has its own session table, in-flight counts and health
view, so the load bound (spills) and re-pins are decided per worker; with a healthy, not
overloaded cluster all workers agree on every session. The same holds for runtime state:
an admin API change (adding or removing a backend; with ``admin_port`` every worker listens there
too, with SO_REUSEPORT), ``DELETE /v1/sessions/{id}`` and the
``/metrics`` and ``/v1/sessions`` views reach only the worker that took the connection.

Exit codes: 0 after a graceful stop, 2 for a configuration error (message on stderr as
``session-router: <message>``), 1 for anything else (e.g. the port is taken).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from router.app import PROXY
from router.config import MiB, RouterConfig, build_config
from router.errors import ConfigError
from router.front.server import RawFront
from router.http_server import JsonErrorAppRunner, limit_accept_error_logs

logger = logging.getLogger("router.cli")

PROG = "session-router"
#: ``module:function`` building the app from the configuration
DEFAULT_APP_FACTORY = "router.app:create_app"
#: ``module:function`` building the admin app from the main app (served when ``admin_port`` is set)
DEFAULT_ADMIN_FACTORY = "router.app:create_admin_app"
#: listen backlog: bursts of new connections (1,000 concurrent clients) must not overflow it
LISTEN_BACKLOG = 1024
#: how long a worker may take from spawn to listening
WORKER_START_TIMEOUT_S = 60.0
#: where the raw front reaches the aiohttp app (an ephemeral port)
INTERNAL_HOST = "127.0.0.1"
#: a supervisor gives up after this many restarts within RESTART_WINDOW_S
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0

AppFactory = Callable[[RouterConfig], web.Application]


class StartupError(Exception):
    """The server could not start (e.g. the port is taken); exit code 1."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``session-router`` and ``python -m router``; returns the exit code."""
    try:
        config = build_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        _complain(exc.message)
        return 2
    configure_logging(config.log_level)
    return run(config)


def run(
    config: RouterConfig,
    *,
    app_factory: str = DEFAULT_APP_FACTORY,
    admin_factory: str = DEFAULT_ADMIN_FACTORY,
) -> int:
    """Serve ``config`` (one process, or a supervised group when ``config.workers > 1``).

    The factories are ``module:function`` names (a worker process imports them by name).
    """
    if config.workers > 1:
        return supervise(config, app_factory=app_factory, admin_factory=admin_factory)
    return run_worker(config, app_factory=app_factory, admin_factory=admin_factory, ignore_late_signals=True)


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


# ------------------------------------------------------------------------ one process


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
            reuse_port=reuse_port,
            on_ready=on_ready,
            admin=admin,
            lifeline=lifeline,
            ignore_late_signals=ignore_late_signals,
        )

    raise_open_files_limit(config.front.max_connections)
    try:
        run_async(_main())
    except ConfigError as exc:
        _complain(exc.message)
        return 2
    except StartupError as exc:
        _complain(str(exc))
        return 1
    return 0


async def serve(
    app: web.Application,
    host: str,
    port: int,
    *,
    drain_timeout_s: float,
    front: str = "raw",
    max_body_bytes: int = 8 * MiB,
    body_timeout_s: float = 60.0,
    max_connections: int = 10_000,
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
    most once per 10 s.
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
        loop.add_reader(lifeline, stop.set)
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
            runner = JsonErrorAppRunner(served, access_log=None, handle_signals=False, shutdown_timeout=shutdown_timeout,
                                   handler_cancellation=True, max_connections=max_connections)
            await runner.setup()
            runners.append(runner)
            if served is app and front == "raw":
                where = f"{INTERNAL_HOST}:0"
                internal = site = web.TCPSite(runner, INTERNAL_HOST, 0, backlog=LISTEN_BACKLOG)
            else:
                where = f"{served_host}:{served_port}"
                site = web.TCPSite(runner, served_host, served_port, backlog=LISTEN_BACKLOG,
                                   reuse_port=reuse_port or None)
            try:
                await site.start()
            except OSError as exc:
                raise StartupError(f"cannot listen on {where}: {exc.strerror or exc}") from None
            if served is app:
                bound_port = site.port
        if internal is not None:
            raw = RawFront(app.get(PROXY), INTERNAL_HOST, internal.port, max_body_bytes=max_body_bytes,
                           body_timeout_s=body_timeout_s, max_connections=max_connections)
            try:
                bound_port = await raw.start(host, port, backlog=LISTEN_BACKLOG, reuse_port=reuse_port)
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


# ------------------------------------------------------------------- supervisor


@dataclass(eq=False)
class _Worker:
    index: int
    process: multiprocessing.process.BaseProcess
    #: the worker sends its port here once it listens
    ready_conn: multiprocessing.connection.Connection | None
    #: held open by this process only: the worker stops when it reads EOF (we died)
    lifeline: multiprocessing.connection.Connection
    ready: bool = False
    signalled: bool = False


def supervise(
    config: RouterConfig,
    *,
    app_factory: str = DEFAULT_APP_FACTORY,
    admin_factory: str = DEFAULT_ADMIN_FACTORY,
) -> int:
    """Run ``config.workers`` SO_REUSEPORT worker processes on one port; return the exit code."""
    try:
        reservation = _reserve_port(config.host, config.port)
    except OSError as exc:
        _complain(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}")
        return 1
    port = reservation.getsockname()[1]
    worker_config = msgspec.structs.replace(config, port=port, workers=1)
    ctx = multiprocessing.get_context("spawn")

    def start(index: int) -> _Worker:
        reader, writer = ctx.Pipe(duplex=False)
        life_r, life_w = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=_worker_entry,
            args=(worker_config, app_factory, admin_factory, writer, life_r),
            name=f"{PROG}-worker-{index}",
        )
        process.start()
        writer.close()  # the worker holds the only writer: its death means EOF here
        life_r.close()  # and the only lifeline reader: our death means EOF there
        return _Worker(index, process, reader, life_w)

    stopping = False
    exit_code = 0

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    old_wakeup = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    workers: list[_Worker] = []
    restarts: list[float] = []
    announced = False
    start_deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    stop_deadline: float | None = None
    try:
        for index in range(config.workers):
            workers.append(start(index))
        while True:
            # One liveness snapshot per turn: a worker that dies after it is still in `alive`,
            # so its sentinel wakes the wait below (checking twice would race with its death).
            alive = [w for w in workers if w.process.is_alive()]
            now = time.monotonic()
            if not stopping:
                for slot, worker in enumerate(workers):
                    if worker in alive:
                        continue
                    code = worker.process.exitcode
                    if not worker.ready:
                        logger.error("worker %d exited with code %s while starting; stopping", worker.index, code)
                        exit_code, stopping = (code if code and code > 0 else 1), True
                        break
                    restarts = [t for t in restarts if now - t < RESTART_WINDOW_S] + [now]
                    if len(restarts) > MAX_RESTARTS:
                        logger.error("workers keep dying (%d restarts in %gs); stopping", len(restarts), RESTART_WINDOW_S)
                        exit_code, stopping = 1, True
                        break
                    logger.warning("worker %d exited with code %s; restarting it", worker.index, code)
                    workers[slot] = replacement = start(worker.index)
                    replacement.ready = True  # the group is already up; it joins when it listens
                    alive.append(replacement)
            if not stopping and not announced and now >= start_deadline:
                logger.error("workers did not start within %gs; stopping", WORKER_START_TIMEOUT_S)
                exit_code, stopping = 1, True
            if stopping:
                if stop_deadline is None:
                    # aiohttp waits up to the drain timeout for handlers, then as long again
                    # for their cancellation; the app's cleanup comes on top.
                    stop_deadline = now + 2 * config.drain_timeout_s + 10.0
                for worker in alive:
                    if not worker.signalled:
                        _signal(worker.process, signal.SIGTERM)
                        worker.signalled = True
                if not alive:
                    break
                if now >= stop_deadline:
                    for worker in alive:
                        logger.error("worker %d did not stop in time; killing it", worker.index)
                        _signal(worker.process, signal.SIGKILL)
                    exit_code = exit_code or 1
                    break

            waitables: list[Any] = [wake_r, *(w.process.sentinel for w in alive)]
            waitables += [w.ready_conn for w in workers if w.ready_conn is not None]
            deadline = stop_deadline if stopping else (None if announced else start_deadline)
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            multiprocessing.connection.wait(waitables, timeout)
            _drain_socket(wake_r)

            for worker in workers:
                conn = worker.ready_conn
                if conn is not None and conn.poll():
                    try:
                        conn.recv()
                        worker.ready = True
                    except EOFError:  # died before it listened
                        pass
                    conn.close()
                    worker.ready_conn = None
            if not announced and not stopping and all(w.ready for w in workers):
                print(listening_line(config.host, port), flush=True)
                announced = True
    finally:
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(old_wakeup)
        wake_r.close()
        wake_w.close()
        for worker in workers:
            if worker.process.is_alive():
                _signal(worker.process, signal.SIGKILL)
            worker.process.join(5.0)
            if worker.ready_conn is not None:
                worker.ready_conn.close()
            worker.lifeline.close()
        reservation.close()
    failed = [(w.index, w.process.exitcode) for w in workers if w.process.exitcode != 0]
    if failed:
        logger.error("workers exited with non-zero codes (worker, code): %s", failed)
        exit_code = exit_code or 1
    return exit_code


def _worker_entry(
    config: RouterConfig,
    app_factory: str,
    admin_factory: str,
    ready: multiprocessing.connection.Connection,
    lifeline: multiprocessing.connection.Connection,
) -> None:
    """Body of one worker process (spawned: a fresh interpreter).

    It leaves the supervisor's process group, so a terminal's Ctrl-C or a group-wide kill
    reaches the supervisor alone, which forwards one SIGTERM; the lifeline stops it if the
    supervisor dies without doing so.
    """
    os.setpgid(0, 0)
    configure_logging(config.log_level)

    def on_ready(port: int) -> None:
        ready.send(port)
        ready.close()

    sys.exit(
        run_worker(
            config,
            app_factory=app_factory,
            admin_factory=admin_factory,
            reuse_port=True,
            on_ready=on_ready,
            lifeline=lifeline.fileno(),
            ignore_late_signals=True,
        )
    )


def _reserve_port(host: str, port: int) -> socket.socket:
    """Bind (never listen) an SO_REUSEPORT socket on ``host:port``: it resolves port 0 and keeps
    the port ours; workers listen beside it, and the kernel never hands it a connection."""
    family, type_, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _signal(process: multiprocessing.process.BaseProcess, signum: int) -> None:
    if process.pid is not None:
        try:
            os.kill(process.pid, signum)
        except ProcessLookupError:
            pass


def _drain_socket(sock: socket.socket) -> None:
    try:
        while sock.recv(512):
            pass
    except (BlockingIOError, InterruptedError):
        pass


def _complain(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)

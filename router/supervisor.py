"""The worker supervisor (``workers = N > 1``): N processes serving one port with SO_REUSEPORT.

This process reserves the port (a socket bound with SO_REUSEPORT that never listens, so
``--port 0`` resolves once for everybody), starts N worker processes that each serve it with
``router.serve`` (the kernel spreads new connections over them), prints the listening line once
all are up, forwards SIGTERM/SIGINT to them and exits 0 when every worker drained and exited 0.
A worker that dies after it was up is restarted; one that fails to start stops the whole group.
Workers leave the supervisor's process group (a terminal's Ctrl-C or a group-wide kill reaches
the supervisor alone, which forwards exactly one SIGTERM) and hold a lifeline pipe to it: if
the supervisor is killed outright, they drain and exit instead of living on as orphans.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from router.config import RouterConfig
from router.serve import (
    DEFAULT_ADMIN_FACTORY,
    DEFAULT_APP_FACTORY,
    PROG,
    complain,
    configure_logging,
    listening_line,
    run_worker,
)

logger = logging.getLogger("router.supervisor")

#: how long a worker may take from spawn to listening
WORKER_START_TIMEOUT_S = 60.0
#: a supervisor gives up after this many restarts within RESTART_WINDOW_S
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


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


def config_of_worker(config: RouterConfig, port: int) -> RouterConfig:
    """What each worker runs: one process on the reserved ``port``. Without shared pins each worker keeps
    its own session table; balanced by its own pin counts, workers would place some new sessions apart,
    so they place them by the hash alone, alike (``session_balance`` 0; README "Placement")."""
    worker = msgspec.structs.replace(config, port=port, workers=1)
    if config.shared_state.url:
        return worker
    return msgspec.structs.replace(worker, placement=msgspec.structs.replace(config.placement, session_balance=0.0))


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
        complain(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}")
        return 1
    port = reservation.getsockname()[1]
    worker_config = config_of_worker(config, port)
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


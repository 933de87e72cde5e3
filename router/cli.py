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

Layout: this module is the command line (argv -> ``RouterConfig``) and ``main``;
``router.supervisor`` runs the worker group; ``router.serve`` serves one process.
"""

from __future__ import annotations

import sys

from router.config import RouterConfig, build_config
from contract.errors import ConfigError
from router.serve import DEFAULT_ADMIN_FACTORY, DEFAULT_APP_FACTORY, complain, configure_logging, run_worker
from router.supervisor import supervise


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``session-router`` and ``python -m router``; returns the exit code."""
    try:
        config = build_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        complain(exc.message)
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


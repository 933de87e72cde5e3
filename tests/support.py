"""Test helpers for real processes (shared with the demo and benchmarks)."""

from bench.procs import (  # noqa: F401
    LOOPBACK,
    REPO,
    Proc,
    free_port,
    http_status,
    start_backend,
    start_process,
    start_router,
    wait_until,
)

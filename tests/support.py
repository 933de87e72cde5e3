"""Test helpers: real processes (shared with the demo and benchmarks), metrics, bounded waits."""

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

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
from router.config import RouterConfig, sectioned


def refused(port: int) -> bool:
    """Whether nothing listens on ``port`` any more. A reset is not yet that: the connection was queued
    on a worker's listening socket (``SO_REUSEPORT``) as the worker closed it, and others may still listen."""
    try:
        socket.create_connection((LOOPBACK, port), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        pass  # queued on a closing worker's socket: ask again
    return False


def cached_of(usage: dict[str, Any]) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of an OpenAI answer; null (vLLM's answer with
    ``--enable-prompt-tokens-details`` when nothing was cached) is 0."""
    details = usage.get("prompt_tokens_details")
    return 0 if details is None else int(details["cached_tokens"])


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the exposition's samples of ``name`` whose labels include ``labels`` (0 when none)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def eventually(check: Callable[[], bool | Awaitable[bool]], *, timeout: float, what: str = "condition",
                     interval: float = 0.01) -> None:
    """Poll ``check`` (returning a bool, or an awaitable of one) until true; fail after ``timeout``
    seconds (a bound, not a sleep). The async twin of ``wait_until``."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def kill_alive(*procs: Proc) -> None:
    """Kill (by PID) those of ``procs`` still running: the clean-up after a test's processes."""
    for proc in procs:
        if proc.alive():
            proc.kill()


def router_config(**settings: Any) -> RouterConfig:
    """A ``RouterConfig`` from keyword settings under their flat names (``health_interval_s=...``,
    as the tests' fixtures pass them around) or whole sections (``placement={...}``), backend
    lists as ``BackendConfig`` lists; the schema's bounds apply, the cross-key checks do not."""
    data, _ = sectioned(settings)
    return msgspec.convert(data, RouterConfig)

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


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the exposition's samples of ``name`` whose labels include ``labels`` (0 when none)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total

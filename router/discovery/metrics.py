"""``session_router_discovery_*``: what discovery sees, its errors and when it last synced, per pool.

- ``discovery_backends{pool, source}``: backends the source currently reports (Ready pods, resolved
  records), read at scrape time;
- ``discovery_errors_total{pool, source, reason}``: failed list/watch calls or resolutions
  (``reason``: a closed set per source, e.g. ``connect``, ``status_5xx``, ``gone``, ``timeout``,
  ``nxdomain``); each one is retried after a backoff, the backends found before stay;
- ``discovery_last_sync_timestamp_seconds{pool, source}``: Unix time of the last successful
  list, watch event or resolution (a stale value with errors rising: the source is cut off);
- ``discovery_changes_total{pool, change}``: backends added to and removed from the pool by discovery.

Plain ints and floats updated off the request path, exported by a collector at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.metrics import labelled

PREFIX = "session_router_discovery_"


class DiscoveryMetrics:
    """The counters and gauges above; ``register`` puts them on a registry."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.backends: dict[tuple[str, str], int] = {}
        self.errors: dict[tuple[str, str, str], int] = {}
        self.last_sync: dict[tuple[str, str], float] = {}
        self.changes: dict[tuple[str, str], int] = {}

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self)  # type: ignore[arg-type]

    def synced(self, pool: str, source: str, backends: int) -> None:
        """A successful list, watch event or resolution: ``backends`` seen now."""
        self.backends[(pool, source)] = backends
        self.last_sync[(pool, source)] = self._clock()

    def error(self, pool: str, source: str, reason: str) -> None:
        key = (pool, source, reason)
        self.errors[key] = self.errors.get(key, 0) + 1

    def changed(self, pool: str, change: str) -> None:
        key = (pool, change)
        self.changes[key] = self.changes.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        yield labelled(GaugeMetricFamily, PREFIX + "backends", "Backends the discovery source currently reports",
                       ["pool", "source"], self.backends.items())
        yield labelled(CounterMetricFamily, PREFIX + "errors", "Failed discovery calls (list, watch, resolve), by reason",
                       ["pool", "source", "reason"], self.errors.items())
        yield labelled(GaugeMetricFamily, PREFIX + "last_sync_timestamp_seconds",
                       "Unix time of the last successful discovery list, watch event or resolution",
                       ["pool", "source"], self.last_sync.items())
        yield labelled(CounterMetricFamily, PREFIX + "changes", "Backends discovery added to or removed from a pool",
                       ["pool", "change"], self.changes.items())

"""``session_router_kv_*``: the KV-event subscriptions and the index, exported at scrape time.

Counters are plain dicts bumped by the event readers (no prometheus-client lock per event); the
collector turns them into families when ``/metrics`` is read, with the index's size read live.
Labels: ``backend`` (the backend's name, as the router's other metrics; a socket's address for
messages no backend could be told from), ``result`` (of a replay: ``filled``, ``partial``,
``failed``, ``unavailable``, ``closed``), ``reason`` (of a reset: ``restart``, ``new_stream``,
``gap``, ``sources_changed``, ``engine_down``; an engine's own ``AllBlocksCleared`` is an event, not a reset; of an
error: ``frames``, ``decode``, ``replay_frames``, ``apply``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.kv.index import KVIndex
from router.metrics import labelled

PREFIX = "session_router_"


class KVMetrics(Collector):
    """The counters of ``router.kv``; register once on the router's registry."""

    def __init__(self, index: KVIndex | None = None) -> None:
        self.index = index
        self.event_counts: dict[str, int] = {}
        self.gaps: dict[str, int] = {}
        self.replays: dict[tuple[str, str], int] = {}
        self.resets: dict[tuple[str, str], int] = {}
        self.errors: dict[tuple[str, str], int] = {}
        #: drains of the KV-event sockets that found batches (each takes what arrived since the last)
        self.reads = 0
        #: backend -> streams subscribed now (a callable so the service's live view is read at scrape time)
        self.sources: Callable[[], dict[str, int]] = dict

    def events(self, backend: str, count: int) -> None:
        counts = self.event_counts
        counts[backend] = counts.get(backend, 0) + count

    def gap(self, backend: str) -> None:
        self.gaps[backend] = self.gaps.get(backend, 0) + 1

    def replay(self, backend: str, result: str) -> None:
        key = (backend, result)
        self.replays[key] = self.replays.get(key, 0) + 1

    def reset(self, backend: str, reason: str) -> None:
        key = (backend, reason)
        self.resets[key] = self.resets.get(key, 0) + 1

    def error(self, backend: str, reason: str) -> None:
        key = (backend, reason)
        self.errors[key] = self.errors.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        yield labelled(CounterMetricFamily, PREFIX + "kv_events", "KV events applied to the router's index, by backend",
                       ["backend"], self.event_counts.items())
        yield labelled(CounterMetricFamily, PREFIX + "kv_event_gaps",
                       "Gaps in a backend's KV-event seq (missed batches)", ["backend"], self.gaps.items())
        yield labelled(CounterMetricFamily, PREFIX + "kv_event_replays",
                       "Replays asked of a backend's replay socket, by result", ["backend", "result"],
                       self.replays.items())
        yield labelled(CounterMetricFamily, PREFIX + "kv_index_resets", "A backend's index entries dropped, by reason",
                       ["backend", "reason"], self.resets.items())
        yield labelled(CounterMetricFamily, PREFIX + "kv_event_errors",
                       "KV-event messages or batches that could not be used, by reason", ["backend", "reason"],
                       self.errors.items())
        yield CounterMetricFamily(PREFIX + "kv_event_reads",
                                  "Drains of the KV-event sockets that found batches (each takes what arrived since "
                                  "the last; see [kv_events] min_read_interval_s)", value=self.reads)
        yield labelled(GaugeMetricFamily, PREFIX + "kv_event_sources", "KV-event streams subscribed, by backend",
                       ["backend"], self.sources().items())
        index = self.index
        yield GaugeMetricFamily(PREFIX + "kv_index_blocks", "Blocks in the router's KV index, over all backends",
                                value=index.blocks if index is not None else 0)
        yield GaugeMetricFamily(PREFIX + "kv_index_sessions", "Sessions with resident KV in the router's index",
                                value=index.sessions if index is not None else 0)
        yield CounterMetricFamily(PREFIX + "kv_index_evicted_blocks",
                                  "Blocks dropped from the index to stay within [kv_events] max_blocks",
                                  value=index.evicted if index is not None else 0)

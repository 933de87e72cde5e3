"""Router metrics: our own ``session_router_`` prefix, labels from closed sets or the top-K sessions.

Closed label sets: ``route`` (the proxied routes), ``backend`` (configured backends),
``status_class`` (2xx..5xx), ``policy``, ``outcome`` (``placement.base.Outcome``), ``reason``.

Per-session series carry a ``session`` label only for the ``top_k`` most recently active
sessions. When a session leaves that set (a more recent one pushed it out, or it left the
session table) every series with its label is removed, so the number of session-labelled
series per metric never exceeds ``top_k``. A session that comes back is re-admitted with its
cumulative totals from the session table, so its counters stay monotonic apart from the gap.

Live state (in-flight, health, table size) is read at scrape time by a collector, so the
request path pays nothing for it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from router.pool import BackendPool
    from router.sessions import SessionEntry

PREFIX = "session_router_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def status_class(status: int) -> str:
    return f"{status // 100}xx"


class _LiveCollector(Collector):
    def __init__(self, pools: Callable[[], Iterable["BackendPool"]], table_size: Callable[[], int]) -> None:
        self._pools = pools
        self._table_size = table_size

    def collect(self):  # type: ignore[no-untyped-def]
        in_flight = GaugeMetricFamily(PREFIX + "backend_in_flight", "Requests in flight per backend", labels=["pool", "backend"])
        healthy = GaugeMetricFamily(PREFIX + "backend_healthy", "1 if the backend receives new requests", labels=["pool", "backend"])
        for pool in self._pools():
            for backend in pool.members:
                in_flight.add_metric([pool.name, backend.name], backend.in_flight)
                healthy.add_metric([pool.name, backend.name], 1.0 if backend.available else 0.0)
        yield in_flight
        yield healthy
        yield GaugeMetricFamily(PREFIX + "sessions_active", "Sessions in the session table", value=self._table_size())


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, *, top_k: int) -> None:
        self.registry = registry
        self.top_k = top_k
        self.requests = Counter(PREFIX + "requests", "Client requests by route, final backend and status class",
                                ["route", "backend", "status_class"], registry=registry)
        self.latency = Histogram(PREFIX + "request_duration_seconds", "End-to-end request latency at the router",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=registry)
        self.ttfb = Histogram(PREFIX + "time_to_first_byte_seconds", "Time until the upstream response head arrived",
                              ["route"], buckets=TTFB_BUCKETS, registry=registry)
        self.tokens = Counter(PREFIX + "tokens", "Tokens reported in responses' usage", ["kind"], registry=registry)
        self.placements = Counter(PREFIX + "placements", "Placement decisions by policy and outcome",
                                  ["policy", "outcome"], registry=registry)
        self.retries = Counter(PREFIX + "retries", "Upstream attempts retried, by reason", ["reason"], registry=registry)
        self.pd_fallbacks = Counter(PREFIX + "pd_fallback", "P/D requests that fell back to decode-only, by reason",
                                    ["reason"], registry=registry)
        self.upstream_errors = Counter(PREFIX + "upstream_errors", "Upstream failures by backend and reason",
                                       ["backend", "reason"], registry=registry)
        self.evictions = Counter(PREFIX + "session_evictions", "Sessions that left the table, by reason",
                                 ["reason"], registry=registry)
        self.health_transitions = Counter(PREFIX + "backend_health_transitions", "Backend health changes",
                                          ["backend", "to"], registry=registry)
        # session-level histograms, recorded when a session leaves the table (no session label)
        self.session_turns = Histogram(PREFIX + "session_turns", "Requests per session over its lifetime",
                                       buckets=(1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000), registry=registry)
        self.session_duration = Histogram(PREFIX + "session_duration_seconds", "First to last request of a session",
                                          buckets=(1, 10, 30, 60, 300, 900, 1800, 3600, 7200, 21600, 86400), registry=registry)
        self.session_cached_ratio = Histogram(PREFIX + "session_cached_token_ratio",
                                              "Cached prompt tokens / prompt tokens per session",
                                              buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0),
                                              registry=registry)
        # per-session series (top-K)
        self.s_requests = Counter(PREFIX + "session_requests", "Requests of a top-K session", ["session"], registry=registry)
        self.s_tokens = Counter(PREFIX + "session_tokens", "Tokens of a top-K session", ["session", "kind"], registry=registry)
        self.s_errors = Counter(PREFIX + "session_errors", "Failed requests of a top-K session", ["session"], registry=registry)
        self.s_backend = Gauge(PREFIX + "session_backend_info", "Last backend of a top-K session (value 1)",
                               ["session", "backend"], registry=registry)
        self._top: OrderedDict[str, str] = OrderedDict()  # session id -> backend label currently exported
        self._req_children: dict[tuple[str, str, str], Counter] = {}
        self._placement_children: dict[tuple[str, str], Counter] = {}

    def attach_live(self, pools: Callable[[], Iterable["BackendPool"]], table_size: Callable[[], int]) -> None:
        self.registry.register(_LiveCollector(pools, table_size))

    # ------------------------------------------------------------------ request path
    def placement(self, policy: str, outcome: str) -> None:
        key = (policy, outcome)
        child = self._placement_children.get(key)
        if child is None:
            child = self._placement_children[key] = self.placements.labels(policy, outcome)
        child.inc()

    def request_done(self, route: str, backend: str, status: int, duration_s: float) -> None:
        key = (route, backend, status_class(status))
        child = self._req_children.get(key)
        if child is None:
            child = self._req_children[key] = self.requests.labels(*key)
        child.inc()
        self.latency.labels(route).observe(duration_s)

    def first_byte(self, route: str, seconds: float) -> None:
        self.ttfb.labels(route).observe(seconds)

    def usage(self, prompt: int, completion: int, cached: int) -> None:
        self.tokens.labels("prompt").inc(prompt)
        self.tokens.labels("completion").inc(completion)
        self.tokens.labels("cached").inc(cached)

    # ------------------------------------------------------------------ per-session (top-K)
    def session_request(self, entry: "SessionEntry", backend: str, *, prompt: int = 0, completion: int = 0,
                        cached: int = 0, error: bool = False) -> None:
        """Account one finished request of ``entry`` (already added to the entry's totals)."""
        if self.top_k <= 0 or entry.evicted:
            # an evicted entry: the request finished after its session left the table (e.g. a
            # DELETE during its stream); it must not re-create the session's series
            return
        sid = entry.session_id
        exported = self._top.get(sid)
        if exported is None:
            self._admit(entry, backend)
            return
        self._top.move_to_end(sid)
        self.s_requests.labels(sid).inc()
        if prompt:
            self.s_tokens.labels(sid, "prompt").inc(prompt)
        if completion:
            self.s_tokens.labels(sid, "completion").inc(completion)
        if cached:
            self.s_tokens.labels(sid, "cached").inc(cached)
        if error:
            self.s_errors.labels(sid).inc()
        if exported != backend:
            self.s_backend.remove(sid, exported)
            self.s_backend.labels(sid, backend).set(1)
            self._top[sid] = backend

    def _admit(self, entry: "SessionEntry", backend: str) -> None:
        sid = entry.session_id
        self._top[sid] = backend
        self.s_requests.labels(sid).inc(entry.requests)
        self.s_tokens.labels(sid, "prompt").inc(entry.prompt_tokens)
        self.s_tokens.labels(sid, "completion").inc(entry.completion_tokens)
        self.s_tokens.labels(sid, "cached").inc(entry.cached_tokens)
        self.s_errors.labels(sid).inc(entry.errors)
        self.s_backend.labels(sid, backend).set(1)
        while len(self._top) > self.top_k:
            old, old_backend = self._top.popitem(last=False)
            self._drop_series(old, old_backend)

    def _drop_series(self, sid: str, backend: str) -> None:
        self.s_requests.remove(sid)
        for kind in ("prompt", "completion", "cached"):
            self.s_tokens.remove(sid, kind)
        self.s_errors.remove(sid)
        self.s_backend.remove(sid, backend)

    def session_evicted(self, entry: "SessionEntry", reason: str) -> None:
        """Called by the session table for every entry that leaves it."""
        self.evictions.labels(reason).inc()
        backend = self._top.pop(entry.session_id, None)
        if backend is not None:
            self._drop_series(entry.session_id, backend)
        self.session_turns.observe(entry.requests)
        self.session_duration.observe(max(0.0, entry.last_active - entry.created))
        if entry.prompt_tokens:
            self.session_cached_ratio.observe(entry.cached_tokens / entry.prompt_tokens)

    def exported_sessions(self) -> list[str]:
        return list(self._top)

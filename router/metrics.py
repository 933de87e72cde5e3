"""Router metrics: our own ``session_router_`` prefix, labels from closed sets or the top-K sessions.

Closed label sets: ``route`` (the proxied routes), ``backend`` (configured backends),
``status_class`` (2xx..5xx), ``policy``, ``outcome`` (``placement.base.Outcome``), ``reason``
(retries: why; placement decisions: ``placement.base.REASONS``, "none" from a policy that gives none).

Per-session series carry a ``session`` label only for the ``top_k`` most recently active
sessions of the session table. Its value follows ``session_label``: ``"hash"`` (the default)
``contract.ids.session_hash`` of the id (16 hex digits; the id is a capability for
``GET``/``DELETE /v1/sessions/{id}``, so it is not shown to whoever reads /metrics), ``"id"``
the id itself, ``"none"`` no per-session series at all. They are not updated on the request
path at all: a collector reads them from the table's entries (cumulative requests, tokens,
errors, last backend) at scrape time. So a session that leaves the top K, or the table (expiry, capacity, DELETE), has no series
from the next scrape on, the number of session-labelled series per metric never exceeds
``top_k``, and a session that comes back shows its cumulative totals again.

Live state (in-flight, health, table size) is read at scrape time too, so the request path
pays only for the closed-label counters and histograms, whose label children are cached.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString
from prometheus_client.registry import Collector

from contract.ids import session_hash

if TYPE_CHECKING:
    from router.membership import BackendPool
    from router.sessions.table import SessionEntry, SessionTable

PREFIX = "session_router_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def status_class(status: int) -> str:
    return f"{status // 100}xx"


def labelled(family: Callable[..., Any], name: str, doc: str, labels: list[str],
             samples: Iterable[tuple[Any, float]]) -> Any:
    """A counter or gauge family ``name`` with one sample per ``(label values, value)`` of ``samples``:
    the label values as a tuple, or one string when there is one label."""
    metric = family(name, doc, labels=labels)
    for key, value in samples:
        metric.add_metric(list(key) if isinstance(key, tuple) else [key], value)
    return metric


class _Histogram:
    """A lock-free histogram for the event-loop thread: per-bucket counts and a sum."""

    __slots__ = ("buckets", "counts", "total")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last slot is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value

    def family_samples(self) -> tuple[list[tuple[str, float]], float]:
        cumulative: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else floatToGoString(bound), running))
        return cumulative, self.total


class _HotCounters:
    """What every request updates: plain ints and lists, exported by the collector at scrape time
    (prometheus-client's objects take a lock and a label lookup per update)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}
        #: placements by (policy, outcome, reason); ``placements`` (by policy and outcome) sums them at scrape time
        self.decisions: dict[tuple[str, str, str], int] = {}
        self.tokens = [0, 0, 0]  # prompt, completion, cached
        self.latency: dict[str, _Histogram] = {}
        self.ttfb: dict[str, _Histogram] = {}

    def collect(self):  # type: ignore[no-untyped-def]
        yield labelled(CounterMetricFamily, PREFIX + "requests", "Client requests by route, final backend and status class",
                       ["route", "backend", "status_class"], self.requests.items())
        placements: dict[tuple[str, str], int] = {}
        for (policy, outcome, _reason), count in self.decisions.items():
            placements[policy, outcome] = placements.get((policy, outcome), 0) + count
        yield labelled(CounterMetricFamily, PREFIX + "placements", "Placement decisions by policy and outcome",
                       ["policy", "outcome"], placements.items())
        yield labelled(CounterMetricFamily, PREFIX + "placement_decisions",
                       "Placement decisions by policy, outcome and reason (why it went there)",
                       ["policy", "outcome", "reason"], self.decisions.items())
        tokens = CounterMetricFamily(PREFIX + "tokens", "Tokens reported in responses' usage", labels=["kind"])
        for kind, value in zip(("prompt", "completion", "cached"), self.tokens):
            tokens.add_metric([kind], value)
        yield tokens
        for name, doc, table in (
            ("request_duration_seconds", "End-to-end request latency at the router", self.latency),
            ("time_to_first_byte_seconds", "Time until the upstream response head arrived", self.ttfb),
        ):
            family = HistogramMetricFamily(PREFIX + name, doc, labels=["route"])
            for route, hist in table.items():
                buckets, total = hist.family_samples()
                family.add_metric([route], buckets, total)
            yield family


#: render calls: a render server answers in about a millisecond, a local render of a long prompt in tens
RENDER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RenderMetrics:
    """``session_router_render_*`` (tokens mode): renders by the render servers, per server, and in the
    router itself. Plain ints and lock-free histograms, exported at scrape time, as ``_HotCounters``.

    - ``render_requests{render_server, status_class}``: calls to a render server and what it answered
      (its 4xx are the client's errors, relayed);
    - ``render_errors{render_server, reason}``: calls that got no usable answer (``connect``, ``timeout``,
      ``protocol``, ``status_5xx``); each one moved on to the next render server or ended in a 503;
    - ``render_duration_seconds{render_server}``: a render server's answer time, per call;
    - ``render_local_duration_seconds``: the router's own render time (CPU, in the event loop).
    """

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.remote: dict[str, _Histogram] = {}
        self.local = _Histogram(RENDER_BUCKETS)

    def remote_done(self, server: str, status: int, seconds: float) -> None:
        """A render server answered ``status`` after ``seconds``."""
        key = (server, status_class(status))
        self.requests[key] = self.requests.get(key, 0) + 1
        hist = self.remote.get(server)
        if hist is None:
            hist = self.remote[server] = _Histogram(RENDER_BUCKETS)
        hist.observe(seconds)

    def remote_failed(self, server: str, reason: str) -> None:
        """A call to a render server failed (``reason``: connect, timeout, protocol, status_5xx)."""
        key = (server, reason)
        self.errors[key] = self.errors.get(key, 0) + 1

    def local_done(self, seconds: float) -> None:
        """The router rendered one request itself in ``seconds``."""
        self.local.observe(seconds)

    def collect(self):  # type: ignore[no-untyped-def]
        yield labelled(CounterMetricFamily, PREFIX + "render_requests",
                       "Calls to render servers by server and status class",
                       ["render_server", "status_class"], self.requests.items())
        yield labelled(CounterMetricFamily, PREFIX + "render_errors",
                       "Calls to render servers that got no usable answer, by server and reason",
                       ["render_server", "reason"], self.errors.items())
        remote = HistogramMetricFamily(PREFIX + "render_duration_seconds", "Render server answer time per call",
                                       labels=["render_server"])
        for server, hist in self.remote.items():
            buckets, total = hist.family_samples()
            remote.add_metric([server], buckets, total)
        yield remote
        local = HistogramMetricFamily(PREFIX + "render_local_duration_seconds", "Render time in the router itself")
        buckets, total = self.local.family_samples()
        local.add_metric([], buckets, total)
        yield local


SESSION_LABELS: dict[str, Callable[[str], str] | None] = {"hash": session_hash, "id": str, "none": None}


class _LiveCollector(Collector):
    def __init__(self, pools: Callable[[], Iterable["BackendPool"]], table: "SessionTable", top_k: int,
                 label: Callable[[str], str] | None) -> None:
        self._pools = pools
        self._table = table
        self._top_k = top_k
        self._label = label

    def collect(self):  # type: ignore[no-untyped-def]
        in_flight = GaugeMetricFamily(PREFIX + "backend_in_flight", "Requests in flight per backend", labels=["pool", "backend"])
        healthy = GaugeMetricFamily(PREFIX + "backend_healthy", "1 if the backend receives new requests", labels=["pool", "backend"])
        for pool in self._pools():
            for backend in pool.members:
                in_flight.add_metric([pool.name, backend.name], backend.in_flight)
                healthy.add_metric([pool.name, backend.name], 1.0 if backend.available else 0.0)
        yield in_flight
        yield healthy
        yield GaugeMetricFamily(PREFIX + "sessions_active", "Sessions in the session table", value=len(self._table))
        label = self._label
        if label is None:  # session_label = "none"
            return
        top = self._table.recent(self._top_k) if self._top_k > 0 else []
        requests = CounterMetricFamily(PREFIX + "session_requests", "Requests of a top-K session", labels=["session"])
        tokens = CounterMetricFamily(PREFIX + "session_tokens", "Tokens of a top-K session", labels=["session", "kind"])
        errors = CounterMetricFamily(PREFIX + "session_errors", "Failed requests of a top-K session", labels=["session"])
        backend_info = GaugeMetricFamily(PREFIX + "session_backend_info", "Last backend of a top-K session (value 1)",
                                         labels=["session", "backend"])
        for entry in top:
            sid = label(entry.session_id)
            requests.add_metric([sid], entry.requests)
            tokens.add_metric([sid, "prompt"], entry.prompt_tokens)
            tokens.add_metric([sid, "completion"], entry.completion_tokens)
            tokens.add_metric([sid, "cached"], entry.cached_tokens)
            errors.add_metric([sid], entry.errors)
            if entry.last_backend:
                backend_info.add_metric([sid, entry.last_backend], 1.0)
        yield requests
        yield tokens
        yield errors
        yield backend_info


class _UpstreamCollector(Collector):
    """The upstream pool's connections, read at scrape time: ``opened()`` = connections opened so far,
    ``by_address()`` = per backend ``host:port``, its idle and busy connections now."""

    def __init__(self, opened: Callable[[], int], by_address: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        self._opened = opened
        self._by_address = by_address

    def collect(self):  # type: ignore[no-untyped-def]
        yield CounterMetricFamily(
            PREFIX + "upstream_connections_opened",
            "TCP connections opened to backends; rising under steady load means [upstream] max_idle_per_host "
            "is below the concurrency a backend sees",
            value=self._opened())
        now = GaugeMetricFamily(PREFIX + "upstream_connections", "Open connections to a backend, by state",
                                labels=["address", "state"])
        for address, counts in sorted(self._by_address().items()):
            now.add_metric([address, "idle"], counts["idle"])
            now.add_metric([address, "busy"], counts["busy"])
        yield now


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, *, top_k: int, session_label: str = "hash") -> None:
        """``session_label``: ``hash`` | ``id`` | ``none`` (see the module docstring)."""
        self.registry = registry
        self.top_k = top_k
        self.session_label = session_label
        self.hot = _HotCounters()
        registry.register(self.hot)
        #: tokens mode's render calls (``session_router_render_*``; empty families in text mode)
        self.render = RenderMetrics()
        registry.register(self.render)
        self.retries = Counter(PREFIX + "retries", "Upstream attempts retried, by reason", ["reason"], registry=registry)
        self.pd_fallbacks = Counter(PREFIX + "pd_fallback", "P/D requests that fell back to decode-only, by reason",
                                    ["reason"], registry=registry)
        # issue 11: client kv_transfer_params are not trusted; held KV is released when the decode leg fails
        self.kv_params_stripped = Counter(PREFIX + "kv_params_stripped",
                                          "Requests whose client-sent kv_transfer_params were removed, by route",
                                          ["route"], registry=registry)
        self.pd_kv_releases = Counter(PREFIX + "pd_kv_releases",
                                      "P/D hand-offs whose decode leg failed: the prefill was told to free the held "
                                      "KV, by result (released, not_held = already pulled or expired, failed)",
                                      ["result"], registry=registry)
        # issue 13: tokens mode ends engine requests the router no longer reads (stop strings, client gone)
        self.engine_aborts = Counter(PREFIX + "engine_aborts",
                                     "Tokens mode: engine requests aborted by the router (every choice ended on a stop "
                                     "string, or the client left), by result (aborted, failed)",
                                     ["result"], registry=registry)
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
        self._table: "SessionTable | None" = None

    def attach_live(self, pools: Callable[[], Iterable["BackendPool"]], table: "SessionTable") -> None:
        self._table = table
        self.registry.register(_LiveCollector(pools, table, self.top_k, SESSION_LABELS[self.session_label]))

    def attach_upstream(self, opened: Callable[[], int],
                        by_address: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        """Export the upstream pool's connections (``_UpstreamCollector``)."""
        self.registry.register(_UpstreamCollector(opened, by_address))

    # ------------------------------------------------------------------ request path
    def placement(self, policy: str, outcome: str, reason: str = "") -> None:
        decisions = self.hot.decisions
        why = (policy, outcome, reason or "none")
        decisions[why] = decisions.get(why, 0) + 1

    def request_done(self, route: str, backend: str, status: int, duration_s: float) -> None:
        hot = self.hot
        key = (route, backend, status_class(status))
        hot.requests[key] = hot.requests.get(key, 0) + 1
        hist = hot.latency.get(route)
        if hist is None:
            hist = hot.latency[route] = _Histogram(LATENCY_BUCKETS)
        hist.observe(duration_s)

    def first_byte(self, route: str, seconds: float) -> None:
        hist = self.hot.ttfb.get(route)
        if hist is None:
            hist = self.hot.ttfb[route] = _Histogram(TTFB_BUCKETS)
        hist.observe(seconds)

    def usage(self, prompt: int, completion: int, cached: int) -> None:
        tokens = self.hot.tokens
        tokens[0] += prompt
        tokens[1] += completion
        tokens[2] += cached

    # ------------------------------------------------------------------ sessions
    def session_evicted(self, entry: "SessionEntry", reason: str) -> None:
        """Called by the session table for every entry that leaves it."""
        self.evictions.labels(reason).inc()
        self.session_turns.observe(entry.requests)
        self.session_duration.observe(max(0.0, entry.last_active - entry.created))
        if entry.prompt_tokens:
            self.session_cached_ratio.observe(entry.cached_tokens / entry.prompt_tokens)

    def exported_sessions(self) -> list[str]:
        """Sessions (their ids) that carry per-session series now, least recently active first."""
        if self._table is None or self.top_k <= 0 or self.session_label == "none":
            return []
        return [e.session_id for e in reversed(self._table.recent(self.top_k))]

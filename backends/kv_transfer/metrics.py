"""The P/D transfer's metrics: plain counters on the request path, turned into metric families
at scrape time (names in the package's docstring)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.engine.holds import HoldTable

#: the closed set of pull failure reasons (metric label values)
FAILURE_REASONS = (
    "invalid_params",  # do_remote_prefill without a usable engine id / request id / host / port / block ids
    "not_allowed",  # the side channel is not on the allow-list: no connection was attempted
    "unreachable",  # connect error or connection lost
    "timeout",  # no full reply within the pull timeout
    "not_found",  # the prefill does not hold that request (freed, expired or never there)
    "mismatch",  # engine id, block size or prompt differ (the prefill's 409, or a reply for another prompt)
    "rejected",  # any other status from the side channel
    "bad_reply",  # a 200 whose body is not a KVPullResponse
)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class KVTransferMetrics:
    """Plain counters on the hot path, turned into metric families at scrape time."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine_index: int) -> None:
        self.labels = [model_name, str(engine_index)]
        self.pulls = 0
        self.pulled_tokens = 0
        self.failures = dict.fromkeys(FAILURE_REASONS, 0)
        self.pulls_served = 0
        self.external_queries = 0
        self.external_hits = 0
        self.by_source = dict.fromkeys(SOURCES, 0)
        self.held_requests = lambda: 0
        #: the engine's holds (bounds, counts by reason); None without an engine
        self.holds: HoldTable | None = None
        registry.register(_KVCollector(self))

    def families(self) -> Iterator[Metric]:
        labels = self.labels
        names = ["model_name", "engine"]
        counters = (
            ("session_backend_kv_pulls", "P/D decode: KV pulls from a prefill instance that succeeded.", self.pulls),
            ("session_backend_kv_pulled_tokens", "P/D decode: prompt tokens (full blocks) pulled from prefill "
             "instances.", self.pulled_tokens),
            ("session_backend_kv_pulls_served", "P/D prefill: held requests whose blocks a decode instance pulled "
             "(then freed).", self.pulls_served),
            ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance "
             "cache sharing, in terms of number of queried tokens.", self.external_queries),
            ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache "
             "sharing, in terms of number of cached tokens.", self.external_hits),
        )  # fmt: skip
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(labels, value)
            yield c
        failures = CounterMetricFamily(
            "session_backend_kv_pull_failures",
            "P/D decode: KV pulls that failed (the prompt was recomputed locally), by reason.",
            labels=[*names, "reason"],
        )
        for reason, value in self.failures.items():
            failures.add_metric([*labels, reason], value)
        yield failures
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", labels=[*names, "source"]
        )
        for source, value in self.by_source.items():
            by_source.add_metric([*labels, source], value)
        yield by_source
        held = GaugeMetricFamily(
            "session_backend_kv_held_requests",
            "P/D prefill: finished requests whose KV blocks are held for a decode instance to pull.",
            labels=names,
        )
        held.add_metric(labels, float(self.held_requests()))
        yield held
        holds = self.holds
        held_blocks = GaugeMetricFamily(
            "session_backend_kv_held_blocks",
            "P/D prefill: KV blocks held for decode instances to pull.",
            labels=names,
        )
        held_blocks.add_metric(labels, float(holds.num_blocks if holds is not None else 0))
        yield held_blocks
        freed = CounterMetricFamily(
            "session_backend_kv_holds_freed",
            "P/D prefill: holds of KV blocks that ended, by reason (pulled, released by the router, expired, "
            "evicted by the total bound, freed under block pressure, replaced).",
            labels=[*names, "reason"],
        )
        refused = CounterMetricFamily(
            "session_backend_kv_holds_refused",
            "P/D prefill: requests for remote decode whose blocks were not held, by reason.",
            labels=[*names, "reason"],
        )
        if holds is not None:
            for reason, value in holds.freed.items():
                freed.add_metric([*labels, reason], value)
            for reason, value in holds.refused.items():
                refused.add_metric([*labels, reason], value)
        yield freed
        yield refused


class _KVCollector(Collector):
    def __init__(self, metrics: KVTransferMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.families()

    def describe(self) -> Iterator[Metric]:
        return self._metrics.families()

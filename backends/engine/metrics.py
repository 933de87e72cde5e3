"""The engine's Prometheus metrics: vLLM's names and labels, plus bounded per-session series.

vLLM's series (labels ``model_name``, ``engine``), counted per child sequence as vLLM counts its
child requests:

- gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
  (0..1), ``vllm:cache_config_info`` (= 1, cache settings as labels);
- counters (exposed with ``_total``) ``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits`` (in
  tokens), ``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:num_preemptions``,
  ``vllm:request_success`` (extra label ``finished_reason``: stop, length, abort);
- histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens`` (vLLM's bucket choices);
- the request-phase histograms, one observation per finished child (where ``e2e`` is observed,
  so every one of them counts the same requests as ``vllm:request_success``), vLLM 0.32's
  intervals between the engine's timestamps of a sequence: *queued* (added to the engine),
  *scheduled* (first admitted to the running batch; a preempted sequence's re-admission does not
  move it), *first token* and *last token*:

  * ``vllm:request_queue_time_seconds`` = scheduled - queued (WAITING; a preempted sequence's
    second wait is not in it),
  * ``vllm:request_prefill_time_seconds`` = first token - scheduled (includes the simulated time
    of the step that computes the prompt's last chunk and samples the first token, and any
    preemption before it),
  * ``vllm:request_decode_time_seconds`` = last token - first token,
  * ``vllm:request_inference_time_seconds`` = last token - scheduled (= prefill + decode),
  * ``vllm:request_time_per_output_token_seconds`` = decode / (generated tokens - 1), 0 with one
    token (inter-token-latency buckets; the others use the e2e buckets, as vLLM does).

  A sequence that finishes without reaching a phase (aborted while waiting, or before its first
  token; an unschedulable prompt) has that phase end when it finishes: never scheduled = all its
  time queued and 0 for the rest; no first token = prefill until the finish, 0 decode.

Ours (prefix ``session_backend_``): ``session_backend_session_requests_total``,
``session_backend_session_prompt_tokens_total``, ``session_backend_session_cached_tokens_total`` and
``session_backend_session_generated_tokens_total`` with an extra ``session`` label, and the gauge
``session_backend_tracked_sessions``.

Cardinality bound: per-session series exist only for the ``session_top_k`` most recently active
sessions (the head of the engine's ``SessionAccounting``). A session that leaves the top K has its
series removed at once (they are no longer exposed); the full table is at ``GET /v1/sessions``.

How: the engine updates plain Python numbers on its hot path (an int add, a bisect per histogram
observation) and one ``prometheus_client`` Collector, registered in the caller's
``CollectorRegistry``, turns them into metric families at scrape time. Gauges are read from the bound
engine core at scrape time. One registry can hold one engine's metrics.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from backends.engine.accounting import SessionAccounting

FINISHED_REASONS = ("stop", "length", "abort")

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
#: vLLM's "request_latency" family: e2e and the request-phase histograms (queue, prefill, decode, inference)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
E2E_BUCKETS = REQUEST_LATENCY_BUCKETS


def buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 buckets up to ``max_value`` (1, 2, 5, 10, 20, 50, ...)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return tuple(out)
            out.append(float(v))
        exponent += 1


class FastHistogram:
    """Bucket counts kept as plain ints; ``observe`` is one bisect and two adds."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last = +Inf only
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for bound, c in zip(self.bounds, self.counts):
            acc += c
            out.append((floatToGoString(bound), acc))
        acc += self.counts[-1]
        out.append(("+Inf", acc))
        return out


class EngineState(Protocol):
    """What the gauges read at scrape time (the engine core)."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_cache_usage(self) -> float: ...


class EngineMetrics:
    """Counters and histograms of one engine, exposed through ``registry``."""

    def __init__(
        self, registry: CollectorRegistry, model_name: str, engine_index: int, session_top_k: int
    ) -> None:
        self.model_name = model_name
        self.engine_index = engine_index
        self.session_top_k = max(0, session_top_k)
        self.created = time.time()
        self.labels = [model_name, str(engine_index)]
        # counters
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self.request_success = dict.fromkeys(FINISHED_REASONS, 0)
        # histograms
        self.ttft = FastHistogram(TTFT_BUCKETS)
        self.itl = FastHistogram(ITL_BUCKETS)
        self.e2e = FastHistogram(E2E_BUCKETS)
        self.queue_time = FastHistogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = FastHistogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = FastHistogram(REQUEST_LATENCY_BUCKETS)
        self.inference_time = FastHistogram(REQUEST_LATENCY_BUCKETS)
        self.time_per_output_token = FastHistogram(ITL_BUCKETS)
        self.request_prompt_tokens = FastHistogram(buckets_1_2_5(1 << 20))
        self.request_generation_tokens = FastHistogram(buckets_1_2_5(1 << 20))
        # bound later by the engine core
        self._state: EngineState | None = None
        self._sessions: SessionAccounting | None = None
        self._cache_info: dict[str, str] = {}
        self._collector = _EngineCollector(self)
        registry.register(self._collector)

    def bind(self, state: EngineState, sessions: SessionAccounting, cache_info: dict[str, str]) -> None:
        """Called by the engine core: where gauges and per-session series are read from."""
        self._state = state
        self._sessions = sessions
        self._cache_info = cache_info

    def set_max_model_len(self, max_model_len: int) -> None:
        """Use vLLM's 1-2-5 token buckets up to ``max_model_len`` (call before any observation)."""
        self.request_prompt_tokens = FastHistogram(buckets_1_2_5(max_model_len))
        self.request_generation_tokens = FastHistogram(buckets_1_2_5(max_model_len))

    def count_finished(
        self,
        reason: str,
        e2e_s: float,
        prompt_tokens: int,
        generation_tokens: int,
        *,
        queued_at: float,
        scheduled_at: float,
        first_token_at: float,
        last_token_at: float,
        finished_at: float,
    ) -> None:
        """One child sequence finished with ``reason``.

        The ``*_at`` are its engine timestamps (monotonic; 0.0 = never reached): the request-phase
        histograms get vLLM's intervals between them (module docstring)."""
        success = self.request_success
        success[reason] = success.get(reason, 0) + 1
        self.e2e.observe(e2e_s)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if scheduled_at == 0.0:  # never scheduled: queued until it finished
            scheduled_at = finished_at
        if first_token_at == 0.0:  # no token: in prefill until it finished
            first_token_at = last_token_at = finished_at
        decode_s = last_token_at - first_token_at
        self.queue_time.observe(scheduled_at - queued_at)
        self.prefill_time.observe(first_token_at - scheduled_at)
        self.decode_time.observe(decode_s)
        self.inference_time.observe(last_token_at - scheduled_at)
        self.time_per_output_token.observe(decode_s / (generation_tokens - 1) if generation_tokens > 1 else 0.0)

    # -- exposition ------------------------------------------------------------------------
    def families(self) -> Iterator[Metric]:
        labels = self.labels
        names = ["model_name", "engine"]
        state = self._state
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             state.num_running if state else 0),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             state.num_waiting if state else 0),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             state.kv_cache_usage if state else 0.0),
        )  # fmt: skip
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(labels, float(value))
            yield g
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=["engine", *self._cache_info]
        )
        info.add_metric([labels[1], *self._cache_info.values()], 1.0)
        yield info

        counters = (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             self.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             self.prefix_cache_hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", self.num_preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", self.generation_tokens),
        )  # fmt: skip
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(labels, value, created=self.created)
            yield c
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        for reason, value in self.request_success.items():
            success.add_metric([*labels, reason], value, created=self.created)
        yield success

        histograms = (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", self.request_prompt_tokens),
            ("vllm:request_generation_tokens", "Number of generation tokens processed.",
             self.request_generation_tokens),
            ("vllm:request_time_per_output_token_seconds",
             "Histogram of time_per_output_token_seconds per request.", self.time_per_output_token),
            ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
             self.queue_time),
            ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
             self.inference_time),
            ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
             self.prefill_time),
            ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
             self.decode_time),
        )  # fmt: skip
        for name, doc, hist in histograms:
            h = HistogramMetricFamily(name, doc, labels=names)
            h.add_metric(labels, hist.cumulative(), hist.sum)
            yield h

        yield from self._session_families(labels, names)

    def _session_families(self, labels: list[str], names: list[str]) -> Iterator[Metric]:
        sessions = self._sessions
        tracked = GaugeMetricFamily(
            "session_backend_tracked_sessions",
            "Sessions in the engine's accounting table (bounded; see GET /v1/sessions).",
            labels=names,
        )
        tracked.add_metric(labels, float(len(sessions)) if sessions is not None else 0.0)
        yield tracked
        top = sessions.recent(self.session_top_k) if sessions is not None else []
        session_names = [*names, "session"]
        fams = (
            ("session_backend_session_requests", "Requests finished, per recently active session.", "requests"),
            ("session_backend_session_prompt_tokens", "Prompt tokens, per recently active session.",
             "prompt_tokens"),
            ("session_backend_session_cached_tokens", "Prompt tokens served from the prefix cache, per "
             "recently active session.", "cached_tokens"),
            ("session_backend_session_generated_tokens", "Generated tokens, per recently active session.",
             "generated_tokens"),
        )  # fmt: skip
        for name, doc, attr in fams:
            c = CounterMetricFamily(name, doc, labels=session_names)
            for session_id, stats in top:
                c.add_metric([*labels, session_id], getattr(stats, attr))
            yield c


class _EngineCollector(Collector):
    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.families()

    def describe(self) -> Iterator[Metric]:
        # the registry reads names from here to refuse duplicates; the values do not matter
        return self._metrics.families()

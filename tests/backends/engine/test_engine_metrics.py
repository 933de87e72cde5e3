"""The engine's /metrics: vLLM's names and labels, values that match what happened, bounded sessions."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backends.engine.client import AsyncEngine
from backends.engine.config import EngineConfig
from backends.engine.core import EngineCore
from backends.engine.metrics import EngineMetrics, FastHistogram, buckets_1_2_5
from backends.engine.request import EngineCoreRequest, SamplingParams
from tests.backends.engine.engine_support import wire

LABELS = {"model_name": "sim-model", "engine": "3"}


def make_core(registry: CollectorRegistry, top_k: int = 5, **overrides: Any) -> EngineCore:
    config = EngineConfig(**{"model": "sim-model", "engine_index": 3, "speed": 0.0, "eos_probability": 0.0,
                             "session_metrics_top_k": top_k, **overrides})  # fmt: skip
    return EngineCore(config, EngineMetrics(registry, config.model, config.engine_index, top_k))


def drain(core: EngineCore) -> None:
    for _ in range(10_000):
        if not core.has_work():
            return
        core.step()
    raise AssertionError("did not finish")


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(smp: dict[Any, float], name: str, **extra: str) -> float:
    return smp[(name, tuple(sorted({**LABELS, **extra}.items())))]


def test_exposition_has_vllm_names_labels_and_types() -> None:
    """Counters are registered as ``vllm:x`` and exposed as ``vllm:x_total`` (as vLLM's are)."""
    registry = CollectorRegistry()
    make_core(registry)
    text = generate_latest(registry).decode()
    for line in (
        "# TYPE vllm:num_requests_running gauge",
        "# TYPE vllm:num_requests_waiting gauge",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        "# TYPE vllm:prefix_cache_queries_total counter",
        "# TYPE vllm:prefix_cache_hits_total counter",
        "# TYPE vllm:prompt_tokens_total counter",
        "# TYPE vllm:generation_tokens_total counter",
        "# TYPE vllm:num_preemptions_total counter",
        "# TYPE vllm:request_success_total counter",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        "# TYPE vllm:inter_token_latency_seconds histogram",
        "# TYPE vllm:e2e_request_latency_seconds histogram",
        "# TYPE vllm:request_prompt_tokens histogram",
        "# TYPE vllm:request_generation_tokens histogram",
        'vllm:num_requests_running{engine="3",model_name="sim-model"} 0.0',
        'vllm:prompt_tokens_total{engine="3",model_name="sim-model"} 0.0',
        'vllm:request_success_total{engine="3",finished_reason="abort",model_name="sim-model"} 0.0',
        'vllm:time_to_first_token_seconds_bucket{engine="3",le="0.001",model_name="sim-model"} 0.0',
        'vllm:e2e_request_latency_seconds_bucket{engine="3",le="+Inf",model_name="sim-model"} 0.0',
    ):
        assert line in text, line


def test_values_follow_what_the_engine_did() -> None:
    registry = CollectorRegistry()
    core = make_core(registry, max_num_seqs=1)
    prompt = list(range(40))
    core.add_request(wire("a", prompt, "s1", max_tokens=5))
    core.add_request(wire("b", prompt, "s1", max_tokens=3))
    core.step()  # a prefilled (first token); b waits (max_num_seqs=1)
    smp = samples(registry)
    assert value(smp, "vllm:num_requests_running") == 1
    assert value(smp, "vllm:num_requests_waiting") == 1
    assert value(smp, "vllm:kv_cache_usage_perc") == pytest.approx(3 / core.config.num_blocks)
    drain(core)
    core.add_request(wire("c", prompt, "s2", max_tokens=100))
    core.step()
    core.abort_request("c")
    smp = samples(registry)
    assert value(smp, "vllm:num_requests_running") == 0
    assert value(smp, "vllm:kv_cache_usage_perc") == 0
    assert value(smp, "vllm:prompt_tokens_total") == 120
    assert value(smp, "vllm:generation_tokens_total") == 5 + 3 + 1
    assert value(smp, "vllm:prefix_cache_queries_total") == 120
    assert value(smp, "vllm:prefix_cache_hits_total") == 64  # b and c hit a's 2 full blocks
    assert value(smp, "vllm:request_success_total", finished_reason="length") == 2
    assert value(smp, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(smp, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(smp, "vllm:time_to_first_token_seconds_count") == 3
    assert value(smp, "vllm:inter_token_latency_seconds_count") == 4 + 2
    assert value(smp, "vllm:e2e_request_latency_seconds_count") == 3
    assert value(smp, "vllm:request_generation_tokens_sum") == 9
    assert value(smp, "vllm:request_prompt_tokens_bucket", le="50.0") == 3
    assert value(smp, "vllm:request_prompt_tokens_bucket", le="20.0") == 0
    assert value(smp, "session_backend_session_requests_total", session="s1") == 2
    assert value(smp, "session_backend_session_generated_tokens_total", session="s1") == 8
    assert value(smp, "session_backend_session_cached_tokens_total", session="s1") == 32
    assert value(smp, "session_backend_session_prompt_tokens_total", session="s2") == 40


def test_preemptions_are_counted() -> None:
    registry = CollectorRegistry()
    core = make_core(registry, block_size=4, num_blocks=6, max_model_len=64)
    for i in range(3):
        core.add_request(wire(f"p{i}", list(range(10 * i, 10 * i + 8)), max_tokens=12))
    drain(core)
    assert value(samples(registry), "vllm:num_preemptions_total") == core.metrics.num_preemptions > 0


def test_session_series_are_bounded_to_the_top_k_most_recent() -> None:
    k = 3
    registry = CollectorRegistry()
    core = make_core(registry, top_k=k)
    names = [f"sess-{i}" for i in range(3 * k)]
    for i, name in enumerate(names):
        core.add_request(wire(f"r{i}", [1, 2, 3, i], name, max_tokens=2))
        drain(core)
        present = {
            labels
            for (metric, labels) in samples(registry)
            if metric == "session_backend_session_requests_total"
        }
        sessions = {dict(lbl)["session"] for lbl in present}
        assert len(sessions) <= k
        assert sessions == set(names[max(0, i - k + 1) : i + 1])  # the K most recently active
    text = generate_latest(registry).decode()
    for evicted in names[: 2 * k]:
        assert f'session="{evicted}"' not in text
    # a series comes back when its session is active again, with its full count
    core.add_request(wire("again", [9], names[0], max_tokens=2))
    drain(core)
    assert value(samples(registry), "session_backend_session_requests_total", session=names[0]) == 2
    assert value(samples(registry), "session_backend_tracked_sessions") == 3 * k


def test_two_engines_need_two_registries() -> None:
    registry = CollectorRegistry()
    EngineMetrics(registry, "m", 0, 1)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        EngineMetrics(registry, "m", 1, 1)


def test_fast_histogram_matches_prometheus_bucket_semantics() -> None:
    h = FastHistogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(v)
    h.observe(0.2, count=2)
    assert h.cumulative() == [("0.1", 2), ("1.0", 6), ("+Inf", 7)]  # le is inclusive
    assert h.count == 7 and h.sum == pytest.approx(5.05)
    assert buckets_1_2_5(100) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)


async def test_metrics_through_the_async_engine() -> None:
    registry = CollectorRegistry()
    eng = AsyncEngine(EngineConfig(model="sim-model", engine_index=3, speed=0.0), registry)
    await eng.start()
    try:
        req = EngineCoreRequest("r", [1, 2, 3], None, SamplingParams(max_tokens=3, ignore_eos=True), None,
                                time.time(), None, None, None, session_id="s")  # fmt: skip
        async for _ in eng.generate(req):
            pass
        smp = samples(registry)
        assert value(smp, "vllm:generation_tokens_total") == 3
        assert value(smp, "session_backend_session_requests_total", session="s") == 1
        assert eng.metrics is eng.core.metrics
    finally:
        await eng.stop()

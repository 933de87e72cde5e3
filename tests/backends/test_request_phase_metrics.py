"""vLLM 0.32's request-phase histograms (queue, prefill, decode, inference, time per output token):
names, help texts, labels and buckets as vLLM exports them; exact intervals from the engine's
timestamps (a hand-driven core on a fake clock, preemption and an abort while waiting included);
and a real backend over HTTP: counts, a queue that grows when requests must wait, a prefill time that
follows the uncached prompt tokens, consistent sums."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from backends.app import create_app
from backends.engine import core as core_module
from backends.engine import scheduler as scheduler_module
from backends.engine.config import EngineConfig
from backends.engine.core import EngineCore
from backends.engine.latency import LatencyModel
from backends.engine.metrics import EngineMetrics
from backends.frontend import FRONTEND
from tests.backends.engine.engine_support import wire
from tests.support import metric_sum

MODEL = "sim-model"
LABELS = {"model_name": MODEL, "engine": "0"}

QUEUE = "vllm:request_queue_time_seconds"
PREFILL = "vllm:request_prefill_time_seconds"
DECODE = "vllm:request_decode_time_seconds"
INFERENCE = "vllm:request_inference_time_seconds"
TPOT = "vllm:request_time_per_output_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"
PHASES = (QUEUE, PREFILL, DECODE, INFERENCE, TPOT)

#: GET /metrics of a live vLLM 0.32 (recorded by helper V; tests/data/kv_events/README.md)
VLLM_METRICS = Path(__file__).resolve().parents[1] / "data" / "kv_events" / "vllm032_metrics_idle.txt"


def exposition_of(text: str, name: str) -> tuple[list[str], list[str]]:
    """The HELP and TYPE lines of ``name`` and its buckets' ``le`` values, in order."""
    header = [line for line in text.splitlines() if line.startswith((f"# HELP {name} ", f"# TYPE {name} "))]
    les = re.findall(rf'^{re.escape(name)}_bucket{{[^}}]*le="([^"]+)"', text, flags=re.MULTILINE)
    return header, les


# ---- the engine core on a fake clock: exact intervals ---------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(core_module, "_monotonic", fake)
    monkeypatch.setattr(scheduler_module, "_monotonic", fake)
    return fake


def make_core(**overrides: Any) -> tuple[EngineCore, CollectorRegistry]:
    registry = CollectorRegistry()
    config = EngineConfig(**{"model": MODEL, "speed": 0.0, "eos_probability": 0.0, **overrides})
    return EngineCore(config, EngineMetrics(registry, config.model, config.engine_index, 5)), registry


def run(core: EngineCore, clock: FakeClock, step_s: float = 1.0) -> None:
    """Drive ``core`` to the end; each step takes ``step_s`` between its scheduling and its tokens."""
    for _ in range(1000):
        if not core.has_work():
            return
        sched = core.schedule()
        clock.now += step_s
        core.execute(sched)
    raise AssertionError("did not finish")


def scrape(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_exposition_matches_a_live_vllm_032() -> None:
    """Names, help texts, types, labels and bucket boundaries as the recorded vLLM exports them."""
    vllm = VLLM_METRICS.read_text()
    _, registry = make_core()
    ours = scrape(registry)
    for name in PHASES:
        header, les = exposition_of(ours, name)
        assert (header, les) == exposition_of(vllm, name), name
        assert len(header) == 2 and header[1] == f"# TYPE {name} histogram"
        assert len(les) > 10 and les[-1] == "+Inf"
        for le in les:  # the labels our other series have: model_name and engine
            assert f'{name}_bucket{{engine="0",le="{le}",model_name="{MODEL}"}} 0.0' in ours
        assert f'{name}_count{{engine="0",model_name="{MODEL}"}} 0.0' in ours
    # the phases use the e2e buckets, time per output token the inter-token-latency buckets (as vLLM)
    assert exposition_of(ours, QUEUE)[1] == exposition_of(ours, E2E)[1]
    assert exposition_of(ours, TPOT)[1] == exposition_of(ours, "vllm:inter_token_latency_seconds")[1]


def test_intervals_follow_vllms_timestamps(clock: FakeClock) -> None:
    """max_num_seqs=1: b waits for a. Each step takes 1 s from its scheduling to its tokens."""
    core, registry = make_core(max_num_seqs=1)
    core.add_request(wire("a", list(range(10, 50)), max_tokens=3, ignore_eos=True))
    core.add_request(wire("b", list(range(60, 100)), max_tokens=2, ignore_eos=True))
    run(core, clock)
    # a: scheduled at 0, tokens at 1, 2, 3. b: scheduled at 3 (after a finished), tokens at 4, 5.
    text = scrape(registry)
    assert metric_sum(text, QUEUE + "_sum", **LABELS) == pytest.approx(0 + 3)
    assert metric_sum(text, PREFILL + "_sum", **LABELS) == pytest.approx(1 + 1)
    assert metric_sum(text, DECODE + "_sum", **LABELS) == pytest.approx(2 + 1)
    assert metric_sum(text, INFERENCE + "_sum", **LABELS) == pytest.approx(3 + 2)
    assert metric_sum(text, TPOT + "_sum", **LABELS) == pytest.approx(2 / 2 + 1 / 1)
    assert metric_sum(text, E2E + "_sum", **LABELS) == pytest.approx(3 + 5)
    for name in (*PHASES, E2E):
        assert metric_sum(text, name + "_count", **LABELS) == 2
    # bucket placement: b's 3 s wait is above 2.5, a's 0 is in the first bucket
    assert metric_sum(text, QUEUE + "_bucket", le="0.3", **LABELS) == 1
    assert metric_sum(text, QUEUE + "_bucket", le="2.5", **LABELS) == 1
    assert metric_sum(text, QUEUE + "_bucket", le="5.0", **LABELS) == 2
    assert metric_sum(text, TPOT + "_bucket", le="1.0", **LABELS) == 2


def test_one_token_has_no_time_per_output_token_and_no_decode(clock: FakeClock) -> None:
    core, registry = make_core()
    core.add_request(wire("one", list(range(10, 30)), max_tokens=1, ignore_eos=True))
    run(core, clock, step_s=0.5)
    text = scrape(registry)
    assert metric_sum(text, PREFILL + "_sum", **LABELS) == pytest.approx(0.5)
    assert metric_sum(text, DECODE + "_sum", **LABELS) == 0
    assert metric_sum(text, TPOT + "_sum", **LABELS) == 0
    assert metric_sum(text, TPOT + "_count", **LABELS) == 1


def test_a_preempted_request_keeps_its_first_scheduling(clock: FakeClock) -> None:
    """vLLM ignores re-scheduling after a preemption: the second wait is not queue time but part of
    the phase it interrupted (here decode), and inference still equals prefill + decode."""
    core, registry = make_core(block_size=4, num_blocks=4, max_model_len=16, max_num_seqs=2)
    core.add_request(wire("a", [11, 12, 13, 14], max_tokens=8, ignore_eos=True))
    core.add_request(wire("b", [21, 22, 23, 24], max_tokens=8, ignore_eos=True))
    run(core, clock)
    text = scrape(registry)
    assert metric_sum(text, "vllm:num_preemptions_total", **LABELS) >= 1
    assert metric_sum(text, QUEUE + "_sum", **LABELS) == 0  # both first scheduled at once
    assert metric_sum(text, PREFILL + "_sum", **LABELS) == pytest.approx(2)  # first tokens one step in
    decode = metric_sum(text, DECODE + "_sum", **LABELS)
    assert decode > 2 * 7  # 7 decode steps each, plus the preempted one's wait and recompute
    inference = metric_sum(text, INFERENCE + "_sum", **LABELS)
    assert inference == pytest.approx(2 + decode)
    assert metric_sum(text, E2E + "_sum", **LABELS) == pytest.approx(inference)


def test_finished_before_a_phase_ends_that_phase_at_its_finish(clock: FakeClock) -> None:
    """Aborted while waiting: all its time queued. Aborted in (chunked) prefill: prefill until then."""
    core, registry = make_core(max_num_seqs=1, max_num_batched_tokens=16)
    core.add_request(wire("long", list(range(100, 164)), max_tokens=2, ignore_eos=True))  # 4 chunks of 16
    core.add_request(wire("waits", list(range(200, 210)), max_tokens=2, ignore_eos=True))
    core.execute(core.schedule())
    clock.now += 2.0
    core.abort_request("waits")  # 2 s queued, never scheduled
    core.execute(core.schedule())
    clock.now += 3.0
    core.abort_request("long")  # scheduled at 0, no token yet at 5
    text = scrape(registry)
    for name in (*PHASES, E2E):
        assert metric_sum(text, name + "_count", **LABELS) == 2
    assert metric_sum(text, "vllm:request_success_total", finished_reason="abort", **LABELS) == 2
    assert metric_sum(text, QUEUE + "_sum", **LABELS) == pytest.approx(2.0)
    assert metric_sum(text, PREFILL + "_sum", **LABELS) == pytest.approx(5.0)
    assert metric_sum(text, DECODE + "_sum", **LABELS) == 0
    assert metric_sum(text, INFERENCE + "_sum", **LABELS) == pytest.approx(5.0)


# ---- a real backend over HTTP --------------------------------------------------------------------


async def scrape_http(client: Any) -> str:
    resp = await client.get("/metrics")
    assert resp.status == 200
    return await resp.text()


def totals(text: str) -> dict[str, tuple[float, float]]:
    """(count, sum) of each phase histogram and e2e."""
    return {name: (metric_sum(text, name + "_count", **LABELS), metric_sum(text, name + "_sum", **LABELS))
            for name in (*PHASES, E2E)}


async def complete(client: Any, prompt: Any, max_tokens: int, n: int = 1) -> dict[str, Any]:
    resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "n": n,
                                                      "ignore_eos": True})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_counts_equal_finished_requests_and_sums_are_consistent(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_app(EngineConfig(speed=0.2, model=MODEL, eos_probability=0.0)))
    answers = await asyncio.gather(
        complete(client, list(range(10, 90)), 6),
        complete(client, list(range(100, 120)), 3, n=2),  # two child sequences, counted as vLLM does
        complete(client, "a short text prompt", 1),
        complete(client, list(range(10, 90)), 4),
    )
    assert [len(a["choices"]) for a in answers] == [1, 2, 1, 1]
    text = await scrape_http(client)
    t = totals(text)
    finished = metric_sum(text, "vllm:request_success_total", **LABELS)
    assert finished == 5
    for name in (*PHASES, E2E):
        assert t[name][0] == finished, name
    queue, prefill, decode, inference = (t[n][1] for n in (QUEUE, PREFILL, DECODE, INFERENCE))
    assert min(prefill, decode, inference) > 0
    assert inference == pytest.approx(prefill + decode, rel=1e-9)
    # a request finishes at its last token: e2e (from its arrival at the engine) = queued + running
    assert t[E2E][1] == pytest.approx(queue + inference, rel=1e-9)


async def test_queue_time_grows_when_requests_must_wait(aiohttp_client: Any) -> None:
    async def queue_and_decode(max_num_seqs: int) -> tuple[float, float]:
        app = create_app(EngineConfig(speed=1.0, model=MODEL, eos_probability=0.0, max_num_seqs=max_num_seqs))
        client = await aiohttp_client(app)
        # a streams; once its first token is out (it runs), b arrives and must wait (max_num_seqs=1)
        resp = await client.post("/v1/completions", json={"prompt": list(range(10, 30)), "max_tokens": 25,
                                                          "ignore_eos": True, "stream": True})
        assert resp.status == 200
        first = await resp.content.readline()
        assert json.loads(first.removeprefix(b"data: "))["choices"][0]["index"] == 0
        second = asyncio.ensure_future(complete(client, list(range(40, 60)), 25))
        await resp.read()
        await second
        t = totals(await scrape_http(client))
        assert t[QUEUE][0] == 2
        return t[QUEUE][1], t[DECODE][1]

    serial_queue, serial_decode = await queue_and_decode(1)
    together_queue, together_decode = await queue_and_decode(8)
    # serial: b waited for most of a's 24 decode steps (~10 ms each); together: at most about a step
    assert serial_queue > serial_decode / 4
    assert together_queue < together_decode / 4
    assert serial_queue > 5 * together_queue


async def test_prefill_time_follows_the_uncached_prompt_tokens(aiohttp_client: Any) -> None:
    """What the router's engine-load scrape learns the prefill rate from: Δprefill time against
    Δ(prompt tokens - prefix-cache hits). Speed 0.5: 8 ms per 64 tokens computed, 5 ms per step."""
    speed = 0.5
    app = create_app(EngineConfig(speed=speed, model=MODEL, eos_probability=0.0))
    vocab = app[FRONTEND].model.vocab_size
    client = await aiohttp_client(app)

    async def one(prompt: list[int]) -> tuple[float, float]:
        before = await scrape_http(client)
        await complete(client, prompt, 1)
        after = await scrape_http(client)

        def delta(name: str) -> float:
            return metric_sum(after, name, **LABELS) - metric_sum(before, name, **LABELS)

        assert delta(PREFILL + "_count") == 1
        computed = delta("vllm:prompt_tokens_total") - delta("vllm:prefix_cache_hits_total")
        return delta(PREFILL + "_sum"), computed

    short_s, short_computed = await one(list(range(10, 42)))
    long_prompt = [3 + (i * 7) % (vocab - 3) for i in range(2048)]
    long_s, long_computed = await one(long_prompt)
    cached_s, cached_computed = await one(long_prompt)  # all but the last block from the prefix cache
    assert (short_computed, long_computed) == (32, 2048)
    assert cached_computed <= 16
    model = LatencyModel()
    per_token = speed * model.per_prefill_token_s
    assert long_s > 10 * short_s
    assert long_s > 10 * cached_s
    # the rate is the latency model's (the time also holds one step and the event loop's overhead)
    learned = (long_s - speed * model.base_s) / long_computed
    assert per_token * 0.9 < learned < per_token * 1.5

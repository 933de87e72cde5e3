"""``router.engine_load``: vLLM's series parsed from ``/metrics``, the constants learned from the deltas,
and the same against a real ``session-backend`` process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from router.engine_load import MIN_SAMPLES, WINDOW, EngineLoad, EngineSample, Learned, learn, parse_metrics
from router.membership import Backend
from tests.support import kill_alive, start_backend

TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 200.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.25
"""


def test_parse_sums_ranks_and_takes_the_fullest_kv_cache() -> None:
    sample = parse_metrics(TEXT)
    assert sample is not None
    assert (sample.running, sample.waiting, sample.kv_usage) == (5.0, 4.0, 0.75)
    assert (sample.prompt_tokens, sample.prefix_hits) == (1000.0, 200.0)
    assert (sample.ttft_count, sample.ttft_sum) == (4.0, 0.5)
    assert sample.has_prefill_time and (sample.prefill_time_count, sample.prefill_time_sum) == (4.0, 0.25)
    assert parse_metrics("# nothing of vLLM here\nother_metric 1.0\n") is None


def test_learning_from_the_deltas_between_scrapes() -> None:
    learned = Learned()
    before = EngineSample(running=4, itl_sum=1.0, itl_count=100, prompt_tokens=0, prefix_hits=0,
                          ttft_sum=1.0, ttft_count=10, e2e_sum=10.0, e2e_count=10)
    # 10 requests computed 4,000 - 400 = 3,600 tokens in 2.0 s of TTFT, less 10 steps of 20 ms
    now = EngineSample(running=4, itl_sum=3.0, itl_count=200, prompt_tokens=4000, prefix_hits=400,
                       ttft_sum=3.0, ttft_count=20, e2e_sum=30.0, e2e_count=20)
    now.at = 10.0  # seconds after ``before``
    learn(learned, before, now)
    assert learned.first_step.value == pytest.approx(0.02)
    assert learned.prefill_per_token.value == pytest.approx((2.0 - 10 * 0.02) / 3600)
    assert learned.queued.value == pytest.approx(10.0 / 10)  # 10 requests finished in 10 s
    # interference: 10% of a request's life before its first token, x 360 computed tokens each
    assert learned.busy.value == pytest.approx(0.1 * 360 * learned.prefill_per_token.value)
    # 100 tokens after the first ones, over 10 finished requests: 11 tokens each
    assert learned.output.value == pytest.approx(100 / 10 + 1)
    # a mostly cached interval teaches nothing about the prefill rate
    cached = EngineSample(running=4, itl_sum=3.0, itl_count=200, prompt_tokens=5000, prefix_hits=1390,
                          ttft_sum=3.5, ttft_count=30, e2e_sum=30.0, e2e_count=20, at=20.0)
    learn(learned, now, cached)
    assert learned.prefill_per_token.count == 1 and learned.first_step.count == 2


def test_concurrent_prefills_count_their_shared_time_once() -> None:
    """Six prompts prefilled in one 1 s step: each TTFT is 1 s, but the engine spent 1 s, not 6."""
    learned = Learned()
    before = EngineSample(at=0.0)
    now = EngineSample(prompt_tokens=6000, ttft_sum=6.0, ttft_count=6, at=1.0)
    learn(learned, before, now)
    assert learned.prefill_per_token.value == pytest.approx(1.0 / 6000)


def test_the_prefill_histogram_is_preferred_over_ttft() -> None:
    learned = Learned()
    before = EngineSample(has_prefill_time=True)
    now = EngineSample(has_prefill_time=True, prompt_tokens=1000, prefill_time_sum=0.5, prefill_time_count=2,
                       ttft_sum=9.0, ttft_count=2)
    learn(learned, before, now)
    assert learned.prefill_per_token.value == pytest.approx(0.5 / 1000)  # step not learned: counted as 0


def test_apply_records_the_gauges_and_a_restart_restarts_the_deltas() -> None:
    load = EngineLoad(clock=lambda: 42.0)
    backend = Backend("http://127.0.0.1:8100")
    backend.in_flight = 7
    load.apply(backend, EngineSample(waiting=2, running=5, kv_usage=0.5, itl_sum=1.0, itl_count=100))
    assert (backend.engine_waiting, backend.engine_running, backend.kv_usage) == (2, 5, 0.5)
    assert (backend.load_scraped_at, backend.in_flight_at_scrape) == (42.0, 7)
    assert backend.others_at_scrape == 0  # the engine holds fewer than this router has in flight: none are others'
    load.apply(backend, EngineSample(waiting=4, running=9, itl_sum=1.0, itl_count=100))
    assert backend.others_at_scrape == 6  # 13 there, 7 of them this router's: 6 other replicas' (or workers')
    load.apply(backend, EngineSample(itl_sum=0.5, itl_count=10))  # counters went back: an engine restart
    assert backend.step_s == -1.0
    for i in range(1, MIN_SAMPLES + 1):
        assert backend.step_s == -1.0  # not trusted before MIN_SAMPLES intervals measured it
        load.apply(backend, EngineSample(itl_sum=0.5 + 0.2 * i, itl_count=10 + 10 * i))
    assert backend.step_s == pytest.approx(0.02)
    load.apply(backend, EngineSample(waiting=1, running=10, itl_sum=0.5 + 0.2 * MIN_SAMPLES,
                                     itl_count=10 + 10 * MIN_SAMPLES))
    assert backend.others_at_scrape == 4
    load.clear(backend)
    assert (backend.engine_waiting, backend.engine_running, backend.kv_usage) == (0, 0, 0)
    assert backend.others_at_scrape == 0  # no scrape: nothing known of the others
    assert backend.step_s == pytest.approx(0.02)  # learned constants stay
    frozen = EngineLoad(learn=False)
    other = Backend("http://127.0.0.1:8101")
    for i in range(MIN_SAMPLES + 2):
        frozen.apply(other, EngineSample(itl_sum=1.0 * i, itl_count=10 * i))
    assert other.step_s == -1.0  # learn = false: the configured values only


@pytest.mark.slow
async def test_constants_learned_from_a_real_backend(tmp_path: Path) -> None:
    """Two real backends, one four times slower: their learned step and prefill cost say so."""
    fast = start_backend(str(tmp_path), speed="0.5")
    slow = start_backend(str(tmp_path), speed="2")
    try:
        load = EngineLoad()
        backends = [Backend(fast.url), Backend(slow.url)]
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession() as http:
            for backend in backends:
                assert await load.scrape(backend, http, timeout)

            async def one(url: str, i: int) -> None:
                body = {"prompt": f"request {i}: " + "lorem ipsum dolor sit amet " * 30, "max_tokens": 4,
                        "ignore_eos": True}
                async with http.post(url + "/v1/completions", json=body, timeout=timeout) as resp:
                    assert resp.status == 200
                    await resp.read()

            for backend in backends:  # each engine on its own: the scrapes bracket its own work
                for round_ in range(MIN_SAMPLES):  # a constant is trusted after MIN_SAMPLES intervals
                    await asyncio.gather(*(one(backend.url, round_ * 10 + i) for i in range(6)))
                    assert await load.scrape(backend, http, timeout)
        quick, sluggish = backends
        for backend in backends:
            assert backend.step_s > 0 and backend.prefill_s_per_token > 0 and backend.queued_request_s > 0
            assert backend.load_scraped_at > 0 and backend.engine_waiting == 0
            assert backend.output_tokens == pytest.approx(4)  # each answer is its 4 tokens (ignore_eos)
        assert sluggish.step_s > 2 * quick.step_s
        assert sluggish.prefill_s_per_token > 2 * quick.prefill_s_per_token
    finally:
        kill_alive(fast, slow)


def test_a_ttft_sample_is_capped_at_the_configured_cost_at_the_learned_speed() -> None:
    """From TTFT only (no prefill histogram): queueing must not make a fast engine's prefill look dear;
    before any sample, the configured cost scaled by the engine's step stands in."""
    ratio = 0.00025 / 0.010  # the defaults: 4,000 tokens/s and a 10 ms step
    learned = Learned()
    for i in range(MIN_SAMPLES):
        learn(learned, EngineSample(itl_sum=0.5 * i, itl_count=100 * i, at=i),
              EngineSample(itl_sum=0.5 * (i + 1), itl_count=100 * (i + 1), at=i + 1.0), ratio=ratio)
    backend = Backend("http://127.0.0.1:8100")
    learned.publish(backend, ratio=ratio)
    assert backend.step_s == pytest.approx(0.005)  # an engine twice as fast as configured
    assert backend.prefill_s_per_token == pytest.approx(0.000125)  # so its prefill too, until measured
    queued = EngineSample(itl_sum=2.0, itl_count=400, prompt_tokens=1000, ttft_sum=0.9, ttft_count=1, at=5.0)
    learn(learned, EngineSample(itl_sum=1.5, itl_count=300, at=4.0), queued, ratio=ratio)
    assert learned.prefill_per_token.value == pytest.approx(0.000125)  # 0.9 s of TTFT was mostly a queue


def test_the_first_step_is_what_a_newcomer_meets_there() -> None:
    """Short decode steps, long first tokens (an engine stalled part of the time, or queueing): the
    first step is learned from the TTFT less the requests' own prefill, the decode step from the ITL."""
    learned = Learned()
    learned.prefill_per_token.add(0.0001)
    before = EngineSample(at=0.0)
    now = EngineSample(itl_sum=0.2, itl_count=100, ttft_sum=0.5, ttft_count=10, prompt_tokens=100, at=1.0)
    learn(learned, before, now)
    assert learned.decode_step.value == pytest.approx(0.002)
    assert learned.first_step.value == pytest.approx(0.05 - 10 * 0.0001)  # mean TTFT 50 ms, 1 ms of it prefill


def test_learned_constants_are_dropped_after_a_long_idle_spell() -> None:
    """A backend that lost its sessions for being slow, and recovered, is not judged by old numbers
    for ever: after FORGET_AFTER_IDLE idle scrapes the configured constants apply again."""
    from router.engine_load import FORGET_AFTER_IDLE

    load = EngineLoad()
    backend = Backend("http://127.0.0.1:8100")
    load.apply(backend, EngineSample())
    for i in range(1, MIN_SAMPLES + 1):
        busy = EngineSample(itl_sum=5.0 * i, itl_count=10 * i, ttft_sum=5.0 * i, ttft_count=10 * i, e2e_sum=9.0 * i,
                            e2e_count=10 * i)
        load.apply(backend, busy)
    assert backend.step_s > 0.4 and backend.decode_step_s == pytest.approx(0.5)
    for _ in range(FORGET_AFTER_IDLE - 1):
        load.apply(backend, busy)  # nothing began or ended
    assert backend.step_s > 0.4
    load.apply(backend, busy)
    assert backend.step_s == backend.decode_step_s == backend.prefill_s_per_token == -1.0


def busy_interval(at: float, before: EngineSample, ttft_s: float, requests: int = 4) -> EngineSample:
    """``before`` plus an interval of ``requests`` requests with a ``ttft_s`` first token each and 10 ms steps."""
    return EngineSample(itl_sum=before.itl_sum + 0.01 * 10 * requests, itl_count=before.itl_count + 10 * requests,
                        ttft_sum=before.ttft_sum + ttft_s * requests, ttft_count=before.ttft_count + requests,
                        e2e_sum=before.e2e_sum + (ttft_s + 0.1) * requests, e2e_count=before.e2e_count + requests,
                        at=at)


def test_one_cold_request_does_not_make_an_engine_look_slow() -> None:
    """An engine's first request took 1.2 s (cold), the next intervals 20 ms: the learned first step
    is the warm one, and nothing replaces the configured step before MIN_SAMPLES intervals."""
    times = iter(float(i) for i in range(100))
    load = EngineLoad(clock=lambda: next(times))
    backend = Backend("http://127.0.0.1:8100")
    sample = EngineSample()
    load.apply(backend, sample)
    sample = busy_interval(0, sample, 1.2, requests=1)  # the cold one
    load.apply(backend, sample)
    assert backend.step_s == -1.0  # one interval: the configured step still applies
    for _ in range(MIN_SAMPLES - 1):
        sample = busy_interval(0, sample, 0.02)
        load.apply(backend, sample)
    assert backend.step_s == pytest.approx(0.02)  # the median: the cold interval is outvoted
    assert backend.queued_request_s > 0 and backend.decode_step_s == pytest.approx(0.01)


def test_a_real_slowdown_shows_within_a_majority_of_the_window() -> None:
    """A single slow interval moves nothing; once most of the window is slow, the engine is slow."""
    times = iter(float(i) for i in range(100))
    load = EngineLoad(clock=lambda: next(times))
    backend = Backend("http://127.0.0.1:8100")
    sample = EngineSample()
    load.apply(backend, sample)
    for _ in range(WINDOW):
        sample = busy_interval(0, sample, 0.02)
        load.apply(backend, sample)
    assert backend.step_s == pytest.approx(0.02)
    sample = busy_interval(0, sample, 2.0)  # one odd interval
    load.apply(backend, sample)
    assert backend.step_s == pytest.approx(0.02)
    for _ in range(WINDOW // 2):
        sample = busy_interval(0, sample, 2.0)
        load.apply(backend, sample)
    assert backend.step_s == pytest.approx(2.0)


def test_a_queue_persists_only_when_three_scrapes_in_a_row_see_it() -> None:
    """``queued_floor`` is the least ``vllm:num_requests_waiting`` of the last three scrapes: a busy
    engine shows a few arrivals waiting at any instant, and two scrapes in a row often catch that."""
    load = EngineLoad(learn=False)
    backend = Backend("http://127.0.0.1:8100")
    for waiting, floor in ((5, 0), (7, 0), (6, 5), (0, 0), (9, 0), (9, 0), (12, 9)):
        load.apply(backend, EngineSample(waiting=waiting))
        assert backend.queued_floor == floor, (waiting, floor)
    load.clear(backend)  # a failed scrape: nothing known, the history starts again
    assert backend.queued_floor == 0
    for _ in range(2):
        load.apply(backend, EngineSample(waiting=12))
        assert backend.queued_floor == 0
    load.apply(backend, EngineSample(waiting=12))
    assert backend.queued_floor == 12

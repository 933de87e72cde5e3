"""``kv_aware`` checks that a turn fits its pin's free KV cache before sending it there (issue 14: a
heavy session's next turn that does not fit is preempted): the capacity comes from the engine's
``vllm:cache_config_info`` (num_gpu_blocks x block_size), the free share from ``kv_cache_usage_perc``."""

from __future__ import annotations

from router.engine_load import EngineLoad, parse_metrics
from router.membership import Backend, BackendPool
from router.placement import KVAwarePolicy, Outcome, PlacementHint
from router.sessions.table import SessionTable

METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="64"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75
"""

CAPACITY = 64 * 16  # tokens


def test_the_capacity_is_scraped_from_cache_config_info() -> None:
    sample = parse_metrics(METRICS)
    assert sample is not None and sample.kv_capacity_tokens == CAPACITY and sample.kv_usage == 0.75
    backend = Backend("http://127.0.0.1:8100")
    EngineLoad(learn=False).apply(backend, sample)
    assert backend.kv_capacity_tokens == CAPACITY
    # an engine that does not say keeps it unknown (0): no fit check
    other = parse_metrics(METRICS.replace('num_gpu_blocks="64"', 'num_gpu_blocks="None"'))
    assert other is not None and other.kv_capacity_tokens == 0


def setup(usage: float) -> tuple[KVAwarePolicy, BackendPool, SessionTable, Backend, Backend]:
    pool = BackendPool("default", [Backend("http://127.0.0.1:8100"), Backend("http://127.0.0.1:8101")])
    policy, sessions = KVAwarePolicy(), SessionTable(100, 3600)
    first = policy.place(pool, "heavy", sessions.touch("heavy"), hint=PlacementHint(100))
    pin = first.backend
    other = next(b for b in pool.members if b is not pin)
    for backend in pool.members:
        backend.kv_capacity_tokens = CAPACITY
    pin.kv_usage = usage
    return policy, pool, sessions, pin, other


def test_a_long_turn_that_does_not_fit_the_pin_moves_where_it_fits() -> None:
    policy, pool, sessions, pin, other = setup(usage=0.75)  # 256 tokens free on the pin (not pressured)
    entry = sessions.touch("heavy")
    # a turn whose new tokens fit the pin's free KV stays
    placement = policy.place(pool, "heavy", entry, hint=PlacementHint(600, last_tokens=400))
    assert (placement.backend, placement.outcome) == (pin, Outcome.STICKY)
    # 500 new tokens do not fit 256 free: a preemption there; the other (empty) backend holds them
    placement = policy.place(pool, "heavy", entry, hint=PlacementHint(900, last_tokens=400))
    assert (placement.backend, placement.outcome, placement.reason) == (other, Outcome.SPILL, "kv_pressure")
    assert entry.pins["default"] == other.url


def test_it_stays_when_it_fits_nowhere_else_or_capacity_is_unknown() -> None:
    policy, pool, sessions, pin, other = setup(usage=0.75)
    entry = sessions.touch("heavy")
    other.kv_usage = 0.5  # 512 free there: the whole 900-token prompt (nothing cached there) does not fit
    placement = policy.place(pool, "heavy", entry, hint=PlacementHint(900, last_tokens=400))
    assert (placement.backend, placement.outcome) == (pin, Outcome.STICKY)
    other.kv_usage, other.kv_capacity_tokens = 0.0, 0  # free, but its capacity was never scraped
    placement = policy.place(pool, "heavy", entry, hint=PlacementHint(900, last_tokens=400))
    assert (placement.backend, placement.outcome) == (pin, Outcome.STICKY)


def test_requests_finished_since_the_scrape_free_kv() -> None:
    policy, pool, sessions, pin, other = setup(usage=0.75)
    entry = sessions.touch("heavy")
    pin.in_flight_at_scrape, pin.in_flight = 3, 0  # 3 of 4 requests holding that cache finished
    placement = policy.place(pool, "heavy", entry, hint=PlacementHint(900, last_tokens=400))
    assert (placement.backend, placement.outcome) == (pin, Outcome.STICKY)

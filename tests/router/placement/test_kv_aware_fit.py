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
    # a turn whose whole prompt fits the pin's free KV stays
    placement = policy.place(pool, "heavy", entry, hint=PlacementHint(200, last_tokens=150))
    assert (placement.backend, placement.outcome) == (pin, Outcome.STICKY)
    # 900 tokens do not fit 256 free: a preemption there; the other (empty) backend holds them
    placement = policy.place(pool, "heavy", entry, hint=PlacementHint(900, last_tokens=400))
    assert (placement.backend, placement.outcome, placement.reason) == (other, Outcome.SPILL, "kv_pressure")
    assert entry.pins["default"] == other.url


def test_the_cached_prefix_is_charged_too() -> None:
    """The session's cached blocks on its pin count as free in ``kv_cache_usage_perc`` (evictable)
    until its turn runs and takes them back: the turn needs its whole prompt's room there, not only
    its new tokens'."""
    policy, pool, sessions, pin, other = setup(usage=0.75)  # 256 free
    entry = sessions.touch("heavy")
    # 600 tokens of which the pin holds the last 400 (prompt + answer): 200 new would fit, 600 do not
    placement = policy.place(pool, "heavy", entry, hint=PlacementHint(600, last_tokens=400))
    assert (placement.backend, placement.outcome, placement.reason) == (other, Outcome.SPILL, "kv_pressure")


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
    # the usage taken as 0.75 x 1/4: 832 tokens free
    placement = policy.place(pool, "heavy", entry, hint=PlacementHint(800, last_tokens=400))
    assert (placement.backend, placement.outcome) == (pin, Outcome.STICKY)


def test_prompts_placed_since_the_scrape_are_charged_until_the_next() -> None:
    """The usage is scraped every health interval; the prompts placed on a backend since take its
    free KV before the next scrape shows them, and give it back as their requests finish."""
    pool = BackendPool("default", [Backend("http://127.0.0.1:8100"), Backend("http://127.0.0.1:8101")])
    policy, sessions = KVAwarePolicy(), SessionTable(100, 3600)
    for backend in pool.members:
        backend.kv_capacity_tokens, backend.load_scraped_at = CAPACITY, 1.0

    def send(session: str, prompt: int, pin: Backend | None = None) -> Backend:
        entry = sessions.touch(session)
        if pin is not None:
            entry.pins["default"] = pin.url
        placement = policy.place(pool, session, entry, hint=PlacementHint(prompt, last_tokens=prompt // 2))
        placement.backend.in_flight += 1  # as the proxy does while the request runs
        return placement.backend

    first = send("a", 400)
    # sessions pinned to the same backend: each turn's 400 tokens fit its 1,024 free until two are there
    assert send("b", 400, first) is first
    other = send("c", 400, first)
    assert other is not first and first.in_flight == 2
    # one of them finished: its prompt's room is back, a pinned 400-token turn stays
    first.in_flight -= 1
    assert send("d", 400, first) is first
    # a scrape: its usage stands for what runs there now, and the charges start again from it
    first.in_flight_at_scrape, first.kv_usage, first.load_scraped_at = first.in_flight, 0.2, 2.0
    assert send("e", 800, first) is first  # 819 free
    assert send("f", 100, first) is not first  # 19 left


def test_a_heavy_session_stays_when_its_move_costs_more_than_a_preemption() -> None:
    """A full pin sheds the turns whose recompute elsewhere is cheap (no more than the KV a request
    there holds on average, what a preemption recomputes); a heavy session's turn, whose move would
    recompute far more, is decided as usual (it stays)."""
    policy, pool, sessions, pin, other = setup(usage=0.75)  # 768 used by 4 requests: 192 each
    pin.in_flight_at_scrape = pin.in_flight = 4
    entry = sessions.touch("heavy")
    # 300 tokens do not fit the 256 free; their recompute on the other backend (300) > 192: stays
    placement = policy.place(pool, "heavy", entry, hint=PlacementHint(300, last_tokens=250))
    assert (placement.backend, placement.outcome) == (pin, Outcome.STICKY)
    pin.in_flight += 1
    # a light turn (200 tokens) does not fit either; its recompute is no more than a request's share
    # there now ((768 + 300) / 5 = 213.6): it moves
    light = sessions.touch("light")
    light.pins["default"] = pin.url
    placement = policy.place(pool, "light", light, hint=PlacementHint(200, last_tokens=150))
    assert (placement.backend, placement.outcome, placement.reason) == (other, Outcome.SPILL, "kv_pressure")


def test_room_is_kept_for_what_the_requests_will_generate() -> None:
    """Preemptions come from running requests growing as they decode: a turn fits where its prompt
    and its own answer fit with half an answer more for each request there (the engine's learned
    tokens per request, ``output_tokens``)."""
    policy, pool, sessions, pin, other = setup(usage=0.5)  # 512 free, held by the one request there
    pin.in_flight_at_scrape = pin.in_flight = 1
    entry = sessions.touch("heavy")
    # nothing learned yet: the 400-token prompt fits the 512 free
    assert policy._fits(pin, 400) and policy._fits(pin, 512) and not policy._fits(pin, 513)
    # 100 tokens per answer learned there: 400 + 100 + 50 for the running one's rest > 512
    pin.output_tokens = other.output_tokens = 100.0
    assert policy._fits(pin, 362) and not policy._fits(pin, 363)
    placement = policy.place(pool, "heavy", entry, hint=PlacementHint(400, last_tokens=300))
    assert (placement.backend, placement.outcome, placement.reason) == (other, Outcome.SPILL, "kv_pressure")

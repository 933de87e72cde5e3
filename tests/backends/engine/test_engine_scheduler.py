"""Continuous batching, chunked prefill, prefix hits and preemption (the core driven step by step)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from backends.engine.config import EngineConfig
from backends.engine.core import EngineCore
from backends.engine.metrics import EngineMetrics
from backends.engine.outputs import RequestOutput
from tests.backends.engine.engine_support import wire, run_to_completion


def make_core(**overrides: Any) -> EngineCore:
    config = EngineConfig(**{"speed": 0.0, "eos_probability": 0.0, **overrides})
    return EngineCore(config, EngineMetrics(CollectorRegistry(), "m", 0, 10))


def tokens_of(outs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for o in outs for d in o.deltas if d.index == index for t in d.token_ids]


def test_max_num_seqs_bounds_the_batch_and_the_rest_waits() -> None:
    core = make_core(max_num_seqs=2)
    for i in range(5):
        core.add_request(wire(f"r{i}", [1, 2, 3, i]))
    sched = core.schedule()
    assert [s.seq_id for s, _ in sched.scheduled] == ["r0", "r1"]
    assert core.num_running == 2 and core.num_waiting == 3
    finished = [o.request_id for o in core.execute(sched) if o.finished]
    while core.has_work():
        sched = core.schedule()
        assert 0 < len(sched.scheduled) <= 2
        assert core.num_running <= 2
        finished += [o.request_id for o in core.execute(sched) if o.finished]
    assert sorted(finished) == [f"r{i}" for i in range(5)]
    assert core.num_running == 0 and core.num_waiting == 0


def test_chunked_prefill_respects_the_token_budget() -> None:
    core = make_core(max_num_batched_tokens=32)
    core.add_request(wire("long", list(range(100, 200)), max_tokens=2))
    chunks = []
    outputs = []
    while core.has_work():
        sched = core.schedule()
        chunks.append(sched.num_prefill_tokens)
        outputs.append(core.execute(sched))
    assert chunks == [32, 32, 32, 4, 0]  # then one decode step
    assert [len(o) for o in outputs] == [0, 0, 0, 1, 1]  # the first token comes with the last chunk


def test_budget_is_shared_by_running_decodes_and_new_prefills() -> None:
    core = make_core(max_num_batched_tokens=32)
    core.add_request(wire("a", list(range(20)), max_tokens=3))
    core.add_request(wire("b", list(range(50, 70)), max_tokens=3))
    sched = core.schedule()
    assert [(s.seq_id, n) for s, n in sched.scheduled] == [("a", 20), ("b", 12)]
    core.execute(sched)
    sched = core.schedule()
    # a decodes (1 token), b finishes its prefill (8 tokens)
    assert [(s.seq_id, n) for s, n in sched.scheduled] == [("a", 1), ("b", 8)]
    assert sched.num_decode_seqs == 1 and sched.num_prefill_tokens == 8


def test_waiting_queue_is_first_come_first_served() -> None:
    core = make_core(block_size=4, num_blocks=4, max_model_len=16)
    core.add_request(wire("big1", list(range(12))))  # 3 blocks
    core.add_request(wire("big2", list(range(20, 32))))  # 3 blocks: does not fit next to big1
    core.add_request(wire("small", [7, 7]))  # 1 block: would fit, but must not overtake big2
    sched = core.schedule()
    assert [s.seq_id for s, _ in sched.scheduled] == ["big1"]
    outs = run_to_completion(core)
    assert set(outs) == {"big1", "big2", "small"}


def test_prefix_hit_skips_the_cached_blocks_at_most_num_tokens_minus_one() -> None:
    core = make_core()
    prompt = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16
    core.add_request(wire("first", prompt))
    run_to_completion(core)
    core.add_request(wire("second", prompt))
    sched = core.schedule()
    assert sched.num_prefill_tokens == 8 and sched.prefix_hits == 32 and sched.prefix_queries == 40
    (seq, n), = sched.scheduled
    assert seq.num_cached_tokens == 32 and n == 8
    core.execute(sched)
    run_to_completion(core)
    # a prompt of exactly 2 blocks: only 1 block may hit (one token is always computed)
    exact = list(range(2000, 2032))
    core.add_request(wire("e1", exact))
    run_to_completion(core)
    core.add_request(wire("e2", exact))
    sched = core.schedule()
    assert sched.scheduled[0][0].num_cached_tokens == 16 and sched.num_prefill_tokens == 16


def test_siblings_admitted_in_one_step_share_the_prompt_blocks() -> None:
    core = make_core()
    core.add_request(wire("par", list(range(40)), n=3))
    sched = core.schedule()
    cached = [s.num_cached_tokens for s, _ in sched.scheduled]
    assert cached == [0, 32, 32]
    assert sched.num_prefill_tokens == 40 + 8 + 8
    blocks = [s.blocks for s, _ in sched.scheduled]
    assert blocks[0][:2] == blocks[1][:2] == blocks[2][:2]  # same physical blocks
    assert len({b[2] for b in blocks}) == 3  # own partial tail blocks


def test_preemption_under_a_tiny_cache_recomputes_and_keeps_results() -> None:
    """6 blocks of 4 tokens; three sequences of up to 19 computed tokens (5 blocks) each."""
    prompts = {f"p{i}": list(range(100 * i, 100 * i + 8)) for i in range(3)}

    def run(num_blocks: int) -> tuple[dict[str, list[int]], EngineCore]:
        core = make_core(block_size=4, num_blocks=num_blocks, max_model_len=64)
        for rid, prompt in prompts.items():
            core.add_request(wire(rid, prompt, max_tokens=12, seed=7))
        outs = run_to_completion(core)
        for rid, o in outs.items():
            assert o[-1].finished and o[-1].deltas[-1].finish_reason == "length"
        return {rid: tokens_of(o) for rid, o in outs.items()}, core

    roomy, roomy_core = run(num_blocks=64)
    tight, tight_core = run(num_blocks=6)
    assert roomy_core.metrics.num_preemptions == 0
    assert tight_core.metrics.num_preemptions > 0
    assert tight == roomy  # recompute does not change what is generated
    assert all(len(t) == 12 for t in tight.values())
    kv = tight_core.kv_cache
    assert kv.usage == 0.0 and all(r == 0 for r in kv.ref_cnt)
    assert tight_core.num_running == 0 and tight_core.num_waiting == 0


def test_a_sequence_never_outgrows_the_cache_alone() -> None:
    """max_model_len larger than the cache: the sequence is capped at the cache size ("length")."""
    core = make_core(block_size=4, num_blocks=3, max_model_len=1000)
    core.add_request(wire("r", [1, 2, 3, 4, 5], max_tokens=None))
    outs = run_to_completion(core)
    toks = tokens_of(outs["r"])
    assert len(toks) == 12 - 5  # prompt + output capped at num_blocks * block_size
    assert outs["r"][-1].deltas[0].finish_reason == "length"


# -- invariants under random workloads -----------------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_request = st.tuples(
    st.lists(st.integers(0, 40), min_size=1, max_size=30),  # prompt (small alphabet: shared prefixes)
    st.integers(1, 3),  # n
    st.integers(1, 12),  # max_tokens
    st.sampled_from([None, "s1", "s2"]),  # session
    st.booleans(),  # abort it after a few steps
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(_request, min_size=1, max_size=8),
    num_blocks=st.integers(8, 24),
    budget=st.integers(4, 64),
    max_seqs=st.integers(1, 6),
    abort_after=st.integers(0, 6),
)
def test_random_workloads_keep_the_invariants(
    reqs: list[tuple[list[int], int, int, str | None, bool]],
    num_blocks: int,
    budget: int,
    max_seqs: int,
    abort_after: int,
) -> None:
    def run(blocks: int, abort: bool) -> tuple[dict[str, list[RequestOutput]], EngineCore]:
        core = make_core(
            block_size=4, num_blocks=blocks, max_model_len=48,
            max_num_batched_tokens=budget, max_num_seqs=max_seqs, eos_probability=0.1,
        )  # fmt: skip
        for i, (prompt, n, max_tokens, session, _) in enumerate(reqs):
            core.add_request(wire(f"r{i}", prompt, session, n=min(n, max_seqs), max_tokens=max_tokens, seed=i))
        outs: dict[str, list[RequestOutput]] = {}
        for step in range(5_000):
            if abort and step == abort_after:
                for i, req in enumerate(reqs):
                    if req[4]:
                        out = core.abort_request(f"r{i}")
                        if out is not None:
                            outs.setdefault(out.request_id, []).append(out)
            if not core.has_work():
                break
            for out in core.step():
                outs.setdefault(out.request_id, []).append(out)
        else:
            raise AssertionError("the engine did not finish the workload")
        # nothing is left behind
        kv = core.kv_cache
        assert core.requests == {} and core.num_running == 0 and core.num_waiting == 0
        assert all(r == 0 for r in kv.ref_cnt) and kv.usage == 0.0
        assert kv.num_free_blocks == blocks
        # every request got exactly one finished output, last
        assert sorted(outs) == sorted(f"r{i}" for i in range(len(reqs)))
        for o in outs.values():
            assert [x.finished for x in o] == [False] * (len(o) - 1) + [True]
        # accounting == the sum of what the outputs report, per session
        expected: dict[str, list[int]] = {}
        for i, (prompt, n, max_tokens, session, _) in enumerate(reqs):
            o = outs[f"r{i}"]
            toks = tokens_by_index_all(o)
            assert sorted(toks) == list(range(min(n, max_seqs))) or o[-1].deltas[0].finish_reason == "abort"
            for index_tokens in toks.values():
                assert len(index_tokens) <= max_tokens
            if session is not None:
                e = expected.setdefault(session, [0, 0, 0, 0])
                e[0] += 1
                e[1] += o[-1].num_prompt_tokens
                e[2] += o[-1].num_cached_tokens
                e[3] += sum(len(t) for t in toks.values())
        for session, e in expected.items():
            stats = core.sessions.get(session)
            assert stats is not None
            assert [stats.requests, stats.prompt_tokens, stats.cached_tokens, stats.generated_tokens] == e
        return outs, core

    tight, _ = run(num_blocks, abort=True)
    if not any(r[4] for r in reqs):
        roomy, _ = run(1024, abort=False)
        # preemption and eviction never change what is generated; the only difference allowed is
        # the cap that keeps a lone sequence inside the small cache (prompt + output <= blocks * 4)
        cap = min(48, num_blocks * 4)
        for i, (prompt, *_rest) in enumerate(reqs):
            t, r = tokens_by_index_all(tight[f"r{i}"]), tokens_by_index_all(roomy[f"r{i}"])
            assert sorted(t) == sorted(r)
            for index, tokens in r.items():
                assert t[index] == tokens[: max(1, cap - len(prompt))]


def tokens_by_index_all(outs: list[RequestOutput]) -> dict[int, list[int]]:
    res: dict[int, list[int]] = {}
    for o in outs:
        for d in o.deltas:
            res.setdefault(d.index, []).extend(d.token_ids)
    return res

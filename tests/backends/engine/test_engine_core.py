"""The engine core: sessions through the wire bytes, accounting, generation rules, aborts, P/D hooks."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from backends.engine.config import EngineConfig
from backends.engine.core import DuplicateRequestError, EngineCore, InvalidRequestError
from backends.engine.metrics import EngineMetrics
from backends.engine.outputs import RequestOutput
from backends.engine.request import EngineCoreRequest, SamplingParams, encode_request
from tests.backends.engine.engine_support import wire, run_to_completion


def make_core(**overrides: Any) -> EngineCore:
    config = EngineConfig(**{"speed": 0.0, "eos_probability": 0.0, **overrides})
    return EngineCore(config, EngineMetrics(CollectorRegistry(), "m", 0, 10))


def usage(outs: list[RequestOutput]) -> tuple[int, int, int]:
    """What the HTTP frontend reports: prompt_tokens, cached_tokens, completion_tokens."""
    final = outs[-1]
    assert final.finished
    return final.num_prompt_tokens, final.num_cached_tokens, sum(len(d.token_ids) for o in outs for d in o.deltas)


def tokens_by_index(outs: list[RequestOutput]) -> dict[int, list[int]]:
    res: dict[int, list[int]] = {}
    for o in outs:
        for d in o.deltas:
            res.setdefault(d.index, []).extend(d.token_ids)
    return res


# -- sessions ----------------------------------------------------------------------------------
def test_internal_request_and_every_child_carry_the_session_id() -> None:
    core = make_core()
    core.add_request(wire("par", list(range(30)), "sess-n3", n=3, max_tokens=5))
    req = core.requests["par"]
    assert req.session_id == "sess-n3"
    assert len(req.children) == 3
    assert [c.session_id for c in req.children] == ["sess-n3"] * 3
    assert [c.index for c in req.children] == [0, 1, 2]
    assert len({c.seq_id for c in req.children}) == 3
    # the scheduled sequences (what the batch holds) carry it too
    sched = core.schedule()
    assert {s.session_id for s, _ in sched.scheduled} == {"sess-n3"}
    outs = core.execute(sched)
    outs += run_to_completion(core)["par"]
    assert sorted(tokens_by_index(outs)) == [0, 1, 2]
    assert all(len(t) == 5 for t in tokens_by_index(outs).values())


def test_accounting_equals_what_the_outputs_report() -> None:
    core = make_core(eos_probability=0.2)  # some sequences stop early on eos
    expected = {"sA": [0, 0, 0, 0], "sB": [0, 0, 0, 0]}
    shared = list(range(500, 548))
    plan = [
        ("a1", shared, "sA", {"n": 1, "max_tokens": 9}),
        ("a2", shared + [1, 2, 3], "sA", {"n": 3, "max_tokens": 7}),
        ("b1", list(range(20)), "sB", {"n": 2, "max_tokens": 30}),
        ("b2", list(range(20)), "sB", {"n": 1, "max_tokens": 30, "output_kind": 2}),
        ("x1", shared, None, {"max_tokens": 3}),  # no session: not accounted
    ]
    for rid, prompt, session, sp in plan:
        core.add_request(wire(rid, prompt, session, **sp))
        outs = run_to_completion(core)[rid]
        if session is not None:
            p, c, g = usage(outs)
            e = expected[session]
            e[0] += 1
            e[1] += p
            e[2] += c
            e[3] += g
    for session, (requests, prompt, cached, generated) in expected.items():
        stats = core.sessions.get(session)
        assert stats is not None
        assert msgspec.structs.asdict(stats) == {
            "requests": requests,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "generated_tokens": generated,
        }
    assert expected["sA"][2] > 0  # a2 hit a1's blocks
    assert len(core.sessions) == 2


def test_n_gt_1_counts_once_with_child_0_cached_tokens() -> None:
    core = make_core()
    core.add_request(wire("r", list(range(40)), "s", n=4, max_tokens=3))
    children = core.requests["r"].children
    outs = run_to_completion(core)["r"]
    assert outs[-1].num_cached_tokens == 0  # child 0 computed the prompt ...
    assert [c.num_cached_tokens for c in children] == [0, 32, 32, 32]  # ... children 1-3 hit it
    stats = core.sessions.get("s")
    assert stats is not None
    assert (stats.requests, stats.prompt_tokens, stats.cached_tokens, stats.generated_tokens) == (1, 40, 0, 12)
    assert core.metrics.request_success["length"] == 4  # vLLM counts each child request
    assert core.metrics.prefix_cache_hits == 3 * 32


# -- generation rules --------------------------------------------------------------------------
def test_a_seed_makes_outputs_deterministic_across_engines() -> None:
    def gen(seed: int | None, prompt: list[int]) -> dict[int, list[int]]:
        core = make_core()
        core.add_request(wire("r", prompt, n=2, max_tokens=12, seed=seed))
        return tokens_by_index(run_to_completion(core)["r"])

    p = list(range(64))
    assert gen(5, p) == gen(5, p)
    assert gen(5, p) != gen(6, p)
    assert gen(5, p) == gen(5, p[:10])  # with a seed, the prompt does not matter
    assert gen(None, p) == gen(None, p)  # without: a stable hash of the prompt
    assert gen(None, p) != gen(None, p[:10])
    out = gen(5, p)
    assert out[0] != out[1]  # children differ
    config = EngineConfig()
    assert all(config.gen_token_min <= t < config.gen_token_max for t in out[0] + out[1])


def test_eos_ends_with_stop_and_counts_as_a_generated_token() -> None:
    core = make_core(eos_probability=1.0)
    core.add_request(wire("r", [5, 6, 7], "s", max_tokens=10, min_tokens=3))
    outs = run_to_completion(core)["r"]
    toks = tokens_by_index(outs)[0]
    assert len(toks) == 4 and toks[-1] == core.config.eos_token_id
    assert eos_not_in(toks[:-1], core.config.eos_token_id)
    last = outs[-1].deltas[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", None)
    assert core.sessions.get("s").generated_tokens == 4  # type: ignore[union-attr]


def eos_not_in(tokens: list[int], eos: int) -> bool:
    return eos not in tokens


def test_ignore_eos_runs_to_max_tokens() -> None:
    core = make_core(eos_probability=1.0)
    core.add_request(wire("r", [5, 6, 7], max_tokens=6, ignore_eos=True))
    outs = run_to_completion(core)["r"]
    assert len(tokens_by_index(outs)[0]) == 6
    assert outs[-1].deltas[-1].finish_reason == "length"


def test_stop_token_ids_end_with_stop_and_report_the_id_after_min_tokens() -> None:
    # every drawable id is the stop id 4: min_tokens holds it back for 3 tokens
    core = make_core(gen_token_min=4, gen_token_max=5)
    core.add_request(wire("r", [1, 2, 3], max_tokens=10, stop_token_ids=[4], min_tokens=3))
    core.add_request(wire("q", [1, 2, 3], max_tokens=10, stop_token_ids=[4]))
    outs = run_to_completion(core)
    r_last = outs["r"][-1].deltas[-1]
    assert tokens_by_index(outs["r"])[0] == [4, 4, 4, 4]
    assert (r_last.finish_reason, r_last.stop_reason) == ("stop", 4)
    assert tokens_by_index(outs["q"])[0] == [4]


def test_max_tokens_none_fills_the_model_length() -> None:
    core = make_core(max_model_len=64)
    core.add_request(wire("r", list(range(10)), max_tokens=None))
    outs = run_to_completion(core)["r"]
    assert len(tokens_by_index(outs)[0]) == 54
    assert outs[-1].deltas[-1].finish_reason == "length"


def test_final_only_gives_one_output_with_the_same_tokens() -> None:
    core = make_core()
    core.add_request(wire("delta", list(range(30)), n=2, max_tokens=7, seed=1))
    core.add_request(wire("final", list(range(30)), n=2, max_tokens=7, seed=1, output_kind=2))
    outs = run_to_completion(core)
    assert len(outs["final"]) == 1 and outs["final"][0].finished
    assert tokens_by_index(outs["final"]) == tokens_by_index(outs["delta"])
    assert len(outs["delta"]) == 7


# -- bad or odd requests never crash the core --------------------------------------------------
def test_prompts_that_cannot_run_finish_at_once() -> None:
    core = make_core(max_model_len=32, block_size=4, num_blocks=4)
    core.add_request(wire("too-long", list(range(40)), "s"))  # > max_model_len
    core.add_request(wire("empty", [], "s"))
    core.add_request(wire("ok", [1, 2, 3], "s"))
    outs = run_to_completion(core)
    assert outs["too-long"][0].finished and outs["too-long"][0].deltas[0].finish_reason == "length"
    assert outs["empty"][0].deltas[0].finish_reason == "abort"
    assert outs["ok"][-1].finished and len(tokens_by_index(outs["ok"])[0]) == 4
    # the cache holds 16 tokens: a 20-token prompt fits the model but never the cache
    core2 = make_core(max_model_len=32, block_size=4, num_blocks=4)
    core2.add_request(wire("too-big", list(range(20))))
    (out,) = run_to_completion(core2)["too-big"]
    assert out.finished and out.deltas[0].finish_reason == "abort"
    assert core2.num_waiting == 0


def test_a_duplicate_request_id_is_refused_and_bad_bytes_raise() -> None:
    core = make_core()
    core.add_request(wire("same", [1, 2, 3]))
    with pytest.raises(DuplicateRequestError, match="same"):
        core.add_request(wire("same", [4, 5, 6]))
    with pytest.raises(msgspec.DecodeError):
        core.add_request(b"\xc1 not msgpack")
    with pytest.raises(msgspec.ValidationError):
        core.add_request(msgspec.msgpack.encode([1, 2, 3]))
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        core.add_request(wire("many", [1], n=core.config.max_num_seqs + 1))
    assert list(core.requests) == ["same"]


def test_abort_immediately_finishes_without_accounting() -> None:
    core = make_core()
    data = encode_request(
        EngineCoreRequest("r", [1, 2, 3], None, SamplingParams(), None, 0.0, None, None, None,
                          abort_immediately=True, session_id="s")
    )  # fmt: skip
    core.add_request(data)
    (out,) = run_to_completion(core)["r"]
    assert out.finished and out.deltas[0].finish_reason == "abort"
    assert core.sessions.get("s") is None
    assert core.metrics.request_success["abort"] == 1


# -- aborts --------------------------------------------------------------------------------------
def test_abort_frees_blocks_counts_abort_and_accounts_what_was_generated() -> None:
    core = make_core()
    core.add_request(wire("run", list(range(40)), "s", n=2, max_tokens=100))
    core.add_request(wire("wait", list(range(40)), "s", max_tokens=100))
    core.scheduler.max_num_seqs = 2  # "wait" stays in the waiting queue
    for _ in range(3):
        core.step()
    assert core.num_running == 2 and core.num_waiting == 1 and core.kv_cache.usage > 0
    out = core.abort_request("run")
    assert out is not None and out.finished
    assert [(d.index, d.finish_reason) for d in out.deltas] == [(0, "abort"), (1, "abort")]
    out2 = core.abort_request("wait")
    assert out2 is not None and out2.deltas[0].finish_reason == "abort"
    assert core.abort_request("wait") is None  # already gone
    assert core.num_running == 0 and core.num_waiting == 0 and not core.has_work()
    assert core.kv_cache.usage == 0.0 and all(r == 0 for r in core.kv_cache.ref_cnt)
    assert core.metrics.request_success["abort"] == 3
    stats = core.sessions.get("s")
    assert stats is not None
    assert (stats.requests, stats.prompt_tokens, stats.generated_tokens) == (2, 80, 6)


def test_abort_of_a_request_scheduled_in_the_current_step() -> None:
    """The async driver sleeps between schedule and execute; an abort may land in between."""
    core = make_core()
    core.add_request(wire("r", list(range(20)), max_tokens=50))
    sched = core.schedule()
    core.abort_request("r")
    assert core.execute(sched) == []
    assert core.kv_cache.usage == 0.0 and core.num_running == 0


# -- multi-turn ----------------------------------------------------------------------------------
def test_turn_two_hits_turn_one_prompt_and_answer() -> None:
    core = make_core()
    turn1 = list(range(3000, 3045))  # 45 tokens
    core.add_request(wire("t1", turn1, "conv", max_tokens=20))
    outs1 = run_to_completion(core)["t1"]
    answer = tokens_by_index(outs1)[0]
    turn2 = turn1 + answer + [9, 9, 9, 9, 9, 9, 9]  # 72 tokens
    core.add_request(wire("t2", turn2, "conv", max_tokens=5))
    outs2 = run_to_completion(core)["t2"]
    cached = outs2[-1].num_cached_tokens
    assert cached >= len(turn1) // 16 * 16
    # the answer's blocks were cached too: all full blocks of prompt + answer except the last token
    assert cached == (len(turn1) + len(answer) - 1) // 16 * 16 == 64
    stats = core.sessions.get("conv")
    assert stats is not None
    assert stats.cached_tokens == cached and stats.requests == 2
    assert stats.prompt_tokens == len(turn1) + len(turn2)


def test_cache_salt_isolates_prefixes() -> None:
    core = make_core()
    prompt = list(range(64))
    core.add_request(wire("a", prompt, salt="tenant-a"))
    run_to_completion(core)
    core.add_request(wire("b", prompt, salt="tenant-b"))
    core.add_request(wire("a2", prompt, salt="tenant-a"))
    outs = run_to_completion(core)
    assert outs["b"][-1].num_cached_tokens == 0
    assert outs["a2"][-1].num_cached_tokens == 48


# -- P/D -----------------------------------------------------------------------------------------
REMOTE_DECODE = {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}


def test_prefill_role_holds_blocks_and_returns_transfer_params() -> None:
    core = make_core(role="prefill", kv_host="127.0.0.1", kv_port=5600, kv_engine_id="pfx")
    prompt = list(range(50))
    core.add_request(wire("p1", prompt, "s", max_tokens=10, extra_args=REMOTE_DECODE))
    (out,) = run_to_completion(core)["p1"]
    assert out.finished and out.deltas[0].finish_reason == "length" and len(out.deltas[0].token_ids) == 1
    params = out.kv_transfer_params
    assert params is not None
    held = core.get_held("p1")
    assert held is not None
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "pfx",
        "remote_request_id": "p1",
        "remote_block_ids": held.block_ids,
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }
    assert held.token_ids == prompt and len(held.block_hashes) == 3 and len(held.block_ids) == 4
    assert core.kv_cache.usage == 4 / core.config.num_blocks  # still referenced
    assert core.release_held("p1") and not core.release_held("p1")
    assert core.kv_cache.usage == 0.0


def test_held_blocks_expire() -> None:
    core = make_core(role="prefill", kv_hold_timeout_s=30.0)
    core.add_request(wire("p1", list(range(20)), extra_args=REMOTE_DECODE))
    run_to_completion(core)
    expiry = core.next_hold_expiry()
    assert expiry is not None
    assert core.expire_held(now=expiry - 1.0) == 0 and core.num_held == 1
    assert core.expire_held(now=expiry) == 1 and core.num_held == 0
    assert core.kv_cache.usage == 0.0


def test_holds_are_bounded_per_request_and_in_total() -> None:
    """Issue 11: all holds within kv_hold_max_fraction of the cache (oldest freed first); a request
    over kv_hold_max_blocks is not held and returns no kv_transfer_params."""
    core = make_core(role="prefill", num_blocks=20, kv_hold_max_fraction=0.5)  # 10 blocks for holds
    finals = {}
    for rid in ("p1", "p2", "p3"):  # 50 tokens + 1: 4 blocks each
        core.add_request(wire(rid, list(range(100 * len(finals), 100 * len(finals) + 50)), extra_args=REMOTE_DECODE))
        finals[rid] = run_to_completion(core)[rid][-1]
        assert finals[rid].kv_transfer_params is not None
        assert core.num_held_blocks <= 10
    assert core.get_held("p1") is None and core.get_held("p2") is not None and core.get_held("p3") is not None
    assert core.holds.freed["evicted"] == 1 and core.num_held_blocks == 8
    # the same request id held again replaces its old hold
    core.add_request(wire("p3", list(range(500, 520)), extra_args=REMOTE_DECODE))
    run_to_completion(core)
    assert core.holds.freed["replaced"] == 1 and core.num_held == 2

    small = make_core(role="prefill", kv_hold_max_blocks=3)
    small.add_request(wire("big", list(range(50)), extra_args=REMOTE_DECODE))
    (out,) = run_to_completion(small)["big"]
    assert out.finished and out.deltas[0].finish_reason == "length" and out.kv_transfer_params is None
    assert small.num_held == 0 and small.kv_cache.usage == 0.0
    assert small.holds.refused["over_request_limit"] == 1
    small.add_request(wire("fits", list(range(40)), extra_args=REMOTE_DECODE))  # 41 tokens: 3 blocks
    assert run_to_completion(small)["fits"][-1].kv_transfer_params is not None and small.num_held == 1


def test_a_running_request_frees_holds_before_it_is_preempted() -> None:
    """Issue 11: holds yield to requests that need blocks (oldest first), before any preemption."""
    core = make_core(role="prefill", num_blocks=8, kv_hold_max_fraction=1.0)
    core.add_request(wire("old", list(range(1000, 1050)), extra_args=REMOTE_DECODE))  # 4 blocks
    core.add_request(wire("new", list(range(2000, 2030)), extra_args=REMOTE_DECODE))  # 2 blocks
    run_to_completion(core)
    assert core.num_held == 2 and core.num_held_blocks == 6
    # 40 prompt tokens (3 blocks) growing to 120 (8 blocks, the whole cache); 2 blocks are free: its
    # admission frees the older hold, its growth the newer one
    core.add_request(wire("grow", list(range(3000, 3040)), max_tokens=80, ignore_eos=True))
    outs = run_to_completion(core)["grow"]
    assert sum(len(o.deltas[0].token_ids) for o in outs) == 80
    assert core.metrics.num_preemptions == 0
    assert core.holds.freed["pressure"] == 2 and core.num_held == 0
    assert core.get_held("old") is None


def test_decode_role_ignores_do_remote_decode() -> None:
    core = make_core(role="decode")
    core.add_request(wire("d", list(range(20)), max_tokens=3, extra_args=REMOTE_DECODE))
    outs = run_to_completion(core)["d"]
    assert len(tokens_by_index(outs)[0]) == 3 and outs[-1].kv_transfer_params is None
    assert core.num_held == 0


def test_preloaded_blocks_count_as_cached_and_skip_prefill() -> None:
    prefill = make_core(role="prefill")
    prompt = list(range(7000, 7070))  # 70 tokens: 4 full blocks
    prefill.add_request(wire("p", prompt, extra_args=REMOTE_DECODE))
    run_to_completion(prefill)
    held = prefill.get_held("p")
    assert held is not None
    decode = make_core(role="decode")
    assert decode.preload_blocks(held.token_ids) == 64
    assert decode.kv_cache.usage == 0.0  # unreferenced until a request uses them
    decode.add_request(wire("d", prompt, "s", max_tokens=3))
    sched = decode.schedule()
    assert sched.num_prefill_tokens == 6  # only the partial tail block is computed
    decode.execute(sched)
    outs = run_to_completion(decode)["d"]
    assert outs[-1].num_cached_tokens == 64
    assert decode.sessions.get("s").cached_tokens == 64  # type: ignore[union-attr]

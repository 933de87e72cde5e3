"""The engine's KV-cache event hooks, through the real recorder (``StepEvents``), without sockets:
what is reported for stores, prefix hits, evictions, resets and P/D pulls, one batch per step."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from backends.engine.config import EngineConfig
from backends.engine.core import EngineCore
from backends.engine.kv_cache import KVCacheManager, hash_full_blocks
from backends.engine.metrics import EngineMetrics
from backends.kv_events.recorder import StepEvents, int_block_hashes
from contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from tests.backends.engine.engine_support import run_to_completion, wire

BS = 16


def make_core(**overrides: Any) -> tuple[EngineCore, list[KVEventBatch]]:
    config = EngineConfig(**{"speed": 0.0, "eos_probability": 0.0, "block_size": BS, **overrides})
    core = EngineCore(config, EngineMetrics(CollectorRegistry(), "m", 0, 10))
    batches: list[KVEventBatch] = []
    # bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) compare with the engine's keys directly;
    # the int conversion (vLLM's default) is tested on its own below
    core.attach_kv_events(StepEvents(BS, batches.append, int_hashes=False))
    return core, batches


def events_of(batches: list[KVEventBatch]) -> list[KVEvent]:
    return [e for b in batches for e in b.events]


def stored(batches: list[KVEventBatch]) -> list[BlockStored]:
    return [e for e in events_of(batches) if isinstance(e, BlockStored)]


def generated(outs: Any, rid: str) -> list[int]:
    return [t for o in outs[rid] for d in o.deltas for t in d.token_ids]


PROMPT = list(range(100, 140))  # 40 tokens: 2 full blocks and 8 tokens


def test_a_request_reports_each_run_of_full_blocks_with_its_session() -> None:
    core, batches = make_core()
    core.add_request(wire("a", PROMPT, "sess-a", max_tokens=10, ignore_eos=True))
    outs = run_to_completion(core)
    tokens = PROMPT + generated(outs, "a")[:-1]  # the last sampled token is never computed
    keys = hash_full_blocks(tokens, BS)
    first, second = stored(batches)
    assert first == BlockStored(block_hashes=keys[:2], parent_block_hash=None, token_ids=PROMPT[:32], block_size=BS,
                                lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0,
                                kv_cache_spec_kind="full_attention", session_id="sess-a")
    # the third block fills with generated tokens: chained after the second
    assert second.block_hashes == keys[2:3] and second.parent_block_hash == keys[1]
    assert second.token_ids == tokens[32:48] and second.session_id == "sess-a"
    # one batch per step that had events, each holding only that step's events
    assert [len(b.events) for b in batches] == [1, 1]
    assert all(b.data_parallel_rank == 0 and b.ts > 0 for b in batches)


def test_a_salted_prompt_names_its_salt_on_block_zero() -> None:
    core, batches = make_core()
    core.add_request(wire("a", PROMPT, "s", salt="tenant-7", max_tokens=1))
    run_to_completion(core)
    [event] = stored(batches)
    assert event.extra_keys == [("tenant-7",), None]
    assert event.block_hashes == hash_full_blocks(PROMPT, BS, "tenant-7")[:2]


def test_a_prefix_hit_is_reported_only_when_the_request_asks_for_it() -> None:
    core, batches = make_core()
    core.add_request(wire("t1", PROMPT, "sess-1", max_tokens=1))
    run_to_completion(core)
    keys = hash_full_blocks(PROMPT, BS)[:2]
    turn2 = PROMPT[:32] + list(range(500, 520))  # hits the first two blocks
    # vLLM's default ("incremental"): the hit is not reported; the new blocks chain after it
    batches.clear()
    core.add_request(wire("t2", turn2, "sess-2", max_tokens=1))
    run_to_completion(core)
    [new] = stored(batches)
    assert new.parent_block_hash == keys[1] and new.token_ids == turn2[32:48] and new.session_id == "sess-2"
    # kv_cache_report_mode "full" (vllm_xargs): the hit blocks again, from block 0, tagged with the NEW session
    batches.clear()
    core.add_request(wire("t3", turn2, "sess-3", max_tokens=1, extra_args={"kv_cache_report_mode": "full"}))
    run_to_completion(core)
    [reuse] = stored(batches)  # all three full blocks were hits (at most num_tokens - 1 = 51 tokens)
    assert reuse.parent_block_hash is None and reuse.session_id == "sess-3"
    assert reuse.block_hashes == keys + [new.block_hashes[0]] and reuse.token_ids == turn2[:48]


def test_eviction_reports_one_block_removed_per_evicted_key() -> None:
    core, batches = make_core(num_blocks=8, max_model_len=128)
    core.add_request(wire("a", list(range(100, 164)), "sa", max_tokens=1))  # 4 full blocks, 5 used
    run_to_completion(core)
    a_keys = [k for e in stored(batches) for k in e.block_hashes]
    assert len(a_keys) == 4
    batches.clear()
    core.add_request(wire("b", list(range(300, 400)), "sb", max_tokens=1))  # 7 blocks: evicts 3 of a's
    run_to_completion(core)
    removed = [e for e in events_of(batches) if isinstance(e, BlockRemoved)]
    assert all(len(e.block_hashes) == 1 and e.medium == "GPU" and e.group_idx == 0 for e in removed)
    gone = [e.block_hashes[0] for e in removed]
    assert len(gone) == 3 and set(gone) <= set(a_keys)
    # the evictions come before the blocks they made room for, in the same step's batch
    first = batches[0].events
    assert isinstance(first[0], BlockRemoved) and isinstance(first[-1], BlockStored)
    assert first[-1].session_id == "sb"


def test_reset_publishes_all_blocks_cleared_at_once_and_only_when_nothing_is_in_use() -> None:
    core, batches = make_core()
    core.add_request(wire("a", PROMPT, "s", max_tokens=3))
    core.step()  # running: its blocks are referenced
    batches.clear()
    assert core.reset_prefix_cache() is False
    assert batches == [] and core.kv_cache.num_cached_blocks > 0
    run_to_completion(core)
    batches.clear()
    assert core.reset_prefix_cache() is True
    assert [b.events for b in batches] == [[AllBlocksCleared()]]  # its own batch, without waiting for a step
    assert core.kv_cache.num_cached_blocks == 0


def test_a_partial_reset_reports_each_dropped_key_instead() -> None:
    kv = KVCacheManager(8, 4)
    batches: list[KVEventBatch] = []
    sink = StepEvents(4, batches.append, int_hashes=False)
    kv.events = sink
    held, loose = kv.allocate(1), kv.allocate(1)
    kv.cache_block(held[0], b"h" * 16)
    kv.cache_block(loose[0], b"l" * 16)
    kv.free(loose)
    assert kv.reset_prefix_cache() == 1
    sink.flush()
    assert [b.events for b in batches] == [[BlockRemoved(block_hashes=[b"l" * 16], medium="GPU", group_idx=0)]]
    kv.free(held)
    batches.clear()
    kv.reset_prefix_cache()
    sink.flush()
    assert [b.events for b in batches] == [[AllBlocksCleared()]]


def test_pulled_blocks_are_reported_when_a_request_first_hits_them() -> None:
    core, batches = make_core()
    keys = hash_full_blocks(PROMPT, BS)[:2]
    assert core.preload_blocks(PROMPT) == 32
    core.step()
    assert batches == []  # a P/D pull alone reports nothing
    core.add_request(wire("d", PROMPT, "sess-decode", max_tokens=1))
    run_to_completion(core)
    pulled = stored(batches)[0]
    assert pulled.block_hashes == keys and pulled.parent_block_hash is None
    assert pulled.token_ids == PROMPT[:32] and pulled.session_id == "sess-decode"


def test_blocks_a_pull_evicts_are_reported_at_once() -> None:
    core, batches = make_core(num_blocks=4, max_model_len=64)
    core.add_request(wire("a", list(range(100, 164)), "sa", max_tokens=1))  # 4 cached blocks
    run_to_completion(core)
    a_keys = stored(batches)[0].block_hashes
    batches.clear()
    core.preload_blocks(list(range(300, 332)))  # 2 pulled blocks evict 2 of a's, between steps
    [batch] = batches
    # the tail of a sequence is evicted first (freed in reverse)
    assert [e.block_hashes[0] for e in batch.events if isinstance(e, BlockRemoved)] == [a_keys[3], a_keys[2]]


def test_pulled_blocks_evicted_before_any_hit_are_not_reported_removed() -> None:
    core, batches = make_core(num_blocks=4, max_model_len=64)
    core.preload_blocks(list(range(100, 148)))  # 3 blocks, never hit
    core.add_request(wire("x", list(range(700, 760)), "sx", max_tokens=1))  # needs all 4 blocks
    run_to_completion(core)
    assert not [e for e in events_of(batches) if isinstance(e, BlockRemoved)]
    assert stored(batches)[0].session_id == "sx"


def test_detached_sink_gets_nothing() -> None:
    core, batches = make_core()
    core.attach_kv_events(None)
    assert core.kv_cache.events is None
    core.add_request(wire("a", PROMPT, "s", max_tokens=2))
    run_to_completion(core)
    assert core.reset_prefix_cache() and batches == []


def test_hashes_are_vllms_default_ints_the_low_64_bits_big_endian() -> None:
    batches: list[KVEventBatch] = []
    sink = StepEvents(BS, batches.append)  # the default, as vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1
    key0, key1 = bytes(range(16)), bytes(range(16, 32))
    sink.stored([key1], key0, list(range(BS)), "s", None)
    sink.removed(key1)
    sink.flush()
    stored_event, removed_event = batches[0].events
    assert isinstance(stored_event, BlockStored) and isinstance(removed_event, BlockRemoved)
    # vLLM: int.from_bytes(digest, "big") & (2**64 - 1): the last 8 bytes of our 16-byte key
    assert stored_event.block_hashes == [0x18191A1B1C1D1E1F] and stored_event.parent_block_hash == 0x08090A0B0C0D0E0F
    assert removed_event.block_hashes == [0x18191A1B1C1D1E1F]


def test_the_int_hashes_switch_reads_like_vllms() -> None:
    assert int_block_hashes({}) is True
    assert int_block_hashes({"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}) is False
    assert int_block_hashes({"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1"}) is True
    with pytest.raises(ValueError, match="must be 0 .* or 1"):
        int_block_hashes({"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "yes"})

"""``router.kv.index.KVIndex``: stores, reuse re-tags, removals, clears, the LRU bound, forgetting
sessions, and prompt prefixes against the router-side content keys."""

from __future__ import annotations

import pytest

from contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from router.kv.index import MAX_TAGS, KVIndex, prompt_block_keys
from tests.router.kv.events import BS, batch, engine_hashes, removed, stored

A = "http://127.0.0.1:8101"
B = "http://127.0.0.1:8102"
PROMPT = list(range(100, 124))  # 6 blocks of 4


def test_stored_blocks_count_for_their_session_on_their_backend() -> None:
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(PROMPT[:16], "s1")))
    assert dict(index.session_tokens("s1")) == {A: 16}
    assert index.blocks == 4
    assert dict(index.session_tokens("nobody")) == {}
    # the next turn stores the blocks after the cached ones, chained to the last of them
    index.apply(A, batch(stored(PROMPT, "s1", skip_blocks=4)))
    assert dict(index.session_tokens("s1")) == {A: 24}
    index.apply(B, batch(stored(PROMPT[:8], "s1")))
    assert dict(index.session_tokens("s1")) == {A: 24, B: 8}
    assert index.sessions == 1


def test_a_partial_last_block_is_not_in_the_event_and_blocks_without_a_session_count_for_none() -> None:
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(PROMPT[:10])))  # 2 full blocks
    assert index.blocks == 2
    assert index.sessions == 0
    assert index.prefix_tokens(PROMPT) == {A: 8}


def test_a_reuse_retags_resident_blocks_to_the_new_session_without_double_counting() -> None:
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(PROMPT[:8], "s1")))
    # vLLM's reuse report: BlockStored for the hit blocks (parent None), tagged with the hitting session
    index.apply(A, batch(stored(PROMPT[:8], "s2")))
    assert dict(index.session_tokens("s1")) == {A: 8}
    assert dict(index.session_tokens("s2")) == {A: 8}
    assert index.blocks == 2
    index.apply(A, batch(stored(PROMPT[:8], "s2")))  # reported again: still 8
    assert dict(index.session_tokens("s2")) == {A: 8}
    # a removal takes the block from both sessions
    index.apply(A, batch(removed(PROMPT, 1)))
    assert dict(index.session_tokens("s1")) == {A: 4}
    assert dict(index.session_tokens("s2")) == {A: 4}
    index.apply(A, batch(removed(PROMPT, 0)))
    assert dict(index.session_tokens("s1")) == {}
    assert index.sessions == 0
    assert index.blocks == 0


def test_a_block_counts_for_at_most_max_tags_sessions_the_most_recent() -> None:
    index = KVIndex(max_blocks=100)
    sessions = [f"s{i}" for i in range(MAX_TAGS + 2)]
    for sid in sessions:
        index.apply(A, batch(stored(PROMPT[:4], sid)))
    assert all(dict(index.session_tokens(sid)) == {} for sid in sessions[:2])
    assert all(dict(index.session_tokens(sid)) == {A: 4} for sid in sessions[2:])
    # re-reported by an old tag: it becomes the most recent, the oldest other one drops
    index.apply(A, batch(stored(PROMPT[:4], sessions[2])))
    index.apply(A, batch(stored(PROMPT[:4], "late")))
    assert dict(index.session_tokens(sessions[2])) == {A: 4}
    assert dict(index.session_tokens(sessions[3])) == {}


def test_removed_blocks_unknown_to_the_index_are_ignored() -> None:
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(PROMPT[:8], "s1")))
    index.apply(A, batch(removed(list(range(900, 908)), 0, 1)))
    index.apply(B, batch(removed(PROMPT, 0)))  # the same hash on another backend: not A's block
    assert dict(index.session_tokens("s1")) == {A: 8}


def test_all_blocks_cleared_and_reset_drop_one_backend_only() -> None:
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(PROMPT, "s1")))
    index.apply(B, batch(stored(PROMPT, "s1")))
    index.apply(A, batch(AllBlocksCleared()))
    assert dict(index.session_tokens("s1")) == {B: 24}
    assert index.prefix_tokens(PROMPT) == {B: 24}
    assert index.backend_blocks(A) == 0
    index.reset_backend(B)
    assert dict(index.session_tokens("s1")) == {}
    assert index.prefix_tokens(PROMPT) == {}
    assert index.blocks == 0
    # after a reset the backend's new blocks count again
    index.apply(B, batch(stored(PROMPT[:4], "s1")))
    assert dict(index.session_tokens("s1")) == {B: 4}


def test_remove_backend_frees_its_slot_for_the_next_one() -> None:
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(PROMPT, "s1")))
    index.apply(B, batch(stored(PROMPT[:8], "s2")))
    index.remove_backend(A)
    assert index.prefix_tokens(PROMPT) == {B: 8}
    c = "http://127.0.0.1:8103"
    index.apply(c, batch(stored(PROMPT[:12], "s3")))  # takes A's bit: must not inherit A's blocks
    assert index.prefix_tokens(PROMPT) == {B: 8, c: 12}
    assert dict(index.session_tokens("s1")) == {}


def test_the_bound_evicts_the_least_recently_stored_or_reused_blocks_across_backends() -> None:
    index = KVIndex(max_blocks=6)
    old = list(range(0, 8))
    index.apply(A, batch(stored(old, "old")))  # 2 blocks
    index.apply(B, batch(stored(PROMPT[:8], "b")))  # 2 blocks
    index.apply(A, batch(stored(old, "old")))  # reuse: A's blocks are the most recent now
    index.apply(A, batch(stored(list(range(50, 58)), "new")))  # 2 more: 6, at the bound
    assert index.blocks == 6
    index.apply(A, batch(stored(list(range(60, 68)), "newer")))  # 8 > 6: B's two blocks go
    assert index.blocks == 6
    assert index.evicted == 2
    assert dict(index.session_tokens("b")) == {}
    assert dict(index.session_tokens("old")) == {A: 8}
    assert index.prefix_tokens(PROMPT) == {}
    assert index.backend_blocks(B) == 0


def test_forgotten_sessions_count_nowhere_and_a_returning_id_starts_afresh() -> None:
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(PROMPT[:8], "s1")))
    index.forget_session("s1")
    assert dict(index.session_tokens("s1")) == {}
    assert index.sessions == 0
    # the blocks are still there (other sessions, prompts)
    assert index.prefix_tokens(PROMPT) == {A: 8}
    index.apply(A, batch(stored(PROMPT[:12], "s1", skip_blocks=2)))
    # its chain from block 0: the two blocks the forgotten record tagged, and its own
    assert dict(index.session_tokens("s1")) == {A: 12}
    # removing the forgotten record's blocks leaves the new record's own block tagged, but its chain
    # now starts with a hole: nothing a next turn could hit
    index.apply(A, batch(removed(PROMPT, 0, 1)))
    assert index.sessions == 1
    assert dict(index.session_tokens("s1")) == {}


def test_prefix_tokens_is_the_longest_resident_prefix_per_backend() -> None:
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(PROMPT[:8], "s1")))
    index.apply(B, batch(stored(PROMPT[:20], "s2")))
    assert index.prefix_tokens(PROMPT) == {A: 8, B: 20}
    assert index.prefix_tokens(PROMPT[:10]) == {A: 8, B: 8}
    assert index.prefix_tokens(PROMPT[:3]) == {}
    assert index.prefix_tokens([7] + PROMPT[1:]) == {}  # differs in the first block: nothing matches
    # a hole in B's chain: the prefix stops before it
    index.apply(B, batch(removed(PROMPT, 2)))
    assert index.prefix_tokens(PROMPT) == {A: 8, B: 8}


def test_content_keys_do_not_depend_on_the_engine_hash() -> None:
    """Two backends hashing differently (bytes vs ints) store the same tokens: same content keys."""
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(PROMPT[:8], "s1")))
    int_hashes = [int.from_bytes(h[:8], "big") for h in engine_hashes(PROMPT[:8])]
    index.apply(B, batch(BlockStored(block_hashes=int_hashes, parent_block_hash=None, token_ids=PROMPT[:8],
                                     block_size=BS, lora_id=None, medium="GPU", lora_name=None)))
    assert index.prefix_tokens(PROMPT) == {A: 8, B: 8}
    keys = prompt_block_keys(PROMPT, BS)
    assert len(keys) == 6 and len(set(keys)) == 6
    assert prompt_block_keys(PROMPT[:8], BS) == keys[:2]
    assert prompt_block_keys(PROMPT, 8)[0] != keys[0]


def test_a_block_whose_parent_is_unknown_counts_for_nothing_until_its_chain_is_known() -> None:
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(PROMPT[:12], "s1", skip_blocks=1)))  # its parent was never seen
    assert dict(index.session_tokens("s1")) == {}  # no chain from block 0: a next turn hits nothing
    assert index.blocks == 2
    assert index.prefix_tokens(PROMPT) == {}
    index.apply(A, batch(stored(PROMPT[:12], "s1")))  # the whole chain reported from the root
    assert index.prefix_tokens(PROMPT) == {A: 12}
    assert dict(index.session_tokens("s1")) == {A: 12}


def test_two_engine_blocks_with_the_same_content_on_one_backend() -> None:
    """Same tokens, two engine hashes (another LoRA or salt): the prefix holds while either is there."""
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(PROMPT[:4], "s1")))
    other = BlockStored(block_hashes=[b"another-hash-xyz"], parent_block_hash=None, token_ids=PROMPT[:4],
                        block_size=BS, lora_id=1, medium="GPU", lora_name="adapter", session_id="s2")
    index.apply(A, batch(other))
    assert index.blocks == 2
    index.apply(A, batch(removed(PROMPT, 0)))
    assert index.prefix_tokens(PROMPT) == {A: 4}
    index.apply(A, batch(removed(PROMPT, 0)))  # already gone: no-op
    assert index.prefix_tokens(PROMPT) == {A: 4}
    index.apply(A, batch(BlockRemoved(block_hashes=[b"another-hash-xyz"], medium="GPU")))
    assert index.prefix_tokens(PROMPT) == {}


def test_other_tiers_and_groups_are_not_indexed() -> None:
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(PROMPT[:8], "s1")))
    index.apply(A, batch(stored(PROMPT[:8], "s1", medium="CPU"), stored(PROMPT[:8], "s1", group_idx=1)))
    cpu_removed = removed(PROMPT, 0, 1)
    cpu_removed.medium = "CPU"
    index.apply(A, batch(cpu_removed))
    assert index.blocks == 2
    assert dict(index.session_tokens("s1")) == {A: 8}


def test_the_block_size_is_learned_from_the_events() -> None:
    index = KVIndex(max_blocks=100, block_size_hint=16)
    assert index.block_size == 16
    index.apply(A, batch(stored(PROMPT[:8], "s1")))
    assert index.block_size == BS
    assert index.prefix_tokens(PROMPT) == {A: 8}


def test_version_bumps_on_every_change() -> None:
    index = KVIndex(max_blocks=100)
    seen = [index.version]
    index.apply(A, batch(stored(PROMPT[:8], "s1")))
    seen.append(index.version)
    index.forget_session("s1")
    seen.append(index.version)
    index.reset_backend(A)
    seen.append(index.version)
    index.remove_backend(A)
    seen.append(index.version)
    assert seen == sorted(set(seen))


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="max_blocks"):
        KVIndex(max_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        prompt_block_keys(PROMPT, 0)

"""``KVIndex.session_tokens`` answers the session's resident chain from block 0 (what a next turn
would hit), not the sum of its blocks: an evicted block cuts everything after it; and
``observe_hit`` lets the engine's reported cache hit correct a stale claim."""

from __future__ import annotations

from contract.kv_events import AllBlocksCleared
from router.kv.index import KVIndex
from tests.router.kv.events import batch, removed, stored

A = "http://127.0.0.1:8101"
B = "http://127.0.0.1:8102"
CHAT = list(range(200, 248))  # 12 blocks of 4
SYSTEM = CHAT[:8]  # a shared system prompt: 2 blocks


def two_turns(index: KVIndex, backend: str = A, session: str = "s1") -> None:
    index.apply(backend, batch(stored(CHAT[:12], session)))  # turn 1: blocks 0-2
    index.apply(backend, batch(stored(CHAT[:24], session, skip_blocks=3)))  # turn 2: blocks 3-5 after them


def test_evicting_a_middle_block_cuts_the_session_to_the_prefix_before_it() -> None:
    index = KVIndex(max_blocks=100)
    two_turns(index)
    assert dict(index.session_tokens("s1")) == {A: 24}
    index.apply(A, batch(removed(CHAT, 3)))
    assert dict(index.session_tokens("s1")) == {A: 12}  # blocks 4 and 5 are resident but unreachable
    assert index.blocks == 5
    index.apply(A, batch(removed(CHAT, 1)))  # a hole further up cuts more
    assert dict(index.session_tokens("s1")) == {A: 4}
    index.apply(A, batch(removed(CHAT, 5)))  # a block below a hole changes nothing
    assert dict(index.session_tokens("s1")) == {A: 4}
    index.apply(A, batch(removed(CHAT, 0)))  # block 0 gone: a next turn hits nothing
    assert dict(index.session_tokens("s1")) == {}


def test_evicting_the_last_block_leaves_the_chain_before_it() -> None:
    index = KVIndex(max_blocks=100)
    two_turns(index)
    index.apply(A, batch(removed(CHAT, 5), removed(CHAT, 4)))  # vLLM frees a request's tail first
    assert dict(index.session_tokens("s1")) == {A: 16}
    index.apply(A, batch(removed(CHAT, 3)))
    assert dict(index.session_tokens("s1")) == {A: 12}


def test_a_chain_stored_after_a_hole_does_not_count_until_the_hole_is_filled() -> None:
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(CHAT[:12], "s1")))
    index.apply(A, batch(removed(CHAT, 1)))
    # the next turn's blocks chained to block 2 (still resident, but behind the hole)
    index.apply(A, batch(stored(CHAT[:24], "s1", skip_blocks=3)))
    assert dict(index.session_tokens("s1")) == {A: 4}
    # the chain reported again from block 0 (vLLM's full report mode): block 1 is back, all of it counts
    index.apply(A, batch(stored(CHAT[:24], "s1")))
    assert dict(index.session_tokens("s1")) == {A: 24}


def test_the_shared_system_prompt_counts_for_every_session_chained_to_it() -> None:
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(SYSTEM, "first")))
    # s2's first turn hits the system prompt: vLLM reports only its new blocks, parent = the last hit block
    index.apply(A, batch(stored(CHAT[:20], "s2", skip_blocks=2)))
    assert dict(index.session_tokens("s2")) == {A: 20}
    # s2's own blocks go, the system prompt stays: the prefix before the first evicted block
    index.apply(A, batch(removed(CHAT, 2)))
    assert dict(index.session_tokens("s2")) == {A: 8}
    index.apply(A, batch(removed(CHAT, 0)))
    assert dict(index.session_tokens("s2")) == {}
    assert dict(index.session_tokens("first")) == {}


def test_sibling_branches_are_cut_independently() -> None:
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(SYSTEM, "first")))
    other = SYSTEM + list(range(900, 912))
    index.apply(A, batch(stored(CHAT[:20], "s1", skip_blocks=2), stored(other, "s2", skip_blocks=2)))
    index.apply(A, batch(removed(CHAT, 3)))
    assert dict(index.session_tokens("s1")) == {A: 12}
    assert dict(index.session_tokens("s2")) == {A: 20}
    index.apply(A, batch(removed(other, 2)))
    assert dict(index.session_tokens("s2")) == {A: 8}
    assert dict(index.session_tokens("s1")) == {A: 12}


def test_each_backend_has_its_own_chain() -> None:
    index = KVIndex(max_blocks=100)
    two_turns(index, A)
    two_turns(index, B)
    index.apply(A, batch(removed(CHAT, 2)))
    assert dict(index.session_tokens("s1")) == {A: 8, B: 24}
    index.apply(B, batch(AllBlocksCleared()))
    assert dict(index.session_tokens("s1")) == {A: 8}
    index.apply(B, batch(stored(CHAT[:8], "s1")))  # the chain stored again after the clear
    assert dict(index.session_tokens("s1")) == {A: 8, B: 8}


def test_the_bound_cuts_chains_like_an_engine_eviction() -> None:
    index = KVIndex(max_blocks=6)
    index.apply(A, batch(stored(CHAT[:24], "s1")))  # 6 blocks: at the bound
    index.apply(A, batch(stored(list(range(500, 504)), "s2")))  # a 7th: the oldest block (block 0) goes
    assert index.blocks == 6
    assert dict(index.session_tokens("s1")) == {}
    assert dict(index.session_tokens("s2")) == {A: 4}


def test_prefix_tokens_is_unchanged_by_sessions_chains() -> None:
    index = KVIndex(max_blocks=100)
    two_turns(index)
    index.apply(A, batch(removed(CHAT, 3)))
    assert index.prefix_tokens(CHAT) == {A: 12}
    assert index.prefix_tokens(CHAT[:8]) == {A: 8}


def test_a_session_whose_own_blocks_all_went_counts_nowhere_until_it_stores_again() -> None:
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(SYSTEM, "first")))
    index.apply(A, batch(stored(CHAT[:12], "s1", skip_blocks=2)))
    index.apply(A, batch(removed(CHAT, 2)))
    assert dict(index.session_tokens("s1")) == {}
    index.apply(A, batch(stored(CHAT[:16], "s1", skip_blocks=2)))
    assert dict(index.session_tokens("s1")) == {A: 16}


def test_a_tip_on_a_block_its_session_did_not_tag_is_dropped_when_that_block_goes() -> None:
    """The session's tip moved up into another session's blocks; when such a block goes (the session is
    not among its tags) the stale tip counts for nothing, even once the freed id holds another block."""
    index = KVIndex(max_blocks=100)
    index.apply(A, batch(stored(SYSTEM, "first")))
    index.apply(A, batch(stored(CHAT[:16], "s1", skip_blocks=2)))
    index.apply(A, batch(stored(list(range(600, 604)), "s1")))  # another, shorter chain of s1's
    assert dict(index.session_tokens("s1")) == {A: 16}
    index.apply(A, batch(removed(CHAT, 3), removed(CHAT, 2)))
    assert dict(index.session_tokens("s1")) == {A: 8}  # the tip is "first"'s block 1 now
    index.apply(A, batch(removed(CHAT, 1)))
    assert dict(index.session_tokens("s1")) == {}
    index.apply(B, batch(stored(list(range(700, 720)), "x")))  # reuses the freed ids
    assert dict(index.session_tokens("s1")) == {}


def test_observe_hit_caps_a_stale_claim_until_the_sessions_next_stored_blocks() -> None:
    index = KVIndex(max_blocks=100)
    two_turns(index)
    two_turns(index, B)
    version = index.version
    # the engine found 8 of a 30-token prompt cached; the index claimed 24 and has not seen the prompt stored
    index.observe_hit("s1", A, 8, 30)
    assert dict(index.session_tokens("s1")) == {A: 8, B: 24}
    assert index.version > version
    index.observe_hit("s1", A, 12, 30)  # more than the engine's last word: the cap stays
    assert dict(index.session_tokens("s1")) == {A: 8, B: 24}
    # newer events for the session on that backend: the index's own view again
    index.apply(A, batch(stored(CHAT[:28], "s1", skip_blocks=6)))
    assert dict(index.session_tokens("s1")) == {A: 28, B: 24}


def test_observe_hit_ignores_reports_the_index_has_already_overtaken() -> None:
    index = KVIndex(max_blocks=100)
    two_turns(index)
    index.observe_hit("s1", A, 0, 24)  # a first turn's miss: its blocks (24 tokens) are already indexed
    index.observe_hit("s1", A, 24, 40)  # the engine found as much as claimed
    index.observe_hit("s1", B, 0, 40)  # nothing claimed there
    index.observe_hit("nobody", A, 0, 40)
    index.observe_hit("s1", "http://127.0.0.9:1", 0, 40)
    assert dict(index.session_tokens("s1")) == {A: 24}


def test_forgetting_a_session_drops_its_chain_and_cap() -> None:
    index = KVIndex(max_blocks=100)
    two_turns(index)
    index.observe_hit("s1", A, 4, 40)
    index.forget_session("s1")
    assert dict(index.session_tokens("s1")) == {}
    index.apply(A, batch(stored(CHAT[:28], "s1", skip_blocks=6)))
    assert dict(index.session_tokens("s1")) == {A: 28}

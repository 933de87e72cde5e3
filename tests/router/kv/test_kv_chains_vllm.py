"""The session chains against a live vLLM 0.32's recorded events (``tests/data/kv_events/``): after
every batch, each session's ``session_tokens`` is the length of a chain that is resident from block 0
in an independent model of the engine's cache (hashes stored and not yet removed, parents resolved by
hash), and no longer than the resident prefix before the first hole of any chain through a block the
session stored: no answer counts a block behind an evicted one. (vLLM frees a request's blocks tail first, so
these recordings hold no middle eviction: test_kv_chains.py has those.)"""

from __future__ import annotations

import pytest

from contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from router.kv.index import KVIndex
from tests.contract.test_kv_events_vllm_golden import RUNS, STREAMS

URL = "http://127.0.0.1:9"


def resident_prefix(h: int, parent: dict[int, int | None], tokens: dict[int, int], resident: set[int]) -> int:
    """Tokens from block 0 along ``h``'s chain up to the first block not resident."""
    chain = [h]
    while (up := parent[chain[-1]]) is not None:
        chain.append(up)
    total = 0
    for block in reversed(chain):
        if block not in resident:
            break
        total += tokens[block]
    return total


def rooted_depths(parent: dict[int, int | None], tokens: dict[int, int], resident: set[int]) -> set[int]:
    """Tokens from block 0 through each resident block whose whole chain is resident."""
    depths: dict[int, int | None] = {}

    def depth(h: int) -> int | None:
        if h in depths:
            return depths[h]
        up = parent[h]
        below = 0 if up is None else (depth(up) if up in resident else None)
        depths[h] = None if below is None else below + tokens[h]
        return depths[h]

    return {d for h in resident if (d := depth(h)) is not None}


@pytest.mark.parametrize("run", RUNS)
def test_every_answer_is_a_chain_resident_from_block_0(run: str) -> None:
    index = KVIndex(max_blocks=100_000, block_size_hint=16)
    parent: dict[int, int | None] = {}
    tokens: dict[int, int] = {}
    resident: set[int] = set()
    tagged: dict[str, set[int]] = {}
    engine = None
    checked = cut = 0
    for m in STREAMS[run]:
        if m.engine_run != engine:
            if engine is not None:
                index.reset_backend(URL)
                resident.clear()
            engine = m.engine_run
        index.apply(URL, m.batch)
        for e in m.batch.events:
            if isinstance(e, BlockStored):
                up = e.parent_block_hash
                for h in e.block_hashes:
                    parent[h], tokens[h] = up, e.block_size
                    resident.add(h)
                    up = h
                if e.session_id is not None:
                    tagged.setdefault(e.session_id, set()).update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                resident.difference_update(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                resident.clear()
        depths = rooted_depths(parent, tokens, resident)
        for sid, mine in tagged.items():
            answer = index.session_tokens(sid).get(URL)
            if answer is not None:
                assert answer in depths, (run, m.seq, m.phase, sid, answer)
                most = max((resident_prefix(h, parent, tokens, resident) for h in mine if h in resident),
                           default=0)
                assert answer <= most, (run, m.seq, m.phase, sid, answer, most)
                checked += 1
            elif any(isinstance(e, BlockRemoved) for e in m.batch.events):
                cut += 1
    assert checked > 50
    if run == "ipc":
        assert cut > 0  # the evictions cut some sessions' chains to nothing

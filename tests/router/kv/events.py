"""Building KV events for the router's index tests: a chain of blocks as an engine would store them."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BS = 4  # tokens per block in these tests


def engine_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """An engine-side chained block hash (sha256, as vLLM's default; not the router's content key)."""
    return hashlib.sha256((parent or b"root") + repr(list(tokens)).encode()).digest()[:16]


def engine_hashes(tokens: Sequence[int], bs: int = BS, parent: bytes | None = None) -> list[bytes]:
    hashes: list[bytes] = []
    for start in range(0, len(tokens) // bs * bs, bs):
        parent = engine_hash(parent, tokens[start:start + bs])
        hashes.append(parent)
    return hashes


def stored(tokens: Sequence[int], session: str | None = None, *, bs: int = BS, skip_blocks: int = 0,
           medium: str | None = "GPU", group_idx: int | None = None) -> BlockStored:
    """``BlockStored`` for the full blocks of ``tokens`` from block ``skip_blocks`` on, chained to the
    block before (as vLLM reports newly full blocks after the cached ones)."""
    hashes = engine_hashes(tokens, bs)
    parent = hashes[skip_blocks - 1] if skip_blocks else None
    full = len(hashes) * bs
    return BlockStored(block_hashes=hashes[skip_blocks:], parent_block_hash=parent,
                       token_ids=list(tokens[skip_blocks * bs:full]), block_size=bs, lora_id=None,
                       medium=medium, lora_name=None, group_idx=group_idx, session_id=session)


def removed(tokens: Sequence[int], *blocks: int, bs: int = BS) -> BlockRemoved:
    """``BlockRemoved`` for blocks number ``blocks`` of ``tokens`` (one event, as many hashes)."""
    hashes = engine_hashes(tokens, bs)
    return BlockRemoved(block_hashes=[hashes[i] for i in blocks], medium="GPU")


def batch(*events: BlockStored | BlockRemoved | AllBlocksCleared, ts: float = 1.0) -> KVEventBatch:
    return KVEventBatch(ts=ts, events=list(events), data_parallel_rank=0)

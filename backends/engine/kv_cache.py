"""Paged KV-cache blocks with automatic prefix caching (vLLM's scheme, simplified).

A sequence's tokens live in blocks of ``block_size`` tokens. Every FULL block has a key chained from
its parent's key::

    key(0) = H(NONE_HASH || tokens[0:B] || cache_salt)
    key(i) = H(key(i-1)   || tokens[i*B:(i+1)*B])

with H = blake2b-128 over the little-endian int64 token ids (stable across processes; not Python's
salted ``hash``). A trailing partial block has no key and is never shared.

Block states:

- *referenced*: used by >= 1 running sequence (``ref_cnt > 0``); possibly also cached (has a key).
- *free*: ``ref_cnt == 0`` and no key; allocated first.
- *evictable*: ``ref_cnt == 0`` with a key, kept in LRU order (a block joins the tail when its last
  reference goes; a prefix hit takes it out). Allocation evicts from the head (least recently used)
  only when no free block is left, dropping its key.

Usage (``vllm:kv_cache_usage_perc``) = 1 - (free + evictable) / num_blocks, as in vLLM.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

NONE_HASH = b"\x00" * 16
_blake2b = hashlib.blake2b


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Stable bytes of token ids (int64 LE; ids outside int64 fall back to their decimal text)."""
    try:
        return array("q", tokens).tobytes()
    except (OverflowError, TypeError):
        return repr(list(tokens)).encode()


def hash_block(parent: bytes, tokens: Sequence[int], cache_salt: str | None = None) -> bytes:
    """The key of one full block, chained from ``parent`` (``NONE_HASH`` for block 0)."""
    data = parent + token_bytes(tokens)
    if cache_salt is not None:
        data += b"\x01salt" + cache_salt.encode("utf-8", "surrogatepass")
    return _blake2b(data, digest_size=16).digest()


def hash_full_blocks(
    tokens: Sequence[int], block_size: int, cache_salt: str | None = None, parent: bytes = NONE_HASH
) -> list[bytes]:
    """Keys of every full block of ``tokens`` (the salt goes into block 0 only)."""
    keys: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size], cache_salt if start == 0 else None)
        keys.append(parent)
    return keys


class KVCacheManager:
    """``num_blocks`` blocks of ``block_size`` tokens, reference counts and the prefix cache."""

    __slots__ = ("num_blocks", "block_size", "ref_cnt", "block_hash", "_cached", "_free", "_evictable", "_external")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        # popped from the end: block 0 is handed out first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        #: blocks put in by ``insert_cached`` (pulled from a remote prefill) that no sequence has hit
        #: yet: their first hit is an external hit, not a local prefix-cache hit (as vLLM counts them)
        self._external: set[int] = set()

    # -- state -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take (free + evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by running sequences, 0..1."""
        return 1.0 - (len(self._free) + len(self._evictable)) / self.num_blocks

    def cached_block(self, key: bytes) -> int | None:
        """The block holding ``key``, or None."""
        return self._cached.get(key)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    # -- operations ------------------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (prefix hits), taking them out of the LRU."""
        ref_cnt = self.ref_cnt
        evictable = self._evictable
        for b in block_ids:
            if ref_cnt[b] == 0:
                evictable.pop(b, None)
            ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with one reference each; evicts LRU cached blocks if needed.

        The caller checks ``num_free_blocks`` first; asking for more raises ``MemoryError``.
        """
        if n > len(self._free) + len(self._evictable):
            raise MemoryError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out: list[int] = []
        free = self._free
        ref_cnt = self.ref_cnt
        for _ in range(n):
            if free:
                b = free.pop()
            else:
                b, _unused = self._evictable.popitem(last=False)
                key = self.block_hash[b]
                if key is not None:
                    self.block_hash[b] = None
                    if self._cached.get(key) == b:
                        del self._cached[key]
                if self._external:
                    self._external.discard(b)
            ref_cnt[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. Freed in reverse, so a sequence's tail blocks are
        evicted before its head (its head is the prefix most likely to be shared)."""
        ref_cnt = self.ref_cnt
        block_hash = self.block_hash
        for b in reversed(block_ids):
            n = ref_cnt[b] - 1
            ref_cnt[b] = n
            if n == 0:
                if block_hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
            elif n < 0:  # pragma: no cover - a bookkeeping bug; keep serving
                ref_cnt[b] = 0
                raise AssertionError(f"KV block {b} freed more often than referenced")

    def cache_block(self, block_id: int, key: bytes) -> bool:
        """Register a full, referenced block under ``key``. If another block already holds that key
        (two sequences computed the same content at once), this block stays unkeyed."""
        if key in self._cached or self.block_hash[block_id] is not None:
            return False
        self._cached[key] = block_id
        self.block_hash[block_id] = key
        return True

    def insert_cached(self, keys: Sequence[bytes]) -> int:
        """Make the chained ``keys`` present in the prefix cache without a reference (P/D: blocks
        pulled from a remote prefill). Stops at the first key that does not fit without evicting
        one of the keys just inserted. Returns how many leading keys are now cached."""
        present = 0
        mine = 0  # evictable blocks moved to / put at the LRU tail by this call
        evictable = self._evictable
        for key in keys:
            b = self._cached.get(key)
            if b is not None:
                if b in evictable:
                    evictable.move_to_end(b)
                    mine += 1
                present += 1
                continue
            if not self._free and len(evictable) <= mine:
                break
            (b,) = self.allocate(1)
            self._cached[key] = b
            self.block_hash[b] = key
            self.ref_cnt[b] = 0
            evictable[b] = None
            self._external.add(b)
            mine += 1
            present += 1
        return present

    def take_external(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` (a sequence's prefix hits) were pulled from a remote prefill and
        not hit before; from now on they count as local cache."""
        external = self._external
        if not external:
            return 0
        n = 0
        for b in block_ids:
            if b in external:
                external.discard(b)
                n += 1
        return n

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cached block's key (referenced blocks keep theirs); returns how many."""
        n = len(self._evictable)
        self._external.difference_update(self._evictable)
        for b in self._evictable:
            key = self.block_hash[b]
            self.block_hash[b] = None
            if key is not None and self._cached.get(key) == b:
                del self._cached[key]
            self._free.append(b)
        self._evictable.clear()
        return n

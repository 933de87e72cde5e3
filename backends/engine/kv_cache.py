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

KV-cache events (vLLM's ``BlockPool`` event hooks; ``backends/kv_events`` publishes them): when
``events`` is set, the manager reports, as plain data and in the order they happen, every run of
blocks a sequence registers (``report_stored``, called by the scheduler), the prefix hits a request
asked to have reported (vLLM's ``kv_cache_report_mode: "full"``) and the first hit on blocks a P/D
pull put in (``report_hits``), every key evicted (``removed``) and a reset (``cleared``, or one
``removed`` per key when referenced blocks keep theirs). With ``events`` None (the default) every
hook is a single attribute test.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

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


class KVEventSink(Protocol):
    """Where the manager reports prefix-cache changes (implemented by ``backends.kv_events``)."""

    def stored(self, keys: list[bytes], parent: bytes | None, token_ids: list[int], session_id: str | None,
               cache_salt: str | None) -> None:
        """Consecutive full blocks ``keys`` (chained after ``parent``; None = the prompt's start) hold
        ``token_ids``; ``cache_salt`` is set when the run starts at block 0 of a salted prompt."""

    def removed(self, key: bytes) -> None:
        """The block keyed ``key`` left the prefix cache."""

    def cleared(self) -> None:
        """Every key left the prefix cache."""

    def flush(self) -> None:
        """An engine step ended (or a change outside a step happened): publish what was reported."""


class _HashedSequence(Protocol):
    """What the event hooks read from a ``backends.engine.sequence.Sequence``."""

    request: Any
    cache_salt: str | None

    def block_hash(self, i: int, block_size: int) -> bytes: ...

    def tokens(self, start: int, end: int) -> list[int]: ...


#: vLLM's per-request switch (``vllm_xargs``) that makes a prefix hit reported as ``BlockStored``
REPORT_MODE_KEY = "kv_cache_report_mode"
REPORT_MODE_FULL = "full"


class KVCacheManager:
    """``num_blocks`` blocks of ``block_size`` tokens, reference counts and the prefix cache."""

    __slots__ = ("num_blocks", "block_size", "ref_cnt", "block_hash", "_cached", "_free", "_evictable", "_external",
                 "events")

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
        #: KV-cache event hooks (None: events off)
        self.events: KVEventSink | None = None

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
    def num_referenced_blocks(self) -> int:
        """Blocks some sequence (or a P/D hold) still references."""
        return self.num_blocks - len(self._free) - len(self._evictable)

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
                        # a pulled block no request hit was never reported stored
                        if self.events is not None and b not in self._external:
                            self.events.removed(key)
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
        """Drop every evictable cached block's key (referenced blocks keep theirs); returns how many.

        Events: ``cleared`` when no key is left, else one ``removed`` per dropped key."""
        n = len(self._evictable)
        events = self.events
        dropped: list[bytes] | None = [] if events is not None else None
        for b in self._evictable:
            key = self.block_hash[b]
            self.block_hash[b] = None
            if key is not None and self._cached.get(key) == b:
                del self._cached[key]
                if dropped is not None and b not in self._external:
                    dropped.append(key)
            self._free.append(b)
        self._external.difference_update(self._evictable)
        self._evictable.clear()
        if events is not None and dropped is not None:
            if not self._cached:
                events.cleared()
            else:
                for key in dropped:
                    events.removed(key)
        return n

    # -- event hooks (called only when ``events`` is set) -----------------------------------
    def report_stored(self, seq: _HashedSequence, first: int, end: int) -> None:
        """``seq`` registered its full blocks ``first..end-1``: one ``stored`` for the run (vLLM's
        ``cache_full_blocks``), chained after block ``first - 1``."""
        events = self.events
        if events is None or end <= first:
            return
        bs = self.block_size
        keys = [seq.block_hash(i, bs) for i in range(first, end)]
        parent = seq.block_hash(first - 1, bs) if first else None
        events.stored(keys, parent, seq.tokens(first * bs, end * bs), seq.request.session_id,
                      seq.cache_salt if first == 0 else None)

    def report_hits(self, seq: _HashedSequence, hits: Sequence[int]) -> None:
        """``seq`` was admitted on the prefix hits ``hits`` (block ids, from block 0). A request
        with ``kv_cache_report_mode: "full"`` reports all of them as stored (vLLM's
        ``emit_cached_block_events``); otherwise only blocks a P/D pull put in and nothing hit yet
        are reported, from the first such block on, as the request that loaded them storing them.
        Call before ``take_external``."""
        events = self.events
        if events is None or not hits:
            return
        sp = seq.request.sampling_params
        extra = sp.extra_args if sp is not None else None
        if extra and extra.get(REPORT_MODE_KEY) == REPORT_MODE_FULL:
            self.report_stored(seq, 0, len(hits))
            return
        external = self._external
        if external:
            for i, b in enumerate(hits):
                if b in external:
                    self.report_stored(seq, i, len(hits))
                    return

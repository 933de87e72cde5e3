"""KV blocks held for a remote decode (P/D prefill side): bounded in size, in time and in total.

A prefill-role request finished for remote decode keeps its blocks referenced until a decode
instance pulls them. Unbounded, that lets anyone who can send ``kv_transfer_params`` pin the
whole cache (vLLM's NixlConnector keeps them up to ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s)
and starve every later request. Here a hold is bounded four ways:

- **per request**: a request whose blocks exceed ``max_request_blocks`` is not held at all: its
  blocks are freed at once and it returns no ``kv_transfer_params`` (the router then falls back to
  decode-only, as for any prefill that hands nothing off);
- **in total**: the blocks of all holds stay within ``max_total_blocks``; a new hold that would
  pass it first frees the oldest holds (the likeliest orphans: a pull follows a hand-off within
  milliseconds);
- **under pressure**: a running or waiting request that needs blocks frees the oldest hold before
  anything is preempted or left waiting (``reclaim_oldest``, the scheduler's hook), so holds never
  make a normal request wait;
- **in time**: a hold expires ``timeout_s`` after it began; and it ends early on a pull or on an
  explicit release (the router's "the decode leg will not come").

A decode instance whose blocks were freed early finds nothing to pull (404) and recomputes the
prompt, as vLLM does when remote blocks are gone. Every ending is counted by reason.
"""

from __future__ import annotations

import logging
import time

import msgspec

from backends.engine.kv_cache import KVCacheManager

log = logging.getLogger(__name__)

#: why a hold ended (metric label values)
FREE_REASONS = (
    "pulled",  # a decode instance pulled the blocks
    "released",  # the router said the decode leg will not come (POST /internal/kv/release)
    "expired",  # nobody pulled them within the hold timeout
    "evicted",  # the total bound: freed to make room for a newer hold
    "pressure",  # a running or waiting request needed the blocks
    "replaced",  # a new hold of the same request id
)
#: why a request was not held (metric label values)
REFUSE_REASONS = ("over_request_limit",)


class HeldBlocks(msgspec.Struct):
    """Blocks of a finished prefill-role request, kept for a remote decode instance to pull."""

    request_id: str
    session_id: str | None
    #: the prompt whose KV the blocks hold (the decode side re-keys its full blocks)
    token_ids: list[int]
    #: keys of the prompt's full blocks, in order
    block_hashes: list[bytes]
    block_ids: list[int]
    cache_salt: str | None
    expires_at: float


class HoldTable:
    """The holds of one engine, oldest first (dict order; every hold gets the same timeout, so
    this is also expiry order)."""

    __slots__ = ("kv", "timeout_s", "max_request_blocks", "max_total_blocks", "num_blocks", "freed", "refused",
                 "_held")

    def __init__(self, kv: KVCacheManager, *, timeout_s: float, max_request_blocks: int,
                 max_total_blocks: int) -> None:
        self.kv = kv
        self.timeout_s = timeout_s
        self.max_total_blocks = max(max_total_blocks, 0)
        #: a request's bound never exceeds the total one
        self.max_request_blocks = min(max_request_blocks, self.max_total_blocks)
        #: blocks referenced by holds (a block two holds share counts twice: a conservative bound)
        self.num_blocks = 0
        self.freed = dict.fromkeys(FREE_REASONS, 0)
        self.refused = dict.fromkeys(REFUSE_REASONS, 0)
        self._held: dict[str, HeldBlocks] = {}

    def __len__(self) -> int:
        return len(self._held)

    def get(self, request_id: str) -> HeldBlocks | None:
        return self._held.get(request_id)

    def admit(self, request_id: str, num_blocks: int) -> bool:
        """May a request hold ``num_blocks`` blocks? Frees the oldest holds to make room under the
        total bound; False (nothing freed) when the request alone is over its bound."""
        if request_id in self._held:
            self.release(request_id, "replaced")
        if num_blocks > self.max_request_blocks:
            self.refused["over_request_limit"] += 1
            log.debug("P/D: not holding %s: %d blocks, over the per-request bound of %d", request_id, num_blocks,
                      self.max_request_blocks)
            return False
        while self._held and self.num_blocks + num_blocks > self.max_total_blocks:
            self.release(next(iter(self._held)), "evicted")
        return True

    def add(self, held: HeldBlocks) -> None:
        """Record a hold ``admit`` allowed (its blocks stay referenced until it ends)."""
        self._held[held.request_id] = held
        self.num_blocks += len(held.block_ids)

    def release(self, request_id: str, reason: str) -> bool:
        """End a hold and free its blocks; False if ``request_id`` holds nothing."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self.num_blocks -= len(held.block_ids)
        self.kv.free(held.block_ids)
        self.freed[reason] += 1
        return True

    def reclaim_oldest(self) -> bool:
        """Free the oldest hold because a request needs blocks; False when nothing is held."""
        if not self._held:
            return False
        rid = next(iter(self._held))
        log.info("P/D: freeing the held KV blocks of %s: a running or waiting request needs them", rid)
        return self.release(rid, "pressure")

    def next_expiry(self) -> float | None:
        """Monotonic time at which the oldest hold expires, or None."""
        for held in self._held.values():
            return held.expires_at
        return None

    def expire(self, now: float | None = None) -> int:
        """End holds whose timeout has passed; returns how many."""
        if not self._held:
            return 0
        if now is None:
            now = time.monotonic()
        expired: list[str] = []
        for rid, held in self._held.items():
            if held.expires_at > now:
                break
            expired.append(rid)
        for rid in expired:
            log.warning("P/D: held KV blocks of %s expired before a decode instance pulled them", rid)
            self.release(rid, "expired")
        return len(expired)

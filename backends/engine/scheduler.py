"""Continuous batching over KV blocks (vLLM v1's unified scheduler, simplified).

Each step:

1. Running sequences, in order, get the tokens they still need: 1 for a decoding sequence, the rest
   of the prompt (up to the step's token budget, ``max_num_batched_tokens``) for one in chunked
   prefill. Blocks are allocated as tokens grow. When none are left, the *last* running sequence is
   preempted (recompute, as vLLM does: its blocks are released, it goes back to the head of the
   waiting queue with ``num_computed_tokens = 0`` and keeps its generated tokens).
2. If nothing was preempted, waiting sequences are admitted first come first served while the token
   budget, ``max_num_seqs`` and the free blocks allow. At its first admission a sequence looks its
   full blocks up in the prefix cache: hits are not computed (``num_cached_tokens``; at most
   ``num_tokens - 1`` so that one token is always computed). A sequence that does not fit stays at
   the head (no overtaking).

Full blocks are registered in the prefix cache as soon as the step that computes them is scheduled
(so a sibling admitted in the same step can hit them, as in vLLM).

Blocks held for a remote decode (P/D) are no running sequence's: when a sequence needs blocks
and none are free, the ``reclaim`` hook (the core's hold table) frees the oldest hold first, one at
a time, before anything is preempted or a waiting sequence is left waiting.

The scheduler never sees a sequence that cannot fit alone: the core caps every sequence at
``min(max_model_len, num_blocks * block_size)`` tokens, so a lone sequence always progresses.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from backends.engine.kv_cache import KVCacheManager
from backends.engine.sequence import Sequence, SeqStatus

_monotonic = time.monotonic


class SchedulerOutput:
    """What one step computes."""

    __slots__ = (
        "scheduled",
        "num_prefill_tokens",
        "num_decode_seqs",
        "num_preempted",
        "prefix_queries",
        "prefix_hits",
    )

    def __init__(self) -> None:
        #: (sequence, tokens computed for it this step), in scheduling order
        self.scheduled: list[tuple[Sequence, int]] = []
        #: tokens computed by sequences still in (possibly chunked) prefill or recompute
        self.num_prefill_tokens = 0
        #: sequences computing exactly their last sampled token
        self.num_decode_seqs = 0
        self.num_preempted = 0
        #: prompt tokens looked up / found in the prefix cache by first admissions this step
        self.prefix_queries = 0
        self.prefix_hits = 0

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    __slots__ = (
        "kv",
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "waiting",
        "running",
        "_num_waiting",
        "_num_running",
        "reclaim",
    )

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 reclaim: Callable[[], bool] | None = None) -> None:
        self.kv = kv
        #: frees blocks no running sequence uses (P/D holds); False when there is nothing to free
        self.reclaim = reclaim
        self.block_size = kv.block_size
        self.max_num_seqs = max(1, max_num_seqs)
        self.max_num_batched_tokens = max(1, max_num_batched_tokens)
        self.waiting: deque[Sequence] = deque()
        #: may hold sequences finished since the last step (dropped lazily; counts are exact)
        self.running: list[Sequence] = []
        self._num_waiting = 0
        self._num_running = 0

    # -- queue state -----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return self._num_running

    def has_unfinished(self) -> bool:
        return self._num_waiting > 0 or self._num_running > 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self._num_waiting += 1

    def finish(self, seq: Sequence, *, free_blocks: bool = True) -> list[int]:
        """Take ``seq`` out of the queues (lazily) and release its blocks unless the caller keeps
        them (P/D hold). Returns the blocks it held."""
        if seq.status is SeqStatus.WAITING:
            self._num_waiting -= 1
        elif seq.status is SeqStatus.RUNNING:
            self._num_running -= 1
        seq.status = SeqStatus.FINISHED
        blocks = seq.blocks
        seq.blocks = []
        if free_blocks and blocks:
            self.kv.free(blocks)
        return blocks

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        kv = self.kv
        bs = self.block_size
        budget = self.max_num_batched_tokens
        scheduled = out.scheduled
        running = self.running
        if len(running) != self._num_running:
            running = self.running = [s for s in running if s.status is SeqStatus.RUNNING]

        # 1. running sequences (decode, or the rest of a chunked prefill)
        i = 0
        num_decode = 0
        append = scheduled.append
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            num_new = seq.num_prompt_tokens + len(seq.output_token_ids) - computed
            if num_new > budget:
                num_new = budget
            end = computed + num_new
            need = -(-end // bs) - len(seq.blocks)
            if need > 0:
                preempted_self = False
                reclaim = self.reclaim
                while kv.num_free_blocks < need:
                    if reclaim is not None and reclaim():
                        continue
                    victim = running.pop()
                    self._num_running -= 1
                    self._preempt(victim)
                    out.num_preempted += 1
                    if victim is seq:
                        preempted_self = True
                        break
                if preempted_self:
                    break
                seq.blocks.extend(kv.allocate(need))
            if end // bs > seq.num_keyed_blocks:
                self._key_full_blocks(seq, end)
            append((seq, num_new))
            budget -= num_new
            if num_new == 1 and computed >= seq.num_prompt_tokens:
                num_decode += 1
            else:
                out.num_prefill_tokens += num_new
            i += 1
        out.num_decode_seqs = num_decode

        # 2. admit waiting sequences (not in a step that had to preempt)
        if out.num_preempted == 0:
            waiting = self.waiting
            max_seqs = self.max_num_seqs
            while waiting and budget > 0 and len(running) < max_seqs:
                seq = waiting[0]
                if seq.status is not SeqStatus.WAITING:  # finished (aborted) while waiting
                    waiting.popleft()
                    continue
                # prefix-cache lookup over full blocks, at most num_tokens - 1 tokens
                num_tokens = seq.num_tokens
                hits: list[int] = []
                for j in range((num_tokens - 1) // bs):
                    b = kv.cached_block(seq.block_hash(j, bs))
                    if b is None:
                        break
                    hits.append(b)
                num_hit_tokens = len(hits) * bs
                num_new = num_tokens - num_hit_tokens
                if num_new > budget:
                    num_new = budget
                need = -(-(num_hit_tokens + num_new) // bs) - len(hits)
                reclaimed = sum(1 for b in hits if kv.is_evictable(b))
                if kv.num_free_blocks - reclaimed < need:
                    if self.reclaim is not None and self.reclaim():
                        continue  # look this sequence up again: the freed blocks may be among its hits
                    break
                waiting.popleft()
                self._num_waiting -= 1
                kv.touch(hits)
                if hits and kv.events is not None:  # KV-cache events: a reported prefix hit
                    kv.report_hits(seq, hits)
                seq.blocks = hits
                seq.num_keyed_blocks = len(hits)
                if need > 0:
                    seq.blocks.extend(kv.allocate(need))
                seq.num_computed_tokens = num_hit_tokens
                if seq.num_cached_tokens < 0:
                    seq.scheduled_time = _monotonic()  # vLLM's first SCHEDULED event (request-phase metrics)
                    seq.num_cached_tokens = min(num_hit_tokens, seq.num_prompt_tokens)
                    out.prefix_queries += seq.num_prompt_tokens
                    # blocks a P/D pull just put in are external hits (vllm:external_prefix_cache_*),
                    # not local ones, as vLLM counts them
                    out.prefix_hits += max(seq.num_cached_tokens - kv.take_external(hits) * bs, 0)
                self._key_full_blocks(seq, num_hit_tokens + num_new)
                seq.status = SeqStatus.RUNNING
                running.append(seq)
                self._num_running += 1
                scheduled.append((seq, num_new))
                budget -= num_new
                out.num_prefill_tokens += num_new
        return out

    def _preempt(self, seq: Sequence) -> None:
        blocks = seq.blocks
        seq.blocks = []
        if blocks:
            self.kv.free(blocks)
        seq.num_keyed_blocks = 0
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self._num_waiting += 1

    def _key_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register every full block within the first ``num_tokens`` tokens in the prefix cache."""
        bs = self.block_size
        full = num_tokens // bs
        k = seq.num_keyed_blocks
        if k >= full:
            return
        blocks = seq.blocks
        kv = self.kv
        first = k
        while k < full:
            kv.cache_block(blocks[k], seq.block_hash(k, bs))
            k += 1
        seq.num_keyed_blocks = k
        if kv.events is not None:  # KV-cache events: the run of blocks just stored
            kv.report_stored(seq, first, k)

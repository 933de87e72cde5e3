"""The engine core: requests in as msgpack bytes, one scheduler step at a time, outputs out.

``add_request(bytes)`` decodes the wire ``EngineCoreRequest`` (the contract is exercised on every
request) into an internal ``Request`` with n child ``Sequence``s. A step is split in two so that
the async driver can sleep for the simulated GPU time in between::

    sched = core.schedule()            # batch, allocate blocks, admit, preempt
    ...sleep core.step_seconds(sched)...
    outputs = core.execute(sched)      # sample one token per sequence done computing, finish, account

``core.step()`` does both at once (no sleeping), for synchronous tests.

Outputs: one ``RequestOutput`` per request per step in which one of its children produced a token,
with deltas only for those children; the last has ``finished=True``. A request with
``sampling_params.output_kind == 2`` (vLLM's FINAL_ONLY, what a non-streaming frontend wants) gets a
single output when it finishes, holding every child's full token list.

P/D (vLLM NixlConnector semantics, engine side):

- prefill role: a request whose ``sampling_params.extra_args["kv_transfer_params"]`` has
  ``do_remote_decode`` finishes after one token with "length"; child 0's blocks stay referenced
  (held) until ``release_held(request_id)`` or ``config.kv_hold_timeout_s``; its final output
  carries ``kv_transfer_params`` for the decode instance (``remote_block_ids`` is a flat list).
  ``get_held(request_id)`` gives the side channel the held prompt's token ids and block keys.
  Holds are bounded (``backends/engine/holds.py``): a request over ``kv_hold_max_blocks`` is not
  held (no ``kv_transfer_params`` returned), all holds stay within ``kv_hold_max_fraction`` of the
  cache (oldest freed first), and a request that needs blocks frees the oldest hold before it
  waits or preempts anything.
- decode role: ``preload_blocks(token_ids, cache_salt)`` puts the full blocks of pulled tokens in the
  prefix cache (unreferenced, most recently used); the request added right after hits them, so they
  count as cached and cost no prefill time. Under block pressure they may be evicted before the
  request is admitted; it then recomputes them (as vLLM does when remote blocks are gone).

KV-cache events (``attach_kv_events``; off by default, and then no hook does any work): the KV-cache
manager reports stores, reported hits, evictions and resets to the sink as they happen; ``execute``
flushes them at the start of each step's execution, so one batch holds one step's events (vLLM
publishes at the end of its step, after the forward pass: same grouping, same order).
``reset_prefix_cache`` (vLLM's: refused while any block is referenced) and ``preload_blocks`` (a
P/D pull may evict) happen between steps and flush at once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from backends.engine.accounting import SessionAccounting
from backends.engine.config import EngineConfig
from backends.engine.holds import HeldBlocks, HoldTable
from backends.engine.kv_cache import KVCacheManager, KVEventSink, hash_full_blocks
from backends.engine.latency import LatencyModel
from backends.engine.metrics import EngineMetrics
from backends.engine.outputs import CompletionDelta, RequestOutput
from backends.engine.request import EngineCoreRequest, SamplingParams, decode_request
from backends.engine.scheduler import Scheduler, SchedulerOutput
from backends.engine.sequence import OUTPUT_KIND_FINAL_ONLY, Request, Sequence, SeqStatus

log = logging.getLogger(__name__)

_monotonic = time.monotonic
_RUNNING = SeqStatus.RUNNING
_FINISHED = SeqStatus.FINISHED


class InvalidRequestError(ValueError):
    """A wire request the core refuses (the frontend validates first; this is the last guard)."""


class DuplicateRequestError(InvalidRequestError):
    """A request id that is already in the engine."""


class EngineCore:
    """The scheduler loop's state machine (synchronous; driven by ``AsyncEngine``)."""

    def __init__(self, config: EngineConfig, metrics: EngineMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.kv_cache = KVCacheManager(config.num_blocks, config.block_size)
        total_hold = int(config.kv_hold_max_fraction * config.num_blocks)
        self.holds = HoldTable(self.kv_cache, timeout_s=config.kv_hold_timeout_s,
                               max_request_blocks=config.kv_hold_max_blocks or total_hold,
                               max_total_blocks=total_hold)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   reclaim=self.holds.reclaim_oldest)
        self.sessions = SessionAccounting(config.max_tracked_sessions)
        self.latency = LatencyModel()
        #: the longest a sequence may grow (prompt + output) so that it always fits alone
        self.max_seq_len = min(config.max_model_len, config.num_blocks * config.block_size)
        self.requests: dict[str, Request] = {}
        self.engine_id = config.kv_engine_id or f"{config.model}-engine-{config.engine_index}"
        self._pending: list[RequestOutput] = []
        #: KV-cache event sink (None: events off)
        self._kv_events: KVEventSink | None = None
        metrics.set_max_model_len(config.max_model_len)
        metrics.bind(
            self,
            self.sessions,
            {
                "block_size": str(config.block_size),
                "num_gpu_blocks": str(config.num_blocks),
                "enable_prefix_caching": "True",
                "prefix_caching_hash_algo": "blake2b",
            },
        )

    # -- state -----------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Sequences in the running batch (a child of an n > 1 request counts, as in vLLM)."""
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache.usage

    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished()

    # -- KV-cache events ---------------------------------------------------------------------
    def attach_kv_events(self, sink: KVEventSink | None) -> None:
        """Report prefix-cache changes to ``sink`` from now on (None: stop)."""
        self._kv_events = sink
        self.kv_cache.events = sink

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: drop every cached key, only when no block is referenced
        (running requests or P/D holds: False, nothing changes; the caller may retry)."""
        kv = self.kv_cache
        if kv.num_referenced_blocks:
            return False
        kv.reset_prefix_cache()
        if self._kv_events is not None:
            self._kv_events.flush()
        return True

    # -- requests in -----------------------------------------------------------------------
    def add_request(self, data: bytes) -> None:
        """Add one request from its wire bytes (``encode_request`` output of any compatible peer).

        Raises ``msgspec.ValidationError``/``DecodeError`` for bytes that are not an
        EngineCoreRequest, ``DuplicateRequestError`` for an id already in the engine and
        ``InvalidRequestError`` for ``n > max_num_seqs``.
        """
        self._add(decode_request(data))

    def _add(self, ecr: EngineCoreRequest) -> None:
        rid = ecr.request_id
        if rid in self.requests:
            raise DuplicateRequestError(f"request id {rid!r} is already in the engine; use a unique id")
        config = self.config
        sp = ecr.sampling_params if ecr.sampling_params is not None else SamplingParams()
        prompt = list(ecr.prompt_token_ids or ())
        num_prompt = len(prompt)
        n = sp.n if sp.n >= 1 else 1
        if n > config.max_num_seqs:
            raise InvalidRequestError(f"n must be at most max_num_seqs ({config.max_num_seqs}), got {n}")
        kvp = None
        if sp.extra_args:
            raw = sp.extra_args.get("kv_transfer_params")
            kvp = raw if isinstance(raw, dict) else None
        remote_decode = bool(kvp and kvp.get("do_remote_decode")) and config.role != "decode"
        room = self.max_seq_len - num_prompt
        max_output = room if sp.max_tokens is None else min(max(sp.max_tokens, 1), room)
        max_output = max(max_output, 1)
        stop_ids = frozenset(sp.stop_token_ids) if sp.stop_token_ids else None
        eos = None if sp.ignore_eos else config.eos_token_id
        if remote_decode:  # one token, always "length" (what the NixlConnector hands off on)
            max_output, stop_ids, eos = 1, None, None
        req = Request(
            rid,
            prompt,
            session_id=ecr.session_id,
            n=n,
            max_tokens=max_output,
            min_tokens=max(sp.min_tokens, 0),
            stop_token_ids=stop_ids,
            eos_token_id=eos,
            seed=sp.seed,
            arrival_time=ecr.arrival_time,
            added_at=_monotonic(),
            priority=ecr.priority,
            cache_salt=ecr.cache_salt,
            kv_transfer_params=kvp if remote_decode else None,
            final_only=sp.output_kind == OUTPUT_KIND_FINAL_ONLY,
            sampling_params=sp,
        )
        self.requests[rid] = req
        req.num_unfinished = n
        bs = config.block_size
        if ecr.abort_immediately or num_prompt == 0 or num_prompt > self.max_seq_len:
            # never scheduled: an abort notification (P/D rejection), an empty prompt, or a prompt
            # the frontend should have rejected (longer than the model or the whole KV cache)
            req.accounted = not ecr.abort_immediately
            reason = "length" if num_prompt > config.max_model_len else "abort"
            if num_prompt > self.max_seq_len:
                log.warning("request %s: prompt of %d tokens cannot fit (limit %d)", rid, num_prompt, self.max_seq_len)
            self._pending.append(self._finish_unscheduled(req, reason))
            return
        req.prompt_block_hashes = hash_full_blocks(prompt, bs, ecr.cache_salt) if num_prompt >= bs else []
        add = self.scheduler.add
        for i in range(n):
            seq = self._new_sequence(req, i, max_output)
            req.children.append(seq)
            add(seq)

    def _new_sequence(self, req: Request, index: int, max_output: int) -> Sequence:
        c = self.config
        return Sequence(
            req,
            index,
            max_output=max_output,
            eos_probability=c.eos_probability,
            token_lo=c.gen_token_min,
            token_hi=c.gen_token_max,
            token_pool=c.gen_token_ids,
        )

    def _finish_unscheduled(self, req: Request, reason: str) -> RequestOutput:
        """Finish a request that never reached the scheduler."""
        now = _monotonic()
        for i in range(req.n):
            seq = self._new_sequence(req, i, req.max_tokens)
            seq.status = _FINISHED
            seq.finish_reason = reason
            req.children.append(seq)
            self.metrics.count_finished(reason, now - req.added_at, req.num_prompt_tokens, 0, queued_at=req.added_at,
                                        scheduled_at=0.0, first_token_at=0.0, last_token_at=0.0, finished_at=now)
        req.num_unfinished = 0
        self._finish_request(req)
        deltas = [CompletionDelta(i, [], reason) for i in range(req.n)]
        return RequestOutput(req.request_id, deltas, True, req.num_prompt_tokens, 0)

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Abort a request: free its blocks, count ``finished_reason=reason`` ("abort", or "stop"
        when the frontend matched a stop string, as vLLM's output processor reports it) for each
        unfinished child, account what was generated. Returns its final output (None if
        unknown/finished)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        return self._finish_all(req, reason, _monotonic())

    def abort_all(self) -> list[RequestOutput]:
        now = _monotonic()
        return [self._finish_all(req, "abort", now) for req in list(self.requests.values())]

    def _finish_all(self, req: Request, reason: str, now: float) -> RequestOutput:
        deltas: list[CompletionDelta] = []
        for seq in req.children:
            if seq.status is not _FINISHED:
                self._finish_seq(seq, reason, None, now)
                deltas.append(CompletionDelta(seq.index, [], reason))
        if req.final_only:
            deltas = [
                CompletionDelta(s.index, list(s.output_token_ids), s.finish_reason, s.stop_reason)
                for s in req.children
            ]
        return RequestOutput(req.request_id, deltas, True, req.num_prompt_tokens, req.num_cached_tokens)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def step_seconds(self, sched: SchedulerOutput) -> float:
        """Simulated GPU time of ``sched`` at ``config.speed``."""
        return self.latency.step_seconds(self.config.speed, sched.num_prefill_tokens, sched.num_decode_seqs)

    def step(self) -> list[RequestOutput]:
        """Schedule and execute one step without sleeping."""
        return self.execute(self.schedule())

    def take_pending(self) -> list[RequestOutput]:
        outs = self._pending
        self._pending = []
        return outs

    def execute(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Apply a scheduled step: advance computed tokens, sample, finish, build outputs."""
        if self._kv_events is not None:  # the step's KV-cache events: one batch
            self._kv_events.flush()
        outs = self._pending
        self._pending = []
        m = self.metrics
        if sched.num_preempted:
            m.num_preemptions += sched.num_preempted
        if sched.prefix_queries:
            m.prefix_cache_queries += sched.prefix_queries
            m.prefix_cache_hits += sched.prefix_hits
        if not sched.scheduled:
            return outs
        now = _monotonic()
        ttft = m.ttft
        # inter-token latencies grouped by the previous token's time (usually one value per step)
        itl: dict[float, int] = {}
        generated = 0
        prompt_tokens = 0
        grouped: dict[str, tuple[RequestOutput, Request]] | None = None
        for seq, num_new in sched.scheduled:
            if seq.status is not _RUNNING:  # aborted while the step ran
                continue
            computed = seq.num_computed_tokens + num_new
            seq.num_computed_tokens = computed
            out_ids = seq.output_token_ids
            if computed < seq.num_prompt_tokens + len(out_ids):
                continue  # a prefill chunk; more to come
            tok = seq.sample()
            out_ids.append(tok)
            generated += 1
            req = seq.request
            last = seq.last_token_time
            if last == 0.0:
                ttft.observe(now - req.added_at)
                prompt_tokens += seq.num_prompt_tokens
                seq.first_token_time = now
            else:
                itl[last] = itl.get(last, 0) + 1
            seq.last_token_time = now
            n_out = len(out_ids)
            reason = None
            stop_reason = None
            if n_out > seq.min_tokens and (
                tok == seq.eos_token_id or (seq.stop_token_ids is not None and tok in seq.stop_token_ids)
            ):
                reason = "stop"
                if tok != seq.eos_token_id:
                    stop_reason = tok
            elif n_out >= seq.max_output:
                reason = "length"
            if reason is not None:
                self._finish_seq(seq, reason, stop_reason, now)
            if req.final_only:
                if reason is not None and req.num_unfinished == 0:
                    outs.append(self._final_output(req))
                continue
            delta = CompletionDelta(seq.index, [tok], reason, stop_reason)
            if req.n == 1:
                outs.append(
                    RequestOutput(
                        req.request_id,
                        [delta],
                        reason is not None,
                        seq.num_prompt_tokens,
                        seq.num_cached_tokens,
                        req.kv_transfer_params if reason is not None else None,
                    )
                )
                continue
            if grouped is None:
                grouped = {}
            entry = grouped.get(req.request_id)
            if entry is None:
                ro = RequestOutput(req.request_id, [delta], False, req.num_prompt_tokens, req.num_cached_tokens)
                grouped[req.request_id] = (ro, req)
                outs.append(ro)
            else:
                entry[0].deltas.append(delta)
        if grouped:
            for ro, req in grouped.values():
                if req.num_unfinished == 0:
                    ro.finished = True
                    ro.kv_transfer_params = req.kv_transfer_params
        m.generation_tokens += generated
        m.prompt_tokens += prompt_tokens
        if itl:
            observe = m.itl.observe
            for last, count in itl.items():
                observe(now - last, count)
        return outs

    def _final_output(self, req: Request) -> RequestOutput:
        return RequestOutput(
            req.request_id,
            [
                CompletionDelta(s.index, list(s.output_token_ids), s.finish_reason, s.stop_reason)
                for s in req.children
            ],
            True,
            req.num_prompt_tokens,
            req.num_cached_tokens,
            req.kv_transfer_params,
        )

    def _finish_seq(self, seq: Sequence, reason: str, stop_reason: int | None, now: float) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        req = seq.request
        hold = req.kv_transfer_params is not None and seq.index == 0 and reason != "abort"
        blocks = self.scheduler.finish(seq, free_blocks=not hold)
        self.metrics.count_finished(
            reason, now - req.added_at, seq.num_prompt_tokens, len(seq.output_token_ids), queued_at=req.added_at,
            scheduled_at=seq.scheduled_time, first_token_at=seq.first_token_time,
            last_token_at=seq.last_token_time, finished_at=now,
        )
        req.num_unfinished -= 1
        if hold:
            self._hold(req, seq, blocks, now)
        if req.num_unfinished == 0:
            self._finish_request(req)

    def _finish_request(self, req: Request) -> None:
        del self.requests[req.request_id]
        if req.session_id is not None and req.accounted:
            self.sessions.record(
                req.session_id, req.num_prompt_tokens, req.num_cached_tokens, req.num_generated_tokens
            )

    # -- P/D -------------------------------------------------------------------------------
    def _hold(self, req: Request, seq: Sequence, blocks: list[int], now: float) -> None:
        rid = req.request_id
        if not self.holds.admit(rid, len(blocks)):
            # over the per-request bound: not held, no kv_transfer_params (the router falls back)
            self.kv_cache.free(blocks)
            req.kv_transfer_params = None
            return
        bs = self.config.block_size
        full = seq.num_prompt_tokens // bs
        self.holds.add(HeldBlocks(
            request_id=rid,
            session_id=req.session_id,
            token_ids=req.prompt_token_ids,
            block_hashes=[seq.block_hash(i, bs) for i in range(full)],
            block_ids=list(blocks),
            cache_salt=req.cache_salt,
            expires_at=now + self.config.kv_hold_timeout_s,
        ))
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_block_ids": list(blocks),
            "remote_host": self.config.kv_host,
            "remote_port": self.config.kv_port,
            "tp_size": 1,
        }
        req.kv_transfer_params = params

    def get_held(self, request_id: str) -> HeldBlocks | None:
        """The held blocks of a finished prefill-role request (None if released or expired)."""
        return self.holds.get(request_id)

    def release_held(self, request_id: str, reason: str = "pulled") -> bool:
        """Free a held request's blocks (pulled, or released: the decode will not come). False if
        not held."""
        return self.holds.release(request_id, reason)

    @property
    def num_held(self) -> int:
        return len(self.holds)

    @property
    def num_held_blocks(self) -> int:
        return self.holds.num_blocks

    def next_hold_expiry(self) -> float | None:
        """Monotonic time at which the oldest held blocks expire, or None."""
        return self.holds.next_expiry()

    def expire_held(self, now: float | None = None) -> int:
        """Free held blocks whose timeout has passed; returns how many requests were freed."""
        return self.holds.expire(now)

    def preload_blocks(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Insert the full blocks of ``token_ids`` (computed remotely) into the prefix cache.

        Returns the number of leading tokens now held in the cache (a multiple of the block size).
        """
        bs = self.config.block_size
        keys = hash_full_blocks(token_ids, bs, cache_salt)
        present = self.kv_cache.insert_cached(keys) * bs
        if self._kv_events is not None:  # blocks it evicted to make room: published at once
            self._kv_events.flush()
        return present

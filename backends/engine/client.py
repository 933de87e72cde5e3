"""``AsyncEngine``: the asyncio driver of the engine core, and what the HTTP frontend calls.

One task runs the step loop: schedule, sleep for the simulated GPU time (``config.speed`` times the
latency model; at speed 0 it only yields to the event loop once), execute, hand each output to the
request's stream. With nothing to do it waits on an ``asyncio.Event`` (no polling), waking up only
for new work, an abort, or the expiry of held P/D blocks.

``generate(request)`` encodes the ``EngineCoreRequest`` to msgpack bytes and adds those bytes to the
core, as vLLM's core client does over ZMQ. If the consumer stops early (``aclose()``, a cancelled
task, a client gone) the request is aborted in the core at once. When a consumer falls behind, the
outputs waiting for it are merged into one (token deltas concatenated), so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable

from prometheus_client import CollectorRegistry

from backends.engine.accounting import SessionAccounting
from backends.engine.config import EngineConfig
from backends.engine.core import EngineCore, HeldBlocks
from backends.engine.errors import DuplicateRequestIdError, EngineDeadError
from backends.engine.metrics import EngineMetrics
from backends.engine.outputs import RequestOutput
from backends.engine.request import EngineCoreRequest, encode_request

log = logging.getLogger(__name__)


def merge_outputs(into: RequestOutput, new: RequestOutput) -> None:
    """Fold ``new`` (a later step of the same request) into ``into``."""
    for delta in new.deltas:
        for old in into.deltas:
            if old.index == delta.index:
                old.token_ids.extend(delta.token_ids)
                old.finish_reason = delta.finish_reason
                old.stop_reason = delta.stop_reason
                break
        else:
            into.deltas.append(delta)
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    if new.kv_transfer_params is not None:
        into.kv_transfer_params = new.kv_transfer_params


class _Stream:
    __slots__ = ("pending", "waiter", "error")

    def __init__(self) -> None:
        self.pending: RequestOutput | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None

    def put(self, out: RequestOutput) -> None:
        if self.pending is None:
            self.pending = out
        else:
            merge_outputs(self.pending, out)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class AsyncEngine:
    """The engine core plus its step loop; one per backend process (or per test)."""

    def __init__(self, config: EngineConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.metrics = EngineMetrics(registry, config.model, config.engine_index, config.session_metrics_top_k)
        self.core = EngineCore(config, self.metrics)
        self._streams: dict[str, _Stream] = {}
        #: external request id (what clients abort by) -> the engine ids in flight that carry it
        self._external: dict[str, set[str]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._dead: BaseException | None = None

    # -- state -----------------------------------------------------------------------------
    @property
    def sessions(self) -> SessionAccounting:
        return self.core.sessions

    @property
    def num_running(self) -> int:
        return self.core.num_running

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self._dead is None

    @property
    def errored(self) -> BaseException | None:
        """The exception that killed the step loop, if it died."""
        return self._dead

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        self._dead = None
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-step-loop")

    async def stop(self) -> None:
        task = self._task
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception:  # pragma: no cover - already logged by the loop
            pass
        self._task = None
        self._dead = self._dead or EngineDeadError("the engine is stopped")
        self._deliver(self.core.abort_all())
        for stream in self._streams.values():
            stream.fail(self._dead)

    # -- requests --------------------------------------------------------------------------
    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[RequestOutput]:
        """Run ``request`` in the engine; yield its outputs until one has ``finished=True``."""
        if self._dead is not None or self._task is None:
            raise self._dead or EngineDeadError("the engine is not started")
        rid = request.request_id
        if rid in self._streams:
            raise DuplicateRequestIdError(
                f"request id {rid!r} is already in flight; send a unique X-Request-Id", param="request_id"
            )
        data = encode_request(request)
        stream = _Stream()
        self._streams[rid] = stream
        external = request.external_req_id
        if external is not None:
            self._external.setdefault(external, set()).add(rid)
        finished = False
        added = False
        try:
            self.core.add_request(data)
            added = True
            self._wake.set()
            loop = asyncio.get_running_loop()
            while True:
                out = stream.pending
                if out is None:
                    if stream.error is not None:
                        raise stream.error
                    stream.waiter = loop.create_future()
                    try:
                        await stream.waiter
                    finally:
                        stream.waiter = None
                    continue
                stream.pending = None
                if out.finished:
                    finished = True
                    yield out
                    return
                yield out
        finally:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
            if external is not None:
                ids = self._external.get(external)
                if ids is not None:
                    ids.discard(rid)
                    if not ids:
                        del self._external[external]
            if added and not finished and self.core.abort_request(rid) is not None:
                self._wake.set()

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Abort a request; its consumer (if any) receives a final output with ``reason``.
        False when the engine does not hold ``request_id`` (finished or unknown)."""
        out = self.core.abort_request(request_id, reason)
        if out is None:
            return False
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(out)
        self._wake.set()
        return True

    def abort_external(self, external_ids: Iterable[str]) -> int:
        """Abort every request in flight whose external id (vLLM's: the id the API server gave it,
        e.g. ``generate-tokens-<X-Request-Id>``) is in ``external_ids``; unknown ids are ignored.
        Returns how many engine requests were aborted."""
        aborted = 0
        for external in external_ids:
            for rid in tuple(self._external.get(external, ())):
                if self.abort(rid):
                    aborted += 1
        return aborted

    # -- P/D pass-throughs ------------------------------------------------------------------
    def get_held(self, request_id: str) -> HeldBlocks | None:
        return self.core.get_held(request_id)

    def release_held(self, request_id: str, reason: str = "pulled") -> bool:
        released = self.core.release_held(request_id, reason)
        if released:
            self._wake.set()
        return released

    def preload_blocks(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        return self.core.preload_blocks(token_ids, cache_salt)

    # -- the loop --------------------------------------------------------------------------
    def _deliver(self, outs: list[RequestOutput]) -> None:
        streams = self._streams
        for out in outs:
            stream = streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    async def _run(self) -> None:
        core = self.core
        wake = self._wake
        monotonic = time.monotonic
        sleep = asyncio.sleep
        try:
            while True:
                if core.num_held:
                    core.expire_held()
                sched = core.schedule()
                if not sched:
                    outs = core.execute(sched)  # counters of a step that only preempted, pending outputs
                    if outs or sched.num_preempted:
                        self._deliver(outs)
                        continue
                    wake.clear()
                    expiry = core.next_hold_expiry()
                    if expiry is None:
                        await wake.wait()
                    else:
                        try:
                            await asyncio.wait_for(wake.wait(), max(expiry - monotonic(), 0.0) + 0.001)
                        except TimeoutError:
                            pass
                    continue
                started = monotonic()
                delay = core.step_seconds(sched)
                if delay > 0.0:
                    await sleep(max(delay - (monotonic() - started), 0.0))
                else:
                    await sleep(0)
                self._deliver(core.execute(sched))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("engine step loop failed; failing every in-flight request")
            self._dead = EngineDeadError(f"the engine failed: {exc!r}")
            for stream in self._streams.values():
                stream.fail(self._dead)
            raise

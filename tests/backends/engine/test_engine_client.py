"""``AsyncEngine``: the step loop, early stops and aborts, output merging, the latency model, P/D wake-ups."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from backends.engine.client import AsyncEngine
from backends.engine.config import EngineConfig
from backends.engine.errors import DuplicateRequestIdError, EngineDeadError
from backends.engine.outputs import RequestOutput
from backends.engine.request import EngineCoreRequest, SamplingParams
from backends.http_errors import http_error
from contract.errors import BadRequestError
from tests.support import eventually


def request(rid: str, prompt: list[int], session: str | None = None, **sp: Any) -> EngineCoreRequest:
    params = SamplingParams(**{"max_tokens": 4, **sp})
    return EngineCoreRequest(rid, prompt, None, params, None, time.time(), None, None, None, session_id=session)


wait_for = functools.partial(eventually, timeout=5.0, interval=0.001)


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(speed=0.0, eos_probability=0.0), CollectorRegistry())
    await eng.start()
    yield eng
    await eng.stop()


async def collect(gen: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in gen]


async def test_generate_yields_each_step_and_finishes(engine: AsyncEngine) -> None:
    outs = await collect(engine.generate(request("r", list(range(20)), "s", n=2, max_tokens=5)))
    assert [o.finished for o in outs] == [False] * 4 + [True]
    assert all(len(o.deltas) == 2 for o in outs)
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.sessions.get("s") is not None and engine.sessions is engine.core.sessions


async def test_many_concurrent_requests(engine: AsyncEngine) -> None:
    async def one(i: int) -> int:
        outs = await collect(engine.generate(request(f"r{i}", [1, 2, i], f"s{i % 7}", max_tokens=6)))
        return sum(len(d.token_ids) for o in outs for d in o.deltas)

    totals = await asyncio.gather(*(one(i) for i in range(300)))
    assert totals == [6] * 300
    assert sum(s.requests for _, s in engine.sessions.recent(100)) == 300


async def test_aclose_aborts_in_the_core_at_once(engine: AsyncEngine) -> None:
    gen = engine.generate(request("r", list(range(40)), "s", max_tokens=10_000, ignore_eos=True))
    first = await gen.__anext__()
    assert not first.finished and engine.num_running == 1
    await gen.aclose()
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.metrics.request_success["abort"] == 1
    assert engine.core.kv_cache.usage == 0.0
    stats = engine.sessions.get("s")
    assert stats is not None and stats.requests == 1 and stats.generated_tokens >= 1


async def test_a_cancelled_consumer_aborts(engine: AsyncEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(request("r", [1, 2, 3], max_tokens=10_000)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.num_running == 0
    assert engine.metrics.request_success["abort"] == 1
    assert "r" not in engine.core.requests


async def test_abort_sends_a_final_abort_output_to_the_consumer(engine: AsyncEngine) -> None:
    gen = engine.generate(request("r", [1, 2, 3], max_tokens=10_000))
    await gen.__anext__()
    engine.abort("r")
    rest = await collect(gen)
    assert rest[-1].finished and rest[-1].deltas[-1].finish_reason == "abort"
    engine.abort("r")  # unknown now: no-op
    assert engine.metrics.request_success["abort"] == 1


async def test_a_slow_consumer_gets_merged_outputs(engine: AsyncEngine) -> None:
    gen = engine.generate(request("r", [1, 2, 3], n=2, max_tokens=50))
    first = await gen.__anext__()
    await wait_for(lambda: "r" not in engine.core.requests)  # the engine ran to the end meanwhile
    rest = await collect(gen)
    assert len(rest) == 1 and rest[0].finished
    assert [len(d.token_ids) for d in rest[0].deltas] == [49, 49]
    assert [d.finish_reason for d in rest[0].deltas] == ["length", "length"]
    assert len(first.deltas) == 2


async def test_duplicate_in_flight_id_is_a_400(engine: AsyncEngine) -> None:
    gen = engine.generate(request("dup", [1, 2, 3], max_tokens=10_000))
    await gen.__anext__()
    with pytest.raises(DuplicateRequestIdError) as info:
        await engine.generate(request("dup", [4, 5, 6])).__anext__()
    answer = http_error(info.value)  # the engine's plain exception, as the backend's HTTP layer answers it
    assert isinstance(answer, BadRequestError) and answer.status == 400
    # the refused duplicate did not disturb the running request
    assert "dup" in engine.core.requests
    await gen.aclose()


async def test_bad_bytes_propagate_and_leave_nothing_behind(engine: AsyncEngine) -> None:
    bad = request("bad", [1, 2, 3])
    bad.sampling_params = "not sampling params"  # type: ignore[assignment]
    with pytest.raises(Exception):
        await engine.generate(bad).__anext__()
    assert engine.core.requests == {} and engine._streams == {}
    # and the engine still serves
    assert (await collect(engine.generate(request("ok", [1]))))[-1].finished


async def test_stop_finishes_consumers_and_refuses_new_work() -> None:
    eng = AsyncEngine(EngineConfig(speed=0.0), CollectorRegistry())
    await eng.start()
    gen = eng.generate(request("r", [1, 2, 3], max_tokens=10_000))
    await gen.__anext__()
    await eng.stop()
    rest = await collect(gen)
    assert rest[-1].finished and rest[-1].deltas[0].finish_reason == "abort"
    assert eng.num_running == 0 and not eng.is_running
    with pytest.raises(EngineDeadError):
        await eng.generate(request("x", [1])).__anext__()


async def test_idle_loop_waits_without_polling(engine: AsyncEngine) -> None:
    calls = 0
    schedule = engine.core.schedule

    def counting_schedule() -> Any:
        nonlocal calls
        calls += 1
        return schedule()

    engine.core.schedule = counting_schedule  # type: ignore[method-assign]
    await collect(engine.generate(request("r", [1, 2, 3], max_tokens=3)))
    busy = calls
    assert busy >= 3
    await asyncio.sleep(0.05)  # an idle period: a polling loop would schedule thousands of times
    assert calls <= busy + 1
    await collect(engine.generate(request("r2", [1, 2, 3], max_tokens=3)))
    assert calls > busy + 1


async def test_speed_one_latency_model() -> None:
    """At speed 1 a decode step takes >= 10 ms; prefill adds 0.25 ms per computed token."""
    eng = AsyncEngine(EngineConfig(speed=1.0, eos_probability=0.0), CollectorRegistry())
    await eng.start()
    try:
        t0 = time.monotonic()
        outs = await collect(eng.generate(request("r", list(range(400)), max_tokens=4)))
        elapsed = time.monotonic() - t0
        # step 1: prefill of 400 tokens (10 + 100 ms), then 3 decode steps of >= 10 ms
        assert elapsed >= 0.010 + 0.100 + 3 * 0.010 - 0.002
        assert elapsed < 2.0
        assert len(outs) == 4
        ttft = eng.metrics.ttft
        assert ttft.count == 1 and ttft.sum >= 0.108
        # a second request hits the prefix: its prefill costs 16 tokens, not 400
        t1 = time.monotonic()
        gen = eng.generate(request("r2", list(range(400)), max_tokens=2))
        first = await gen.__anext__()
        assert time.monotonic() - t1 < 0.100
        assert first.num_cached_tokens == 384
        await gen.aclose()
    finally:
        await eng.stop()


async def test_speed_zero_is_fast() -> None:
    eng = AsyncEngine(EngineConfig(speed=0.0, eos_probability=0.0), CollectorRegistry())
    await eng.start()
    try:
        t0 = time.monotonic()
        outs = await collect(eng.generate(request("r", [1, 2, 3], max_tokens=2000, output_kind=2)))
        assert len(outs[0].deltas[0].token_ids) == 2000
        assert time.monotonic() - t0 < 2.0
    finally:
        await eng.stop()


async def test_a_hold_never_makes_the_next_request_wait() -> None:
    """P/D (issue 11): a held prefill fills the whole cache (the total bound allows it here); the next
    request frees the hold to get its blocks instead of waiting for the hold timeout."""
    config = EngineConfig(speed=0.0, role="prefill", block_size=4, num_blocks=4, max_model_len=16,
                          kv_hold_max_fraction=1.0)
    eng = AsyncEngine(config, CollectorRegistry())
    await eng.start()
    try:
        remote = {"kv_transfer_params": {"do_remote_decode": True}}
        outs = await collect(eng.generate(request("p", list(range(15)), extra_args=remote)))
        assert outs[-1].kv_transfer_params is not None and eng.core.kv_cache.usage == 1.0
        rest = await asyncio.wait_for(collect(eng.generate(request("next", list(range(100, 112)), max_tokens=2))), 5)
        assert rest[-1].finished and rest[-1].deltas[0].finish_reason == "length"
        assert eng.core.num_held == 0 and eng.core.holds.freed["pressure"] == 1
        assert not eng.release_held("p")  # already freed
    finally:
        await eng.stop()


async def test_hold_timeout_frees_blocks_without_any_other_event() -> None:
    config = EngineConfig(
        speed=0.0, role="prefill", block_size=4, num_blocks=4, max_model_len=16, kv_hold_timeout_s=0.05,
        kv_hold_max_fraction=1.0,
    )
    eng = AsyncEngine(config, CollectorRegistry())
    await eng.start()
    try:
        remote = {"kv_transfer_params": {"do_remote_decode": True}}
        await collect(eng.generate(request("p", list(range(15)), extra_args=remote)))
        assert eng.core.num_held == 1
        await wait_for(lambda: eng.core.num_held == 0, timeout=5)
        assert eng.core.kv_cache.usage == 0.0
    finally:
        await eng.stop()


async def test_a_failing_step_kills_the_engine_visibly(engine: AsyncEngine) -> None:
    def boom() -> Any:
        raise RuntimeError("simulated engine bug")

    gen = engine.generate(request("r", [1, 2, 3], max_tokens=10_000))
    await gen.__anext__()
    engine.core.schedule = boom  # type: ignore[method-assign]
    with pytest.raises(EngineDeadError, match="simulated engine bug"):
        await collect(gen)
    assert engine.errored is not None and not engine.is_running
    with pytest.raises(EngineDeadError):
        await engine.generate(request("x", [1])).__anext__()

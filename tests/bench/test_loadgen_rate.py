"""bench.loadgen's open loop (``rate``): requests start on a schedule, not as answers come back, and a
schedule the server cannot keep up with shows as late requests (a real server on 127.0.0.1)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from bench.loadgen import LoadSpec, run_load

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"


class _Server(asyncio.Protocol):
    """Answers each request (one per write, as the load generator sends them) after ``delay`` s."""

    def __init__(self, delay: float, seen: list[int]) -> None:
        self.delay = delay
        self.seen = seen

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.seen.append(1)
        if self.delay:
            asyncio.get_running_loop().call_later(self.delay, self.transport.write, ANSWER)  # type: ignore[attr-defined]
        else:
            self.transport.write(ANSWER)  # type: ignore[attr-defined]


async def _serve(delay: float, seen: list[int]) -> tuple[asyncio.Server, str]:
    server = await asyncio.get_running_loop().create_server(lambda: _Server(delay, seen), "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def quick_server() -> AsyncIterator[tuple[str, list[int]]]:
    seen: list[int] = []
    server, url = await _serve(0.0, seen)
    yield url, seen
    server.close()


def _spec(url: str, **kw: object) -> LoadSpec:
    return LoadSpec(urls=[url], concurrency=4, seconds=0.5, warmup_s=0.1, sessions=4, drain_s=2.0, **kw)  # type: ignore[arg-type]


async def test_open_loop_sends_on_schedule_not_as_fast_as_answers_come(quick_server: tuple[str, list[int]]) -> None:
    url, seen = quick_server
    result = await run_load(_spec(url, rate=40.0))
    # 40/s for 0.6 s is 24 requests due; an instant server answers thousands a second closed loop
    assert result.errors == 0 and result.late == 0
    assert 5 <= len(seen) <= 26, len(seen)
    assert 5 <= result.requests <= 21, result.requests  # the 0.5 s window: ~20
    seen.clear()
    closed = await run_load(_spec(url))
    assert closed.requests > 3 * 21 and closed.late == 0  # closed loop, as before


async def test_a_rate_the_connections_cannot_carry_counts_late_requests() -> None:
    seen: list[int] = []
    server, url = await _serve(0.05, seen)  # 50 ms per answer, 1 connection: at most ~20/s
    try:
        result = await run_load(LoadSpec(urls=[url], concurrency=1, seconds=0.5, warmup_s=0.1, sessions=1,
                                         drain_s=2.0, rate=100.0))
    finally:
        server.close()
    assert result.errors == 0
    assert result.late > 10 and result.requests <= 12, (result.late, result.requests)


async def test_a_negative_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="rate"):
        await run_load(LoadSpec(urls=["http://127.0.0.9:9"], rate=-1.0))

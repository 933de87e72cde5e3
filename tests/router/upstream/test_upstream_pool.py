"""UpstreamPool against a real aiohttp server on 127.0.0.1: JSON, SSE, reuse, concurrency,
back-pressure, client disconnect, idle expiry. Every scenario also runs once under uvloop."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.upstream import UpstreamLimits, UpstreamPool, UpstreamTimeouts, build_request_head
from tests.support import eventually

TIMEOUTS = UpstreamTimeouts(connect_s=2.0, first_byte_s=5.0, total_s=10.0)
LIMITS = UpstreamLimits(sweep_interval_s=0.02)


@dataclass
class ServerState:
    peers: set[tuple[str, int]] = field(default_factory=set)
    arrived: int = 0
    barrier_n: int = 0
    barrier: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    big_sent: int = 0


STATE = web.AppKey("state", ServerState)
PATTERN = bytes(range(256)) * 256  # 64 KiB


@web.middleware
async def _count_peers(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    assert request.transport is not None
    request.app[STATE].peers.add(request.transport.get_extra_info("peername"))
    return await handler(request)


async def _echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response(
        {
            "method": request.method,
            "path": request.path_qs,
            "headers": [[k, v] for k, v in request.headers.items()],
            "body": body.decode(),
        },
        headers={"X-Request-Id": request.headers.get("X-Request-Id", ""), "X-Private": "1", "Connection": "X-Private"},
    )


async def _sse(request: web.Request) -> web.StreamResponse:
    n = int(request.query.get("n", "5"))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for i in range(n):
        await resp.write(f"data: {{\"i\": {i}}}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _big(request: web.Request) -> web.StreamResponse:
    total = int(request.query["bytes"])
    state = request.app[STATE]
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    sent = 0
    while sent < total:
        piece = PATTERN[: min(len(PATTERN), total - sent)]
        await resp.write(piece)  # waits for the socket to drain: blocks while the client pauses
        sent += len(piece)
        state.big_sent = sent
    await resp.write_eof()
    return resp


async def _empty(request: web.Request) -> web.Response:
    return web.Response(body=b"", status=200)


async def _barrier(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.arrived += 1
    if state.arrived >= state.barrier_n:
        state.barrier.set()
    await asyncio.wait_for(state.barrier.wait(), 5.0)
    return web.Response(text="ok")


async def _endless(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    try:
        for _ in range(5000):  # bounded: 5000 * 2 ms
            await resp.write(b"data: tick\n\n")
            await asyncio.sleep(0.002)
    except (ConnectionResetError, asyncio.CancelledError):
        state.disconnected.set()
        raise
    return resp


def _app() -> web.Application:
    app = web.Application(middlewares=[_count_peers])
    app[STATE] = ServerState()
    app.router.add_post("/echo", _echo)
    app.router.add_post("/sse", _sse)
    app.router.add_get("/big", _big)
    app.router.add_get("/empty", _empty)
    app.router.add_get("/barrier", _barrier)
    app.router.add_get("/endless", _endless)
    return app


@asynccontextmanager
async def _server_and_pool(limits: UpstreamLimits = LIMITS, drop_headers: tuple[str, ...] = ()
                           ) -> AsyncIterator[tuple[TestServer, ServerState, UpstreamPool]]:
    app = _app()
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    pool = UpstreamPool(TIMEOUTS, limits, drop_headers=drop_headers)
    try:
        yield server, app[STATE], pool
    finally:
        await pool.close()
        await server.close()


def _head(method: str, path: str, server: TestServer, body: bytes = b"", headers: list[tuple[str, str]] | None = None) -> bytes:
    return build_request_head(method, path, f"127.0.0.1:{server.port}", headers or [], len(body))


_until = functools.partial(eventually, timeout=5.0, interval=0.005)


# ---------------------------------------------------------------------- scenarios
async def scenario_json_round_trip() -> None:
    async with _server_and_pool() as (server, _, pool):
        body = b'{"prompt": "hello", "session_id": "s1"}'
        head = _head(
            "POST",
            "/echo?q=1",
            server,
            body,
            [("Content-Type", "application/json"), ("X-Request-Id", "r-1"), ("Connection", "close"), ("TE", "gzip")],
        )
        resp = await pool.request("127.0.0.1", server.port, head, body)
        assert resp.status == 200
        assert resp.content_type.startswith("application/json")
        assert resp.content_length is not None and not resp.chunked
        names = [k.lower() for k, _ in resp.headers]
        assert "x-request-id" in names and "connection" not in names and "x-private" not in names
        assert "content-length" not in names and "transfer-encoding" not in names
        assert resp.header("x-request-id") == "r-1"
        data = json.loads(await resp.read())
        assert data["method"] == "POST" and data["path"] == "/echo?q=1" and data["body"] == body.decode()
        sent = {k.lower(): v for k, v in data["headers"]}
        assert sent["host"] == f"127.0.0.1:{server.port}"
        assert sent["content-length"] == str(len(body))
        assert sent["x-request-id"] == "r-1"
        assert "te" not in sent and "connection" not in sent
        # "Connection: close" from the client is hop-by-hop: the upstream connection stays pooled
        assert pool.stats()[f"127.0.0.1:{server.port}"] == {"open": 1, "idle": 1, "busy": 0}


async def scenario_drop_headers_are_left_out_as_the_head_is_parsed() -> None:
    async with _server_and_pool(drop_headers=("DATE", "server", "X-Request-Id", "Content-Type")) as (server, _, pool):
        body = b'{"n": 1}'
        head = _head("POST", "/echo", server, body, [("X-Request-Id", "r-2")])
        resp = await pool.request("127.0.0.1", server.port, head, body)
        names = [k.lower() for k, _ in resp.headers]
        assert names == []  # the rest of its head is hop-by-hop (Connection, the header it names) or framing
        assert resp.content_type.startswith("application/json")  # read even though it is left out
        assert resp.header("x-request-id") is None and "x-private" not in names  # Connection-named: hop-by-hop
        assert json.loads(await resp.read())["body"] == body.decode()
        assert pool.drop_headers == frozenset({"date", "server", "x-request-id", "content-type"})
    async with _server_and_pool() as (server, _, pool):  # none dropped besides hop-by-hop ones
        resp = await pool.request("127.0.0.1", server.port, _head("POST", "/echo", server, b"{}"), b"{}")
        names = {k.lower() for k, _ in resp.headers}
        assert {"date", "server", "x-request-id", "content-type"} <= names
        await resp.read()


async def scenario_sse_stream_then_reuse() -> None:
    async with _server_and_pool() as (server, state, pool):
        for _ in range(3):
            resp = await pool.request("127.0.0.1", server.port, _head("POST", "/sse?n=50", server, b"{}"), b"{}")
            assert resp.status == 200 and resp.chunked and resp.content_type == "text/event-stream"
            received = b"".join([chunk async for chunk in resp])
            expected = b"".join(f"data: {{\"i\": {i}}}\n\n".encode() for i in range(50)) + b"data: [DONE]\n\n"
            assert received == expected
        assert len(state.peers) == 1
        assert pool.connects == 1


async def scenario_sequential_requests_reuse_one_connection() -> None:
    async with _server_and_pool() as (server, state, pool):
        for i in range(200):
            body = f'{{"n": {i}}}'.encode()
            resp = await pool.request("127.0.0.1", server.port, _head("POST", "/echo", server, body), body)
            assert json.loads(await resp.read())["body"] == body.decode()
            resp = await pool.request("127.0.0.1", server.port, _head("GET", "/empty", server), b"")
            assert resp.status == 200 and resp.content_length == 0
            assert await resp.read() == b""
        assert len(state.peers) == 1
        assert pool.connects == 1
        assert pool.stats()[f"127.0.0.1:{server.port}"]["open"] == 1


async def scenario_concurrency_opens_connections_and_keeps_max_idle() -> None:
    n = 20
    async with _server_and_pool(UpstreamLimits(max_idle_per_host=5, sweep_interval_s=0.02)) as (server, state, pool):
        state.barrier_n = n

        async def one() -> bytes:
            resp = await pool.request("127.0.0.1", server.port, _head("GET", "/barrier", server), b"")
            return await resp.read()

        # every handler waits until all n requests are inside the server at once: with one request
        # per connection (no pipelining) that needs n connections
        results = await asyncio.gather(*(one() for _ in range(n)))
        assert results == [b"ok"] * n
        assert len(state.peers) == n and pool.connects == n
        await _until(lambda: pool.stats()[f"127.0.0.1:{server.port}"]["open"] == 5)
        assert pool.stats()[f"127.0.0.1:{server.port}"] == {"open": 5, "idle": 5, "busy": 0}
        # the kept connections serve the next requests
        state.barrier_n = 0
        for _ in range(5):
            assert await one() == b"ok"
        assert pool.connects == n


async def scenario_backpressure_bounds_buffer() -> None:
    total = 24 * 1024 * 1024
    limits = UpstreamLimits(read_high_water=128 * 1024, read_low_water=32 * 1024, sweep_interval_s=0.02)
    async with _server_and_pool(limits) as (server, state, pool):
        resp = await pool.request("127.0.0.1", server.port, _head("GET", f"/big?bytes={total}", server), b"")
        digest = hashlib.sha256()
        received = 0
        pauses = 0
        max_chunk = 0
        async for chunk in resp:
            digest.update(chunk)
            received += len(chunk)
            max_chunk = max(max_chunk, len(chunk))
            if received < total // 2 and pauses < 3:
                # a slow consumer: wait until the pool has stopped reading the socket
                await _until(lambda: resp.reading_paused or resp.complete)
                assert resp.reading_paused
                pauses += 1
                buffered = resp.buffered
                # bounded: high water plus at most one socket read
                assert limits.read_high_water < buffered <= limits.read_high_water + 512 * 1024
                # and the server is held back (its writes wait for the socket), not done
                assert state.big_sent < total
        assert pauses == 3
        assert received == total
        expected = hashlib.sha256()
        for _ in range(total // len(PATTERN)):
            expected.update(PATTERN)
        assert digest.hexdigest() == expected.hexdigest()
        assert max_chunk <= limits.read_high_water + 512 * 1024
        # reused afterwards (the connection was resumed before going back to the pool)
        resp = await pool.request("127.0.0.1", server.port, _head("GET", "/empty", server), b"")
        assert await resp.read() == b""
        assert pool.connects == 1


async def scenario_client_close_mid_stream_closes_upstream() -> None:
    async with _server_and_pool() as (server, state, pool):
        resp = await pool.request("127.0.0.1", server.port, _head("GET", "/endless", server), b"")
        first = await resp.iter_chunks().__anext__()
        assert first.startswith(b"data: tick")
        resp.close()
        assert f"127.0.0.1:{server.port}" not in pool.stats()  # closed at once, never pooled
        # the backend sees the disconnect (its next write fails) promptly
        await asyncio.wait_for(state.disconnected.wait(), 2.0)
        await _until(lambda: not pool._conns)
        # a new request gets a fresh connection and works
        resp = await pool.request("127.0.0.1", server.port, _head("GET", "/empty", server), b"")
        assert await resp.read() == b""
        assert pool.connects == 2


async def scenario_idle_connections_expire() -> None:
    limits = UpstreamLimits(idle_timeout_s=0.1, sweep_interval_s=0.02)
    async with _server_and_pool(limits) as (server, state, pool):
        resp = await pool.request("127.0.0.1", server.port, _head("GET", "/empty", server), b"")
        await resp.read()
        assert pool.stats()[f"127.0.0.1:{server.port}"]["idle"] == 1
        await _until(lambda: not pool.stats())
        resp = await pool.request("127.0.0.1", server.port, _head("GET", "/empty", server), b"")
        await resp.read()
        assert pool.connects == 2 and len(state.peers) == 2


async def scenario_tcp_nodelay_is_set() -> None:
    async with _server_and_pool() as (server, _, pool):
        resp = await pool.request("127.0.0.1", server.port, _head("GET", "/empty", server), b"")
        await resp.read()
        (conn,) = pool._conns  # white-box: the option lives on our socket only
        sock = conn.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def scenario_concurrent_requests_get_their_own_responses() -> None:
    async with _server_and_pool() as (server, state, pool):

        async def one(i: int) -> None:
            body = f'{{"i": {i}, "pad": "{"x" * (i * 37 % 3000)}"}}'.encode()
            if i % 3 == 0:
                resp = await pool.request("127.0.0.1", server.port, _head("POST", f"/sse?n={i % 7}", server, b"{}"), b"{}")
                got = b"".join([c async for c in resp])
                assert got.endswith(b"data: [DONE]\n\n") and got.count(b"data: ") == i % 7 + 1
            else:
                head = _head("POST", f"/echo?i={i}", server, body, [("X-Request-Id", f"r-{i}")])
                resp = await pool.request("127.0.0.1", server.port, head, body)
                assert resp.header("X-Request-Id") == f"r-{i}"
                data = json.loads(await resp.read())
                assert data["path"] == f"/echo?i={i}" and data["body"] == body.decode()

        sem = asyncio.Semaphore(32)

        async def bounded(i: int) -> None:
            async with sem:
                await one(i)

        await asyncio.gather(*(bounded(i) for i in range(400)))
        # one request per connection, connections reused: never more than the concurrency
        assert pool.connects <= 32 and len(state.peers) == pool.connects
        stats = pool.stats()[f"127.0.0.1:{server.port}"]
        assert stats["busy"] == 0 and stats["idle"] == stats["open"] == pool.connects


async def scenario_read_after_partial_iteration_of_paused_body() -> None:
    total = 4 * 1024 * 1024
    limits = UpstreamLimits(read_high_water=64 * 1024, read_low_water=16 * 1024, sweep_interval_s=0.02)
    async with _server_and_pool(limits) as (server, _, pool):
        resp = await pool.request("127.0.0.1", server.port, _head("GET", f"/big?bytes={total}", server), b"")
        first = await resp.__anext__()
        await _until(lambda: resp.reading_paused)
        rest = await resp.read()  # read() lifts the back-pressure: it wants the whole body
        assert len(first) + len(rest) == total
        assert (first + rest)[:len(PATTERN)] == PATTERN and (first + rest)[-len(PATTERN):] == PATTERN
        assert pool.stats()[f"127.0.0.1:{server.port}"]["idle"] == 1


SCENARIOS = [
    scenario_json_round_trip,
    scenario_drop_headers_are_left_out_as_the_head_is_parsed,
    scenario_concurrent_requests_get_their_own_responses,
    scenario_read_after_partial_iteration_of_paused_body,
    scenario_sse_stream_then_reuse,
    scenario_sequential_requests_reuse_one_connection,
    scenario_concurrency_opens_connections_and_keeps_max_idle,
    scenario_backpressure_bounds_buffer,
    scenario_client_close_mid_stream_closes_upstream,
    scenario_idle_connections_expire,
    scenario_tcp_nodelay_is_set,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__.removeprefix("scenario_") for s in SCENARIOS])
async def test_scenario(scenario: Callable[[], Awaitable[None]]) -> None:
    await asyncio.wait_for(scenario(), 30.0)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__.removeprefix("scenario_") for s in SCENARIOS])
def test_scenario_under_uvloop(scenario: Callable[[], Awaitable[None]]) -> None:
    uvloop = pytest.importorskip("uvloop")

    async def bounded() -> None:
        await asyncio.wait_for(scenario(), 30.0)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(bounded())

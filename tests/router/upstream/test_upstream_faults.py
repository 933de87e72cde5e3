"""UpstreamPool against misbehaving raw TCP servers on 127.0.0.1: timeouts, broken framing,
the keep-alive race, refused and unanswered connects. Each scenario also runs under uvloop."""

from __future__ import annotations

import asyncio
import functools
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from contract.errors import UpstreamConnectError, UpstreamError, UpstreamProtocolError, UpstreamTimeoutError
from router.upstream import UpstreamLimits, UpstreamPool, UpstreamTimeouts, build_request_head
from tests.raw_http import Handler, RawServer, ServerConn
from tests.support import eventually

LIMITS = UpstreamLimits(sweep_interval_s=0.02)
TIMEOUTS = UpstreamTimeouts(connect_s=2.0, first_byte_s=5.0, total_s=10.0)

OK_2 = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"


@asynccontextmanager
async def _setup(
    handler: Handler, timeouts: UpstreamTimeouts = TIMEOUTS, limits: UpstreamLimits = LIMITS
) -> AsyncIterator[tuple[RawServer, UpstreamPool]]:
    server = RawServer(handler)
    await server.start()
    pool = UpstreamPool(timeouts, limits)
    try:
        yield server, pool
    finally:
        await pool.close()
        await server.stop()


def _get(port: int, path: str = "/") -> bytes:
    return build_request_head("GET", path, f"127.0.0.1:{port}", [], 0)


def _post(port: int, body: bytes) -> bytes:
    return build_request_head("POST", "/v1/completions", f"127.0.0.1:{port}", [("Content-Type", "application/json")], len(body))


_until = functools.partial(eventually, timeout=5.0, interval=0.005)


# ---------------------------------------------------------------------- timeouts
async def scenario_first_byte_timeout() -> None:
    closed = asyncio.Event()

    async def never_answers(conn: ServerConn) -> None:
        assert await conn.read_request() is not None
        await conn.wait_closed_by_peer()
        closed.set()

    timeouts = UpstreamTimeouts(connect_s=2.0, first_byte_s=0.2, total_s=10.0)
    async with _setup(never_answers, timeouts) as (server, pool):
        start = time.monotonic()
        with pytest.raises(UpstreamTimeoutError) as info:
            await pool.request("127.0.0.1", server.port, _post(server.port, b"{}"), b"{}")
        elapsed = time.monotonic() - start
        assert 0.15 <= elapsed < 2.0
        assert f"127.0.0.1:{server.port}" in info.value.message and "head" in info.value.message
        assert info.value.status == 504
        # the connection was closed, so the backend can abort the request
        await asyncio.wait_for(closed.wait(), 2.0)
        assert not pool.stats()


async def scenario_per_request_timeouts_override_pool_defaults() -> None:
    async def never_answers(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.wait_closed_by_peer()

    async with _setup(never_answers) as (server, pool):  # pool default first_byte_s = 5
        start = time.monotonic()
        with pytest.raises(UpstreamTimeoutError):
            await pool.request(
                "127.0.0.1", server.port, _get(server.port), b"", timeouts=UpstreamTimeouts(first_byte_s=0.1)
            )
        assert time.monotonic() - start < 2.0


async def scenario_total_timeout_cuts_a_stalled_stream() -> None:
    closed = asyncio.Event()

    async def head_then_stall(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"d\r\ndata: first\n\n\r\n"
        )
        await conn.wait_closed_by_peer()
        closed.set()

    timeouts = UpstreamTimeouts(connect_s=2.0, first_byte_s=5.0, total_s=0.4)
    async with _setup(head_then_stall, timeouts) as (server, pool):
        start = time.monotonic()
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        assert resp.status == 200 and resp.chunked
        chunks = []
        with pytest.raises(UpstreamTimeoutError) as info:
            async for chunk in resp:
                chunks.append(chunk)
        assert b"".join(chunks) == b"data: first\n\n"
        assert 0.35 <= time.monotonic() - start < 2.5
        assert "0.4 s" in info.value.message and f"127.0.0.1:{server.port}" in info.value.message
        await asyncio.wait_for(closed.wait(), 2.0)


async def scenario_total_timeout_while_waiting_for_head_and_in_read() -> None:
    async def stall_mid_body(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        await conn.wait_closed_by_peer()

    timeouts = UpstreamTimeouts(connect_s=2.0, first_byte_s=5.0, total_s=0.3)
    async with _setup(stall_mid_body, timeouts) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        with pytest.raises(UpstreamTimeoutError):
            await resp.read()

    async def never_answers(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.wait_closed_by_peer()

    async with _setup(never_answers, timeouts) as (server, pool):
        with pytest.raises(UpstreamTimeoutError) as info:
            await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        assert "finish" in info.value.message


# ---------------------------------------------------------------------- broken responses
async def scenario_close_mid_body_content_length() -> None:
    async def short_body(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"partial\":")
        conn.close()

    async with _setup(short_body) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _post(server.port, b"{}"), b"{}")
        assert resp.status == 200 and resp.content_length == 100
        with pytest.raises(UpstreamProtocolError) as info:
            await resp.read()
        assert "middle of the response body" in info.value.message
        assert f"127.0.0.1:{server.port}" in info.value.message
        assert not pool.stats()


async def scenario_close_mid_body_chunked_stream() -> None:
    async def broken_stream(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"c\r\ndata: a\n\n\r\n\r\n"
        )
        await conn.send(b"c\r\ndata: b\n\n\r\n")
        conn.close()  # no terminating 0-chunk: not a clean end of message

    async with _setup(broken_stream) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        got = []
        with pytest.raises(UpstreamProtocolError):
            async for chunk in resp:
                got.append(chunk)
        # what arrived before the break was delivered (fewer bytes if the reset discarded some)
        assert b"data: a\n\n\r\ndata: b\n\n".startswith(b"".join(got)[: len(b"data: a\n\n\r\n")])


async def scenario_garbage_is_a_protocol_error() -> None:
    async def garbage(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(b"HELLO THERE\r\n\r\n")
        await conn.wait_closed_by_peer()

    async with _setup(garbage) as (server, pool):
        with pytest.raises(UpstreamProtocolError) as info:
            await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        assert "invalid HTTP response" in info.value.message
        assert not pool.stats()

    async def bad_chunk(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\nZZZ\r\n")
        await conn.wait_closed_by_peer()

    async with _setup(bad_chunk) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        with pytest.raises(UpstreamProtocolError):
            await resp.read()

    async def smuggling(conn: ServerConn) -> None:  # both framings at once: llhttp refuses it
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n")
        await conn.wait_closed_by_peer()

    async with _setup(smuggling) as (server, pool):
        with pytest.raises(UpstreamProtocolError):
            resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
            await resp.read()


async def scenario_closed_before_head_on_fresh_connection_is_not_retried() -> None:
    async def close_at_once(conn: ServerConn) -> None:
        await conn.read_request()
        conn.close()

    async with _setup(close_at_once) as (server, pool):
        with pytest.raises(UpstreamProtocolError) as info:
            await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        assert "before sending a complete response head" in info.value.message
        assert server.connections == 1 and pool.stale_retries == 0


# ---------------------------------------------------------------------- keep-alive race
async def scenario_stale_keepalive_is_retried_once_on_a_fresh_connection() -> None:
    seen: list[tuple[int, bytes]] = []

    async def first_conn_dies_on_second_request(conn: ServerConn) -> None:
        while (req := await conn.read_request()) is not None:
            seen.append((conn.index, req))
            if conn.index == 0 and len(seen) == 2:
                conn.writer.transport.abort()  # the backend dropped the idle connection as we wrote
                return
            await conn.send(OK_2)

    async with _setup(first_conn_dies_on_second_request) as (server, pool):
        body = b'{"n": 1}'
        for _ in range(3):
            resp = await pool.request("127.0.0.1", server.port, _post(server.port, body), body)
            assert await resp.read() == b"ok"
        assert server.connections == 2
        assert pool.stale_retries == 1
        assert [index for index, _ in seen] == [0, 0, 1, 1]
        assert seen[1][1] == seen[2][1]  # the same request bytes were sent again


async def scenario_no_retry_after_response_bytes() -> None:
    async def partial_head_on_second(conn: ServerConn) -> None:
        n = 0
        while await conn.read_request() is not None:
            n += 1
            if n == 2:
                await conn.send(b"HTTP/1.1 200 OK\r\nContent-")
                conn.close()
                return
            await conn.send(OK_2)

    async with _setup(partial_head_on_second) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        assert await resp.read() == b"ok"
        with pytest.raises(UpstreamProtocolError):
            await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        assert server.connections == 1 and pool.stale_retries == 0


async def scenario_idle_connection_closed_by_backend_is_dropped() -> None:
    async def answer_then_close_later(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(OK_2)
        conn.close()  # keep-alive advertised, then closed while idle

    async with _setup(answer_then_close_later) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        assert await resp.read() == b"ok"
        await _until(lambda: not pool.stats())
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        assert await resp.read() == b"ok"
        assert server.connections == 2 and pool.stale_retries == 0


# ---------------------------------------------------------------------- framing and reuse rules
async def scenario_body_until_close_and_connection_close() -> None:
    async def until_close(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nhello ")
        await conn.send(b"world")
        conn.close()

    async with _setup(until_close) as (server, pool):
        for _ in range(2):
            resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
            assert resp.content_length is None and not resp.chunked
            assert await resp.read() == b"hello world"
        assert server.connections == 2
        await _until(lambda: not pool.stats())

    async def http10(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.0 200 OK\r\n\r\nold")
        conn.close()

    async with _setup(http10) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        assert [c async for c in resp] == [b"old"]

    async def until_reset(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\ntrunc")
        sock = conn.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.writer.transport.abort()  # a reset: the body may be cut, so it is not a clean end

    async with _setup(until_reset) as (server, pool):
        with pytest.raises(UpstreamProtocolError):  # mid-body, or before the head if the reset won the race
            resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
            await resp.read()


async def scenario_connection_close_with_length_is_not_reused() -> None:
    async def close_each(conn: ServerConn) -> None:
        while await conn.read_request() is not None:
            await conn.send(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 4\r\n\r\nbusy")

    async with _setup(close_each) as (server, pool):
        for _ in range(3):
            resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
            assert resp.status == 503  # a status is an answer, not an error: the proxy decides
            assert await resp.read() == b"busy"
        assert server.connections == 3
        await _until(lambda: not pool.stats())


async def scenario_informational_responses_are_skipped() -> None:
    async def with_1xx(conn: ServerConn) -> None:
        while await conn.read_request() is not None:
            await conn.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            await conn.send(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + OK_2)

    async with _setup(with_1xx) as (server, pool):
        for _ in range(3):
            resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
            assert resp.status == 200
            assert resp.header("link") is None and resp.content_type == "text/plain"
            assert await resp.read() == b"ok"
        assert server.connections == 1


async def scenario_extra_bytes_after_response_poison_the_connection() -> None:
    async def two_answers(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(OK_2 + OK_2)
        await conn.wait_closed_by_peer()

    async with _setup(two_answers) as (server, pool):
        for _ in range(2):
            resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
            assert await resp.read() == b"ok"
        assert server.connections == 2

    async def late_junk(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(OK_2)
        await conn.send(b"junk")
        await conn.wait_closed_by_peer()

    async with _setup(late_junk) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        assert await resp.read() == b"ok"
        await _until(lambda: server.connections == 1 and not pool.stats())
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        assert await resp.read() == b"ok"
        assert server.connections == 2


async def scenario_large_request_body_is_sent_whole() -> None:
    body = b"x" * (3 * 1024 * 1024 + 7)
    got: list[bytes] = []

    async def echo_len(conn: ServerConn) -> None:
        req = await conn.read_request()
        assert req is not None
        got.append(req)
        n = str(len(req.split(b"\r\n\r\n", 1)[1])).encode()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(n)).encode() + b"\r\n\r\n" + n)

    async with _setup(echo_len) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _post(server.port, body), body)
        assert await resp.read() == str(len(body)).encode()


# ---------------------------------------------------------------------- disconnects and shutdown
async def scenario_close_unfinished_response_closes_socket_at_once() -> None:
    closed = asyncio.Event()

    async def slow_stream(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ntick1\r\n")
        await conn.wait_closed_by_peer()
        closed.set()

    async with _setup(slow_stream) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        assert await resp.__anext__() == b"tick1"
        resp.close()
        await asyncio.wait_for(closed.wait(), 1.0)
        with pytest.raises(UpstreamProtocolError):
            await resp.__anext__()
        resp.close()  # idempotent
        await _until(lambda: not pool.stats())


async def scenario_cancelled_request_closes_socket() -> None:
    received = asyncio.Event()
    closed = asyncio.Event()

    async def never_answers(conn: ServerConn) -> None:
        await conn.read_request()
        received.set()
        await conn.wait_closed_by_peer()
        closed.set()

    async with _setup(never_answers) as (server, pool):
        task = asyncio.ensure_future(pool.request("127.0.0.1", server.port, _get(server.port), b""))
        await asyncio.wait_for(received.wait(), 2.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 1.0)

    async def stream_forever(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await conn.wait_closed_by_peer()
        closed.set()

    closed.clear()
    async with _setup(stream_forever) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        task = asyncio.ensure_future(resp.read())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 1.0)


async def scenario_pool_close_fails_in_flight_and_refuses_new() -> None:
    received = asyncio.Event()

    async def never_answers(conn: ServerConn) -> None:
        await conn.read_request()
        received.set()
        await conn.wait_closed_by_peer()

    async with _setup(never_answers) as (server, pool):
        task = asyncio.ensure_future(pool.request("127.0.0.1", server.port, _get(server.port), b""))
        await asyncio.wait_for(received.wait(), 2.0)
        await pool.close()
        with pytest.raises(UpstreamProtocolError):
            await task
        with pytest.raises(UpstreamConnectError):
            await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        assert not pool.stats()


# ---------------------------------------------------------------------- connect failures
async def scenario_refused_port_is_a_connect_error() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # bound and closed: nothing listens there
    pool = UpstreamPool(TIMEOUTS, LIMITS)
    try:
        with pytest.raises(UpstreamConnectError) as info:
            await pool.request("127.0.0.1", port, _get(port), b"")
        assert f"127.0.0.1:{port}" in info.value.message and "refused" in info.value.message
        assert info.value.status == 502 and isinstance(info.value, UpstreamError)
    finally:
        await pool.close()


async def scenario_connect_timeout_with_full_backlog() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # never accepted: once the queue is full, SYNs are dropped
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    pool = UpstreamPool(UpstreamTimeouts(connect_s=0.3), LIMITS)
    try:
        start = time.monotonic()
        with pytest.raises(UpstreamConnectError) as info:
            await pool.request("127.0.0.1", port, _get(port), b"")
        assert 0.25 <= time.monotonic() - start < 2.0
        assert f"127.0.0.1:{port}" in info.value.message and "0.3 s" in info.value.message
    finally:
        await pool.close()
        for filler in fillers:
            filler.close()
        listener.close()


# ---------------------------------------------------------------------- bounds and odd answers (issue 11)
async def scenario_head_over_max_head_bytes_fails_and_closes() -> None:
    limit = 2048
    start = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nX-Fill: "
    closed = asyncio.Event()

    def head(over: int) -> bytes:
        return start + b"a" * (limit - len(start) - 4 + over) + b"\r\n\r\n"

    async def answers(conn: ServerConn) -> None:
        over = 0
        while await conn.read_request() is not None:
            data = head(over) + b"ok"
            try:
                for i in range(0, len(data), 100):  # the bound holds across many reads
                    await conn.send(data[i:i + 100])
            except ConnectionError:
                break
            over += 1  # the next answer's head is one byte over the bound
        closed.set()

    limits = UpstreamLimits(sweep_interval_s=0.02, max_head_bytes=limit)
    async with _setup(answers, limits=limits) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")  # exactly the bound: fine
        assert resp.status == 200 and await resp.read() == b"ok"
        with pytest.raises(UpstreamProtocolError, match="larger than 2048 bytes"):
            await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        await asyncio.wait_for(closed.wait(), 5)
        await _until(lambda: not pool.stats())


async def scenario_body_over_max_body_bytes_fails_read_and_closes() -> None:
    limit = 64 * 1024
    closed = asyncio.Event()

    async def declares_a_big_body(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 10000000\r\n\r\n{")
        await conn.wait_closed_by_peer()  # never sends the rest: read() must not wait for it
        closed.set()

    limits = UpstreamLimits(sweep_interval_s=0.02, max_body_bytes=limit)
    async with _setup(declares_a_big_body, limits=limits) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        with pytest.raises(UpstreamProtocolError, match="max_upstream_body_bytes"):
            await resp.read()
        await asyncio.wait_for(closed.wait(), 5)

    async def chunked_big(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(100):
                await conn.send(b"4000\r\n" + b"a" * 0x4000 + b"\r\n")
        except ConnectionError:
            pass
        await conn.wait_closed_by_peer()

    async with _setup(chunked_big, limits=limits) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        with pytest.raises(UpstreamProtocolError, match="max_upstream_body_bytes"):
            await resp.read()
        await _until(lambda: not pool.stats())
        # the same answer consumed chunk by chunk (a relayed stream) is not bounded by it
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        got = 0
        async for data in resp:
            got += len(data)
            if got > 4 * limit:
                break
        resp.close()
        assert got > 4 * limit


async def scenario_status_outside_100_599_is_a_protocol_error() -> None:
    statuses = [b"000", b"099", b"600", b"999"]

    async def odd(conn: ServerConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 " + statuses[conn.index] + b" X\r\nContent-Length: 2\r\n\r\nok")
        await conn.wait_closed_by_peer()

    async with _setup(odd) as (server, pool):
        for status in statuses:
            with pytest.raises(UpstreamProtocolError, match=f"status {status.decode()}"):
                await pool.request("127.0.0.1", server.port, _get(server.port), b"")


async def scenario_header_bytes_are_kept() -> None:
    value = "café".encode() + b" \xff\x80"

    async def non_ascii(conn: ServerConn) -> None:
        while await conn.read_request() is not None:
            await conn.send(b"HTTP/1.1 200 OK\r\nX-Odd: " + value + b"\r\nContent-Length: 2\r\n\r\nok")

    async with _setup(non_ascii) as (server, pool):
        resp = await pool.request("127.0.0.1", server.port, _get(server.port), b"")
        got = resp.header("x-odd")
        assert got is not None and got.encode("utf-8", "surrogateescape") == value
        assert await resp.read() == b"ok"


SCENARIOS = [
    scenario_first_byte_timeout,
    scenario_per_request_timeouts_override_pool_defaults,
    scenario_total_timeout_cuts_a_stalled_stream,
    scenario_total_timeout_while_waiting_for_head_and_in_read,
    scenario_close_mid_body_content_length,
    scenario_close_mid_body_chunked_stream,
    scenario_garbage_is_a_protocol_error,
    scenario_closed_before_head_on_fresh_connection_is_not_retried,
    scenario_stale_keepalive_is_retried_once_on_a_fresh_connection,
    scenario_no_retry_after_response_bytes,
    scenario_idle_connection_closed_by_backend_is_dropped,
    scenario_body_until_close_and_connection_close,
    scenario_connection_close_with_length_is_not_reused,
    scenario_informational_responses_are_skipped,
    scenario_extra_bytes_after_response_poison_the_connection,
    scenario_large_request_body_is_sent_whole,
    scenario_close_unfinished_response_closes_socket_at_once,
    scenario_cancelled_request_closes_socket,
    scenario_pool_close_fails_in_flight_and_refuses_new,
    scenario_refused_port_is_a_connect_error,
    scenario_connect_timeout_with_full_backlog,
    scenario_head_over_max_head_bytes_fails_and_closes,
    scenario_body_over_max_body_bytes_fails_read_and_closes,
    scenario_status_outside_100_599_is_a_protocol_error,
    scenario_header_bytes_are_kept,
]
IDS = [s.__name__.removeprefix("scenario_") for s in SCENARIOS]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=IDS)
async def test_scenario(scenario: Callable[[], Awaitable[None]]) -> None:
    await asyncio.wait_for(scenario(), 20.0)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=IDS)
def test_scenario_under_uvloop(scenario: Callable[[], Awaitable[None]]) -> None:
    uvloop = pytest.importorskip("uvloop")

    async def bounded() -> None:
        await asyncio.wait_for(scenario(), 20.0)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(bounded())

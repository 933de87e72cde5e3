"""The raw front (``router.front``): HTTP/1.x contracts on the router's port.

Most tests run the front in-process exactly as ``router.serve.serve`` assembles it: the app from
``router.app.create_app`` on an internal aiohttp listener and ``RawFront`` on its own port, both
on 127.0.0.1 ephemeral ports, in front of ``tests.fakes.EchoBackend`` servers (or a small
streaming backend defined here). Requests are written raw over sockets, so framing, pipelining
and malformed input are exactly what a test sends. The process tests (marked slow) start
``python -m router`` in front of real ``python -m backends`` processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from router.config import build_config
from contract.errors import ConfigError
from router.state import RouterState
from tests.raw_http import GOOD, Conn, get, post, read_answer
from tests.router.front.conftest import LIMIT, Factory
from tests.support import eventually, kill_alive, metric_sum, start_backend, start_router, wait_until

TOKEN = "raw-front-admin-token"


# ----------------------------------------------------------------------------- plumbing


def in_flight(state: RouterState) -> int:
    return sum(b.in_flight for pool in state.pools.values() for b in pool.members)


# ------------------------------------------------------------------------ connections


async def test_keep_alive_serves_hot_and_relayed_requests_on_one_connection(served: Factory) -> None:
    router = await served()
    conn = await router.conn()
    first = await conn.ask(post("/v1/completions", extra="X-Session-ID: ka\r\n"))
    assert first.status == 200 and json.loads(first.body)["backend"] == "b0"
    assert first.header("x-session-id") == "ka" and first.header("x-request-id")
    assert first.header("connection") is None and first.header("date") and first.header("server")
    relayed = await conn.ask(get("/v1/sessions/ka"))
    assert relayed.status == 200 and json.loads(relayed.body)["requests"] == 1
    stream = await conn.ask(post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
                                                        b'"stream": true}', extra="X-Session-ID: ka\r\n"))
    assert stream.status == 200 and stream.header("transfer-encoding") == "chunked"
    assert stream.body.endswith(b"data: [DONE]\n\n")
    again = await conn.ask(post("/tokenize"))
    assert again.status == 200
    assert len(router.front.connections) == 1  # all four on the one connection
    assert [s.path for s in router.fakes[0].seen] == ["/v1/completions", "/v1/chat/completions", "/tokenize"]
    # the backend got the body byte for byte, the session and the request id; no hop-by-hop header
    seen = router.fakes[0].seen[0]
    assert seen.body == GOOD and seen.headers["x-session-id"] == ["ka"]
    assert seen.headers["x-request-id"] == [first.header("x-request-id")]


async def test_pipelined_requests_are_answered_in_order(served: Factory) -> None:
    router = await served()
    gate = asyncio.Event()
    router.fakes[0].gates[0] = gate  # the stream (first) waits; the others may not overtake it
    conn = await router.conn()
    await conn.send(post("/v1/completions", b'{"prompt": "a", "stream": true}', extra="X-Request-Id: rid-1\r\n")
                    + post("/v1/completions", extra="X-Request-Id: rid-2\r\n")
                    + get("/health", extra="X-Request-Id: rid-3\r\n"))
    await eventually(lambda: len(router.fakes[0].seen) == 1, timeout=10.0, what="the first request upstream")
    gate.set()
    answers = [await read_answer(conn.reader) for _ in range(3)]
    assert [a.header("x-request-id") for a in answers] == ["rid-1", "rid-2", "rid-3"]
    assert [a.status for a in answers] == [200, 200, 200]
    assert answers[0].body.endswith(b"data: [DONE]\n\n")
    assert json.loads(answers[2].body)["status"] == "ok"
    # one at a time: the second reached the backend after the first one
    assert [s.headers["x-request-id"] for s in router.fakes[0].seen] == [["rid-1"], ["rid-2"]]


async def test_http_1_0(served: Factory) -> None:
    router = await served()
    # no keep-alive unless asked: the answer says close, and the server closes
    conn = await router.conn()
    answer = await conn.ask(post("/v1/completions", version="1.0"))
    assert answer.version == "HTTP/1.0" and answer.status == 200 and answer.header("connection") == "close"
    assert await conn.closed_by_peer()
    # asked for keep-alive: the connection serves a second request
    conn = await router.conn()
    for _ in range(2):
        answer = await conn.ask(post("/v1/completions", version="1.0", extra="Connection: keep-alive\r\n"))
        assert answer.status == 200 and answer.header("connection") == "keep-alive"
    # a stream on HTTP/1.0: no chunked encoding, the end of the body is the close
    answer = await router.once(post("/v1/completions", b'{"prompt": "a", "stream": true}', version="1.0"))
    assert answer.status == 200 and answer.header("transfer-encoding") is None
    assert answer.body.startswith(b"data: ") and answer.body.endswith(b"data: [DONE]\n\n")
    # relayed routes too
    answer = await router.once(b"GET /health HTTP/1.0\r\n\r\n")
    assert answer.version == "HTTP/1.0" and answer.status == 200


async def test_connection_close_from_the_client_is_honoured(served: Factory) -> None:
    router = await served()
    conn = await router.conn()
    answer = await conn.ask(post("/v1/completions", extra="Connection: close\r\n"))
    assert answer.status == 200 and answer.header("connection") == "close"
    assert await conn.closed_by_peer()


# ---------------------------------------------------------------------------- bodies


async def test_413_from_content_length_before_the_body_is_sent(served: Factory) -> None:
    router = await served()
    conn = await router.conn()
    await conn.send(f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: {LIMIT + 1}\r\n"
                    f"X-Request-Id: big-1\r\n\r\n".encode())
    answer = await read_answer(conn.reader)  # no body byte was sent
    assert answer.status == 413 and answer.header("connection") == "close"
    assert answer.header("x-request-id") == "big-1"
    assert "max_body_bytes" in answer.error()["message"]
    await conn.send(b"x" * 1000)  # the rest of the body is discarded, then the connection closes
    conn.writer.write_eof()
    assert await conn.closed_by_peer()
    assert not router.fakes[0].seen
    # the same on a relayed route, and the front keeps serving
    answer = await router.once(f"POST /v1/sessions HTTP/1.1\r\nHost: r\r\nContent-Length: {LIMIT + 1}\r\n\r\n".encode())
    assert answer.status == 413
    assert (await router.once(post("/v1/completions"))).status == 200


@pytest.mark.parametrize("front", ["raw", "aiohttp"])
async def test_a_body_that_stalls_gets_a_408_and_the_router_keeps_serving(served: Factory, front: str) -> None:
    router = await served(body_timeout_s=0.3)
    port = router.port if front == "raw" else router.aiohttp_port  # the app's own listener = the aiohttp front
    conn = await Conn.open(port)
    router.opened.append(conn)
    started = time.monotonic()
    answer = await conn.ask(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 100\r\nX-Request-Id: slow-1\r\n\r\n{\"model\": ")
    assert answer.status == 408 and answer.error()["type"] == "RequestTimeoutError"
    assert "body_timeout_s" in answer.error()["message"]
    assert answer.header("x-request-id") == "slow-1"
    assert time.monotonic() - started >= 0.3
    assert not router.fakes[0].seen and in_flight(router.state) == 0
    if front == "raw":  # the rest of the body was never read: the connection closes
        assert answer.header("connection") == "close"
        assert await conn.closed_by_peer()
        # a relayed route's body is bounded the same way
        slow_admin = await router.once(b"POST /v1/sessions HTTP/1.1\r\nHost: r\r\nContent-Length: 10\r\n\r\n{")
        assert slow_admin.status == 408
    fresh = await Conn.open(port)
    router.opened.append(fresh)
    assert (await fresh.ask(post("/v1/completions"))).status == 200


async def test_chunked_body_over_the_limit_is_a_413_as_soon_as_it_exceeds_it(served: Factory) -> None:
    router = await served()
    conn = await router.conn()
    await conn.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n"
                    b"Content-Type: application/json\r\n\r\n")
    piece = b"a" * 1000
    for _ in range(5):  # 5000 bytes > LIMIT; no terminating chunk is ever sent
        await conn.send(b"%x\r\n%b\r\n" % (len(piece), piece))
    answer = await read_answer(conn.reader)
    assert answer.status == 413 and answer.header("connection") == "close"
    assert answer.error()["type"] == "PayloadTooLargeError"
    assert await conn.closed_by_peer()
    assert not router.fakes[0].seen
    # a chunked body within the limit is proxied, de-chunked, byte for byte
    conn = await router.conn()
    answer = await conn.ask(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
                            + b"%x\r\n%b\r\n" % (10, GOOD[:10]) + b"%x\r\n%b\r\n" % (len(GOOD) - 10, GOOD[10:])
                            + b"0\r\n\r\n")
    assert answer.status == 200
    assert router.fakes[0].seen[-1].body == GOOD


async def test_expect_100_continue(served: Factory) -> None:
    router = await served()
    conn = await router.conn()
    await conn.send(f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: {len(GOOD)}\r\n"
                    f"Expect: 100-continue\r\n\r\n".encode())
    interim = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    answer = await conn.ask(GOOD)
    assert answer.status == 200
    assert "expect" not in router.fakes[0].seen[0].headers  # the front answered it; not forwarded
    # over the limit: a 413 instead of the 100
    conn = await router.conn()
    await conn.send(f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: {LIMIT + 1}\r\n"
                    f"Expect: 100-continue\r\n\r\n".encode())
    answer = await read_answer(conn.reader)
    assert answer.status == 413 and answer.header("connection") == "close"
    # relayed routes get their 100 too
    conn = await router.conn()
    await conn.send(b"POST /v1/sessions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
    assert await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert (await conn.ask(b"{}")).status == 405


# ------------------------------------------------------------------------- bad input


MALFORMED = {
    "control_char": post("/v1/completions", extra="X-Session-ID: ab\x01cd\r\n"),
    "bare_lf": post("/v1/completions", extra="X-Custom: abc\nX-Injected: 1\r\n"),
    "bare_cr": post("/v1/completions", extra="X-Custom: abc\rX-Injected: 1\r\n"),
    "nul": post("/v1/completions", extra="X-Custom: ab\x00cd\r\n"),
    "del": post("/v1/completions", extra="X-Custom: ab\x7fcd\r\n"),
    "obs_fold": post("/v1/completions", extra="X-Custom: abc\r\n folded\r\n"),
    "space_in_name": post("/v1/completions", extra="X Custom: 1\r\n"),
    "bad_method": b"P@ST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\n{}",
    "no_version": b"GET /health\r\n\r\n",
    "http_2": b"GET /health HTTP/2.0\r\nHost: r\r\n\r\n",
    "cl_and_te": b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
    "two_lengths": b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "bad_length": b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: -1\r\n\r\n",
    "bad_chunk_size": b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "te_gzip": b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: gzip\r\n\r\n",
    "long_header": post("/v1/completions", extra="X-Long: " + "a" * 40_000 + "\r\n"),
    "long_target": get("/health?" + "q" * 40_000),
    "connect": b"CONNECT 127.0.0.1:9 HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n",
    "connect_with_a_path": b"CONNECT /v1/completions HTTP/1.1\r\nHost: r\r\n\r\n",
    "absolute_form_post": post("http://127.0.0.77:9/v1/completions"),
    "absolute_form_get": get("http://router/health"),
    "asterisk": get("*", method="OPTIONS"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
async def test_malformed_requests_get_a_400_in_openai_shape_and_the_front_keeps_serving(
        served: Factory, name: str) -> None:  # fmt: skip
    router = await served()
    conn = await router.conn()
    answer = await conn.ask(MALFORMED[name])
    assert answer.status == 400, answer.body[:200]
    error = answer.error()
    assert "Traceback" not in error["message"]
    assert answer.header("x-request-id")
    assert answer.header("connection") == "close"
    assert await conn.closed_by_peer()
    assert not router.fakes[0].seen  # nothing reached a backend
    assert (await router.once(post("/v1/completions"))).status == 200
    assert in_flight(router.state) == 0


async def test_a_bad_host_after_a_good_one_on_the_same_connection_is_a_400(served: Factory) -> None:
    """The parser remembers the last Host value found valid on a connection (keep-alive clients repeat
    it): another value is checked again."""
    router = await served()
    conn = await router.conn()
    for _ in range(2):
        assert (await conn.ask(post("/v1/completions"))).status == 200
    bad = post("/v1/completions").replace(b"Host: router\r\n", b"Host: a/b\r\n")
    answer = await conn.ask(bad)
    assert answer.status == 400 and "Host" in answer.error()["message"]
    assert await conn.closed_by_peer()
    assert len(router.fakes[0].seen) == 2


async def test_a_chunked_body_that_breaks_mid_way_is_a_400(served: Factory) -> None:
    router = await served()
    conn = await router.conn()
    answer = await conn.ask(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
                            b"5\r\n{\"pro\r\nzz\r\n")
    assert answer.status == 400 and answer.header("connection") == "close"
    answer.error()
    assert not router.fakes[0].seen
    assert (await router.once(post("/v1/completions"))).status == 200


async def test_duplicate_session_headers_and_forwarded_headers(served: Factory) -> None:
    router = await served()
    answer = await router.once(post("/v1/completions", extra="X-Session-ID: a\r\nx-session-id: b\r\n"))
    assert answer.status == 400 and "X-Session-ID" in answer.error()["message"]
    assert answer.header("x-request-id")
    same = await router.once(post("/v1/completions", extra="X-Session-ID: a\r\nX-Session-ID: a\r\n"))
    assert same.status == 200 and same.header("x-session-id") == "a"
    answer = await router.once(post("/v1/completions", extra=(
        "Authorization: Bearer k\r\nX-Custom:  spaced value \t\r\nProxy-Authorization: p\r\nKeep-Alive: 5\r\n"
        "TE: trailers\r\nUpgrade-Insecure-Requests: 1\r\nX-Session-ID:  s1 \r\n")))
    assert answer.status == 200
    seen = router.fakes[0].seen[-1].headers
    assert seen["authorization"] == ["Bearer k"] and seen["x-custom"] == ["spaced value"]
    assert seen["upgrade-insecure-requests"] == ["1"] and seen["x-session-id"] == ["s1"]
    for dropped in ("proxy-authorization", "keep-alive", "te"):  # hop-by-hop: never forwarded
        assert dropped not in seen, dropped
    assert len(seen["host"]) == 1 and seen["host"][0] != "router"


# --------------------------------------------------------------------- relayed routes


async def test_relayed_routes_answer_as_the_app_does_with_a_request_id(served: Factory) -> None:
    router = await served(admin_token=TOKEN)
    made = await router.once(post("/v1/completions", extra="X-Session-ID: rel-1\r\n"))
    assert made.status == 200
    cases = [
        (get("/health"), 200),
        (get("/metrics"), 200),
        (get("/v1/sessions/rel-1"), 200),
        (get("/v1/sessions/unknown"), 404),
        (get("/v1/sessions?limit=1"), 401),  # listing every session is an admin action
        (get("/v1/sessions?limit=1", extra=f"Authorization: Bearer {TOKEN}\r\n"), 200),
        (get("/v1/models"), 200),
        (get("/admin/backends"), 401),
        (get("/admin/backends", extra="Authorization: Bearer wrong\r\n"), 401),
        (get("/admin/backends", extra=f"Authorization: Bearer {TOKEN}\r\n"), 200),
        (get("/internal/kv/pull"), 404),  # denied (proxy_deny); other unknown routes are forwarded
        (get("/v1/completions"), 405),
        (get("/v1/sessions/rel-1", method="DELETE"), 200),
        (get("/v1/sessions/rel-1"), 404),
    ]
    for data, status in cases:
        answer = await router.once(data)
        assert answer.status == status, (data[:60], answer.status, answer.body[:200])
        assert answer.header("x-request-id"), data[:60]
        assert len(answer.all("date")) == 1 and len(answer.all("server")) == 1
        if status >= 400:
            answer.error()
    metrics = await router.once(get("/metrics"))
    assert b"session_router_requests_total" in metrics.body
    # the client's request id is kept; HEAD has the length of the GET and no body
    answer = await router.once(get("/health", extra="X-Request-Id: mine-7\r\n"))
    assert answer.header("x-request-id") == "mine-7"
    conn = await router.conn()
    head = await conn.ask(get("/health", method="HEAD"), head_only=True)
    assert head.status == 200 and int(head.header("content-length") or 0) > 0
    after = await conn.ask(get("/health"))  # nothing stray was left on the connection
    assert after.status == 200 and len(after.body) == int(head.header("content-length") or 0)
    # a proxied route reached through a non-canonical path still goes through the proxy (relayed)
    answer = await router.once(post("/v1/%63ompletions", extra="X-Session-ID: rel-2\r\n"))
    assert answer.status == 200 and answer.header("x-session-id") == "rel-2"


# ------------------------------------------------------------- disconnects and back-pressure


async def test_client_disconnect_mid_stream_cancels_the_upstream_request(served: Factory) -> None:
    router = await served()
    fake = router.fakes[0]
    gate = asyncio.Event()
    fake.gates[1] = gate  # chunk 0 flows, chunk 1 waits
    conn = await router.conn()
    await conn.send(post("/v1/completions", b'{"prompt": "a", "stream": true}'))
    answer_head = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)
    assert answer_head.startswith(b"HTTP/1.1 200")
    await eventually(lambda: in_flight(router.state) == 1, timeout=10.0, what="the stream in flight")
    conn.close()
    await eventually(fake.cancelled.is_set, timeout=10.0, what="the backend to see the client go")
    await eventually(lambda: in_flight(router.state) == 0, timeout=10.0, what="the router's in-flight count back to 0")
    await eventually(lambda: not router.front.connections, timeout=10.0, what="the front to forget the connection")


class Firehose:
    """A backend whose stream is as long as the test wants; it counts what it managed to send."""

    def __init__(self, total: int, piece: int = 64 * 1024) -> None:
        self.total = total
        self.piece = piece
        self.sent = 0

    def app(self) -> web.Application:
        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def stream(request: web.Request) -> web.StreamResponse:
            await request.read()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            data = b"data: " + b"x" * (self.piece - 8) + b"\n\n"
            while self.sent < self.total:
                await resp.write(data)  # waits while the router does not read (aiohttp's drain)
                self.sent += len(data)
            await resp.write_eof()
            return resp

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", stream)
        return app


async def test_a_slow_reader_pauses_the_upstream_and_nothing_piles_up(served: Factory, aiohttp_server: Any) -> None:
    total = 64 * 1024 * 1024
    hose = Firehose(total)
    server = await aiohttp_server(hose.app(), host="127.0.0.1")
    router = await served(backends=[f"http://127.0.0.1:{server.port}"])
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port, limit=64 * 1024)
    writer.write(post("/v1/completions", b'{"prompt": "a", "stream": true}'))
    await writer.drain()
    # the client reads nothing: the front's socket fills, it pauses the relay, the pool stops reading
    # the backend's socket, and the backend's writes block
    upstream = router.state.upstream
    await eventually(lambda: any(c.write_paused for c in router.front.connections), timeout=10.0, what="the front to pause writing")
    await eventually(lambda: any(c.paused for c in upstream._conns), timeout=10.0, what="the upstream reads to pause")
    front_conn = next(iter(router.front.connections))
    assert front_conn.transport is not None
    buffered = front_conn.transport.get_write_buffer_size()
    assert buffered <= 1024 * 1024, buffered  # uvloop/asyncio high water + one chunk, not the stream
    assert hose.sent < 32 * 1024 * 1024, hose.sent  # the backend was held back: far less than 64 MiB sent
    # then the client reads it all: every byte arrives, in order, and the request completes
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200")
    received = 0
    while True:
        size = int((await asyncio.wait_for(reader.readline(), 30)).strip(), 16)
        await asyncio.wait_for(reader.readexactly(size + 2), 30)
        if size == 0:
            break
        received += size
    assert received == hose.sent >= total
    await eventually(lambda: in_flight(router.state) == 0, timeout=10.0, what="the request to finish")
    writer.close()


# ------------------------------------------------------------------------- the drain


async def test_shutdown_closes_idle_connections_and_lets_a_stream_finish(served: Factory) -> None:
    router = await served()
    gate = asyncio.Event()
    router.fakes[0].gates[1] = gate
    idle = await router.conn()
    assert (await idle.ask(get("/health"))).status == 200
    busy = await router.conn()
    await busy.send(post("/v1/completions", b'{"prompt": "a", "stream": true}'))
    await asyncio.wait_for(busy.reader.readuntil(b"data: "), 10)  # the stream is under way
    drain = asyncio.create_task(router.front.shutdown(30))
    assert await idle.closed_by_peer()  # idle keep-alive: closed at once
    with pytest.raises(OSError):  # no longer accepting
        await asyncio.open_connection("127.0.0.1", router.port)
    assert not drain.done()
    gate.set()
    rest = await asyncio.wait_for(busy.reader.read(), 10)  # the stream finishes, then the close
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    await asyncio.wait_for(drain, 10)


async def test_shutdown_cuts_what_outlives_the_drain_timeout(served: Factory) -> None:
    router = await served()
    router.fakes[0].gates[1] = asyncio.Event()  # never set
    conn = await router.conn()
    await conn.send(post("/v1/completions", b'{"prompt": "a", "stream": true}'))
    await asyncio.wait_for(conn.reader.readuntil(b"data: "), 10)
    await asyncio.wait_for(router.front.shutdown(0.2), 10)
    rest = await asyncio.wait_for(conn.reader.read(), 10)
    assert not rest.endswith(b"0\r\n\r\n")  # cut: never a cleanly terminated chunked body
    await eventually(router.fakes[0].cancelled.is_set, timeout=10.0, what="the backend to see the request go")
    assert in_flight(router.state) == 0


# -------------------------------------------------------------- the two fronts agree


PARITY = {
    "ok": post("/v1/completions"),
    "stream": post("/v1/completions", b'{"prompt": "a", "stream": true}'),
    "bad_json": post("/v1/completions", b'{"prompt": '),
    "bad_session": post("/v1/completions", extra="X-Session-ID: a b\r\n"),
    "conflicting_sessions": post("/v1/completions", extra="X-Session-ID: a\r\nX-Session-ID: b\r\n"),
    "too_large": post("/tokenize", b'{"prompt": "' + b"a" * LIMIT + b'"}'),
    "control_char": post("/v1/completions", extra="X-Session-ID: ab\x01cd\r\n"),
    "bare_lf": post("/v1/completions", extra="X-Custom: abc\nX-Injected: 1\r\n"),
    "absolute_form": post("http://127.0.0.77:9/v1/completions"),
    "unknown": get("//nope"),  # an ambiguous path: the router's 404 (other unknown routes are forwarded)
    "denied": get("/internal/kv/pull"),
    "wrong_method": get("/v1/chat/completions"),
    "health": get("/health"),
    "session_404": get("/v1/sessions/none"),
    "admin_no_token": get("/admin/backends"),
}


@pytest.mark.parametrize("name", list(PARITY))
async def test_the_raw_front_answers_like_the_aiohttp_front(served: Factory, name: str) -> None:
    router = await served(admin_token=TOKEN)
    answers = []
    for port in (router.port, router.aiohttp_port):  # the app's internal listener is the aiohttp front
        conn = await Conn.open(port)
        router.opened.append(conn)
        answers.append(await conn.ask(PARITY[name]))
    raw, aio = answers
    assert raw.status == aio.status, (raw.body[:200], aio.body[:200])
    if raw.status >= 400:
        assert raw.error()["type"] == aio.error()["type"]
    if name != "stream":
        assert (raw.header("content-type") or "").split(";")[0] == (aio.header("content-type") or "").split(";")[0]


# ---------------------------------------------------------------------- configuration


def test_the_front_setting() -> None:
    assert build_config(["--backend", "http://127.0.0.1:9"]).front.kind == "raw"
    assert build_config(["--backend", "http://127.0.0.1:9", "--front", "aiohttp"]).front.kind == "aiohttp"
    with pytest.raises(ConfigError, match="--front"):
        build_config(["--backend", "http://127.0.0.1:9", "--front", "nginx"])


# ------------------------------------------------------------------ real processes


def sse_request(port: int, body: dict[str, Any], session: str) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                 b"X-Session-ID: " + session.encode() + b"\r\nContent-Length: " + str(len(payload)).encode()
                 + b"\r\n\r\n" + payload)
    return sock


def read_until(sock: socket.socket, marker: bytes, seen: bytes = b"") -> bytes:
    while marker not in seen:
        data = sock.recv(65536)
        if not data:
            raise AssertionError(f"closed before {marker!r}: {seen[-300:]!r}")
        seen += data
    return seen


def scrape(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


@pytest.mark.slow
def test_process_disconnect_mid_stream_aborts_on_the_backend(tmp_path: Path) -> None:
    backend = start_backend(str(tmp_path), speed="1")
    router = start_router(str(tmp_path), "--backend", backend.url)
    try:
        before = metric_sum(scrape(backend.url), "vllm:request_success_total", finished_reason="abort")
        sock = sse_request(router.port, {"model": "session-sim", "prompt": "go on", "max_tokens": 2000,
                                         "ignore_eos": True, "stream": True}, "raw-gone")
        read_until(sock, b"data: ")
        sock.close()
        wait_until(lambda: metric_sum(scrape(backend.url), "vllm:request_success_total", finished_reason="abort")
                   == before + 1, what="the backend to count the abort")
        wait_until(lambda: metric_sum(scrape(backend.url), "vllm:num_requests_running") == 0, what="nothing running")
        wait_until(lambda: metric_sum(scrape(router.url), "session_router_backend_in_flight") == 0,
                   what="the router's in-flight count back to 0")
        assert router.stop() == 0
    finally:
        kill_alive(router, backend)
    assert "Traceback" not in router.log()


@pytest.mark.slow
def test_process_sigterm_lets_a_stream_finish_and_exits_0(tmp_path: Path) -> None:
    backend = start_backend(str(tmp_path), speed="1")
    router = start_router(str(tmp_path), "--backend", backend.url)
    try:
        sock = sse_request(router.port, {"model": "session-sim", "prompt": "count", "max_tokens": 40,
                                         "ignore_eos": True, "stream": True}, "raw-drain")
        seen = read_until(sock, b"data: ")
        os.kill(router.pid, signal.SIGTERM)
        seen = read_until(sock, b"data: [DONE]\n\n\r\n0\r\n\r\n", seen)  # the whole stream, cleanly ended
        assert seen.count(b'"finish_reason":null') + seen.count(b'"finish_reason":"length"') >= 40
        assert sock.recv(1) == b""  # then the connection closes
        sock.close()
        router.popen.wait(20)
        assert router.popen.returncode == 0
    finally:
        kill_alive(router, backend)
    assert "Traceback" not in router.log()


@pytest.mark.slow
def test_process_workers_and_the_aiohttp_front_serve_the_same_routes(tmp_path: Path) -> None:
    backend = start_backend(str(tmp_path))
    routers = [start_router(str(tmp_path), "--backend", backend.url, "--workers", "2"),
               start_router(str(tmp_path), "--backend", backend.url, "--front", "aiohttp")]
    try:
        for router in routers:
            for _ in range(4):
                sock = sse_request(router.port, {"model": "session-sim", "prompt": "hi", "max_tokens": 2,
                                                 "stream": True}, "raw-w")
                assert read_until(sock, b"data: [DONE]").startswith(b"HTTP/1.1 200")
                sock.close()
            assert "session_router_requests_total" in scrape(router.url)
        for router in routers:
            assert router.stop() == 0
    finally:
        kill_alive(*routers, backend)

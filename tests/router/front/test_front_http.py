"""HTTP/1.x correctness (RFC 9110/9112) on both fronts, and the fronts' resource bounds.

Each test writes raw bytes to a real router (the raw front, and the aiohttp front as
``router.serve.serve`` builds it: ``CappedAppRunner`` over the app), on 127.0.0.1 ephemeral
ports in front of in-process fake backends, and reads what comes back byte for byte.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from router.config import FrontConfig
from tests.conftest import MakeRouter
from tests.raw_http import GOOD, Conn, get, post, read_answer
from tests.router.front.conftest import Factory
from tests.support import eventually, kill_alive, wait_until

FRONTS = ["raw", "aiohttp"]


async def open_front(router: Any, front: str) -> Conn:
    conn = await Conn.open(router.port if front == "raw" else router.aiohttp_port)
    router.opened.append(conn)
    return conn


def closes(answer: Any) -> bool:
    """The answer says the connection closes after it (HTTP/1.0 answers may say so by saying nothing)."""
    connection = (answer.header("connection") or "").lower()
    return connection == "close" or (answer.version == "HTTP/1.0" and connection != "keep-alive")


def chunked(path: str, body: bytes, *, version: str = "1.1", extra: str = "", trailer: str = "") -> bytes:
    head = f"POST {path} HTTP/{version}\r\nHost: router\r\nContent-Type: application/json\r\n" \
           f"Transfer-Encoding: chunked\r\n{extra}\r\n"
    return head.encode() + b"%x\r\n%b\r\n0\r\n" % (len(body), body) + trailer.encode() + b"\r\n"


def completions_app(infer: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.Application:
    """A fake backend: ``infer`` answers POST /v1/completions, GET /health answers 200 ``ok``."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", infer)
    app.router.add_get("/health", health)
    return app


# ------------------------------------------------------------------- 4. trailer fields


@pytest.mark.parametrize("front", FRONTS)
async def test_trailer_fields_are_neither_forwarded_nor_used_for_routing(served: Factory, front: str) -> None:
    router = await served()
    conn = await open_front(router, front)
    answer = await conn.ask(chunked("/v1/completions", GOOD, extra="X-Session-ID: head-sid\r\n",
                                    trailer="X-Session-ID: trailer-sid\r\nX-Trailer-Field: t\r\n"))
    assert answer.status == 200, answer.body[:200]
    assert answer.header("x-session-id") == "head-sid"
    seen = router.fakes[0].seen[-1]
    assert seen.body == GOOD
    assert seen.headers["x-session-id"] == ["head-sid"]
    assert "x-trailer-field" not in seen.headers
    # a trailer is no session id either: without one in the head, the trailer's is ignored
    answer = await conn.ask(chunked("/v1/completions", GOOD, trailer="X-Session-ID: only-trailer\r\n"))
    assert answer.status == 200 and answer.header("x-session-id") != "only-trailer"
    assert router.fakes[0].seen[-1].headers.get("x-session-id") != ["only-trailer"]
    assert (await router.once(get("/v1/sessions/only-trailer"))).status == 404


# ------------------------------------------------------- 5. headers named in Connection


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/%63ompletions"])  # hot, and relayed on the raw front
async def test_headers_named_in_connection_are_not_forwarded(served: Factory, front: str, path: str) -> None:
    router = await served()
    conn = await open_front(router, front)
    answer = await conn.ask(post(path, extra=(
        "Connection: keep-alive, X-Hop-One ,x-hop-two\r\nX-Hop-One: 1\r\nX-HOP-TWO: 2\r\nX-End: 3\r\n"
        "Connection: X-Hop-Three\r\nX-Hop-Three: 4\r\n")))
    assert answer.status == 200, answer.body[:200]
    assert answer.header("connection") is None  # still keep-alive
    seen = router.fakes[0].seen[-1].headers
    assert seen["x-end"] == ["3"]
    for hop in ("x-hop-one", "x-hop-two", "x-hop-three", "connection", "keep-alive"):
        assert hop not in seen, hop
    assert (await conn.ask(post(path))).status == 200


# ------------------------------------------------- 6. HTTP/1.0 with Transfer-Encoding


@pytest.mark.parametrize("front", FRONTS)
async def test_http_1_0_with_transfer_encoding_closes_after_the_answer(served: Factory, front: str) -> None:
    router = await served()
    conn = await open_front(router, front)
    answer = await conn.ask(chunked("/v1/completions", GOOD, version="1.0", extra="Connection: keep-alive\r\n"))
    assert answer.status == 200, answer.body[:200]
    assert router.fakes[0].seen[-1].body == GOOD
    assert closes(answer)
    assert await conn.closed_by_peer()


# --------------------------------------------------------------------------- 7. Host


HOSTS = {
    "missing": b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n",
    "duplicated": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nHost: b\r\nContent-Length: %d\r\n\r\n",
    "duplicated_same": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nhost: a\r\nContent-Length: %d\r\n\r\n",
    "space": b"POST /v1/completions HTTP/1.1\r\nHost: a b\r\nContent-Length: %d\r\n\r\n",
    "slash": b"POST /v1/completions HTTP/1.1\r\nHost: a/b\r\nContent-Length: %d\r\n\r\n",
    "userinfo": b"POST /v1/completions HTTP/1.1\r\nHost: user@a\r\nContent-Length: %d\r\n\r\n",
    "bad_port": b"POST /v1/completions HTTP/1.1\r\nHost: a:port\r\nContent-Length: %d\r\n\r\n",
}


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("name", list(HOSTS))
async def test_a_missing_duplicated_or_invalid_host_is_a_400(served: Factory, front: str, name: str) -> None:
    router = await served()
    conn = await open_front(router, front)
    answer = await conn.ask(HOSTS[name] % len(GOOD) + GOOD)
    assert answer.status == 400, (name, answer.body[:200])
    assert "Host" in answer.error()["message"]
    assert closes(answer)
    assert await conn.closed_by_peer()
    assert not router.fakes[0].seen


@pytest.mark.parametrize("front", FRONTS)
async def test_good_hosts_and_http_1_0_without_host_are_served(served: Factory, front: str) -> None:
    router = await served()
    for host in ("router", "127.0.0.1:8000", "[::1]:8000", "example.com.", "xn--bcher-kva.example:80", ""):
        conn = await open_front(router, front)
        if host == "":  # HTTP/1.0 needs none
            data = b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%b" % (len(GOOD), GOOD)
        else:
            data = b"POST /v1/completions HTTP/1.1\r\nHost: %b\r\nContent-Length: %d\r\n\r\n%b" % (
                host.encode(), len(GOOD), GOOD)
        answer = await conn.ask(data)
        assert answer.status == 200, (host, answer.body[:200])


# ------------------------------------------------------------- 8. the head-size limit


def head_of(size: int) -> bytes:
    """A POST head of exactly ``size`` bytes (request line through the blank line), then its body."""

    start = f"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Length: {len(GOOD)}\r\n".encode()
    pads: list[bytes] = []
    room = size - len(start) - 2
    i = 0
    while room > 0:
        name = b"X-Pad-%03d" % i
        overhead = len(name) + 4  # name ": " value CRLF
        value_len = min(8000, room - overhead)  # fake backends take 8190-byte lines
        if value_len < 1:  # too little room left for a header: widen the previous one
            last = pads.pop()
            pads.append(last[:-2] + b"a" * room + b"\r\n")
            room = 0
            break
        pads.append(name + b": " + b"a" * value_len + b"\r\n")
        room -= overhead + value_len
        i += 1
    head = start + b"".join(pads) + b"\r\n"
    assert len(head) == size
    return head + GOOD


async def test_the_head_limit_counts_every_byte_of_the_head(served: Factory) -> None:
    MAX_HEAD_BYTES = FrontConfig().max_head_bytes  # the default

    router = await served()
    answer = await router.once(head_of(MAX_HEAD_BYTES))
    assert answer.status == 200, answer.body[:200]
    for size in (MAX_HEAD_BYTES + 1, MAX_HEAD_BYTES * 3 // 2, 2 * MAX_HEAD_BYTES - 1000):
        conn = await router.conn()
        answer = await conn.ask(head_of(size))
        assert answer.status == 400, (size, answer.body[:200])
        assert "head too large" in answer.error()["message"]
        assert await conn.closed_by_peer()
    # written in pieces, the count goes on across reads
    conn = await router.conn()
    data = head_of(MAX_HEAD_BYTES + 1)
    for i in range(0, len(data), 50_000):
        await conn.send(data[i:i + 50_000])
        await asyncio.sleep(0.01)  # separate reads (the result must not depend on it)
    answer = await read_answer(conn.reader)
    assert answer.status == 400
    assert len(router.fakes[0].seen) == 1
    # whitespace counts too (the parser does not report it)
    answer = await router.once(post("/v1/completions", extra="X-Pad:" + " " * MAX_HEAD_BYTES + "v\r\n"))
    assert answer.status == 400 and "head too large" in answer.error()["message"]
    assert len(router.fakes[0].seen) == 1
    # a head pipelined behind a request is counted on its own: at the limit it is served, past it
    # the connection closes after the answers before it (as for any malformed pipelined request)
    conn = await router.conn()
    await conn.send(post("/v1/completions") + head_of(MAX_HEAD_BYTES))
    assert (await read_answer(conn.reader)).status == 200
    assert (await read_answer(conn.reader)).status == 200
    await conn.send(post("/v1/completions") + head_of(MAX_HEAD_BYTES + 1))
    last = await read_answer(conn.reader)
    assert last.status == 200 and last.header("connection") == "close"
    assert await conn.closed_by_peer()


# ------------------------------------------------------------- 9. an upgrade offer


UPGRADE = "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"


@pytest.mark.parametrize("front", FRONTS)
async def test_an_upgrade_offer_is_ignored_and_the_request_served(served: Factory, front: str) -> None:
    router = await served()
    conn = await open_front(router, front)
    answer = await conn.ask(post("/v1/completions", extra=UPGRADE))
    assert answer.status == 200, answer.body[:200]
    assert answer.header("upgrade") is None and answer.header("connection") is None
    seen = router.fakes[0].seen[-1]
    assert seen.body == GOOD
    for hop in ("upgrade", "http2-settings", "connection"):
        assert hop not in seen.headers, hop
    # the connection stays HTTP/1.1: the next request on it, and a chunked upgrade offer, are answered too
    answer = await conn.ask(post("/v1/completions"))
    assert answer.status == 200
    answer = await conn.ask(chunked("/v1/completions", GOOD, extra=UPGRADE))
    assert answer.status == 200
    assert [s.body for s in router.fakes[0].seen] == [GOOD] * 3
    if front == "raw":  # (aiohttp's parser loses what follows an upgrade offer in the same read)
        await conn.send(chunked("/v1/completions", GOOD, extra=UPGRADE)
                        + post("/v1/completions", extra=UPGRADE + "X-Request-Id: after\r\n")
                        + post("/v1/completions", extra="X-Request-Id: last\r\n"))
        answers = [await read_answer(conn.reader) for _ in range(3)]
        assert [a.status for a in answers] == [200] * 3
        assert [a.header("x-request-id") for a in answers][1:] == ["after", "last"]
        assert [s.body for s in router.fakes[0].seen] == [GOOD] * 6
    # a GET offering websocket: served as a plain GET
    answer = await conn.ask(get("/health", extra="Connection: Upgrade\r\nUpgrade: websocket\r\n"))
    assert answer.status == 200


# ------------------------------------------- 10. the request that closes, then more bytes


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("closing", ["connection_close", "http_1_0"])
async def test_bytes_after_a_request_that_closes_are_discarded(served: Factory, front: str, closing: str) -> None:
    router = await served()
    conn = await open_front(router, front)
    request = post("/v1/completions", extra="Connection: close\r\n") if closing == "connection_close" else \
        post("/v1/completions", version="1.0")
    await conn.send(request + b"GARBAGE / HTTP/9\r\n\r\n" + post("/v1/completions"))
    answer = await read_answer(conn.reader)
    assert answer.status == 200, answer.body[:200]
    assert closes(answer)
    assert await conn.closed_by_peer()  # and no second answer
    assert len(router.fakes[0].seen) == 1


class Gated:
    """A backend whose (non-streamed) answers wait until the test opens the gate."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.arrived = asyncio.Event()

    def app(self) -> web.Application:
        async def infer(request: web.Request) -> web.Response:
            await request.read()
            self.arrived.set()
            await self.gate.wait()
            return web.json_response({"ok": True})

        return completions_app(infer)


@pytest.mark.parametrize("front", FRONTS)
async def test_answers_during_the_drain_say_connection_close(served: Factory, make_router: MakeRouter,
                                                             aiohttp_server: Any, front: str) -> None:
    gated = Gated()
    backend = await aiohttp_server(gated.app(), host="127.0.0.1")
    url = f"http://127.0.0.1:{backend.port}"
    if front == "raw":
        router = await served(backends=[url])
        conn = await open_front(router, front)
        drain = lambda: router.front.shutdown(30)  # noqa: E731
    else:  # the aiohttp front as router.serve.serve runs it: its drain is the runner's cleanup
        routed = await make_router("aiohttp", n=0, urls=[url], shutdown_timeout=30)
        assert routed.runner is not None
        conn = await Conn.open(routed.port)
        drain = routed.runner.cleanup
    try:
        await conn.send(post("/v1/completions"))
        await asyncio.wait_for(gated.arrived.wait(), 10)
        draining = asyncio.create_task(drain())
        await asyncio.sleep(0.05)  # the drain has begun (nothing below depends on more than that)
        gated.gate.set()
        answer = await read_answer(conn.reader)
        assert answer.status == 200 and answer.header("connection") == "close"
        assert await conn.closed_by_peer()
        await asyncio.wait_for(draining, 10)
    finally:
        conn.close()


# ------------------------------------------------ 12. pipelining to a client that never reads


class Bulky:
    """A backend whose answers are large (so that unread answers fill the socket buffers soon)."""

    def __init__(self, size: int) -> None:
        self.body = json.dumps({"data": "x" * size}).encode()
        self.count = 0

    def app(self) -> web.Application:
        async def infer(request: web.Request) -> web.Response:
            await request.read()
            self.count += 1
            return web.Response(body=self.body, content_type="application/json")

        return completions_app(infer)


@pytest.mark.parametrize("front", FRONTS)
async def test_pipelined_requests_wait_while_the_client_does_not_read(served: Factory, aiohttp_server: Any,
                                                                      front: str) -> None:
    import socket

    bulky = Bulky(128 * 1024)
    backend = await aiohttp_server(bulky.app(), host="127.0.0.1")
    router = await served(backends=[f"http://127.0.0.1:{backend.port}"])
    total = 1000  # 1,000 answers of 128 KiB: 125 MiB if the router answered them all into its buffers
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    sock.connect(("127.0.0.1", router.port if front == "raw" else router.aiohttp_port))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        requests = b"".join(post("/v1/completions", extra=f"X-Request-Id: p-{i}\r\n") for i in range(total))
        writer.write(requests)
        await writer.drain()

        # the router stops: the backend saw far fewer requests than were sent, and that stays so
        async def settled() -> bool:
            if front == "raw":  # the answers are not read, and nothing runs: the count is final
                conns = router.front.connections
                return bool(conns) and all(c.write_paused and c.task is None for c in conns)
            before = bulky.count
            await asyncio.sleep(0.3)
            return bulky.count == before

        await eventually(settled, timeout=20.0, what="the router to stop serving the unread pipeline")
        assert bulky.count < total // 5, bulky.count
        if front == "raw":
            from router.front.connection import FEED_BYTES, MAX_QUEUED

            conn = next(iter(router.front.connections))
            assert conn.transport is not None
            assert conn.transport.get_write_buffer_size() <= 512 * 1024  # high water + one answer
            # the requests not run yet are not all parsed and queued either: the rest waits as bytes
            assert len(conn._queue) <= MAX_QUEUED + FEED_BYTES // len(post("/v1/completions")), len(conn._queue)
        # the client reads: every answer comes, in order
        for i in range(total):
            answer = await read_answer(reader)
            assert answer.status == 200 and answer.header("x-request-id") == f"p-{i}"
            assert len(answer.body) == len(bulky.body)
        assert bulky.count == total
    finally:
        writer.close()


# ------------------------------------------------------------- 14. the connection bound


@pytest.mark.parametrize("front", FRONTS)
async def test_connections_over_max_connections_are_closed_at_once_and_logged_rarely(
        make_router: MakeRouter, front: str, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    router = await make_router(front, max_connections=2)
    fake, raw, port = router.fakes[0], router.raw, router.port
    opened: list[Conn] = []
    try:
        caplog.set_level("WARNING")
        for _ in range(2):
            conn = await Conn.open(port)
            opened.append(conn)
            assert (await conn.ask(post("/v1/completions"))).status == 200
        for _ in range(30):  # over the bound: closed at once, before any answer
            conn = await Conn.open(port)
            opened.append(conn)
            await conn.send(post("/v1/completions"))
            assert await conn.closed_by_peer()
        refusals = [r for r in caplog.records if "max_connections" in r.getMessage()]
        assert len(refusals) == 1, [r.getMessage() for r in refusals]  # one line per 10 s, not 30
        assert len(fake.seen) == 2
        # the two connections inside the bound still serve; once one closes, a new one is taken
        assert (await opened[0].ask(post("/v1/completions"))).status == 200
        opened[1].close()
        if raw is not None:
            await eventually(lambda: len(raw.connections) == 1, timeout=10.0, what="the front to forget it")

        async def accepted() -> bool:
            conn = await Conn.open(port)
            opened.append(conn)
            try:
                return (await conn.ask(post("/v1/completions"))).status == 200
            except (ConnectionError, asyncio.IncompleteReadError):
                return False

        await eventually(accepted, timeout=10.0, what="a connection within the bound again")
    finally:
        for conn in opened:
            conn.close()


EMFILE_SCRIPT = r"""
import asyncio, resource, sys, logging
logging.basicConfig(level="WARNING", stream=sys.stderr)
resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
from router.http_server import limit_accept_error_logs

class Hold(asyncio.Protocol):
    pass

async def main():
    loop = asyncio.get_running_loop()
    limit_accept_error_logs(loop)
    server = await loop.create_server(Hold, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(float(sys.argv[1]))

asyncio.run(main())  # asyncio's own loop: it logs every failed accept() with a traceback
"""


def test_out_of_file_descriptors_is_logged_at_a_bounded_rate(tmp_path: Any) -> None:
    import socket
    import subprocess
    import sys
    import time

    from tests.support import REPO

    err_path = tmp_path / "stderr.log"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", EMFILE_SCRIPT, "4"], stdout=subprocess.PIPE, stderr=err,
                                cwd=str(REPO))
    held: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # far more connections than the child has descriptors
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:
                pass
        assert len(held) > 32
        assert proc.wait(20) == 0
    finally:
        for sock in held:
            sock.close()
        if proc.poll() is None:
            proc.kill()
    log = err_path.read_text()
    assert log.count("cannot accept connections") == 1, log[:2000]
    assert "Too many open files" in log and "Traceback" not in log
    assert len(log) < 2000


async def test_large_bodies_and_many_pipelined_requests_parse_piece_by_piece(served: Factory) -> None:
    from router.front.connection import MAX_QUEUED

    router = await served(max_body_bytes=8 * 1024 * 1024)
    body = json.dumps({"model": "m", "prompt": "p" * (900 * 1024)}).encode()  # (the fake takes up to 1 MiB)
    conn = await router.conn()
    answer = await conn.ask(post("/v1/completions", body))
    assert answer.status == 200 and router.fakes[0].seen[-1].body == body
    answer = await conn.ask(chunked("/v1/completions", body))
    assert answer.status == 200 and router.fakes[0].seen[-1].body == body
    # more pipelined requests than MAX_QUEUED in one write, the client reading as it goes: all answered
    count = MAX_QUEUED * 10
    await conn.send(b"".join(get("/health", extra=f"X-Request-Id: h-{i}\r\n") for i in range(count)))
    for i in range(count):
        answer = await read_answer(conn.reader)
        assert answer.status == 200 and answer.header("x-request-id") == f"h-{i}"


ROUTER_WITH_FEW_FDS = r"""
import resource, runpy, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
sys.modules["uvloop"] = None  # asyncio's own loop, as without the `fast` extra: it logs every failed accept()
sys.argv = ["session-router", *sys.argv[1:]]
runpy.run_module("router", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("front", FRONTS)
def test_process_out_of_file_descriptors_keeps_a_small_log_and_recovers(tmp_path: Any, front: str) -> None:
    import socket
    import sys
    import time

    from tests.support import LOOPBACK, REPO, free_port, http_status, start_backend
    from bench.procs import launch

    backend = start_backend(str(tmp_path))
    port = free_port()
    router = launch("router", [sys.executable, "-c", ROUTER_WITH_FEW_FDS, "--host", LOOPBACK, "--port", str(port),
                               "--backend", backend.url, "--front", front, "--log-level", "info"],
                    port, str(tmp_path), cwd=str(REPO))
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and len(held) < 600:  # ten times the router's descriptors
            try:
                sock = socket.create_connection((LOOPBACK, port), timeout=1)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
                held.append(sock)
            except OSError:
                pass
        for sock in held:
            sock.close()
        held.clear()
        wait_until(lambda: http_status(router.url + "/health") == 200, what="the router to serve again")
        assert router.stop() == 0
    finally:
        for sock in held:
            sock.close()
        kill_alive(router, backend)
    log = router.log()
    assert len(log) < 4000, log[:4000]
    assert "Traceback" not in log


@pytest.mark.parametrize("front", FRONTS)
async def test_a_compressed_request_body_is_forwarded_with_its_encoding(make_router: MakeRouter, front: str) -> None:
    import gzip

    import aiohttp

    routed = await make_router(front)
    plain = b'{"model": "m", "input": "hello"}'
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        async with http.post(f"http://127.0.0.1:{routed.port}/v1/embeddings", data=gzip.compress(plain),
                             headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}) as resp:
            assert resp.status == 200, await resp.text()
    seen = routed.fakes[0].seen[-1]
    assert seen.headers["content-encoding"] == ["gzip"] and seen.body == plain  # the backend decoded it once

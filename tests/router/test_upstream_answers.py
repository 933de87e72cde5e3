"""What the router does with what backends answer, on both fronts (issue 11, items 11, 13, 15, 18, 22).

Every test runs the router in-process as ``router.serve.serve`` assembles it: the app from
``router.app.create_app`` on an aiohttp listener (the aiohttp front) and ``RawFront`` on its own
port (the raw front), both on 127.0.0.1 ephemeral ports. Requests are written raw over sockets,
so the bytes a client gets are exactly what a test reads. Backends are either
``tests.fakes.EchoBackend`` or ``Scripted``: a raw asyncio server that answers with whatever
bytes a test gives it (stalls, breaks, oversized or malformed answers).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from contract.errors import ConfigError
from contract.ids import session_hash
from router.access_log import ACCESS_LOGGER, BatchingHandler
from router.app import create_app
from router.config import BackendConfig, build_config, config_from_mapping
from router.http_server import CappedAppRunner
from router.proxy import event_boundary
from router.state import RouterState
from tests.conftest import MakeRouter
from tests.fakes import EchoBackend
from tests.raw_http import Answer, RawServer, ServerConn, post, read_answer
from tests.support import eventually, router_config

FRONTS = ["raw", "aiohttp"]
GOOD = b'{"model": "m", "prompt": "hello", "session_id": "sess-1"}'
STREAM = b'{"model": "m", "prompt": "hello", "stream": true, "session_id": "sess-1"}'


# ----------------------------------------------------------------------------- a scripted backend


Script = Callable[[ServerConn], Awaitable[None]]


class Scripted(RawServer):
    """A backend that answers GETs (health checks) with 200 and runs ``script`` (set by the test) on a
    connection's first other request."""

    def __init__(self) -> None:
        super().__init__(self._serve)
        self.script: Script | None = None

    async def _serve(self, conn: ServerConn) -> None:
        assert self.script is not None
        while (request := await conn.read_request()) is not None and request.startswith(b"GET "):  # health checks: fine
            await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        if request is not None:
            await self.script(conn)


async def wait_router_close(conn: ServerConn) -> None:
    await asyncio.wait_for(conn.closed_by_peer(), 10)


# ----------------------------------------------------------------------------- the router, both fronts


@dataclass
class Router:
    raw_port: int
    aiohttp_port: int
    state: RouterState
    fakes: list[EchoBackend] = field(default_factory=list)

    def port(self, front: str) -> int:
        return self.raw_port if front == "raw" else self.aiohttp_port

    async def ask(self, front: str, data: bytes) -> Answer:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port(front))
        try:
            writer.write(data)
            await writer.drain()
            return await read_answer(reader, timeout=15)
        finally:
            writer.close()

    def in_flight(self) -> int:
        return sum(b.in_flight for pool in self.state.pools.values() for b in pool.members)


Factory = Callable[..., Awaitable[Router]]


@pytest.fixture
def router(make_router: MakeRouter) -> Factory:
    async def make(*, backends: list[str] | None = None, n: int = 1, **overrides: Any) -> Router:
        settings: dict[str, Any] = {"retries": 0}
        settings.update(overrides)
        served = await make_router("raw", n=0 if backends is not None else n, urls=backends or [], **settings)
        return Router(served.port, served.aiohttp_port, served.state, served.fakes)

    return make


@pytest.fixture
async def scripted() -> AsyncIterator[Scripted]:
    backend = Scripted()
    await backend.start()
    yield backend
    await backend.stop()


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces)


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def sse_events(body: bytes) -> list[str]:
    """The data of each event an SSE client dispatches (WHATWG parsing: CRLF, LF or CR end a line)."""
    events: list[str] = []
    data: list[str] | None = None
    for line in re.split(r"\r\n|\n|\r", body.decode()):
        if line == "":
            if data is not None:
                events.append("\n".join(data))
            data = None
        elif line.startswith("data:"):
            value = line[5:]
            (data := data if data is not None else []).append(value[1:] if value.startswith(" ") else value)
    return events  # an event not ended by a blank line is never dispatched


# ============================================================================ item 11: SSE error event boundary


@pytest.mark.parametrize("tail,expected", [
    (b"data: {}\n\n", b""),
    (b"data: {}\r\n\r\n", b"\n"),  # an extra blank line is harmless
    (b"data: {}\n", b"\n"),
    (b"\n", b"\n"),
    (b"data: {}\r\n", b"\n"),
    (b"data: {\"par", b"\n\n"),
    (b"data: x\r", b"\n\n"),
])
def test_event_boundary(tail: bytes, expected: bytes) -> None:
    assert event_boundary(tail) == expected
    events = sse_events(b"data: first\n\n" + tail + expected + b"data: ERR\n\n")
    assert events[-1] == "ERR"


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("how", ["breaks", "stalls"])
@pytest.mark.parametrize("cut", [b'data: {"i": 1, "te', b'data: {"i": 1}\n', b'data: {"i": 1}\r\n', b"data: {\"i\": 1}"])
async def test_the_error_event_starts_on_an_event_boundary(router: Factory, scripted: Scripted, front: str,
                                                           how: str, cut: bytes) -> None:
    async def script(conn: ServerConn) -> None:
        await conn.send(SSE_HEAD + chunked(b'data: {"i": 0}\n\n', cut))
        if how == "stalls":
            await conn.closed_by_peer()  # the router gives up (total_timeout_s) and closes
        # "breaks": the connection closes mid-event

    scripted.script = script
    r = await router(backends=[f"http://127.0.0.1:{scripted.port}"], total_timeout_s=1.0)
    answer = await r.ask(front, post("/v1/completions", STREAM))
    assert answer.status == 200
    events = sse_events(answer.body)
    assert events[0] == '{"i": 0}'
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]  # the error event parses on its own
    assert error["code"] == (504 if how == "stalls" else 502)
    assert set(error) == {"message", "type", "param", "code"}
    assert r.in_flight() == 0


# ============================================================================ item 13: bounds on backends' answers


@pytest.mark.parametrize("front", FRONTS)
async def test_an_oversized_response_head_is_a_502_and_the_connection_closes(router: Factory, scripted: Scripted,
                                                                              front: str) -> None:
    closed = asyncio.Event()

    async def script(conn: ServerConn) -> None:
        big = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"a" * 1000) for i in range(100))  # ~100 KB of headers
        try:
            await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + big)
            await conn.send(b"Content-Length: 2\r\n\r\n{}")
        except ConnectionError:
            pass
        await wait_router_close(conn)
        closed.set()

    scripted.script = script
    r = await router(backends=[f"http://127.0.0.1:{scripted.port}"], max_upstream_head_bytes=16 * 1024)
    answer = await r.ask(front, post("/v1/completions", GOOD))
    assert answer.status == 502
    error = answer.error()
    assert "max_upstream_head_bytes" in error["message"] and "16384" in error["message"]
    await asyncio.wait_for(closed.wait(), 10)
    assert r.in_flight() == 0
    assert not r.state.upstream.stats()  # nothing kept for reuse


@pytest.mark.parametrize("over", [0, 1])
async def test_the_head_bound_counts_every_byte_across_reads(router: Factory, scripted: Scripted, over: int) -> None:
    limit = 4096
    start = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\nX-Fill: "
    head = start + b"a" * (limit - len(start) - 4 + over) + b"\r\n\r\n"
    assert len(head) == limit + over

    async def script(conn: ServerConn) -> None:
        try:
            for i in range(0, len(head), 7):  # many small segments: the bound counts across reads
                await conn.send(head[i:i + 7])
            await conn.send(b"{}")
        except ConnectionError:
            pass
        await conn.closed_by_peer()

    scripted.script = script
    r = await router(backends=[f"http://127.0.0.1:{scripted.port}"], max_upstream_head_bytes=limit)
    answer = await r.ask("raw", post("/v1/completions", GOOD))
    if over:
        assert answer.status == 502 and "max_upstream_head_bytes" in answer.error()["message"]
    else:
        assert answer.status == 200 and answer.body == b"{}"


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("framing", ["content-length", "chunked", "close"])
async def test_an_oversized_buffered_body_is_a_502_and_the_connection_closes(router: Factory, scripted: Scripted,
                                                                             front: str, framing: str) -> None:
    closed = asyncio.Event()
    size = 3 * 1024 * 1024
    body = b'{"pad": "' + b"a" * (size - 11) + b'"}'

    async def script(conn: ServerConn) -> None:
        try:
            if framing == "content-length":
                await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                % len(body))
                await conn.send(body)
            elif framing == "chunked":
                await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                b"Transfer-Encoding: chunked\r\n\r\n")
                for i in range(0, len(body), 65536):
                    await conn.send(chunked(body[i:i + 65536]))
                await conn.send(b"0\r\n\r\n")
            else:
                await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
                await conn.send(body)
        except ConnectionError:
            pass
        await wait_router_close(conn)
        closed.set()

    scripted.script = script
    limit = 1024 * 1024
    r = await router(backends=[f"http://127.0.0.1:{scripted.port}"], max_upstream_body_bytes=limit)
    answer = await r.ask(front, post("/v1/completions", GOOD))
    assert answer.status == 502
    error = answer.error()
    assert "max_upstream_body_bytes" in error["message"] and str(limit) in error["message"]
    await asyncio.wait_for(closed.wait(), 10)
    assert r.in_flight() == 0
    entry = r.state.sessions.get("sess-1")
    assert entry is not None and entry.errors == 1


@pytest.mark.parametrize("front", FRONTS)
async def test_a_stream_longer_than_the_body_bound_is_relayed_whole(router: Factory, scripted: Scripted,
                                                                    front: str) -> None:
    event = b'data: {"pad": "' + b"a" * 4000 + b'"}\n\n'

    async def script(conn: ServerConn) -> None:
        await conn.send(SSE_HEAD)
        for _ in range(100):  # ~400 KB through a router that buffers at most 64 KiB of a whole answer
            await conn.send(chunked(event))
        await conn.send(chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await conn.closed_by_peer()

    scripted.script = script
    r = await router(backends=[f"http://127.0.0.1:{scripted.port}"], max_upstream_body_bytes=65536)
    answer = await r.ask(front, post("/v1/completions", STREAM))
    assert answer.status == 200
    assert answer.body == event * 100 + b"data: [DONE]\n\n"


def test_the_bounds_are_settings() -> None:
    config = build_config(["--backend", "http://127.0.0.1:8100"])
    assert (config.upstream.max_head_bytes, config.upstream.max_body_bytes) == (64 * 1024, 64 * 1024 * 1024)
    for key in ("max_upstream_head_bytes", "max_upstream_body_bytes"):
        with pytest.raises(ConfigError, match=key):
            config_from_mapping({"backends": [{"url": "http://127.0.0.1:8100"}], key: 10})


# ============================================================================ item 15: status, header bytes, encoding


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("status", [b"000", b"099", b"600", b"999"])
async def test_a_status_outside_100_599_is_a_502(router: Factory, scripted: Scripted, front: str,
                                                 status: bytes) -> None:
    async def script(conn: ServerConn) -> None:
        await conn.send(b"HTTP/1.1 " + status + b" Odd\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        await conn.closed_by_peer()

    scripted.script = script
    r = await router(backends=[f"http://127.0.0.1:{scripted.port}"])
    answer = await r.ask(front, post("/v1/completions", GOOD))
    assert answer.status == 502
    assert status.decode() in answer.error()["message"] and "100-599" in answer.error()["message"]
    assert r.in_flight() == 0


@pytest.mark.parametrize("front", FRONTS)
async def test_non_ascii_header_bytes_pass_through_unchanged(router: Factory, scripted: Scripted, front: str) -> None:
    utf8 = "café – 東京".encode()
    raw = b"caf\xe9 \xff\x80"  # not UTF-8

    async def script(conn: ServerConn) -> None:
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Utf8: " + utf8
                        + b"\r\nX-Raw: " + raw + b"\r\nContent-Length: 2\r\n\r\n{}")
        await conn.closed_by_peer()

    scripted.script = script
    r = await router(backends=[f"http://127.0.0.1:{scripted.port}"])
    answer = await r.ask(front, post("/v1/completions", GOOD))
    assert answer.status == 200
    assert b"\r\nX-Utf8: " + utf8 + b"\r\n" in answer.head
    if front == "raw":
        assert b"\r\nX-Raw: " + raw + b"\r\n" in answer.head
    # aiohttp's header writer cannot emit bytes that are not UTF-8 (it drops them): on that front
    # only UTF-8 is byte-exact (see the README); the raw front is the default


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("stream", [False, True])
async def test_an_encoded_body_is_relayed_byte_for_byte_with_its_content_encoding(
        router: Factory, scripted: Scripted, front: str, stream: bool) -> None:
    if stream:
        plain = b"".join(b'data: {"i": %d}\n\n' % i for i in range(50)) + b"data: [DONE]\n\n"
        kind = b"text/event-stream"
    else:
        plain = json.dumps({"id": "x", "choices": [{"text": "hello " * 200}],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}).encode()
        kind = b"application/json"
    encoded = gzip.compress(plain, mtime=0)

    async def script(conn: ServerConn) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: " + kind + b"\r\nContent-Encoding: gzip\r\n"
        if stream:
            half = len(encoded) // 2
            await conn.send(head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(encoded[:half]))
            await conn.send(chunked(encoded[half:]) + b"0\r\n\r\n")
        else:
            await conn.send(head + b"Content-Length: %d\r\n\r\n" % len(encoded) + encoded)
        await conn.closed_by_peer()

    scripted.script = script
    r = await router(backends=[f"http://127.0.0.1:{scripted.port}"])
    answer = await r.ask(front, post("/v1/completions", STREAM if stream else GOOD))
    assert answer.status == 200
    assert answer.header("content-encoding") == "gzip"
    assert answer.body == encoded
    assert gzip.decompress(answer.body) == plain


@pytest.mark.parametrize("front", FRONTS)
async def test_an_encoded_stream_that_breaks_gets_no_plain_text_appended(router: Factory, scripted: Scripted,
                                                                        front: str) -> None:
    plain = b"".join(b'data: {"i": %d}\n\n' % i for i in range(50))
    encoded = gzip.compress(plain, mtime=0)
    half = encoded[: len(encoded) // 2]

    async def script(conn: ServerConn) -> None:
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n" + chunked(half))
        # then the connection breaks

    scripted.script = script
    r = await router(backends=[f"http://127.0.0.1:{scripted.port}"])
    answer = await r.ask(front, post("/v1/completions", STREAM))
    assert answer.status == 200 and answer.header("content-encoding") == "gzip"
    assert answer.body == half  # the client's gzip decoder sees an unfinished stream, not garbage
    with pytest.raises(EOFError):
        gzip.decompress(answer.body)
    assert r.in_flight() == 0


# ============================================================================ item 18: the access log


def own_handlers() -> list[logging.Handler]:
    """The access log's handlers on its logger (pytest adds capture handlers of its own)."""
    return [h for h in logging.getLogger(ACCESS_LOGGER).handlers if isinstance(h, BatchingHandler)]


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_the_access_log_has_one_line_per_request(router: Factory, tmp_path: Path, front: str,
                                                       fmt: str) -> None:
    path = tmp_path / "access.log"
    r = await router(n=2, access_log=fmt, access_log_file=str(path))
    ok = await r.ask(front, post("/v1/completions", GOOD, extra="X-Request-Id: rid-1\r\n"))
    assert ok.status == 200
    stream = await r.ask(front, post("/v1/chat/completions",
                                     b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
                                     b'"stream": true, "stream_options": {"include_usage": true}, '
                                     b'"session_id": "sess-1"}'))
    assert stream.status == 200
    bad = await r.ask(front, post("/v1/completions", b'{"prompt": "x", "session_id": 7}',
                                  extra="X-Request-Id: rid \"quoted\" x=1\r\n"))
    assert bad.status == 400
    await eventually(lambda: len(path.read_text().splitlines()) == 3, timeout=5, what="three access lines")
    text = path.read_text()
    assert "sess-1" not in text  # the session is hashed, never written as is
    if fmt == "json":
        lines = [json.loads(line) for line in text.splitlines()]
    else:
        lines = [parse_text_line(line) for line in text.splitlines()]
    first, second, third = lines
    assert first["method"] == "POST" and first["route"] == "/v1/completions"
    assert int(first["status"]) == 200 and first["request_id"] == "rid-1"
    assert first["session"] == session_hash("sess-1") and len(first["session"]) == 16
    names = {b.name for b in r.state.serving_pool.members}
    assert first["backend"] in names and first["placement"] == "new"
    assert (int(first["prompt_tokens"]), int(first["completion_tokens"]), int(first["cached_tokens"])) == (10, 3, 4)
    assert 0 < float(first["ttfb_ms"]) <= float(first["duration_ms"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    assert second["route"] == "/v1/chat/completions" and second["placement"] == "sticky"
    assert second["backend"] == first["backend"] and int(second["status"]) == 200
    assert int(second["prompt_tokens"]) == 10  # from the stream's usage chunk
    assert int(third["status"]) == 400 and third["request_id"] == 'rid "quoted" x=1'
    for absent in ("backend", "ttfb_ms", "placement", "prompt_tokens", "session"):
        assert third[absent] in (None, "-")


def parse_text_line(line: str) -> dict[str, Any]:
    """``key=value`` pairs; a value is either plain (no spaces) or a JSON string."""
    out: dict[str, Any] = {}
    for match in re.finditer(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)', line):
        value = match[2]
        out[match[1]] = json.loads(value) if value.startswith('"') else value
    return out


async def test_the_access_log_records_a_client_that_went_away(router: Factory, tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    r = await router(access_log="json", access_log_file=str(path))
    r.fakes[0].stall = True
    reader, writer = await asyncio.open_connection("127.0.0.1", r.raw_port)
    writer.write(post("/v1/completions", GOOD))
    await writer.drain()
    await asyncio.wait_for(r.fakes[0].stalled.wait(), 10)
    writer.close()
    await eventually(lambda: path.exists() and bool(path.read_text()), timeout=5, what="the access line")
    line = json.loads(path.read_text())
    assert line["status"] == 499 and line["ttfb_ms"] is None
    assert line["backend"] == r.state.serving_pool.members[0].name


async def test_the_access_log_is_off_by_default(router: Factory) -> None:
    r = await router()
    assert r.state.config.front.access_log == "off"
    assert r.state.access_log is None and r.state.serving_pool is not None
    assert not own_handlers()
    assert (await r.ask("raw", post("/v1/completions", GOOD))).status == 200


async def test_the_access_log_handler_goes_with_the_app(aiohttp_server: Any, tmp_path: Path) -> None:
    config = router_config(backends=[BackendConfig("http://127.0.0.9:9")], access_log="text",
                          access_log_file=str(tmp_path / "a.log"), health_interval_s=3600.0)
    runner = CappedAppRunner(create_app(config), access_log=None, handle_signals=False)
    await runner.setup()
    assert len(own_handlers()) == 1
    await runner.cleanup()
    assert not own_handlers()


def test_access_log_flags() -> None:
    config = build_config(["--backend", "http://127.0.0.1:8100", "--access-log", "json",
                           "--access-log-file", "/tmp/x.log"])
    assert (config.front.access_log, config.front.access_log_file) == ("json", "/tmp/x.log")
    with pytest.raises(ConfigError, match="--access-log"):
        build_config(["--backend", "http://127.0.0.1:8100", "--access-log", "verbose"])


# ============================================================================ item 22: session_header


@pytest.mark.parametrize("front", FRONTS)
async def test_a_configured_session_header_is_read_echoed_and_forwarded_as_x_session_id(router: Factory,
                                                                                         front: str) -> None:
    r = await router(session_header="X-Conversation-Id")
    fake = r.fakes[0]
    body = b'{"model": "m", "prompt": "hello"}'
    answer = await r.ask(front, post("/v1/completions", body,
                                     extra="X-Conversation-Id: conv-7\r\nX-Session-ID: ignored\r\n"))
    assert answer.status == 200
    assert answer.header("x-conversation-id") == "conv-7"
    assert answer.header("x-session-id") is None
    seen = fake.seen[-1]
    assert seen.headers["x-session-id"] == ["conv-7"]  # what vLLM reads
    assert "x-conversation-id" not in seen.headers
    # the contract's precedence: body session_id > the header > vllm_xargs
    answer = await r.ask(front, post("/v1/completions", b'{"prompt": "x", "session_id": "from-body"}',
                                     extra="X-Conversation-Id: conv-7\r\n"))
    assert answer.header("x-conversation-id") == "from-body"
    answer = await r.ask(front, post("/v1/completions", b'{"prompt": "x", "vllm_xargs": {"session_id": "xa"}}',
                                     extra="X-Conversation-Id: conv-8\r\n"))
    assert answer.header("x-conversation-id") == "conv-8"
    # the tokens-in route reads the configured header too
    answer = await r.ask(front, post("/inference/v1/generate", b'{"token_ids": [1, 2]}',
                                     extra="X-Conversation-Id: conv-9\r\n"))
    assert answer.header("x-conversation-id") == "conv-9" and fake.seen[-1].headers["x-session-id"] == ["conv-9"]
    # conflicts and bad values name the configured header
    answer = await r.ask(front, post("/v1/completions", body,
                                     extra="X-Conversation-Id: a\r\nX-Conversation-Id: b\r\n"))
    assert answer.status == 400 and "X-Conversation-Id" in answer.error()["message"]
    assert r.state.sessions.get("conv-7") is not None and r.state.sessions.get("ignored") is None


@pytest.mark.parametrize("front", FRONTS)
async def test_errors_echo_the_configured_session_header(router: Factory, front: str) -> None:
    r = await router(session_header="X-Conversation-Id")
    r.fakes[0].status = 503
    answer = await r.ask(front, post("/v1/completions", b'{"prompt": "x"}', extra="X-Conversation-Id: c1\r\n"))
    assert answer.status == 503 and answer.header("x-conversation-id") == "c1"
    assert answer.header("x-session-id") is None


def test_session_header_setting() -> None:
    config = build_config(["--backend", "http://127.0.0.1:8100", "--session-header", "X-Conversation-Id"])
    assert config.sessions.header == "X-Conversation-Id"
    assert build_config(["--backend", "http://127.0.0.1:8100"]).sessions.header == "X-Session-ID"
    for bad in ("Host", "X-Request-Id", "Content-Length", "Connection", "bad header", ""):
        with pytest.raises(ConfigError, match="--session-header"):
            build_config(["--backend", "http://127.0.0.1:8100", "--session-header", bad])


# ============================================================================ the flags, on real processes


@pytest.mark.slow
def test_process_access_log_on_stderr_and_session_header(tmp_path: Path) -> None:
    import urllib.request

    from tests.support import start_backend, start_router, wait_until

    backend = start_backend(str(tmp_path))
    try:
        router = start_router(str(tmp_path), "--backend", backend.url, "--access-log", "text",
                              "--session-header", "X-Conversation-Id")
        try:
            request = urllib.request.Request(
                router.url + "/v1/completions", method="POST",
                data=b'{"model": "session-sim", "prompt": "hello there", "max_tokens": 2}',
                headers={"Content-Type": "application/json", "X-Conversation-Id": "conv-process-1"})
            with urllib.request.urlopen(request, timeout=10) as resp:
                assert resp.status == 200
                assert resp.headers["X-Conversation-Id"] == "conv-process-1"
                assert resp.headers.get("X-Session-ID") is None
            wait_until(lambda: "route=/v1/completions" in router.log(), timeout=10, what="the access line")
            line = next(x for x in router.log().splitlines() if "route=/v1/completions" in x)
            fields = parse_text_line(line)
            assert fields["status"] == "200" and fields["session"] == session_hash("conv-process-1")
            assert int(fields["completion_tokens"]) == 2 and fields["backend"] == backend.url
            assert "conv-process-1" not in router.log()
        finally:
            assert router.stop() == 0
    finally:
        backend.stop()

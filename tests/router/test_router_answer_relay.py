"""What the proxy relays of a backend's answer, through a raw-front router and a scripted backend (real
HTTP on loopback): the headers it sets itself replace the backend's (the upstream pool leaves those out
as it parses the head), and a stream's last piece goes out with the stream's end when both arrived
together (one send), or on its own when the backend ends the stream later."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from contract.errors import ConfigError
from router import app as app_module
from router.app import create_app
from router.config import BackendConfig
from router.front.raw_exchange import Exchange
from tests.conftest import MakeRouter
from tests.support import router_config

FIRST = b'data: {"i": 0}\n\n'
DONE = b"data: [DONE]\n\n"
RELEASE = web.AppKey("release", asyncio.Event)


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    own = {"X-Session-ID": "backend-session", "X-Request-ID": "backend-request", "Server": "backend/1",
           "X-Session-Router-Decision": "forged", "X-Custom": "kept"}
    if not body.get("stream"):
        return web.json_response({"id": "c", "choices": [{"text": "hi"}]}, headers=own)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **own})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    await resp.write(FIRST)
    if body["prompt"] == "together":
        await resp.write_eof(DONE)  # the last piece and the chunked body's end in one send
        return resp
    await resp.write(DONE)
    await asyncio.wait_for(request.app[RELEASE].wait(), 10)  # the end only once the client has the piece
    await resp.write_eof()
    return resp


async def _health(request: web.Request) -> web.Response:
    return web.json_response({})


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})


@pytest.fixture
async def routed(make_router: MakeRouter, aiohttp_server: Any) -> tuple[str, asyncio.Event]:
    app = web.Application()
    app[RELEASE] = asyncio.Event()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    backend = await aiohttp_server(app, host="127.0.0.1")
    router = await make_router("raw", n=0, urls=[str(backend.make_url("")).rstrip("/")])
    return router.url, app[RELEASE]


async def test_the_router_sets_its_own_headers_instead_of_the_backends(routed: tuple[str, asyncio.Event]) -> None:
    url, _ = routed
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions", headers={"X-Session-ID": "s", "X-Request-ID": "r-1"},
                             json={"model": "m", "prompt": "x"}) as resp:
            assert resp.status == 200
            await resp.read()
            headers = resp.headers
    assert headers.getall("X-Session-ID") == ["s"]
    assert headers.getall("X-Request-ID") == ["r-1"]
    assert "X-Session-Router-Decision" not in headers  # decision_header is off: the backend's is not relayed
    assert len(headers.getall("Date")) == 1
    assert headers.getall("Server") != ["backend/1"]
    assert headers.getall("X-Custom") == ["kept"]
    assert headers["Content-Type"].startswith("application/json")


@pytest.mark.parametrize("mode", ["together", "apart"])
async def test_a_streams_last_piece_goes_with_its_end_when_they_came_together(
        routed: tuple[str, asyncio.Event], monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    url, release = routed
    writes: list[bytes] = []
    ends: list[bytes] = []
    write, end = Exchange.write, Exchange.end

    async def recorded_write(self: Exchange, data: bytes) -> None:
        writes.append(data)
        await write(self, data)

    async def recorded_end(self: Exchange, last: bytes = b"") -> None:
        ends.append(last)
        await end(self, last)

    monkeypatch.setattr(Exchange, "write", recorded_write)
    monkeypatch.setattr(Exchange, "end", recorded_end)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions", headers={"X-Session-ID": "s"},
                             json={"model": "m", "prompt": mode, "stream": True}) as resp:
            assert resp.status == 200
            assert resp.headers.getall("X-Session-ID") == ["s"] and resp.headers.getall("X-Custom") == ["kept"]
            received = await asyncio.wait_for(resp.content.readuntil(DONE), 10)
            release.set()
            received += await asyncio.wait_for(resp.read(), 10)
    assert received == FIRST + DONE
    assert b"".join(writes) + b"".join(ends) == received and len(ends) == 1
    if mode == "together":  # the stream's end came with its last piece: one send for both
        assert ends[0].endswith(DONE) and all(DONE not in data for data in writes)
    else:  # the end came later: the piece went out as it came, the end on its own
        assert ends == [b""] and writes[-1].endswith(DONE)


def test_the_proxy_refuses_a_pool_that_would_relay_its_own_headers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy relays a backend's headers as the pool parsed them: a pool that keeps the ones the proxy
    sets itself (``response_drops``) is a wiring error, refused at start-up."""
    monkeypatch.setattr(app_module, "response_drops", lambda session_header: frozenset({"date"}))
    with pytest.raises(ConfigError) as info:
        create_app(router_config(backends=[BackendConfig("http://127.0.0.9:9")]))
    assert "drop_headers" in info.value.message

"""Security of the router: the admin API's bearer token (constant-time) and its own port, no
session id or request body in the logs, and no way to make the router connect anywhere but
its configured backends.

In-process tests run ``router.app.create_app`` (and ``create_admin_app``) on 127.0.0.1 in front of
``tests.fakes.EchoBackend`` servers, which record what reached them. The logging test runs the
real ``python -m router`` at DEBUG and reads its log. The "elsewhere" probes name 127.0.0.77, a
loopback address where only the test's own listener lives: it proves no connection arrives.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from router import admin as admin_module
from router.state import ROUTER_STATE
from tests.conftest import MakeRouter
from tests.fakes import EchoBackend
from tests.support import kill_alive, start_backend, start_router

TOKEN = "adm-5ecret-Token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
Factory = Callable[..., Awaitable[tuple[TestClient, list[EchoBackend]]]]


@pytest.fixture
def router(make_router: MakeRouter) -> Factory:
    async def make(n: int = 2, **overrides: Any) -> tuple[TestClient, list[EchoBackend]]:
        served = await make_router("client", n=n, **overrides)
        assert served.client is not None
        return served.client, served.fakes

    return make


async def error_of(resp: aiohttp.ClientResponse, status: int) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    payload = await resp.json()
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["code"] == status
    return payload["error"]


# ------------------------------------------------------------------------- admin token


BAD_AUTH = [
    {},
    {"Authorization": ""},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer "},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {TOKEN[:-1]}"},
    {"Authorization": f"Bearer {TOKEN}x"},
    {"Authorization": f"bearer{TOKEN}"},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": TOKEN},
    {"X-Admin-Token": TOKEN},
    {"Cookie": f"token={TOKEN}"},
]


@pytest.mark.parametrize("headers", BAD_AUTH, ids=[json.dumps(h)[:40] for h in BAD_AUTH])
async def test_admin_needs_the_exact_bearer_token(router: Factory, aiohttp_server: Any, headers: dict[str, str]) -> None:
    client, _fakes = await router(admin_token=TOKEN)
    state = client.server.app[ROUTER_STATE]
    members = list(state.pools["default"].members)
    extra = await aiohttp_server(EchoBackend("x").app(), host="127.0.0.1")

    err = await error_of(await client.get("/admin/backends", headers=headers), 401)
    assert TOKEN not in err["message"]
    await error_of(await client.get(f"/admin/backends?token={TOKEN}", headers=headers), 401)
    await error_of(await client.post("/admin/backends", json={"url": f"http://127.0.0.1:{extra.port}"},
                                      headers=headers), 401)
    await error_of(await client.delete(f"/admin/backends/{members[0].name}", headers=headers), 401)
    # nothing changed: no backend added, none draining or removed
    assert list(state.pools["default"].members) == members
    assert not any(b.draining for b in members)
    # the right token works
    assert (await client.get("/admin/backends", headers=AUTH)).status == 200


async def test_admin_compares_the_token_in_constant_time(router: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = await router(admin_token=TOKEN)
    calls: list[tuple[bytes, bytes]] = []
    real = admin_module.hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(admin_module.hmac, "compare_digest", spy)
    assert (await client.get("/admin/backends", headers={"Authorization": "Bearer nope"})).status == 401
    assert (await client.get("/admin/backends", headers=AUTH)).status == 200
    assert len(calls) == 2
    assert calls[1] == (f"Bearer {TOKEN}".encode(), f"Bearer {TOKEN}".encode())


PATH_TRICKS = ["/admin/backends/", "/ADMIN/backends", "//admin/backends", "/admin//backends", "/admin/%62ackends",
               "/./admin/backends", "/x/../admin/backends", "/admin/backends;x", "/admin/backends%00"]


async def test_admin_path_tricks_never_bypass_the_token(router: Factory) -> None:
    client, _ = await router(admin_token=TOKEN)
    state = client.server.app[ROUTER_STATE]
    members = list(state.pools["default"].members)
    body = b'{"url": "http://127.0.0.1:9"}'
    for path in PATH_TRICKS:  # sent raw: an HTTP client library would normalise them
        for method in ("GET", "POST", "DELETE"):
            target = path + ("/" + members[0].name if method == "DELETE" else "")
            status, _, answer = await raw_exchange(client.server.port, (
                f"{method} {target} HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
            assert status in (401, 404, 405), (method, target, status)
            assert set(json.loads(answer)["error"]) == {"message", "type", "param", "code"}
    assert list(state.pools["default"].members) == members
    assert not any(b.draining for b in members)


async def test_admin_on_its_own_port_only(make_router: MakeRouter) -> None:
    router = await make_router("client", admin=True, admin_token=TOKEN,
                               admin_port=1)  # admin_port != 0: off the data app
    backend, data, admin = router.servers[0], router.client, router.admin_client
    assert data is not None and admin is not None
    # the data port has no admin API, not even with the token
    for method in ("GET", "POST", "DELETE"):
        path = "/admin/backends" + ("/x" if method == "DELETE" else "")
        await error_of(await data.request(method, path, headers=AUTH, json={"url": "http://127.0.0.1:9"}), 404)
    # the admin port: the token is still required, and only the admin API lives there
    await error_of(await admin.get("/admin/backends"), 401)
    await error_of(await admin.get("/admin/backends", headers={"Authorization": "Bearer wrong"}), 401)
    listing = await (await admin.get("/admin/backends", headers=AUTH)).json()
    assert [b["url"] for b in listing["data"]] == [f"http://127.0.0.1:{backend.port}"]
    resp = await admin.post("/v1/completions", json={"prompt": "x"})
    await error_of(resp, resp.status)
    assert resp.status in (404, 405)  # the admin app shares the data app's catch-all (405 for its paths)
    # both views share one state
    assert (await data.post("/v1/completions", json={"prompt": "x", "session_id": "s"})).status == 200


# ----------------------------------------------------------------------------- logging


RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \d+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ", re.MULTILINE)


def records(log: str) -> list[tuple[str, str]]:
    """(level, text) of every record of a router log (a traceback stays with its record)."""
    starts = list(RECORD.finditer(log))
    return [(m.group(1), log[m.start():(starts[i + 1].start() if i + 1 < len(starts) else len(log))])
            for i, m in enumerate(starts)]


@pytest.mark.slow
async def test_session_ids_and_bodies_never_reach_the_log(tmp_path: Path) -> None:
    session = "SESSMARK-7f3a9c"
    secret = "BODYMARK-do-not-log-4411"
    backends = [start_backend(str(tmp_path), speed="1") for _ in range(2)]
    router = start_router(str(tmp_path), "--backend", backends[0].url, "--backend", backends[1].url,
                          "--log-level", "debug")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            base = router.url
            chat = {"model": "session-sim", "messages": [{"role": "user", "content": secret}], "max_tokens": 3}
            sends = [
                ("/v1/chat/completions", dict(chat, session_id=session), {}),
                ("/v1/completions", {"prompt": secret, "max_tokens": 3}, {"X-Session-ID": session + "-h"}),
                ("/v1/completions", {"prompt": secret, "max_tokens": 3, "vllm_xargs": {"session_id": session + "-x"}}, {}),
                ("/v1/responses", {"model": "session-sim", "input": secret, "max_output_tokens": 3}, {"X-Session-ID": session}),
                ("/inference/v1/generate", {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}},
                 {"X-Session-ID": session + "-g"}),
                ("/tokenize", {"prompt": secret}, {"X-Session-ID": session}),
                ("/v1/chat/completions", dict(chat, stream=True), {"X-Session-ID": session + "-s"}),
                # rejected ones: the id or the body is in the request, never in the log
                ("/v1/completions", {"prompt": secret, "session_id": session + "x" * 300}, {}),
                ("/v1/completions", {"prompt": secret, "session_id": session + " space"}, {}),
                ("/v1/completions", {"prompt": secret}, {"X-Session-ID": session + "-A", "x-session-id": session + "-B"}),
                ("/v1/completions", {"prompt": secret, "max_tokens": "many"}, {"X-Session-ID": session}),
            ]
            for path, body, headers in sends:
                async with http.post(base + path, json=body, headers=headers) as resp:
                    await resp.read()
            async with http.post(base + "/v1/completions", data=b'{"prompt": "' + secret.encode() + b'", ',
                                 headers={"X-Session-ID": session}) as resp:
                assert resp.status == 400
            for path in (f"/v1/sessions/{session}", f"/v1/sessions/{session}-unknown"):
                async with http.get(base + path) as resp:
                    await resp.read()
            # a client that leaves mid-stream, and a stream cut by a dying backend
            long = dict(chat, stream=True, max_tokens=200, ignore_eos=True)
            resp = await http.post(base + "/v1/chat/completions", json=long, headers={"X-Session-ID": session + "-c"})
            await resp.content.readuntil(b"\n\n")
            resp.close()
            streams = []
            for i in range(4):
                r = await http.post(base + "/v1/chat/completions", json=long, headers={"X-Session-ID": f"{session}-k{i}"})
                await r.content.readuntil(b"\n\n")
                streams.append(r)
            backends[0].kill()
            for r in streams:
                await asyncio.wait_for(r.read(), 20)
            # the sessions of the dead backend fail over (health warnings are logged)
            for i in range(4):
                async with http.post(base + "/v1/completions", json={"prompt": secret, "max_tokens": 2},
                                     headers={"X-Session-ID": f"{session}-k{i}"}) as resp:
                    assert resp.status == 200
            async with http.delete(base + f"/v1/sessions/{session}") as resp:
                assert resp.status == 200
        assert router.stop() == 0
    finally:
        kill_alive(router, *backends)
    log = router.log()
    entries = records(log)
    assert any(level == "WARNING" and "unhealthy" in text for level, text in entries), log[-2000:]
    assert secret not in log  # bodies: at no level
    leaked = [text for level, text in entries if level != "DEBUG" and session in text]
    assert not leaked, leaked
    assert "Traceback" not in log, log[-3000:]


# ------------------------------------------------------------- forwarding only to backends


class Listener:
    """A listener on 127.0.0.77 that counts connections: the place no request may reach."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> None:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            writer.close()

        for port in (9, 0):  # the example port when we may bind it, else any
            try:
                self.server = await asyncio.start_server(on_connect, "127.0.0.77", port)
                break
            except OSError:
                continue
        assert self.server is not None
        self.port = self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def elsewhere() -> AsyncIterator[Listener]:
    listener = Listener()
    await listener.start()
    # the listener itself answers connections (so a router bug would be seen, not refused)
    _reader, writer = await asyncio.open_connection("127.0.0.77", listener.port)
    writer.close()
    assert listener.connections == 1 or await _eventually(lambda: listener.connections == 1)
    listener.connections = 0
    yield listener
    await listener.close()


async def _eventually(condition: Callable[[], bool]) -> bool:
    for _ in range(200):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return condition()


async def raw_exchange(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), 10)
    writer.close()
    return int(lines[0].split()[1]), headers, body


async def test_requests_never_reach_anything_but_the_configured_backends(router: Factory, elsewhere: Listener) -> None:
    client, fakes = await router(admin_token=TOKEN)
    port = client.server.port
    state = client.server.app[ROUTER_STATE]
    configured = [b.url for b in state.pools["default"].members]
    backend_hosts = {url.removeprefix("http://") for url in configured}
    other = f"127.0.0.77:{elsewhere.port}"
    body = b'{"prompt": "x", "session_id": "probe"}'

    def request(target: str, host: str = "router", extra: str = "") -> bytes:
        return (f"POST {target} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body

    # paths that name another host, or climb out of the routes: a 4xx
    for target in (f"//{other}/v1/completions", f"//{other}", "/../admin/backends", "/v1/../admin/backends",
                   "/%2e%2e/admin/backends", f"/v1/completions/../../{other}/v1/completions",
                   f"/v1/completions/http://{other}/"):
        status, _, answer = await raw_exchange(port, request(target))
        assert 400 <= status < 500, (target, status, answer[:200])
        assert set(json.loads(answer)["error"]) == {"message", "type", "param", "code"}
    assert not any(f.seen for f in fakes)

    # absolute-form names a destination: a 4xx (the router is not a forward proxy)
    for target in (f"http://{other}/v1/completions", f"http://{other}/", "http://router/v1/completions"):
        status, _, answer = await raw_exchange(port, request(target))
        assert 400 <= status < 500, (target, status, answer[:200])
        assert set(json.loads(answer)["error"]) == {"message", "type", "param", "code"}
    assert not any(f.seen for f in fakes)

    # a foreign Host or forwarding headers: served by a configured backend, which sees its own
    # Host; nothing goes elsewhere
    served = [
        request("/v1/completions", host=other),
        request("/v1/completions", extra=f"X-Forwarded-Host: {other}\r\nForwarded: host={other};proto=http\r\n"
                                         f"X-Forwarded-For: 127.0.0.77\r\nX-Real-IP: 127.0.0.77\r\n"),
    ]
    for data in served:
        status, _headers, answer = await raw_exchange(port, data)
        assert status == 200, answer[:300]
    seen = [s for f in fakes for s in f.seen]
    assert len(seen) == len(served)
    for s in seen:
        assert s.path == "/v1/completions"
        assert len(s.headers["host"]) == 1 and s.headers["host"][0] in backend_hosts

    # body fields that look like destinations are data, not routing
    for extra in ({"url": f"http://{other}"}, {"base_url": f"http://{other}"},
                  {"vllm_xargs": {"session_id": "p2", "url": f"http://{other}"}}):
        resp = await client.post("/v1/completions", json={"prompt": "x", **extra})
        assert resp.status == 200
    # `model` routes among the configured backends only: a model none of them lists is the router's 404
    resp = await client.post("/v1/completions", json={"prompt": "x", "model": f"http://{other}/"})
    assert resp.status == 404 and (await resp.json())["error"]["param"] == "model"

    # the admin API cannot be used to add a backend there without the token
    resp = await client.post("/admin/backends", json={"url": f"http://{other}"})
    assert resp.status == 401
    # CONNECT is not a tunnel
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"CONNECT {other} HTTP/1.1\r\nHost: {other}\r\n\r\n".encode())
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    assert 400 <= int(status_line.split()[1]) < 500

    assert [b.url for b in state.pools["default"].members] == configured
    await asyncio.sleep(0)  # let the listener's accept callbacks run
    assert elsewhere.connections == 0


async def test_crlf_in_values_never_splits_the_upstream_head(router: Factory) -> None:
    client, fakes = await router(n=1)
    port = client.server.port

    async def send(header_lines: str, body: bytes) -> int:
        status, _, _ = await raw_exchange(port, (
            f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{header_lines}\r\n").encode("latin-1") + body)
        return status

    ok = b'{"prompt": "x"}'
    # percent-encoded CR LF is just text: forwarded literally, as one header
    assert await send("X-Session-ID: abc%0d%0aX-Injected:%201\r\n", ok) == 200
    assert await send("X-Request-Id: rid%0D%0AX-Injected: 2\r\n", ok) == 200
    assert await send("X-Custom: a%0d%0a%0d%0aGET /admin HTTP/1.1\r\n", ok) == 200
    # CR/LF escapes in JSON decode to real CR LF: the session contract rejects them
    assert await send("", b'{"prompt": "x", "session_id": "a\\r\\nX-Injected: 3"}') == 400
    assert await send("", b'{"prompt": "x", "vllm_xargs": {"session_id": "a\\nX-Injected: 4"}}') == 400
    # raw CR / LF inside a header value: the HTTP parser rejects the request
    assert await send("X-Session-ID: abc\rX-Injected: 5\r\n", ok) == 400
    assert await send("X-Custom: abc\nX-Injected: 6\r\n", ok) == 400
    seen = fakes[0].seen
    assert len(seen) == 3
    for s in seen:
        assert "x-injected" not in s.headers
        assert s.path == "/v1/completions"
    assert seen[0].headers["x-session-id"] == ["abc%0d%0aX-Injected:%201"]
    assert seen[1].headers["x-request-id"] == ["rid%0D%0AX-Injected: 2"]
    assert seen[2].headers["x-custom"] == ["a%0d%0a%0d%0aGET /admin HTTP/1.1"]

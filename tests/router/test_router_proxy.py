"""Router behaviour against scripted in-process upstreams (real HTTP on loopback)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from router.state import ROUTER_STATE
from tests.conftest import MakeRouter
from tests.fakes import EchoBackend

Factory = Callable[..., Awaitable[tuple[TestClient, list[EchoBackend], list[TestServer]]]]


@pytest.fixture
def router(make_router: MakeRouter) -> Factory:
    async def make(n: int = 3, dead: int = 0, **overrides: Any) -> tuple[TestClient, list[EchoBackend], list[TestServer]]:
        served = await make_router("client", n=n, dead=dead, **overrides)
        assert served.client is not None
        return served.client, served.fakes, served.servers

    return make


def chat(session: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                                       {"role": "user", "content": "hello"}]}
    if session is not None:
        body["session_id"] = session
    body.update(extra)
    return body


def backend_of(fakes: list[EchoBackend], session: str) -> list[str]:
    return [f.name for f in fakes for s in f.seen if s.headers.get("x-session-id") == [session]]


async def test_body_session_is_forwarded_as_header_and_echoed(router: Factory) -> None:
    client, fakes, _ = await router()
    raw = json.dumps(chat("sess-A")).encode()
    resp = await client.post("/v1/chat/completions", data=raw, headers={"X-Session-ID": "other",
                                                                        "Content-Type": "application/json"})
    assert resp.status == 200
    assert resp.headers["X-Session-ID"] == "sess-A"
    assert resp.headers["X-Request-Id"]
    seen = [s for f in fakes for s in f.seen]
    assert len(seen) == 1
    # body wins; the upstream header carries the resolved id, once; the body is forwarded byte for byte
    assert seen[0].headers["x-session-id"] == ["sess-A"]
    assert seen[0].body == raw
    assert seen[0].headers["x-request-id"] == [resp.headers["X-Request-Id"]]


async def test_client_request_id_is_kept(router: Factory) -> None:
    client, fakes, _ = await router()
    resp = await client.post("/v1/completions", json={"prompt": "x", "session_id": "s"}, headers={"X-Request-Id": "rid-7"})
    assert resp.headers["X-Request-Id"] == "rid-7"
    assert [s.headers["x-request-id"] for f in fakes for s in f.seen] == [["rid-7"]]


@pytest.mark.parametrize("header,xargs,expected", [
    ("hdr-1", None, "hdr-1"),
    (None, "xa-1", "xa-1"),
    ("hdr-2", "xa-2", "hdr-2"),
])
async def test_precedence_at_the_router(router: Factory, header: str | None, xargs: str | None, expected: str) -> None:
    client, fakes, _ = await router()
    body: dict[str, Any] = {"prompt": "x"}
    if xargs:
        body["vllm_xargs"] = {"session_id": xargs}
    headers = {"X-Session-ID": header} if header else {}
    resp = await client.post("/v1/completions", json=body, headers=headers)
    assert resp.headers["X-Session-ID"] == expected
    assert backend_of(fakes, expected)


async def test_ignored_identity_headers_do_not_make_a_session(router: Factory) -> None:
    client, fakes, _ = await router(stamp="none")
    resp = await client.post("/v1/completions", json={"prompt": "x", "user": "u1"},
                             headers={"X-Correlation-ID": "corr", "X-Request-Id": "req"})
    assert resp.status == 200
    assert "X-Session-ID" not in resp.headers
    assert all("x-session-id" not in s.headers for f in fakes for s in f.seen)


async def test_conflicting_session_headers_are_rejected(router: Factory) -> None:
    client, fakes, _ = await router()
    resp = await client.post("/v1/completions", json={"prompt": "x"},
                             headers=[("X-Session-ID", "a"), ("X-Session-ID", "b")])
    assert resp.status == 400
    body = await resp.json()
    assert body["error"]["code"] == 400 and "X-Session-ID" in body["error"]["message"]
    assert resp.headers["X-Request-Id"]
    assert not any(f.seen for f in fakes)


@pytest.mark.parametrize("value", ["a b", "x" * 257, "tab\there", "caf\u00e9"])
async def test_invalid_session_ids_are_rejected(router: Factory, value: str) -> None:
    client, fakes, _ = await router()
    resp = await client.post("/v1/chat/completions", json=chat(value))
    assert resp.status == 400
    assert (await resp.json())["error"]["type"] == "BadRequestError"
    assert not any(f.seen for f in fakes)


async def test_non_string_body_session_is_rejected(router: Factory) -> None:
    client, _, _ = await router()
    resp = await client.post("/v1/chat/completions", json=chat(None, session_id=12))
    assert resp.status == 400
    assert "session_id" in (await resp.json())["error"]["message"]


async def test_derive_stamps_the_same_conversation_id_and_sticks(router: Factory) -> None:
    client, fakes, _ = await router()
    first = await client.post("/v1/chat/completions", json=chat())
    sid = first.headers["X-Session-ID"]
    assert re.fullmatch(r"conv-[0-9a-f]{32}", sid)
    turn2 = chat()
    turn2["messages"] += [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    second = await client.post("/v1/chat/completions", json=turn2)
    assert second.headers["X-Session-ID"] == sid
    assert len(set(backend_of(fakes, sid))) == 1
    other = await client.post("/v1/chat/completions", json=chat(None, messages=[{"role": "user", "content": "bye"}]))
    assert other.headers["X-Session-ID"] != sid


async def test_mint_and_none_modes(router: Factory) -> None:
    client, fakes, _ = await router()
    resp = await client.post("/v1/completions", json={"prompt": "x"})
    assert re.fullmatch(r"sess-[0-9a-f]{32}", resp.headers["X-Session-ID"])
    client2, fakes2, _ = await router(stamp="mint")
    resp = await client2.post("/v1/chat/completions", json=chat())
    assert resp.headers["X-Session-ID"].startswith("sess-")


async def test_tokens_path_uses_the_header_only(router: Factory) -> None:
    client, fakes, _ = await router(stamp="none")
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}, "session_id": "ignored"}
    resp = await client.post("/inference/v1/generate", json=body, headers={"X-Session-ID": "tok-1"})
    assert resp.headers["X-Session-ID"] == "tok-1"
    resp = await client.post("/inference/v1/generate", json=body)
    assert "X-Session-ID" not in resp.headers


async def test_session_stays_on_one_backend(router: Factory) -> None:
    client, fakes, _ = await router(n=4)
    for i in range(40):
        resp = await client.post("/v1/completions", json={"prompt": str(i), "session_id": "stable"})
        assert resp.status == 200
    assert len(set(backend_of(fakes, "stable"))) == 1
    state = client.server.app[ROUTER_STATE]
    entry = state.sessions.get("stable")
    assert entry is not None and entry.requests == 40


async def test_sessions_spread_over_backends(router: Factory) -> None:
    client, fakes, _ = await router(n=3)
    for i in range(60):
        await client.post("/v1/completions", json={"prompt": "x", "session_id": f"s{i}"})
    assert all(len(f.seen) > 0 for f in fakes)


async def test_stream_is_relayed_chunk_by_chunk(router: Factory) -> None:
    client, fakes, _ = await router(n=1)
    fakes[0].gates = {1: asyncio.Event()}
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True, "session_id": "s"})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    assert b'"i":0' in first  # arrived while the backend still holds chunk 1
    fakes[0].gates[1].set()
    rest = await asyncio.wait_for(resp.read(), 5)
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_stream_usage_is_counted_when_asked(router: Factory) -> None:
    client, fakes, _ = await router(n=1)
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True, "session_id": "su",
                                                      "stream_options": {"include_usage": True}})
    await resp.read()
    entry = client.server.app[ROUTER_STATE].sessions.get("su")
    assert entry is not None
    assert (entry.prompt_tokens, entry.completion_tokens, entry.cached_tokens) == (10, 3, 4)


async def test_broken_upstream_mid_stream_ends_with_error_event(router: Factory) -> None:
    client, fakes, _ = await router(n=1)
    fakes[0].break_after = 1
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True, "session_id": "s"})
    body = await asyncio.wait_for(resp.read(), 10)
    assert b'"i":0' in body
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][len(b"data: "):])
    assert set(error["error"]) == {"message", "type", "param", "code"}
    state = client.server.app[ROUTER_STATE]
    assert all(b.in_flight == 0 for p in state.pools.values() for b in p)


async def test_backend_dying_under_pinned_sessions_fails_over_and_repins(router: Factory) -> None:
    client, fakes, servers = await router(n=3)
    state = client.server.app[ROUTER_STATE]
    for i in range(30):
        assert (await client.post("/v1/completions", json={"prompt": "x", "session_id": f"f{i}"})).status == 200
    victim = state.pools["default"].members[2]
    on_victim = {e.session_id for e in state.sessions.recent(100) if e.pins["default"] == victim.url}
    assert on_victim
    await servers[2].close()  # its port now refuses connections; the health checker has not noticed
    assert victim.healthy
    for i in range(30):
        resp = await client.post("/v1/completions", json={"prompt": "x", "session_id": f"f{i}"})
        assert resp.status == 200, await resp.text()
    assert not victim.healthy
    assert all(e.pins["default"] != victim.url for e in state.sessions.recent(100))
    metrics = await (await client.get("/metrics")).text()
    assert 'session_router_retries_total{reason="connect"} 1.0' in metrics
    repins = f'session_router_placements_total{{outcome="repin_unhealthy",policy="kv_aware"}} {float(len(on_victim))}'
    assert repins in metrics


async def test_retry_on_503_then_success(router: Factory) -> None:
    client, fakes, _ = await router(n=2)
    fakes[0].status = 503
    fakes[1].status = 200
    for i in range(10):
        resp = await client.post("/v1/completions", json={"prompt": "x", "session_id": f"r{i}"})
        assert resp.status == 200


async def test_all_backends_failing_gives_the_upstream_answer_or_503(router: Factory) -> None:
    client, _, _ = await router(n=0, dead=2)
    resp = await client.post("/v1/completions", json={"prompt": "x", "session_id": "s"})
    assert resp.status in (502, 503)
    body = await resp.json()
    assert body["error"]["code"] == resp.status
    resp = await client.post("/v1/completions", json={"prompt": "x", "session_id": "s"})
    assert resp.status == 503
    assert (await client.get("/health")).status == 503


async def test_first_byte_timeout_fails_over(router: Factory) -> None:
    client, fakes, _ = await router(n=2, first_byte_timeout_s=0.3)
    fakes[0].stall = True
    for i in range(6):
        resp = await client.post("/v1/completions", json={"prompt": "x", "session_id": f"t{i}"})
        assert resp.status == 200
        assert json.loads(await resp.read())["backend"] == "b1"


async def test_client_disconnect_closes_upstream(router: Factory) -> None:
    client, fakes, _ = await router(n=1)
    fakes[0].gates = {1: asyncio.Event()}
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True, "session_id": "d"})
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    resp.close()  # the client goes away mid-stream
    await asyncio.wait_for(fakes[0].cancelled.wait(), 5)
    state = client.server.app[ROUTER_STATE]
    for _ in range(200):
        if all(b.in_flight == 0 for b in state.pools["default"]):
            break
        await asyncio.sleep(0.01)
    assert all(b.in_flight == 0 for b in state.pools["default"])


async def test_client_disconnect_while_waiting_for_a_non_stream(router: Factory) -> None:
    client, fakes, _ = await router(n=1)
    fakes[0].stall = True
    body = b'{"prompt": "x", "session_id": "w"}'
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    await asyncio.wait_for(fakes[0].stalled.wait(), 5)
    writer.close()  # the client goes away before any response byte
    await asyncio.wait_for(fakes[0].cancelled.wait(), 5)
    state = client.server.app[ROUTER_STATE]
    for _ in range(500):
        if state.pools["default"].members[0].in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert state.pools["default"].members[0].in_flight == 0


async def test_bad_input(router: Factory) -> None:
    client, fakes, _ = await router(max_body_bytes=1000)
    cases = [
        (await client.post("/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}), 400),
        (await client.post("/v1/completions", data=b"[1,2]"), 400),
        (await client.post("/v1/completions", data=b'{"stream": "yes"}'), 400),
        (await client.post("/v1/completions", data=b"x" * 2000), 413),
        (await client.get("/internal/kv/pull"), 404),  # denied (proxy_deny); unknown routes are forwarded
        (await client.get("/v1/completions"), 405),
    ]
    for resp, status in cases:
        assert resp.status == status, (resp.url, await resp.text())
        body = await resp.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == status
        assert "Traceback" not in body["error"]["message"]
    assert not any(f.seen for f in fakes)
    assert (await client.post("/v1/completions", json={"prompt": "ok", "session_id": "g"})).status == 200


async def test_hop_by_hop_headers_dropped_end_to_end_kept(router: Factory) -> None:
    client, fakes, _ = await router(n=1)
    await client.post("/v1/completions", json={"prompt": "x", "session_id": "h"},
                      headers={"Authorization": "Bearer k", "X-Custom": "1", "Proxy-Authorization": "p",
                               "Keep-Alive": "timeout=5"})
    seen = fakes[0].seen[0].headers
    assert seen["authorization"] == ["Bearer k"] and seen["x-custom"] == ["1"]
    assert "proxy-authorization" not in seen and "keep-alive" not in seen


async def test_sessions_api(router: Factory) -> None:
    client, fakes, _ = await router(n=2, admin_token="s3cret")  # listing every session is an admin action
    auth = {"Authorization": "Bearer s3cret"}
    for i in range(5):
        await client.post("/v1/completions", json={"prompt": "x", "session_id": f"api{i}"})
    listing = await (await client.get("/v1/sessions?limit=3", headers=auth)).json()
    assert [e["session_id"] for e in listing["data"]] == ["api4", "api3", "api2"]
    one = await (await client.get("/v1/sessions/api1")).json()
    assert one["session_id"] == "api1" and one["requests"] == 1
    assert one["pins"]["default"].startswith("http://127.0.0.1:")
    assert one["last_active"] > 0
    assert (await client.delete("/v1/sessions/api1")).status == 200
    assert (await client.get("/v1/sessions/api1")).status == 404
    assert (await client.get("/v1/sessions?limit=0", headers=auth)).status == 400


async def test_models_is_the_union(router: Factory) -> None:
    client, _, _ = await router(n=2)
    data = await (await client.get("/v1/models")).json()
    assert sorted(c["id"] for c in data["data"]) == ["m", "model-b0", "model-b1", "shared"]


async def test_previous_response_id_goes_to_its_backend(router: Factory) -> None:
    client, fakes, _ = await router(n=3, stamp="none")
    resp = await client.post("/v1/responses", json={"input": "hello"})
    rid = (await resp.json())["id"]
    origin = rid.split("_")[1]
    for _ in range(5):
        await client.post("/v1/responses", json={"input": "more", "previous_response_id": rid})
    assert all(f.name == origin for f in fakes for s in f.seen)
    # streamed responses are remembered too
    resp = await client.post("/v1/responses", json={"input": "s", "stream": True})
    text = await resp.text()
    srid = re.search(r'"id":"(resp_[^"]+)"', text).group(1)  # type: ignore[union-attr]
    assert client.server.app[ROUTER_STATE].responses.lookup(srid) is not None


async def test_admin_requires_token_and_drains(router: Factory, aiohttp_server: Any) -> None:
    client, fakes, servers = await router(n=2, admin_token="s3cret")
    assert (await client.get("/admin/backends")).status == 401
    assert (await client.get("/admin/backends", headers={"Authorization": "Bearer wrong"})).status == 401
    auth = {"Authorization": "Bearer s3cret"}
    listing = await (await client.get("/admin/backends", headers=auth)).json()
    assert len(listing["data"]) == 2
    extra = EchoBackend("b9")
    srv = await aiohttp_server(extra.app(), host="127.0.0.1")
    added = await client.post("/admin/backends", json={"url": f"http://127.0.0.1:{srv.port}"}, headers=auth)
    assert added.status == 201
    name = listing["data"][0]["name"]
    removed = await client.delete(f"/admin/backends/{name}", headers=auth)
    assert removed.status == 200 and (await removed.json())["removed"]
    urls = [b["url"] for b in (await (await client.get("/admin/backends", headers=auth)).json())["data"]]
    assert name not in urls and len(urls) == 2
    assert (await client.post("/admin/backends", json={"url": "ftp://x"}, headers=auth)).status == 400

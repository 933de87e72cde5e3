"""Routes the router does not name are forwarded to a backend (issue 11, item 20).

``/v1/embeddings``, multipart ``/v1/audio/transcriptions``, ``/v1/messages``, ``/version``, any
method: forwarded with the body bytes unchanged, with session placement when a session resolves,
model filtering for JSON bodies, the same limits and failover as the named routes, on both
fronts. The router's own routes keep precedence and ``proxy_deny`` is never forwarded.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from contract.errors import ConfigError
from router.config import FrontConfig, RouterConfig, validate_config
from router.routes import canonical_path
from tests.router.routing_support import FRONTS, ModelBackend, Serve, ask, raw_ask


def pair() -> list[ModelBackend]:
    return [ModelBackend("b0", ["m"]), ModelBackend("b1", ["m"])]


@pytest.mark.parametrize("front", FRONTS)
async def test_other_routes_are_forwarded_with_session_placement(serve: Serve, front: str) -> None:
    routed = await serve(front, backends=pair())
    body = {"model": "m", "input": ["a", "b"]}
    # no session: plain placement spreads them
    served = set()
    for _ in range(6):
        status, headers, answer = await ask(routed, "POST", "/v1/embeddings", json_body=body)
        assert status == 200 and headers["x-request-id"] and "x-session-id" not in headers
        served.add(json.loads(answer)["backend"])
    assert served == {"b0", "b1"}
    # a session by header, or by the JSON body's session_id: sticky, echoed, forwarded as the header
    for headers_in, payload, session in (({"X-Session-ID": "emb-1"}, body, "emb-1"),
                                          ({}, {**body, "session_id": "emb-2"}, "emb-2")):
        backends = set()
        for _ in range(4):
            status, headers, answer = await ask(routed, "POST", "/v1/embeddings", json_body=payload,
                                                headers=headers_in)
            assert status == 200 and headers["x-session-id"] == session
            backends.add(json.loads(answer)["backend"])
        assert len(backends) == 1
        entry = routed.state.sessions.get(session)
        assert entry is not None and entry.requests == 4 and entry.prompt_tokens == 20  # usage accounted
        (name,) = backends
        hits = [h for h in routed.hits(name, "/v1/embeddings") if h.headers.get("x-session-id") == session]
        assert len(hits) == 4
    # the request body reaches the backend byte for byte, the query string too
    raw = b'{"model": "m",   "input": "x\\u00e9", "extra": [1, 2.50]}'
    status, headers, answer = await ask(routed, "POST", "/score?dry=1&x=%20", data=raw,
                                        headers={"Content-Type": "application/json", "X-Session-ID": "sc"})
    assert status == 200
    (hit,) = [h for h in routed.all_hits("/score")]
    assert hit.body == raw and hit.path == "/score?dry=1&x=%20" and hit.headers["x-request-id"] == headers["x-request-id"]


@pytest.mark.parametrize("front", FRONTS)
async def test_multipart_is_forwarded_byte_for_byte(serve: Serve, front: str) -> None:
    routed = await serve(front, backends=pair())
    boundary = "----router-test-boundary"
    audio = os.urandom(200_000) + b"\r\n--" + boundary.encode() + b"x\r\n\x00\xff"  # binary, boundary-like bytes
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            f"Content-Type: audio/wav\r\n\r\n").encode() + audio + f"\r\n--{boundary}--\r\n".encode()
    content_type = f"multipart/form-data; boundary={boundary}"
    status, headers, answer = await ask(routed, "POST", "/v1/audio/transcriptions", data=body,
                                        headers={"Content-Type": content_type, "X-Session-ID": "audio-1"})
    assert status == 200, answer[:300]
    result = json.loads(answer)
    assert result["sha256"] == hashlib.sha256(body).hexdigest()
    assert result["content_type"] == content_type
    assert headers["x-session-id"] == "audio-1"
    # chunked from the client: still the same bytes upstream
    async def chunks():  # type: ignore[no-untyped-def]
        for i in range(0, len(body), 65_536):
            yield body[i:i + 65_536]

    async with routed.http.post(routed.url + "/v1/audio/transcriptions", data=chunks(),
                                headers={"Content-Type": content_type}) as resp:
        assert resp.status == 200
        assert (await resp.json())["sha256"] == hashlib.sha256(body).hexdigest()


@pytest.mark.parametrize("front", FRONTS)
async def test_other_routes_are_routed_by_model(serve: Serve, front: str) -> None:
    routed = await serve(front, backends=[ModelBackend("e", ["embedder"]), ModelBackend("g", ["generator"])])
    for _ in range(4):
        status, _, answer = await ask(routed, "POST", "/v1/embeddings", json_body={"model": "embedder", "input": "x"})
        assert status == 200 and json.loads(answer)["backend"] == "e"
    status, _, answer = await ask(routed, "POST", "/v1/embeddings", json_body={"model": "nobody", "input": "x"})
    assert status == 404 and json.loads(answer)["error"] == {
        "message": "The model `nobody` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
    assert [h.path for h in routed.all_hits()] == ["/v1/embeddings"] * 4


@pytest.mark.parametrize("front", FRONTS)
async def test_streams_get_head_and_unknown_routes(serve: Serve, front: str) -> None:
    routed = await serve(front, backends=pair())
    status, headers, answer = await ask(routed, "POST", "/v1/messages", json_body={"model": "m", "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert answer.count(b"event: delta\n") == 3
    status, headers, answer = await ask(routed, "GET", "/version")
    assert status == 200 and json.loads(answer)["version"] == "0.0-test" and headers["x-request-id"]
    status, headers, answer = await ask(routed, "HEAD", "/version")
    assert status == 200 and answer == b"" and int(headers["content-length"]) > 0
    assert [h.method for h in routed.all_hits("/version")] == ["GET", "GET"]  # HEAD is asked as GET
    # a route no backend serves: the backend's own 404, relayed, with the router's request id
    status, headers, answer = await ask(routed, "DELETE", "/v1/nothing/here", headers={"X-Request-Id": "rid-404"})
    assert status == 404 and answer == b"404: Not Found" and headers["x-request-id"] == "rid-404"


@pytest.mark.parametrize("front", FRONTS)
async def test_failover_and_limits_are_the_named_routes(serve: Serve, front: str) -> None:
    routed = await serve(front, backends=pair(), max_body_bytes=100_000)
    routed.fakes["b0"].fail["/v1/embeddings"] = 503
    for _ in range(4):
        status, _, answer = await ask(routed, "POST", "/v1/embeddings", json_body={"model": "m", "input": "x"})
        assert status == 200 and json.loads(answer)["backend"] == "b1"
    # both fail: the last answer is relayed after the retries
    routed.fakes["b1"].fail["/v1/embeddings"] = 503
    status, _, answer = await ask(routed, "POST", "/v1/embeddings", json_body={"model": "m", "input": "x"})
    assert status == 503
    # the body limit: a 413 before any backend is asked
    before = len(routed.all_hits())
    status, _, answer = await ask(routed, "POST", "/v1/audio/transcriptions", data=b"x" * 100_001,
                                  headers={"Content-Type": "application/octet-stream"})
    assert status == 413 and json.loads(answer)["error"]["code"] == 413
    assert len(routed.all_hits()) == before



@pytest.mark.parametrize("front", FRONTS)
async def test_a_connect_error_fails_over(serve: Serve, front: str) -> None:
    routed = await serve(front, backends=[ModelBackend("b0", ["m"])], extra_urls=["http://127.0.0.9:9"])
    dead = routed.state.pools["default"].members[1]
    assert not dead.healthy  # the first health round found nothing there
    for _ in range(3):
        dead.healthy = True  # as if it had just died: the request finds out
        status, _, answer = await ask(routed, "POST", "/v1/embeddings", json_body={"model": "m", "input": "x"})
        assert status == 200 and json.loads(answer)["backend"] == "b0"


@pytest.mark.parametrize("front", FRONTS)
async def test_the_routers_own_routes_keep_precedence(serve: Serve, front: str) -> None:
    routed = await serve(front, backends=pair(), admin_port=1)  # admin API not on this port
    status, _, answer = await ask(routed, "GET", "/metrics")
    assert status == 200 and b"session_router_requests_total" in answer
    status, _, answer = await ask(routed, "GET", "/health")
    assert status == 200 and json.loads(answer)["status"] == "ok"
    status, _, answer = await ask(routed, "GET", "/v1/sessions/none")
    assert status == 404
    for method, path in (("GET", "/admin/backends"), ("POST", "/admin/backends"), ("GET", "/ADMIN/backends"),
                         ("GET", "/admin%2fbackends"), ("GET", "/v1/Sessions"), ("DELETE", "/v1/sessions"),
                         ("POST", "/health"), ("PUT", "/v1/models"), ("GET", "/v1/completions"),
                         ("GET", "/internal/kv/pull"), ("POST", "/Internal/kv/pull"), ("POST", "/%69nternal/kv/pull"),
                         ("POST", "/sleep"), ("POST", "/collective_rpc?x=1"), ("GET", "/v1/embeddings/../../internal/x"),
                         ("GET", "//internal/x"), ("GET", "/v1/embeddings/%2e%2e/x")):
        status, headers, answer = await raw_ask(routed, method, path)  # sent as written
        assert status in (404, 405), (method, path, status)
        error = json.loads(answer)["error"]
        assert error["code"] == status and headers["x-request-id"], (method, path)
    assert routed.all_hits() == []  # none of them reached a backend


@pytest.mark.parametrize("front", FRONTS)
async def test_stored_responses_are_read_where_they_live(serve: Serve, front: str) -> None:
    routed = await serve(front, backends=[ModelBackend(f"b{i}", ["m"]) for i in range(3)])
    state = routed.state
    urls = {b.name: b.url for b in state.pools["default"].members}
    state.responses.remember("resp_abc", urls["b2"], None)
    for _ in range(4):
        status, _, answer = await ask(routed, "GET", "/v1/responses/resp_abc?stream=false")
        assert status == 200 and json.loads(answer) == {"id": "resp_abc", "backend": "b2"}


@pytest.mark.parametrize("front", FRONTS)
async def test_pd_other_routes_go_to_the_decode_pool(serve: Serve, front: str) -> None:
    routed = await serve(front, prefill=[ModelBackend("p", ["m"])], decode=[ModelBackend("d", ["m"])])
    status, _, answer = await ask(routed, "POST", "/v1/embeddings", json_body={"model": "m", "input": "x"})
    assert status == 200 and json.loads(answer)["backend"] == "d"
    assert routed.hits("p") == []


def test_canonical_paths_and_the_deny_setting() -> None:
    assert canonical_path("/A/%62//c/./d/../e;x?q=/admin") == "/a/b/c/e"
    assert canonical_path("/x\\..\\admin") == "/admin"
    assert RouterConfig().front.proxy_deny[0] == "/internal"
    with pytest.raises(ConfigError, match="proxy_deny: entry 0"):
        validate_config(RouterConfig(backends=[], decode=[], front=FrontConfig(proxy_deny=["internal"])))

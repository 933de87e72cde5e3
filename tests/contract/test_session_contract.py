"""The session contract (DESIGN.md §3, issue 2 §2): ``contract.session`` directly, then through the
backend's HTTP routes (3 request kinds x 3 channels, precedence, ignored and invalid values), and
the tokens-in route where only the header counts. What reached the engine is read back from the
engine's per-session accounting (``GET /v1/sessions/{id}``) and, on the tokens path, from the very
``EngineCoreRequest`` bytes the core decoded."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from multidict import CIMultiDict

from backends.app import create_app
from backends.engine.config import EngineConfig
from backends.engine.request import SESSION_ID_POSITION, WIRE_FIELD_COUNT
from backends.frontend import ENGINE
from contract.errors import InvalidSessionIdError
from contract.session import resolve_session_id, session_from_headers, validate_session_id
from tests.support import cached_of

# ---------------------------------------------------------------------------------------------
# the module itself


@pytest.mark.parametrize(
    ("body", "headers", "xargs", "expected"),
    [
        # one channel at a time
        ("b1", [], None, "b1"),
        (None, ["h1"], None, "h1"),
        (None, [], {"session_id": "x1"}, "x1"),
        # precedence pairs
        ("b1", ["h1"], None, "b1"),
        (None, ["h1"], {"session_id": "x1"}, "h1"),
        ("b1", [], {"session_id": "x1"}, "b1"),
        ("b1", ["h1"], {"session_id": "x1"}, "b1"),
        # ignored: empty strings, non-string xargs
        ("", ["h1"], None, "h1"),
        ("", [""], {"session_id": "x1"}, "x1"),
        (None, [""], None, None),
        (None, [], {"session_id": ""}, None),
        (None, [], {"session_id": 7}, None),
        (None, [], {"session_id": ["a"]}, None),
        (None, [], {"session_id": None}, None),
        (None, [], {"other": "x"}, None),
        (None, [], "not-a-mapping", None),
        # the same header twice with the same value is one value
        (None, ["h1", "h1"], None, "h1"),
        (None, [], None, None),
    ],
)
def test_resolve_table(body: Any, headers: list[str], xargs: Any, expected: str | None) -> None:
    assert resolve_session_id(body, headers, xargs) == expected


@pytest.mark.parametrize("value", [1, 0, 1.5, True, False, {"a": 1}, ["a"], []])
def test_non_string_body_session_id_is_rejected(value: Any) -> None:
    with pytest.raises(InvalidSessionIdError) as info:
        resolve_session_id(value, [], None)
    assert "session_id" in info.value.message
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("a" * 257, "257 characters"), ("a b", "visible ASCII"), ("a\tb", "visible ASCII"),
     ("caf\u00e9", "visible ASCII"), ("x\x7f", "visible ASCII"), ("\u65e5", "visible ASCII")],
)
def test_invalid_ids_rejected_on_every_channel(value: str, fragment: str) -> None:
    for args in ((value, [], None), (None, [value], None), (None, [], {"session_id": value})):
        with pytest.raises(InvalidSessionIdError) as info:
            resolve_session_id(*args)
        assert fragment in info.value.message


def test_limits_are_inclusive() -> None:
    longest = "a" * 256
    assert validate_session_id(longest, "test") == longest
    visible = "".join(chr(c) for c in range(0x21, 0x7F))
    assert validate_session_id(visible, "test") == visible


def test_conflicting_headers_rejected_even_when_body_wins() -> None:
    with pytest.raises(InvalidSessionIdError) as info:
        resolve_session_id("b1", ["h1", "h2"], None)
    assert "X-Session-ID" in info.value.message
    with pytest.raises(InvalidSessionIdError):
        session_from_headers(["h1", "", "h2"])
    assert session_from_headers(["", "h1"]) == "h1"


# ---------------------------------------------------------------------------------------------
# through the backend's HTTP routes


@pytest.fixture
async def client(aiohttp_client: Any) -> Any:
    return await aiohttp_client(create_app(EngineConfig(speed=0.0, model="m")))


KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}),
    "completion": ("/v1/completions", {"prompt": "hello there", "max_tokens": 3}),
    "responses": ("/v1/responses", {"input": "hello there", "max_output_tokens": 3}),
}


def _usage(kind: str, data: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens of a response of ``kind``."""
    u = data["usage"]
    if kind == "responses":
        return u["input_tokens"], u["output_tokens"], u["input_tokens_details"]["cached_tokens"]
    return u["prompt_tokens"], u["completion_tokens"], cached_of(u)


async def _send(client: Any, kind: str, *, body: dict[str, Any] | None = None,
                headers: list[tuple[str, str]] | None = None) -> Any:
    path, base = KINDS[kind]
    return await client.post(path, json={**base, **(body or {})}, headers=CIMultiDict(headers or []))


async def _sessions(client: Any) -> list[str]:
    resp = await client.get("/v1/sessions")
    assert resp.status == 200
    return [e["session_id"] for e in (await resp.json())["data"]]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("channel", ["body", "header", "xargs"])
async def test_each_kind_and_channel_reaches_the_engine(client: Any, kind: str, channel: str) -> None:
    sid = f"sess-{kind}-{channel}"
    if channel == "body":
        resp = await _send(client, kind, body={"session_id": sid})
    elif channel == "header":
        resp = await _send(client, kind, headers=[("X-Session-ID", sid)])
    else:
        resp = await _send(client, kind, body={"vllm_xargs": {"session_id": sid}})
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Session-ID"] == sid
    prompt, completion, cached = _usage(kind, await resp.json())
    stats = await (await client.get(f"/v1/sessions/{sid}")).json()
    assert stats == {"requests": 1, "prompt_tokens": prompt, "cached_tokens": cached,
                     "generated_tokens": completion}
    assert await _sessions(client) == [sid]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(
    ("body", "headers", "winner"),
    [
        ({"session_id": "B"}, [("X-Session-ID", "H")], "B"),
        ({"vllm_xargs": {"session_id": "X"}}, [("X-Session-ID", "H")], "H"),
        ({"session_id": "B", "vllm_xargs": {"session_id": "X"}}, [], "B"),
        ({"session_id": "B", "vllm_xargs": {"session_id": "X"}}, [("X-Session-ID", "H")], "B"),
    ],
)
async def test_precedence_over_http(client: Any, kind: str, body: dict[str, Any],
                                    headers: list[tuple[str, str]], winner: str) -> None:
    resp = await _send(client, kind, body=body, headers=headers)
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Session-ID"] == winner
    assert await _sessions(client) == [winner]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(
    ("body", "headers"),
    [
        ({"session_id": ""}, []),
        ({}, [("X-Session-ID", "")]),
        ({"vllm_xargs": {"session_id": ""}}, []),
        ({"vllm_xargs": {"session_id": 42}}, []),
        ({"vllm_xargs": {"session_id": True}}, []),
        ({}, [("X-Correlation-ID", "corr-1")]),
        ({}, [("X-Request-Id", "req-1")]),
        ({"user": "user-1"}, []),
        ({"request_id": "rid-1", "conversation_id": "conv-1"}, []),
    ],
)
async def test_ignored_values_leave_no_session(client: Any, kind: str, body: dict[str, Any],
                                               headers: list[tuple[str, str]]) -> None:
    resp = await _send(client, kind, body=body, headers=headers)
    assert resp.status == 200, await resp.text()
    assert "X-Session-ID" not in resp.headers
    assert await _sessions(client) == []
    for name in ("corr-1", "req-1", "user-1", "rid-1", "conv-1"):
        assert (await client.get(f"/v1/sessions/{name}")).status == 404


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(
    ("body", "headers", "fragment"),
    [
        ({"session_id": 123}, [], "session_id"),
        ({"session_id": True}, [], "session_id"),
        ({"session_id": {"id": "a"}}, [], "session_id"),
        ({"session_id": ["a"]}, [], "session_id"),
        ({"session_id": "a" * 257}, [], "257 characters"),
        ({}, [("X-Session-ID", "h" * 300)], "300 characters"),
        ({"vllm_xargs": {"session_id": "x" * 257}}, [], "257 characters"),
        ({"session_id": "has space"}, [], "visible ASCII"),
        ({"session_id": "has\ttab"}, [], "visible ASCII"),
        ({"session_id": "caf\u00e9"}, [], "visible ASCII"),
        ({"vllm_xargs": {"session_id": "x y"}}, [], "visible ASCII"),
        ({}, [("X-Session-ID", "in side")], "visible ASCII"),
        ({}, [("X-Session-ID", "a"), ("X-Session-ID", "b")], "X-Session-ID"),
        ({"session_id": "ok"}, [("X-Session-ID", "a"), ("X-Session-ID", "b")], "X-Session-ID"),
    ],
)
async def test_invalid_values_are_400(client: Any, kind: str, body: dict[str, Any],
                                      headers: list[tuple[str, str]], fragment: str) -> None:
    resp = await _send(client, kind, body=body, headers=headers)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert fragment in err["message"]
    assert err["code"] == 400 and err["type"] == "BadRequestError"
    assert "Traceback" not in err["message"]
    assert await _sessions(client) == []
    # the server keeps serving
    assert (await _send(client, kind)).status == 200


# ---------------------------------------------------------------------------------------------
# the tokens-in route: the header is the only channel, and it reaches EngineCoreRequest[20]


def _spy_on_core(client: Any) -> list[list[Any]]:
    """Wrap the engine core's add_request: record each request's raw msgpack array."""
    core = client.server.app[ENGINE].core
    original = core.add_request
    seen: list[list[Any]] = []

    def add_request(data: bytes, *args: Any, **kwargs: Any) -> Any:
        assert isinstance(data, bytes)
        seen.append(msgspec.msgpack.decode(data))
        return original(data, *args, **kwargs)

    core.add_request = add_request
    return seen


async def test_generate_header_reaches_engine_core_request(client: Any) -> None:
    seen = _spy_on_core(client)
    body = {"token_ids": [1, 300, 301, 302, 303], "sampling_params": {"max_tokens": 4, "temperature": 0}}
    resp = await client.post("/inference/v1/generate", json=body, headers={"X-Session-ID": "tok-sess-1"})
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Session-ID"] == "tok-sess-1"
    data = await resp.json()
    assert len(seen) == 1
    wire = seen[0]
    assert len(wire) == WIRE_FIELD_COUNT
    assert wire[SESSION_ID_POSITION] == "tok-sess-1"
    assert wire[1] == body["token_ids"]
    stats = await (await client.get("/v1/sessions/tok-sess-1")).json()
    u = data["usage"]
    assert stats == {"requests": 1, "prompt_tokens": u["prompt_tokens"],
                     "cached_tokens": cached_of(u),
                     "generated_tokens": u["completion_tokens"]}
    assert stats["prompt_tokens"] == 5


async def test_generate_ignores_body_session_and_xargs(client: Any) -> None:
    seen = _spy_on_core(client)
    body = {"token_ids": [1, 300, 301], "sampling_params": {"max_tokens": 2},
            "session_id": "body-sess", "vllm_xargs": {"session_id": "xargs-sess"}}
    resp = await client.post("/inference/v1/generate", json=body)
    assert resp.status == 200, await resp.text()
    assert "X-Session-ID" not in resp.headers
    assert seen[0][SESSION_ID_POSITION] is None
    assert await _sessions(client) == []


async def test_generate_streaming_carries_header_session(client: Any) -> None:
    seen = _spy_on_core(client)
    body = {"token_ids": [1, 300, 301], "sampling_params": {"max_tokens": 3}, "stream": True}
    resp = await client.post("/inference/v1/generate", json=body, headers={"X-Session-ID": "tok-stream"})
    assert resp.status == 200
    await resp.read()
    assert seen[0][SESSION_ID_POSITION] == "tok-stream"
    stats = await (await client.get("/v1/sessions/tok-stream")).json()
    assert stats["requests"] == 1 and stats["generated_tokens"] == 3


@pytest.mark.parametrize(
    "headers",
    [[("X-Session-ID", "a"), ("X-Session-ID", "b")], [("X-Session-ID", "bad id")], [("X-Session-ID", "z" * 257)]],
)
async def test_generate_invalid_header_is_400(client: Any, headers: list[tuple[str, str]]) -> None:
    body = {"token_ids": [1, 300], "sampling_params": {"max_tokens": 2}}
    resp = await client.post("/inference/v1/generate", json=body, headers=CIMultiDict(headers))
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == 400


@pytest.mark.parametrize("kind", list(KINDS))
async def test_openai_routes_carry_session_on_the_wire(client: Any, kind: str) -> None:
    seen = _spy_on_core(client)
    resp = await _send(client, kind, headers=[("X-Session-ID", f"wire-{kind}")])
    assert resp.status == 200
    assert seen[0][SESSION_ID_POSITION] == f"wire-{kind}"

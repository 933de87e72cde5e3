"""Agent sessions through real HTTP on both fronts: an agent client's own session header names the
session when no vLLM channel does; the derived id keys on the sender; the credential is never shown."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from router.sessions.agents import AGENT_SESSION_HEADERS
from tests.conftest import MakeRouter, RouterUnderTest
from tests.fakes import EchoBackend

FRONTS = ("raw", "aiohttp")
UUID = "5d0c2a8e-7b1f-4e3a-9c6d-0f2e4b8a1c37"
CREDENTIAL = "Bearer sk-agent-credential-4242"


def chat(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                                       {"role": "user", "content": "hello"}]}
    body.update(extra)
    return body


def upstream_sessions(fakes: list[EchoBackend]) -> list[list[str]]:
    return [s.headers.get("x-session-id", []) for f in fakes for s in f.seen]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, router: RouterUnderTest, headers: dict[str, str],
               path: str = "/v1/chat/completions", **body: Any) -> str:
    """The session the router answered with (in its configured session header)."""
    async with http.post(router.url + path, json=body or chat(), headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers[router.config.sessions.header]


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("name", AGENT_SESSION_HEADERS)
async def test_an_agent_header_names_the_session(make_router: MakeRouter, http: aiohttp.ClientSession,
                                                 front: str, name: str) -> None:
    router = await make_router(front, n=2)
    sid = await post(http, router, {name: UUID})
    assert sid == UUID  # as-is, echoed in the router's session header
    seen = [s for f in router.fakes for s in f.seen]
    assert len(seen) == 1
    assert seen[0].headers["x-session-id"] == [UUID]  # what vLLM reads
    assert seen[0].headers[name] == [UUID]  # the agent's own header is forwarded as received
    entry = router.state.sessions.get(UUID)
    assert entry is not None and entry.requests == 1 and entry.parent is None


@pytest.mark.parametrize("front", FRONTS)
async def test_an_agent_header_names_the_session_of_a_forwarded_route(make_router: MakeRouter,
                                                                      http: aiohttp.ClientSession, front: str) -> None:
    router = await make_router(front, n=2)
    sid = await post(http, router, {"X-Claude-Code-Session-Id": UUID}, path="/v1/embeddings", model="m", input="x")
    assert sid == UUID
    assert upstream_sessions(router.fakes) == [[UUID]]


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("channel", ["body", "header", "xargs"])
async def test_a_vllm_channel_wins_over_agent_headers(make_router: MakeRouter, http: aiohttp.ClientSession,
                                                      front: str, channel: str) -> None:
    router = await make_router(front, n=2)
    headers = {name: f"agent-{i}" for i, name in enumerate(AGENT_SESSION_HEADERS)}
    body = chat()
    if channel == "body":
        body["session_id"] = "vllm-1"
    elif channel == "header":
        headers["X-Session-ID"] = "vllm-1"
    else:
        body["vllm_xargs"] = {"session_id": "vllm-1"}
    assert await post(http, router, headers, **body) == "vllm-1"
    assert upstream_sessions(router.fakes) == [["vllm-1"]]
    assert all(router.state.sessions.get(f"agent-{i}") is None for i in range(len(AGENT_SESSION_HEADERS)))


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("value", ["", "has space", "x" * 257, "caf\u00e9"])
async def test_empty_or_unusable_agent_values_are_ignored(make_router: MakeRouter, http: aiohttp.ClientSession,
                                                          front: str, value: str) -> None:
    router = await make_router(front, n=2)
    derived = await post(http, router, {})
    async with http.post(router.url + "/v1/chat/completions", json=chat(),
                         headers={"X-Claude-Code-Session-Id": value.encode().decode("latin-1")}) as resp:
        assert resp.status == 200  # never refused for an agent's header
        assert resp.headers["X-Session-ID"] == derived  # derived as if the header were absent
    # and an unusable one gives way to the next agent header
    sid = await post(http, router, {"X-Claude-Code-Session-Id": value.encode().decode("latin-1"),
                                    "session-id": "codex-7"})
    assert sid == "codex-7"


@pytest.mark.parametrize("front", FRONTS)
async def test_correlation_and_request_ids_are_never_sessions(make_router: MakeRouter, http: aiohttp.ClientSession,
                                                              front: str) -> None:
    router = await make_router(front, n=2)
    sid = await post(http, router, {"X-Correlation-ID": "corr-1", "X-Request-Id": "req-1"})
    assert re.fullmatch(r"conv-[0-9a-f]{32}", sid)
    assert router.state.sessions.get("corr-1") is None and router.state.sessions.get("req-1") is None


@pytest.mark.parametrize("front", FRONTS)
async def test_a_child_records_its_parent(make_router: MakeRouter, http: aiohttp.ClientSession, front: str) -> None:
    router = await make_router(front, n=2)
    assert await post(http, router, {"x-session-affinity": "ses_parent"}) == "ses_parent"
    child = {"x-session-affinity": "ses_child", "x-parent-session-id": "ses_parent"}
    assert await post(http, router, child) == "ses_child"
    # OpenCode's newer releases name the child in X-Session-ID (the vLLM channel): the parent is read too
    assert await post(http, router, {"X-Session-ID": "ses_child2", "x-parent-session-id": "ses_parent"}) == "ses_child2"
    async with http.get(router.url + "/v1/sessions/ses_child") as resp:
        view = await resp.json()
    assert view["parent"] == "ses_parent"
    async with http.get(router.url + "/v1/sessions/ses_child2") as resp:
        assert (await resp.json())["parent"] == "ses_parent"
    async with http.get(router.url + "/v1/sessions/ses_parent") as resp:
        assert (await resp.json())["parent"] is None
    # set when the entry is created, not on later requests
    assert await post(http, router, {"x-session-affinity": "ses_child", "x-parent-session-id": "other"}) == "ses_child"
    entry = router.state.sessions.get("ses_child")
    assert entry is not None and entry.parent == "ses_parent" and entry.requests == 2


@pytest.mark.parametrize("front", FRONTS)
async def test_derived_ids_key_on_the_credential(make_router: MakeRouter, http: aiohttp.ClientSession,
                                                 front: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    router = await make_router(front, n=2)
    alice = await post(http, router, {"Authorization": CREDENTIAL})
    assert re.fullmatch(r"conv-[0-9a-f]{32}", alice)
    again = chat()
    again["messages"] += [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    assert await post(http, router, {"Authorization": CREDENTIAL}, **again) == alice  # stable per sender
    bob = await post(http, router, {"Authorization": "Bearer sk-someone-else"})
    anonymous = await post(http, router, {})
    assert len({alice, bob, anonymous}) == 3
    # the credential reaches the backend as sent (it is the backend's business), and nothing else shows it
    assert [s.headers.get("authorization") for f in router.fakes for s in f.seen].count([CREDENTIAL]) == 2
    for sid in (alice, bob, anonymous):
        async with http.get(router.url + f"/v1/sessions/{sid}") as resp:
            text = await resp.text()
        assert resp.status == 200 and "sk-" not in text
    assert "sk-agent-credential" not in caplog.text and "sk-someone" not in caplog.text


@pytest.mark.parametrize("front", FRONTS)
async def test_derived_ids_key_on_the_client_address(make_router: MakeRouter, front: str) -> None:
    router = await make_router(front, n=2)
    ids: dict[str, list[str]] = {}
    for source in ("127.0.0.1", "127.0.0.2", "127.0.0.1"):
        connector = aiohttp.TCPConnector(local_addr=(source, 0), force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            ids.setdefault(source, []).append(await post(session, router, {}))
    assert ids["127.0.0.1"][0] == ids["127.0.0.1"][1]  # stable over new connections from one address
    assert ids["127.0.0.2"][0] != ids["127.0.0.1"][0]


@pytest.mark.parametrize("front", FRONTS)
async def test_a_session_header_configured_under_an_agents_name_is_the_vllm_channel(
        make_router: MakeRouter, http: aiohttp.ClientSession, front: str) -> None:
    router = await make_router(front, n=2, session_header="X-Session-Affinity")
    assert await post(http, router, {"x-session-affinity": "ses_1", "session-id": "codex-1"}) == "ses_1"
    # as the session header its values follow the contract: a bad one is a 400, not ignored
    async with http.post(router.url + "/v1/chat/completions", json=chat(),
                         headers={"x-session-affinity": "has space"}) as resp:
        assert resp.status == 400
    # and it is not forwarded under its own name: upstream it is X-Session-ID
    seen = [s for f in router.fakes for s in f.seen]
    assert [s.headers.get("x-session-affinity") for s in seen] == [None]
    assert [s.headers["x-session-id"] for s in seen] == [["ses_1"]]
    # x-session-id is then an ordinary header, no session
    sid = await post(http, router, {"X-Session-ID": "plain-header"})
    assert sid.startswith("conv-")

"""Remote render (tokens mode): ``RemoteRenderer`` against render servers over real HTTP.

The render servers here are in-process aiohttp apps that answer vLLM's recorded render answers (the
golden cases, byte for byte as vLLM's render server sent them), so the client is tested against what a
real vLLM render server says; the end-to-end tests (``test_tokens_routes*``) use our real
``session-backend --role render`` process. A render server that is down is a loopback address nothing
listens on (127.0.0.9).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, generate_latest

from contract.errors import SessionRouterError
from router.health import HealthChecker
from router.metrics import RouterMetrics
from router.tokens.render_client import (
    NoRenderServerError,
    RemoteRenderer,
    RenderAnswerError,
    RenderRejected,
    RenderServerError,
    build_render_pool,
)
from router.upstream import UpstreamPool, UpstreamTimeouts
from tests.support import free_port, metric_sum

DATA = Path(__file__).resolve().parents[2] / "rendering" / "data"
DEAD = "http://127.0.0.9:{port}"
#: the shipped tiny tokenizer's largest token id
MAX_TOKEN_ID = 392


def golden(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines() if line.strip()]


CHAT = golden("render_chat")
COMPLETIONS = golden("render_completions")


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


class GoldenRenderServer:
    """Answers vLLM's recorded render answers for the recorded requests; counts calls; can be told to
    answer 5xx (``fail_with``)."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], tuple[int, bytes]] = {}
        for path, cases in (("/v1/chat/completions/render", CHAT), ("/v1/completions/render", COMPLETIONS)):
            for case in cases:
                self.answers[(path, canonical(case["request"]))] = (case["status"], json.dumps(case["response"]).encode())
        self.calls: list[tuple[str, str | None]] = []
        self.fail_with: int | None = None
        #: answer 200 with this body instead (not a GenerateRequest)
        self.garbage: bytes | None = None
        #: wait this long before answering
        self.delay = 0.0
        self.app = web.Application()
        for path in ("/v1/chat/completions/render", "/v1/completions/render"):
            self.app.router.add_post(path, self.render)
        self.app.router.add_get("/health", self.health)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def render(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, request.headers.get("X-Request-Id")))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.garbage is not None:
            return web.Response(body=self.garbage, content_type="application/json")
        if self.fail_with is not None:
            return web.json_response({"error": {"message": "boom", "type": "InternalServerError", "param": None,
                                                "code": self.fail_with}}, status=self.fail_with)
        status, body = self.answers[(request.path, canonical(json.loads(await request.read())))]
        return web.Response(status=status, body=body, content_type="application/json")


Make = Callable[..., Any]


@pytest.fixture
async def render_setup() -> AsyncIterator[Make]:
    """``await make(servers, dead=0, retries=2)`` -> (RemoteRenderer, fakes, metrics, health): ``servers``
    golden render servers started in-process, after ``dead`` URLs nothing listens on."""
    started: list[TestServer] = []
    upstreams: list[UpstreamPool] = []

    async def make(servers: int = 1, *, dead: int = 0, retries: int = 2, first_byte_s: float = 5.0
                   ) -> tuple[RemoteRenderer, list[GoldenRenderServer], RouterMetrics, HealthChecker]:
        fakes = [GoldenRenderServer() for _ in range(servers)]
        urls = [DEAD.format(port=free_port()) for _ in range(dead)]
        for fake in fakes:
            server = TestServer(fake.app, host="127.0.0.1")
            await server.start_server()
            started.append(server)
            urls.append(f"http://127.0.0.1:{server.port}")
        pool = build_render_pool(urls)
        metrics = RouterMetrics(CollectorRegistry(), top_k=0)
        health = HealthChecker([pool], interval_s=3600, timeout_s=2, eject_after_failures=3, eject_s=30)
        upstream = UpstreamPool(UpstreamTimeouts(connect_s=2, first_byte_s=first_byte_s, total_s=10))
        upstreams.append(upstream)
        renderer = RemoteRenderer(pool, upstream=upstream, health=health, metrics=metrics.render, retries=retries,
                                  retry_backoff_s=0.001, total_timeout_s=10, max_token_id=MAX_TOKEN_ID)
        return renderer, fakes, metrics, health

    yield make
    for upstream in upstreams:
        await upstream.close()
    for server in started:
        await server.close()


def first_ok(cases: list[dict[str, Any]]) -> dict[str, Any]:
    return next(c for c in cases if c["status"] == 200)


def without_id(encoded: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in encoded.items() if k != "request_id"}


async def test_chat_render_decodes_vllms_answer_and_keeps_our_request_id(render_setup: Make) -> None:
    renderer, fakes, metrics, _ = await render_setup(1)
    for case in [c for c in CHAT if c["status"] == 200][:10]:
        body = json.dumps(case["request"]).encode()
        request = await renderer.render_chat(body, request_id="chatcmpl-ours")
        encoded = msgspec.json.decode(msgspec.json.encode(request))
        assert encoded["request_id"] == "chatcmpl-ours"
        assert without_id(encoded) == without_id(case["response"])  # every other field as vLLM sent it
    assert fakes[0].calls[0] == ("/v1/chat/completions/render", "chatcmpl-ours")
    text = generate_latest(metrics.registry).decode()
    server = renderer.pool.members[0].name
    assert metric_sum(text, "session_router_render_requests_total", render_server=server, status_class="2xx") == 10
    assert metric_sum(text, "session_router_render_duration_seconds_count", render_server=server) == 10


async def test_completions_render_is_a_list_numbered_per_prompt(render_setup: Make) -> None:
    renderer, _, _, _ = await render_setup(1)
    multi = next(c for c in COMPLETIONS if len(c["response"]) > 1)
    requests = await renderer.render_completions(json.dumps(multi["request"]).encode(), request_id="cmpl-x")
    assert [r.request_id for r in requests] == [f"cmpl-x-{i}" for i in range(len(multi["response"]))]
    assert [r.token_ids for r in requests] == [r["token_ids"] for r in multi["response"]]
    single = next(c for c in COMPLETIONS if len(c["response"]) == 1)
    (request,) = await renderer.render_completions(json.dumps(single["request"]).encode(), request_id="cmpl-y")
    assert request.request_id == "cmpl-y" and request.token_ids == single["response"][0]["token_ids"]


async def test_a_render_server_that_is_down_is_skipped_for_the_next(render_setup: Make) -> None:
    renderer, fakes, metrics, _ = await render_setup(1, dead=1)
    dead, live = renderer.pool.members
    case = first_ok(CHAT)
    request = await renderer.render_chat(json.dumps(case["request"]).encode(), request_id="chatcmpl-1")
    assert request.token_ids == case["response"]["token_ids"]
    assert not dead.healthy and live.healthy  # a connect error downs it at once, as for backends
    assert len(fakes[0].calls) == 1 and dead.in_flight == 0 and live.in_flight == 0
    text = generate_latest(metrics.registry).decode()
    assert metric_sum(text, "session_router_render_errors_total", render_server=dead.name, reason="connect") == 1
    # the next call goes straight to the healthy one
    await renderer.render_chat(json.dumps(case["request"]).encode(), request_id="chatcmpl-2")
    assert metric_sum(generate_latest(metrics.registry).decode(), "session_router_render_errors_total") == 1


async def test_all_render_servers_down_is_a_503_that_says_what_to_do(render_setup: Make) -> None:
    renderer, _, _, _ = await render_setup(0, dead=2)
    case = first_ok(CHAT)
    with pytest.raises(NoRenderServerError) as caught:
        await renderer.render_chat(json.dumps(case["request"]).encode(), request_id="chatcmpl-1")
    error = json.loads(caught.value.body())["error"]
    assert caught.value.status == 503 and error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert "no render server answered" in error["message"] and "connection refused" in error["message"]
    assert "render = \"local\"" in error["message"]
    assert not any(server.healthy for server in renderer.pool.members)
    # now none is healthy: a 503 at once, without trying
    with pytest.raises(NoRenderServerError) as again:
        await renderer.render_chat(json.dumps(case["request"]).encode(), request_id="chatcmpl-2")
    assert "none of the 2 render server(s) is healthy" in again.value.message


@pytest.mark.parametrize("case", [c for c in CHAT if c["status"] != 200], ids=lambda c: str(c["status"]))
async def test_render_errors_are_relayed_with_the_render_servers_status_and_body(render_setup: Make,
                                                                                 case: dict[str, Any]) -> None:
    renderer, fakes, metrics, _ = await render_setup(2)
    with pytest.raises(RenderRejected) as caught:
        await renderer.render_chat(json.dumps(case["request"]).encode(), request_id="chatcmpl-1")
    assert isinstance(caught.value, SessionRouterError)
    assert caught.value.status == case["status"]
    assert caught.value.body() == json.dumps(case["response"]).encode()  # unchanged
    assert sum(len(f.calls) for f in fakes) == 1  # the client's error: no retry
    assert all(server.healthy for server in renderer.pool.members)
    text = generate_latest(metrics.registry).decode()
    assert metric_sum(text, "session_router_render_requests_total", status_class="4xx") == 1


async def test_a_5xx_goes_to_the_next_render_server_and_the_last_5xx_is_relayed(render_setup: Make) -> None:
    renderer, fakes, metrics, _ = await render_setup(2)
    case = first_ok(CHAT)
    fakes[0].fail_with = 500
    request = await renderer.render_chat(json.dumps(case["request"]).encode(), request_id="chatcmpl-1")
    assert request.token_ids == case["response"]["token_ids"]
    assert [len(f.calls) for f in fakes] == [1, 1]
    fakes[1].fail_with = 503
    with pytest.raises(RenderServerError) as caught:
        await renderer.render_chat(json.dumps(case["request"]).encode(), request_id="chatcmpl-2")
    assert caught.value.status in (500, 503) and json.loads(caught.value.body())["error"]["message"] == "boom"
    text = generate_latest(metrics.registry).decode()
    assert metric_sum(text, "session_router_render_errors_total", reason="status_500") >= 1


async def test_retries_are_bounded_by_the_retries_setting(render_setup: Make) -> None:
    renderer, fakes, _, _ = await render_setup(1, dead=2, retries=1)
    with pytest.raises(NoRenderServerError):
        await renderer.render_chat(json.dumps(first_ok(CHAT)["request"]).encode(), request_id="chatcmpl-1")
    assert fakes[0].calls == []  # two tries (one retry), both on the dead ones
    request = await renderer.render_chat(json.dumps(first_ok(CHAT)["request"]).encode(), request_id="chatcmpl-2")
    assert request.request_id == "chatcmpl-2"  # the dead ones are down now: the live one answers


async def test_health_checks_bring_a_render_server_back(render_setup: Make) -> None:
    import aiohttp

    renderer, fakes, _, health = await render_setup(1)
    (server,) = renderer.pool.members
    health.record_failure(server, connect_error=True)
    with pytest.raises(NoRenderServerError):
        await renderer.render_chat(json.dumps(first_ok(CHAT)["request"]).encode(), request_id="chatcmpl-1")
    async with aiohttp.ClientSession() as session:
        health.start(session)
        try:
            await health.check_now()
        finally:
            await health.stop()
    assert server.healthy
    await renderer.render_chat(json.dumps(first_ok(CHAT)["request"]).encode(), request_id="chatcmpl-2")
    assert len(fakes[0].calls) == 1


async def test_a_render_server_that_does_not_answer_in_time_is_left_for_the_next(render_setup: Make) -> None:
    renderer, fakes, metrics, _ = await render_setup(2, first_byte_s=0.2)
    fakes[0].delay = 1.0
    case = first_ok(CHAT)
    request = await renderer.render_chat(json.dumps(case["request"]).encode(), request_id="chatcmpl-1")
    assert request.token_ids == case["response"]["token_ids"]
    assert [len(f.calls) for f in fakes] == [1, 1]
    text = generate_latest(metrics.registry).decode()
    assert metric_sum(text, "session_router_render_errors_total", render_server=renderer.pool.members[0].name,
                      reason="timeout") == 1
    assert all(server.in_flight == 0 for server in renderer.pool.members)


async def test_an_answer_that_is_not_a_generate_request_is_a_502(render_setup: Make) -> None:
    renderer, fakes, _, _ = await render_setup(1)
    fakes[0].garbage = b'{"not": "a generate request"}'
    with pytest.raises(RenderAnswerError) as caught:
        await renderer.render_chat(json.dumps(first_ok(CHAT)["request"]).encode(), request_id="chatcmpl-1")
    assert caught.value.status == 502 and "not a GenerateRequest" in caught.value.message


async def test_ids_past_the_vocabulary_from_a_render_server_are_refused_before_any_engine(render_setup: Make) -> None:
    """vLLM 0.32's render server passes a client's token ids through unchecked (it answered 200 with
    ``[1, 99999]``, ``bench/vllm_tokens_live.py``) and a tokens-only engine's core dies on such an id:
    the router answers vLLM's 400 itself."""
    renderer, fakes, _, _ = await render_setup(1)
    answer = first_ok(COMPLETIONS)["response"][0]
    fakes[0].garbage = json.dumps([{**answer, "token_ids": [1, MAX_TOKEN_ID + 1]}]).encode()
    body = json.dumps({"model": "tiny-llama", "prompt": [1, MAX_TOKEN_ID + 1]}).encode()
    with pytest.raises(SessionRouterError) as caught:
        await renderer.render_completions(body, request_id="cmpl-1")
    assert caught.value.status == 400
    assert json.loads(caught.value.body())["error"] == {
        "message": f"Token id {MAX_TOKEN_ID + 1} is out of vocabulary", "type": "BadRequestError", "param": None,
        "code": 400}
    fakes[0].garbage = json.dumps([{**answer, "token_ids": [5, -1]}]).encode()
    with pytest.raises(SessionRouterError) as caught:
        await renderer.render_completions(body, request_id="cmpl-1")
    assert caught.value.status == 400 and b"Token id -1 is out of vocabulary" in caught.value.body()
    fakes[0].garbage = json.dumps([{**answer, "token_ids": [1, MAX_TOKEN_ID]}]).encode()  # the last id is fine
    [request] = await renderer.render_completions(body, request_id="cmpl-2")
    assert request.token_ids == [1, MAX_TOKEN_ID]
    chat = first_ok(CHAT)["response"]
    fakes[0].garbage = json.dumps({**chat, "token_ids": [*chat["token_ids"], 5000]}).encode()
    with pytest.raises(SessionRouterError) as caught:
        await renderer.render_chat(json.dumps(first_ok(CHAT)["request"]).encode(), request_id="chatcmpl-1")
    assert caught.value.status == 400 and b"Token id 5000 is out of vocabulary" in caught.value.body()

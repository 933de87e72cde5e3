"""Tokens mode end to end, in process: the OpenAI SDK -> the router (local render, both fronts) ->
tokens-only engines (session-backend's app, the shipped model) -> derendered answers.

Real HTTP over loopback sockets everywhere; the engines are checked directly (their session table,
what is running) to show what reached them.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web
import openai
import pytest
from prometheus_client import generate_latest

from rendering.render import Renderer
from router.app import TOKENS
from tests.router.tokens.conftest import Engine, tokens_settings
from tests.support import eventually, metric_sum

FRONTS = ["raw", "aiohttp"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to ten."}]


async def tokens_router(make_router: Any, tiny_model: Any, *, n: int = 1, speed: float = 0.0,
                        front: str = "raw", **settings: Any) -> tuple[Any, list[Engine]]:
    engines = [Engine(f"e{i}", tiny_model, speed=speed) for i in range(n)]
    router = await make_router(front, fakes=engines, named=True, **tokens_settings(**settings))
    return router, engines


def client_of(router: Any, **headers: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                              default_headers=headers or None)


def prompt_ids(model: Any, messages: list[dict[str, Any]]) -> list[int]:
    body = json.dumps({"model": model.name, "messages": messages}).encode()
    return list(Renderer(model).render_chat(body).request.token_ids)


@pytest.mark.parametrize("front", FRONTS)
async def test_chat_non_stream(make_router: Any, tiny_model: Any, front: str) -> None:
    router, (engine,) = await tokens_router(make_router, tiny_model, front=front)
    async with client_of(router, **{"X-Session-ID": "sess-chat"}) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny-llama", messages=MESSAGES, max_tokens=12, seed=7)
    answer = raw.parse()
    request_id = raw.headers["x-request-id"]
    assert answer.id == f"chatcmpl-{request_id}" and answer.model == "tiny-llama"
    assert raw.headers["x-session-id"] == "sess-chat"
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert answer.usage.prompt_tokens == len(prompt_ids(tiny_model, MESSAGES))
    assert answer.usage.completion_tokens == 12
    # the session reached the engine core with the request, and the router accounted the usage
    stats = engine.engine.sessions.get("sess-chat")
    assert stats is not None and stats.requests == 1 and stats.prompt_tokens == answer.usage.prompt_tokens
    entry = router.state.sessions.get("sess-chat")
    assert entry is not None and entry.completion_tokens == 12


@pytest.mark.parametrize("front", FRONTS)
async def test_chat_stream_n2_with_usage_matches_the_whole_answer(make_router: Any, tiny_model: Any,
                                                                   front: str) -> None:
    router, (engine,) = await tokens_router(make_router, tiny_model, front=front)
    async with client_of(router, **{"X-Session-ID": "sess-stream"}) as client:
        whole = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=10, seed=3,
                                                     n=2)
        stream = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=10, seed=3,
                                                      n=2, stream=True, stream_options={"include_usage": True})
        texts = {0: "", 1: ""}
        finish: dict[int, str | None] = {}
        roles = 0
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                roles += choice.delta.role == "assistant"
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason is not None:
                    finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert roles == 2 and finish == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 20 and usage.prompt_tokens == whole.usage.prompt_tokens
    assert engine.engine.sessions.get("sess-stream").requests == 2


async def stop_word(client: openai.AsyncOpenAI, **kwargs: Any) -> tuple[str, str]:
    """A seeded answer's text and a word from its middle, to stop on."""
    answer = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, seed=11, **kwargs)
    text = answer.choices[0].message.content
    words = text.split(" ")
    assert len(words) > 6, text
    return text, " " + words[4]


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings_trim_the_text_and_abort_the_engine(make_router: Any, tiny_model: Any,
                                                               stream: bool) -> None:
    router, (engine,) = await tokens_router(make_router, tiny_model, speed=0.0)
    async with client_of(router) as client:
        text, stop = await stop_word(client, max_tokens=40)
        expected = text[:text.index(stop)]
        # a long answer, cut by the stop string: the engine's request is aborted, not run to the end
        kwargs: dict[str, Any] = dict(model="tiny-llama", messages=MESSAGES, seed=11, max_tokens=40, stop=[stop])
        if stream:
            events = await client.chat.completions.create(stream=True, **kwargs)
            got = ""
            reasons = []
            async for chunk in events:
                for choice in chunk.choices:
                    got += choice.delta.content or ""
                    if choice.finish_reason:
                        reasons.append((choice.finish_reason, getattr(choice, "stop_reason", None)))
            assert got == expected and reasons == [("stop", stop)]
        else:
            answer = await client.chat.completions.create(**kwargs)
            choice = answer.choices[0]
            assert choice.message.content == expected and choice.finish_reason == "stop"
            assert choice.model_extra["stop_reason"] == stop
            assert answer.usage.completion_tokens < 40
    await eventually(engine.idle, timeout=5, what="the engine has nothing running")


async def test_a_stop_string_aborts_a_slow_engine_at_once(make_router: Any, tiny_model: Any) -> None:
    """With a slow engine the abort is what ends its work: the request leaves the engine long before
    max_tokens would have."""
    router, (engine,) = await tokens_router(make_router, tiny_model, speed=0.0)
    async with client_of(router) as client:
        text, stop = await stop_word(client, max_tokens=40)
    slow, (slow_engine,) = await tokens_router(make_router, tiny_model, speed=1.0)
    aborted_before = await engine_aborts(slow)
    async with client_of(slow) as client:
        answer = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, seed=11,
                                                      max_tokens=2000, stop=[stop])
    assert answer.choices[0].message.content == text[:text.index(stop)]
    await eventually(slow_engine.idle, timeout=5, what="the slow engine has nothing running")
    assert await engine_aborts(slow) == aborted_before + 1


async def engine_aborts(router: Any, index: int = 0) -> float:
    """The engine's count of requests that finished aborted (its own /metrics, over HTTP)."""
    server = router.servers[index]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{server.port}/metrics") as response:
            text = await response.text()
    return metric_sum(text, "vllm:request_success_total", finished_reason="abort")


async def test_a_client_that_disconnects_aborts_the_engine_request(make_router: Any, tiny_model: Any) -> None:
    router, (engine,) = await tokens_router(make_router, tiny_model, speed=1.0)
    body = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 2000, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(router.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            async for line in response.content:
                if b'"content"' in line:
                    break  # one content event seen: the engine is generating
            assert not engine.idle()
            response.close()  # the client goes away mid-stream
    await eventually(engine.idle, timeout=5, what="the engine request aborted after the client left")
    assert await engine_aborts(router) == 1
    metrics = generate_latest(router.state.metrics.registry).decode()
    assert metric_sum(metrics, "session_router_engine_aborts_total", result="aborted") == 1


@pytest.mark.parametrize("prompts", [1, 2])
async def test_a_non_stream_client_that_disconnects_aborts_the_engine(make_router: Any, tiny_model: Any,
                                                                      prompts: int) -> None:
    router, (engine,) = await tokens_router(make_router, tiny_model, speed=1.0)
    body = {"model": "tiny-llama", "prompt": ["Once upon a time"] * prompts, "max_tokens": 2000}
    async with aiohttp.ClientSession() as http:
        request = asyncio.ensure_future(http.post(router.url + "/v1/completions", json=body))
        await eventually(lambda: engine.engine.num_running == prompts, timeout=5, what="the engine generating")
        request.cancel()  # the client goes away before the answer
        with pytest.raises(asyncio.CancelledError):
            await request
    await eventually(engine.idle, timeout=5, what="the engine requests aborted after the client left")
    assert await engine_aborts(router) == prompts
    await eventually(lambda: metric_sum(generate_latest(router.state.metrics.registry).decode(),
                                        "session_router_engine_aborts_total", result="aborted") == prompts,
                     timeout=5, what="the router's aborts answered")


async def test_completions_stream_and_not(make_router: Any, tiny_model: Any) -> None:
    router, (engine,) = await tokens_router(make_router, tiny_model)
    async with client_of(router, **{"X-Session-ID": "sess-cmpl"}) as client:
        whole = await client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=8, seed=5)
        stream = await client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=8, seed=5,
                                                 stream=True)
        text = ""
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert whole.choices[0].text == text and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8
    assert engine.engine.sessions.get("sess-cmpl").requests == 2


async def test_render_errors_are_vllms_and_reach_no_engine(make_router: Any, tiny_model: Any) -> None:
    router, (engine,) = await tokens_router(make_router, tiny_model)
    async with client_of(router) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="tiny-llama", messages=[], max_tokens=3)
        assert info.value.status_code == 400
        assert info.value.body["message"] == ("Cannot apply chat template to an empty conversation. "
                                              "Provide at least one message.")
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="other-model", messages=MESSAGES, max_tokens=3)
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=-1)
        assert info.value.body["param"] == "max_tokens"
    assert engine.engine.sessions.recent(10) == []


class DyingEngine:
    """A generate route that streams two steps of ids, then drops the connection (an engine that dies)."""

    name = "dying"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_post("/inference/v1/abort_requests", self.abort)
        app.router.add_get("/health", self.health)
        self.aborts = 0
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def abort(self, request: web.Request) -> web.Response:
        self.aborts += 1
        return web.Response()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for ids in ([277, 280], [68, 87]):  # " the cat" in the tiny tokenizer
            step = {"request_id": "generate-tokens-x", "choices": [{"index": 0, "token_ids": ids}]}
            await response.write(b"data: " + json.dumps(step).encode() + b"\n\n")
        await response.write(b'data: {"request_id": "generate-tok')  # and dies mid-event
        assert request.transport is not None
        request.transport.close()
        return response


async def test_an_engine_that_dies_mid_stream_ends_the_stream_with_an_error_event(make_router: Any) -> None:
    dying = DyingEngine()
    router = await make_router("raw", fakes=[dying], **tokens_settings())
    body = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 20, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(router.url + "/v1/chat/completions", json=body) as response:
            text = (await response.read()).decode()
    events = [e[len("data: "):] for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 502
    assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[1:-2]) == " the cat"
    assert dying.aborts == 0  # nothing left to abort


# ------------------------------------------------------------------------------------------- P/D


@pytest.mark.parametrize("stream", [False, True])
async def test_pd_both_legs_on_generate_with_the_session(make_router: Any, tiny_model: Any, stream: bool) -> None:
    prefill = Engine("p0", tiny_model, role="prefill")
    decode = Engine("d0", tiny_model, role="decode")
    router = await make_router("raw", fakes=[], prefill=[prefill], decode=[decode], **tokens_settings())
    async with client_of(router, **{"X-Session-ID": "sess-pd"}) as client:
        kwargs: dict[str, Any] = dict(model="tiny-llama", messages=MESSAGES, max_tokens=6, seed=1)
        if stream:
            events = await client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                          **kwargs)
            text, usage = "", None
            async for chunk in events:
                text += "".join(c.delta.content or "" for c in chunk.choices)
                usage = chunk.usage or usage
        else:
            answer = await client.chat.completions.create(**kwargs)
            text, usage = answer.choices[0].message.content, answer.usage
    assert text and usage is not None and usage.completion_tokens == 6
    # each leg reached its engine core with the session; the decode took the prefill's KV blocks
    assert prefill.engine.sessions.get("sess-pd").requests == 1
    assert decode.engine.sessions.get("sess-pd").requests == 1
    metrics = generate_latest(router.state.metrics.registry).decode()
    assert metric_sum(metrics, "session_router_pd_fallback_total") == 0
    await eventually(lambda: prefill.idle() and decode.idle(), timeout=5, what="both engines idle")


# ---------------------------------------------------------------------------- incremental render


async def test_a_sessions_next_turn_renders_from_its_previous_prompt(make_router: Any, tiny_model: Any) -> None:
    """The router keeps each session's last prompt; the next turn renders from it (``previous``), and
    the engine gets exactly the ids of a full render. Deleting the session drops the state."""
    router, (engine,) = await tokens_router(make_router, tiny_model)
    mode = router.app[TOKENS]
    assert mode.prompts is not None
    seen: list[Any] = []
    render = mode.local.renderer.render_chat

    def spy(body: bytes, **kwargs: Any) -> Any:
        seen.append(kwargs.get("previous"))
        return render(body, **kwargs)

    mode.local.renderer.render_chat = spy  # type: ignore[method-assign]
    messages = list(MESSAGES)
    async with client_of(router, **{"X-Session-ID": "sess-turns"}) as client:
        for turn in range(3):
            answer = await client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=5,
                                                          seed=turn)
            assert answer.usage.prompt_tokens == len(prompt_ids(tiny_model, messages))
            messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": f"and then {turn}?"}]
    assert seen[0] is None and seen[1] is not None and seen[2] is not None
    assert seen[2].text.startswith(seen[1].text)
    assert engine.engine.sessions.get("sess-turns").requests == 3
    assert "sess-turns" in mode.prompts
    async with aiohttp.ClientSession() as http:
        async with http.delete(router.url + "/v1/sessions/sess-turns") as response:
            assert response.status in (200, 204)
    assert "sess-turns" not in mode.prompts


async def test_no_prompt_cache_when_its_bound_is_zero(make_router: Any, tiny_model: Any) -> None:
    router, _ = await tokens_router(make_router, tiny_model, prompt_cache_bytes=0)
    assert router.app[TOKENS].prompts is None
    async with client_of(router, **{"X-Session-ID": "s"}) as client:
        answer = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=2)
    assert answer.usage.completion_tokens == 2


# --------------------------------------------------------------------- completions, several prompts


PROMPTS = ["Once upon a time", "The quick brown fox", "In the beginning"]


async def test_several_prompts_answer_as_their_single_requests(make_router: Any, tiny_model: Any) -> None:
    router, engines = await tokens_router(make_router, tiny_model, n=2)
    async with client_of(router, **{"X-Session-ID": "sess-multi"}) as client:
        singles = [await client.completions.create(model="tiny-llama", prompt=p, max_tokens=6, seed=4, n=2)
                   for p in PROMPTS]
        whole = await client.completions.create(model="tiny-llama", prompt=PROMPTS, max_tokens=6, seed=4, n=2)
        stream = await client.completions.create(model="tiny-llama", prompt=PROMPTS, max_tokens=6, seed=4, n=2,
                                                 stream=True, stream_options={"include_usage": True})
        streamed: dict[int, str] = {}
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    expected = [c.text for single in singles for c in single.choices]
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == expected
    assert [streamed[i] for i in range(6)] == expected
    assert whole.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert whole.usage.completion_tokens == 36 and usage is not None and usage.completion_tokens == 36
    assert sum(e.engine.sessions.get("sess-multi").requests for e in engines
               if e.engine.sessions.get("sess-multi") is not None) == 3 + 3 + 3


async def test_several_prompts_with_stop_strings_abort_every_engine_request(make_router: Any,
                                                                            tiny_model: Any) -> None:
    router, (engine,) = await tokens_router(make_router, tiny_model)
    async with client_of(router) as client:
        singles = [await client.completions.create(model="tiny-llama", prompt=p, max_tokens=40, seed=9)
                   for p in PROMPTS[:2]]
        words = [s.choices[0].text.split(" ") for s in singles]
        stops = [" " + words[0][3], " " + words[1][3]]
        slow, (slow_engine,) = await tokens_router(make_router, tiny_model, speed=1.0)
    async with client_of(slow) as client:
        answer = await client.completions.create(model="tiny-llama", prompt=PROMPTS[:2], max_tokens=2000, seed=9,
                                                 stop=stops)
    for single, choice in zip(singles, answer.choices, strict=True):
        text = single.choices[0].text
        cut = min(text.index(s) for s in stops if s in text)
        assert choice.text == text[:cut] and choice.finish_reason == "stop"
    await eventually(slow_engine.idle, timeout=5, what="both engine requests aborted")
    assert await engine_aborts(slow) == 2


class RefusingEngine:
    """Refuses prompt 1 of a fan-out (``X-Request-Id: <id>-1``) with a 400; holds prompt 0 open until the
    router lets go of it."""

    name = "refusing"

    def __init__(self) -> None:
        self.let_go = asyncio.Event()
        self.aborted: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_post("/inference/v1/abort_requests", self.abort)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def abort(self, request: web.Request) -> web.Response:
        self.aborted += (await request.json())["request_ids"]
        return web.Response()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if request.headers["X-Request-Id"].endswith("-1"):
            return web.json_response({"error": {"message": "refused", "type": "BadRequestError", "param": None,
                                                "code": 400}}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await asyncio.Event().wait()
        finally:
            self.let_go.set()
        return response


@pytest.mark.parametrize("stream", [False, True])
async def test_several_prompts_one_refused_is_the_answer(make_router: Any, stream: bool) -> None:
    engine = RefusingEngine()
    router = await make_router("raw", fakes=[engine], **tokens_settings())
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny-llama", "prompt": ["a b c", "d e f"], "max_tokens": 3, "stream": stream}
        async with http.post(router.url + "/v1/completions", json=body, headers={"X-Request-Id": "fan"}) as response:
            status, answer = response.status, await response.json()
    assert status == 400 and answer["error"]["message"] == "refused"
    await asyncio.wait_for(engine.let_go.wait(), 5)  # prompt 0's connection was closed
    await eventually(lambda: engine.aborted == ["generate-tokens-fan-0"], timeout=5, what="prompt 0 aborted")


async def test_max_tokens_16_is_sent_to_the_engine(make_router: Any, tiny_model: Any) -> None:
    """16 is the value the render's JSON leaves out (vLLM's default); the engine must still get it, else it
    reads the missing field as the whole remaining context."""
    router, _ = await tokens_router(make_router, tiny_model)
    async with client_of(router) as client:
        default = await client.completions.create(model="tiny-llama", prompt="Once upon a time", seed=1)
        chat = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=16, seed=1)
        streamed = await client.completions.create(model="tiny-llama", prompt="Once", seed=1, stream=True,
                                                   stream_options={"include_usage": True})
        usage = None
        async for chunk in streamed:
            usage = chunk.usage or usage
    assert default.usage.completion_tokens == 16 and chat.usage.completion_tokens == 16
    assert usage is not None and usage.completion_tokens == 16


async def test_dead_engines_leave_the_live_one_serving(make_router: Any, tiny_model: Any) -> None:
    engine = Engine("e0", tiny_model)
    router = await make_router("raw", fakes=[engine], dead=2, named=True, **tokens_settings())
    async with client_of(router) as client:
        for i in range(6):  # sessions hashed to a dead engine go to the live one (health check or retry)
            answer = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=2,
                                                          extra_headers={"X-Session-ID": f"retry-{i}"})
            assert answer.usage.completion_tokens == 2
    assert sum(engine.engine.sessions.get(f"retry-{i}").requests for i in range(6)) == 6

"""Tokens mode's side routes, unit level: the Responses request as a chat turn, the ``response`` object
made of a ``chat.completion``, and tokens mode's ``/v1/models``. The end-to-end tests with real
processes are in ``test_tokens_routes_e2e.py``."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from contract.errors import BadRequestError, InvalidJSONError
from rendering.model import DEFAULT_MODEL_DIR, load_model
from router.endpoints import tokens_models
from router.membership import Backend, BackendPool
from router.tokens.render_client import build_render_pool
from router.tokens.responses_route import response_object, responses_turn
from tests.support import eventually, free_port, metric_sum

MODEL = load_model(DEFAULT_MODEL_DIR)

# vLLM's ResponsesResponse keys, in its order (pydantic dumps fields as declared)
RESPONSE_KEYS = ["id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object", "output",
                 "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p", "background",
                 "max_output_tokens", "max_tool_calls", "previous_response_id", "prompt", "reasoning", "service_tier",
                 "status", "text", "top_logprobs", "truncation", "usage", "user", "input_messages", "output_messages"]


def chat_of(body: dict[str, Any]) -> dict[str, Any]:
    return json.loads(responses_turn(json.dumps(body).encode()).chat_body)


def test_a_string_input_is_one_user_message_and_instructions_a_leading_system_message() -> None:
    assert chat_of({"model": "tiny-llama", "input": "hi"}) == {
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    chat = chat_of({"input": "hi", "instructions": "be brief", "max_output_tokens": 7, "temperature": 0.5,
                    "top_p": 0.9, "seed": 3, "stop": ["x"], "session_id": "s-1", "store": False})
    assert chat["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"], chat["seed"], chat["stop"]) == (7, 0.5, 0.9, 3, ["x"])
    assert chat["session_id"] == "s-1" and chat["stream"] is False and "store" not in chat
    streamed = chat_of({"input": "hi", "stream": True})
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}


def test_message_items_become_chat_messages_as_vllm_builds_them() -> None:
    chat = chat_of({"input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "first", "annotations": []},
                     {"type": "output_text", "text": "second", "annotations": []}]},
        {"role": "user", "content": "again"},
    ]})
    assert chat["messages"] == [{"role": "developer", "content": "rules"}, {"role": "user", "content": "a\nb"},
                                {"role": "assistant", "content": "first"}, {"role": "user", "content": "again"}]


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": "x", "store": True}, "store", "store is not supported"),
    ({"input": "x", "background": True}, "background", "background is not supported"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "nothing is stored"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools", "tools are not supported"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text", "structured output"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "logprobs"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]}, "input", "only message items"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input", "only text parts"),
    ({"model": "tiny-llama"}, "input", "Field required: input"),
    ({"input": 5}, None, "invalid /v1/responses body"),
])
def test_what_tokens_mode_does_not_do_is_a_400_that_says_what_it_does(body: dict[str, Any], param: str | None,
                                                                       says: str) -> None:
    with pytest.raises(BadRequestError) as caught:
        responses_turn(json.dumps(body).encode())
    assert caught.value.status == 400 and caught.value.param == param and says in caught.value.message
    if param in ("store", "previous_response_id", "background"):
        assert "tokens mode answers /v1/responses without storing anything" in caught.value.message


def test_a_body_that_is_not_json_is_a_400() -> None:
    with pytest.raises(InvalidJSONError):
        responses_turn(b"{not json")


def chat_completion(text: str, finish: str, prompt: int = 20, completion: int = 5, cached: int | None = 3) -> bytes:
    return json.dumps({
        "id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "tiny-llama",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                             "annotations": None, "audio": None, "function_call": None,
                                             "tool_calls": [], "reasoning": None},
                     "logprobs": None, "finish_reason": finish, "stop_reason": None, "token_ids": None}],
        "service_tier": None, "system_fingerprint": None,
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
                  "prompt_tokens_details": None if cached is None else {"cached_tokens": cached}},
        "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None,
    }).encode()


def test_the_response_object_has_vllms_keys_in_vllms_order() -> None:
    turn = responses_turn(json.dumps({"input": "hi", "instructions": "be brief", "metadata": {"k": "v"},
                                      "user": "u1"}).encode())
    answer = json.loads(response_object(turn, MODEL, chat_completion("hello there", "stop")))
    assert list(answer) == RESPONSE_KEYS
    assert answer["id"] == turn.response_id and answer["id"].startswith("resp_") and len(answer["id"]) == 37
    assert answer["object"] == "response" and answer["status"] == "completed"
    assert answer["incomplete_details"] is None and answer["model"] == "tiny-llama"
    assert (answer["instructions"], answer["metadata"], answer["user"]) == ("be brief", {"k": "v"}, "u1")
    (item,) = answer["output"]
    assert list(item) == ["id", "content", "role", "status", "type"] and item["id"].startswith("msg_")
    assert item["content"] == [{"annotations": [], "text": "hello there", "type": "output_text", "logprobs": None}]
    assert (item["role"], item["status"], item["type"]) == ("assistant", "completed", "message")
    assert answer["usage"] == {
        "input_tokens": 20,
        "input_tokens_details": {"cached_tokens": 3, "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                                  "tool_output_tokens_per_turn": []},
        "total_tokens": 25,
    }
    # the sampling parameters it ran with: the model's defaults, and the context left after the prompt
    assert answer["temperature"] == MODEL.default_sampling.get("temperature", 1.0)
    assert answer["max_output_tokens"] == MODEL.max_model_len - 20
    assert (answer["tools"], answer["tool_choice"], answer["parallel_tool_calls"]) == ([], "auto", True)


def test_max_output_tokens_ending_the_answer_is_an_incomplete_response() -> None:
    turn = responses_turn(json.dumps({"input": "hi", "max_output_tokens": 5, "temperature": 0.25,
                                      "request_id": "resp_mine"}).encode())
    answer = json.loads(response_object(turn, MODEL, chat_completion("abc", "length", cached=None)))
    assert answer["id"] == "resp_mine"
    assert answer["status"] == "incomplete" and answer["incomplete_details"] == {"reason": "max_output_tokens"}
    assert answer["max_output_tokens"] == 5 and answer["temperature"] == 0.25
    assert answer["usage"]["input_tokens_details"]["cached_tokens"] == 0


def test_an_empty_answer_has_a_message_item_without_content() -> None:
    turn = responses_turn(b'{"input": "hi"}')
    answer = json.loads(response_object(turn, MODEL, chat_completion("", "stop")))
    assert answer["output"][0]["content"] == []


def state_with(pools: dict[str, BackendPool]) -> Any:
    return SimpleNamespace(pools=pools)


def test_tokens_models_is_the_routers_own_card_when_the_engines_list_none() -> None:
    engines = BackendPool("default", [Backend("http://127.0.0.1:9001")])  # a --tokens-only vLLM: no /v1/models
    render = build_render_pool(["http://127.0.0.1:9100"])
    render.set_models(render.members[0], frozenset({"other"}), ({"id": "other"},))
    answer = tokens_models(MODEL, state_with({"default": engines, "render": render}), 123)
    (card,) = answer["data"]
    assert answer["object"] == "list"
    assert (card["id"], card["object"], card["owned_by"], card["created"]) == ("tiny-llama", "model", "vllm", 123)
    assert card["max_model_len"] == MODEL.max_model_len and card["root"] == str(MODEL.path)
    assert card["permission"][0]["object"] == "model_permission"


def test_tokens_models_is_an_engines_card_when_one_lists_the_model() -> None:
    engines = BackendPool("default", [Backend("http://127.0.0.1:9001"), Backend("http://127.0.0.1:9002")])
    theirs = {"id": "tiny-llama", "object": "model", "created": 5, "owned_by": "vllm", "root": "/models/x",
              "max_model_len": 2048}
    engines.set_models(engines.members[1], frozenset({"tiny-llama", "lora"}), (theirs, {"id": "lora"}))
    assert tokens_models(MODEL, state_with({"default": engines}), 123) == {"object": "list", "data": [theirs]}
    engines.members[1].healthy = False
    assert tokens_models(MODEL, state_with({"default": engines}), 123)["data"][0]["created"] == 123


# ------------------------------------------------------------------ through an in-process router (both fronts)

TOKENS = {"upstream_api": "tokens", "model_dir": str(DEFAULT_MODEL_DIR)}


@pytest.fixture
def renderer() -> Any:
    from rendering.render import Renderer

    return Renderer(MODEL)


@pytest.mark.parametrize("front", ["raw", "aiohttp"])
async def test_the_router_answers_tokenize_and_detokenize_with_the_local_renderer(make_router: Any, renderer: Any,
                                                                                   front: str) -> None:
    import aiohttp

    from tests.router.routing_support import ModelBackend

    # an engine like a --tokens-only vLLM: no /v1/models
    router = await make_router(front, fakes=[ModelBackend("e0", None)], tokens=TOKENS)
    await eventually(lambda: router.state.health.rounds >= 1, timeout=10, what="a health round")
    async with aiohttp.ClientSession() as http:
        for path, body, answer in (
            ("/tokenize", {"model": "tiny-llama", "prompt": "hello café"}, renderer.tokenize),
            ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, renderer.tokenize),
            ("/detokenize", {"model": "tiny-llama", "tokens": [1, 31, 95, 379]}, renderer.detokenize),
        ):
            raw = json.dumps(body).encode()
            async with http.post(router.url + path, data=raw, headers={"X-Request-Id": "r-1"}) as resp:
                assert resp.status == 200 and resp.headers["X-Request-Id"] == "r-1"
                assert json.loads(await resp.read()) == json.loads(answer(raw))
        async with http.post(router.url + "/tokenize", data=b'{"model": "other", "prompt": "x"}') as resp:
            error = json.loads(await resp.read())["error"]
            assert resp.status == 404 and error["type"] == "NotFoundError" and error["param"] == "model"
        async with http.post(router.url + "/v1/responses", json={"input": "hi", "store": True}) as resp:
            error = json.loads(await resp.read())["error"]
            assert resp.status == 400 and error["param"] == "store"
        async with http.post(router.url + "/v1/chat/completions", json={"messages": []}) as resp:
            assert resp.status == 400  # render's own 400, answered without an engine
        async with http.get(router.url + "/metrics") as resp:  # the render was timed, as local
            text = (await resp.read()).decode()
            assert metric_sum(text, "session_router_render_local_duration_seconds_count") == 1
            assert metric_sum(text, "session_router_render_requests_total") == 0
        assert router.fakes[0].hits == []  # the router answered all of it: no backend was asked
        async with http.get(router.url + "/v1/models") as resp:  # the engine lists none
            (card,) = json.loads(await resp.read())["data"]
            assert card["id"] == "tiny-llama" and card["root"] == str(DEFAULT_MODEL_DIR)


async def test_a_clients_generate_with_ids_outside_the_vocabulary_never_reaches_an_engine(make_router: Any) -> None:
    """A ``--tokens-only`` vLLM engine has no tokenizer, so it does not check a prompt's ids, and its
    engine core dies on one past the vocabulary (``bench/vllm_tokens_live.py``): tokens mode answers
    vLLM's 400 for them and forwards the rest as they came."""
    import aiohttp

    from tests.router.routing_support import ModelBackend

    router = await make_router("raw", fakes=[ModelBackend("e0", None)], tokens=TOKENS)
    await eventually(lambda: router.state.health.rounds >= 1, timeout=10, what="a health round")
    top = MODEL.max_token_id
    async with aiohttp.ClientSession() as http:
        for ids, bad in (([1, top + 1], top + 1), ([top + 100, 2], top + 100)):
            async with http.post(router.url + "/inference/v1/generate",
                                 json={"token_ids": ids, "sampling_params": {"max_tokens": 2}}) as resp:
                assert resp.status == 400
                assert json.loads(await resp.read())["error"] == {
                    "message": f"Token id {bad} is out of vocabulary", "type": "BadRequestError", "param": None,
                    "code": 400}
        assert router.fakes[0].hits == []
        good = json.dumps({"token_ids": [1, top], "sampling_params": {"max_tokens": 2}}).encode()
        async with http.post(router.url + "/inference/v1/generate", data=good,
                             headers={"X-Session-ID": "gen-1"}) as resp:
            assert resp.status == 200
        (hit,) = router.fakes[0].hits
        assert hit.path == "/inference/v1/generate" and hit.body == good and hit.headers["x-session-id"] == "gen-1"
        # what the engine checks itself (its own 400s: vLLM's generate protocol refuses these) goes to it
        for odd in (b'{"token_ids": "not a list"}', b'{"token_ids": [-3, 5]}', b'{"token_ids": []}'):
            async with http.post(router.url + "/inference/v1/generate", data=odd) as resp:
                assert resp.status == 200 and router.fakes[0].hits[-1].body == odd


async def test_render_servers_are_listed_by_health_metrics_and_admin_as_backends_are(make_router: Any) -> None:
    """The render pool beside the engines': health-checked (a dead one is down), in /health, in
    /metrics with pool="render", in the admin API's backend list; a render server can be added there."""
    import aiohttp

    dead = f"http://127.0.0.9:{free_port()}"
    router = await make_router("aiohttp", tokens={**TOKENS, "render": [dead]}, admin_token="t")
    await eventually(lambda: router.state.health.rounds >= 1, timeout=10, what="a health round")
    auth = {"Authorization": "Bearer t"}
    async with aiohttp.ClientSession() as http:
        async with http.get(router.url + "/health") as resp:
            health = json.loads(await resp.read())
            assert resp.status == 503 and health["status"] == "unavailable"  # nothing can render
            assert health["pools"]["render"] == {"healthy": 0, "total": 1}
        async with http.get(router.url + "/metrics") as resp:
            text = (await resp.read()).decode()
            assert metric_sum(text, "session_router_backend_healthy", pool="render", backend=dead) == 0
        async with http.get(router.url + "/admin/backends", headers=auth) as resp:
            listed = json.loads(await resp.read())["data"]
            assert {"name": dead, "pool": "render", "healthy": False} == {k: v for k, v in listed[-1].items()
                                                                          if k in ("name", "pool", "healthy")}
        async with http.post(router.url + "/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}]}) as resp:
            error = json.loads(await resp.read())["error"]
            assert resp.status == 503 and "render" in error["message"]
        async with http.post(router.url + "/tokenize", json={"prompt": "hi"}) as resp:
            assert resp.status == 503
        # a render server added through the admin API joins the pool and is used
        live = GoldenTokenizer()
        server = TestServer(live.app, host="127.0.0.1")
        await server.start_server()
        try:
            url = f"http://127.0.0.1:{server.port}"
            async with http.post(router.url + "/admin/backends", headers=auth, json={"url": url, "pool": "render"}) as resp:
                assert resp.status in (200, 201), await resp.read()
            async with http.post(router.url + "/tokenize", json={"prompt": "hi"}) as resp:
                assert resp.status == 200 and json.loads(await resp.read()) == {"tokens": [7]}
            assert live.calls == 1
            async with http.get(router.url + "/metrics") as resp:
                text = (await resp.read()).decode()
                assert metric_sum(text, "session_router_render_requests_total", render_server=url,
                                  status_class="2xx") == 1
        finally:
            await server.close()


class GoldenTokenizer:
    """A render server's /health and /tokenize (a fixed answer), for the admin test."""

    def __init__(self) -> None:
        self.calls = 0
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        self.app.router.add_post("/tokenize", self.tokenize)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def tokenize(self, request: web.Request) -> web.Response:
        self.calls += 1
        return web.json_response({"tokens": [7]})


# ------------------------------------------------------------------ streaming: chat chunks -> Responses events


class RecordingWriter:
    def __init__(self) -> None:
        self.head: tuple[int, list[tuple[str, str]]] | None = None
        self.whole: tuple[int, list[tuple[str, str]], bytes] | None = None
        self.data = b""
        self.ended = False

    @property
    def started(self) -> bool:
        return self.head is not None

    def respond(self, status: int, headers: Any, body: bytes) -> None:
        self.whole = (status, list(headers), body)

    async def start(self, status: int, headers: Any) -> None:
        self.head = (status, list(headers))

    async def write(self, chunk: bytes) -> None:
        self.data += chunk

    async def end(self, last: bytes = b"") -> None:
        self.data += last
        self.ended = True


def sse_events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in data.decode().split("\n\n"):
        if block:
            kind_line, data_line = block.split("\n")
            assert kind_line.startswith("event: ") and data_line.startswith("data: ")
            payload = json.loads(data_line[6:])
            assert payload["type"] == kind_line[7:]
            events.append((payload["type"], payload))
    return events


def chat_chunk(**fields: Any) -> bytes:
    return b"data: " + json.dumps({"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1,
                                   "model": "tiny-llama", **fields}).encode() + b"\n\n"


def delta(text: str | None, finish: str | None = None, role: str | None = None) -> bytes:
    d: dict[str, Any] = {"content": text}
    if role:
        d["role"] = role
    return chat_chunk(choices=[{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}])


async def run_stream(turn_body: dict[str, Any], pieces: list[bytes]) -> tuple[RecordingWriter, list[Any]]:
    from router.attempt import Attempt
    from router.routes import ROUTES
    from router.tokens.responses_route import ResponsesStream

    turn = responses_turn(json.dumps(turn_body).encode())
    attempt = Attempt(next(r for r in ROUTES if r.name == "responses"), "req-1", 0.0)
    attempt.prompt_ids = list(range(30))
    out = RecordingWriter()
    stream = ResponsesStream(out, turn, MODEL, attempt)
    await stream.start(200, [("Content-Type", "text/event-stream"), ("X-Request-Id", "req-1")])
    raw = b"".join(pieces)
    for i in range(0, len(raw), 7):  # the chat path's bytes in arbitrary pieces
        await stream.write(raw[i:i + 7])
    await stream.end()
    return out, sse_events(out.data)


async def test_a_chat_stream_becomes_vllms_responses_event_sequence() -> None:
    usage = chat_chunk(choices=[], usage={"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33,
                                          "prompt_tokens_details": {"cached_tokens": 16}})
    out, events = await run_stream({"input": "hi", "stream": True}, [
        delta("", role="assistant"), delta("Hel"), delta("lo"), delta(" you", "stop"), usage, b"data: [DONE]\n\n"])
    assert out.head is not None and out.head[0] == 200 and out.ended
    assert ("Content-Type", "text/event-stream; charset=utf-8") in out.head[1]
    assert [kind for kind, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    assert created["max_output_tokens"] == MODEL.max_model_len - 30
    assert [e["delta"] for kind, e in events if kind == "response.output_text.delta"] == ["Hel", "lo", " you"]
    item_id = events[2][1]["item"]["id"]
    assert all(e.get("item_id", item_id) == item_id for _, e in events[2:10])
    assert events[7][1]["text"] == "Hello you"
    final = events[-1][1]["response"]
    assert list(final) == RESPONSE_KEYS and final["status"] == "completed"
    assert final["output"] == [{"id": item_id, "content": [{"annotations": [], "text": "Hello you",
                                                             "type": "output_text", "logprobs": None}],
                                "role": "assistant", "status": "completed", "type": "message"}]
    assert final["usage"]["input_tokens"] == 30 and final["usage"]["output_tokens"] == 3
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 16


async def test_a_stream_cut_by_max_output_tokens_completes_incomplete() -> None:
    _, events = await run_stream({"input": "hi", "stream": True, "max_output_tokens": 2},
                                 [delta("ab"), delta("c", "length"), b"data: [DONE]\n\n"])
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["max_output_tokens"] == 2


async def test_an_error_in_the_chat_stream_ends_the_responses_stream_with_an_error_event() -> None:
    error = b'data: {"error": {"message": "engine died", "type": "BadGatewayError", "param": null, "code": 502}}'
    out, events = await run_stream({"input": "hi", "stream": True},
                                   [delta("ab"), b"\n\n" + error + b"\n\ndata: [DONE]\n\n"])
    assert [kind for kind, _ in events][-2:] == ["response.output_text.delta", "error"]
    assert events[-1][1]["message"] == "engine died" and events[-1][1]["code"] == "502"
    assert out.ended


async def test_an_answer_before_the_stream_began_passes_through() -> None:
    from router.attempt import Attempt
    from router.routes import ROUTES
    from router.tokens.responses_route import ResponsesStream

    turn = responses_turn(b'{"input": "hi", "stream": true}')
    out = RecordingWriter()
    stream = ResponsesStream(out, turn, MODEL, Attempt(ROUTES[0], "r", 0.0))
    stream.respond(400, [("Content-Type", "application/json")], b'{"error": {}}')
    assert out.whole == (400, [("Content-Type", "application/json")], b'{"error": {}}') and out.data == b""

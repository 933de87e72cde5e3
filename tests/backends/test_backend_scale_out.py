"""session-backend's vLLM 0.32 scale-out surface over real HTTP (in-process servers): render and
derender equal the golden cases, --tokens-only's routes and refusals, abort by vLLM's external id
(the engine is left with nothing running and no blocks), the session reaching the engine on generate,
and which routes each surface serves."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.app import create_app
from backends.engine.config import EngineConfig
from backends.frontend import ENGINE
from backends.generate_route import TOKENS_ONLY_STOP_MESSAGE
from backends.render_routes import create_render_app
from rendering.model import DEFAULT_MODEL_DIR, load_model
from tests.support import eventually

DATA = Path(__file__).resolve().parents[1] / "rendering" / "data"
NAME = "tiny-llama"  # the served name the golden cases were recorded with


def golden(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").open(encoding="utf-8")]


CHAT = golden("render_chat")
COMPLETIONS = golden("render_completions")
DERENDER = golden("derender_chat")
#: a few of each kind: plain, multi-turn, stop strings, n/seed, stream, errors
CHAT_PICKS = [0, 1, 2, 5, 9, 13, 20, 30, *[i for i, c in enumerate(CHAT) if c["status"] != 200]]
COMPLETION_PICKS = [0, 3, 7, 12, 19]


def config(**kw: Any) -> EngineConfig:
    return EngineConfig(**{"speed": 0.0, "model": NAME, "max_model_len": 2048, **kw})


@pytest.fixture
async def scale_out(aiohttp_client: Any) -> Any:
    return await aiohttp_client(create_app(config(), scale_out=True))


@pytest.fixture
async def tokens_only(aiohttp_client: Any) -> Any:
    return await aiohttp_client(create_app(config(), tokens_only=True))


@pytest.fixture
async def render_server(aiohttp_client: Any) -> Any:
    return await aiohttp_client(create_render_app(load_model(DEFAULT_MODEL_DIR)))


@pytest.fixture(params=["scale_out", "render_server"])
async def renders(request: pytest.FixtureRequest, aiohttp_client: Any) -> Any:
    """A server with the render routes: a --enable-scale-out backend, or a --role render server."""
    if request.param == "scale_out":
        return await aiohttp_client(create_app(config(), scale_out=True))
    return await aiohttp_client(create_render_app(load_model(DEFAULT_MODEL_DIR)))


def without(obj: Any, *keys: str) -> Any:
    return {k: v for k, v in obj.items() if k not in keys}


async def metric(client: Any, name: str, **labels: str) -> float:
    text = await (await client.get("/metrics")).text()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


# ---- render and derender: the golden cases through HTTP ------------------------------------------


@pytest.mark.parametrize("pick", CHAT_PICKS)
async def test_chat_render_over_http_equals_vllm(renders: Any, pick: int) -> None:
    client = renders
    case = CHAT[pick]
    resp = await client.post("/v1/chat/completions/render", json=case["request"])
    assert resp.status == case["status"], await resp.text()
    got = json.loads(await resp.read())
    if case["status"] != 200:
        assert got == case["response"]
        return
    assert list(got) == list(case["response"])  # vLLM's key order
    assert without(got, "request_id") == without(case["response"], "request_id")
    assert got["request_id"].startswith("chatcmpl-")


@pytest.mark.parametrize("pick", COMPLETION_PICKS)
async def test_completions_render_over_http_equals_vllm(renders: Any, pick: int) -> None:
    client = renders
    case = COMPLETIONS[pick]
    resp = await client.post("/v1/completions/render", json=case["request"])
    assert resp.status == case["status"] == 200
    got = json.loads(await resp.read())
    assert isinstance(got, list) and len(got) == len(case["response"])
    for one, want in zip(got, case["response"], strict=True):
        assert without(one, "request_id") == without(want, "request_id")


async def test_render_request_id_follows_the_x_request_id_header(scale_out: Any) -> None:
    body = CHAT[0]["request"]
    resp = await scale_out.post("/v1/chat/completions/render", json=body, headers={"X-Request-Id": "abc"})
    assert (await resp.json())["request_id"] == "chatcmpl-abc" and resp.headers["X-Request-Id"] == "abc"


@pytest.mark.parametrize("pick", [0, 4, 11, 29])
async def test_chat_derender_over_http_equals_vllm(renders: Any, pick: int) -> None:
    client = renders
    case = DERENDER[pick]
    resp = await client.post("/v1/chat/completions/derender", json=case["request"])
    assert resp.status == 200, await resp.text()
    got = json.loads(await resp.read())
    assert list(got) == list(case["response"])
    assert without(got, "created") == without(case["response"], "created")


async def test_completions_derender_over_http(scale_out: Any) -> None:
    """A generate answer of this backend, derendered by it: the text of the ids, vLLM's object."""
    gen = await (await scale_out.post("/inference/v1/generate", json={
        "token_ids": [1, 300, 301], "sampling_params": {"max_tokens": 6, "ignore_eos": True, "seed": 3}})).json()
    resp = await scale_out.post("/v1/completions/derender", json={
        "generate_responses": [gen], "completion_request": {"model": NAME, "prompt": "x", "max_tokens": 6}})
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    detok = await (await scale_out.post("/detokenize", json={"tokens": gen["choices"][0]["token_ids"]})).json()
    assert answer["object"] == "text_completion" and answer["id"] == gen["request_id"]
    assert answer["choices"][0]["text"] == detok["prompt"] and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 6


async def test_derender_refusals(scale_out: Any) -> None:
    case = DERENDER[0]["request"]
    resp = await scale_out.post("/v1/chat/completions/derender", json={**case, "stream": True})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "stream"
    resp = await scale_out.post("/v1/chat/completions/derender", json={**case, "model": "other"})
    assert resp.status == 404 and (await resp.json())["error"]["type"] == "NotFoundError"
    resp = await scale_out.post("/v1/completions/derender", json={"generate_responses": []})
    assert resp.status == 400
    resp = await scale_out.post("/v1/chat/completions/derender", data=b"", headers={"Content-Type": "application/json"})
    assert resp.status == 400 and "empty" in (await resp.json())["error"]["message"]


# ---- which routes each surface serves -------------------------------------------------------------


async def test_render_server_surface(render_server: Any) -> None:
    assert (await render_server.get("/health")).status == 200
    models = await (await render_server.get("/v1/models")).json()
    assert models["data"][0]["id"] == NAME and models["data"][0]["max_model_len"] == 2048
    assert (await (await render_server.get("/load")).json()) == {"server_load": 0}
    assert "version" in await (await render_server.get("/version")).json()
    tok = await (await render_server.post("/tokenize", json={"prompt": "hello world"})).json()
    assert (await (await render_server.post("/detokenize", json={"tokens": tok["tokens"]})).json()) == {
        "prompt": "hello world"}
    for path in ("/inference/v1/generate", "/v1/chat/completions", "/v1/completions", "/abort_requests"):
        resp = await render_server.post(path, json={"token_ids": [1], "messages": [], "prompt": "x"})
        assert resp.status == 404, path
        assert (await resp.json())["error"]["code"] == 404
    await render_server.post("/v1/chat/completions/render", json=CHAT[0]["request"])
    assert await metric(render_server, "session_backend_render_requests_total",
                        route="/v1/chat/completions/render", status="200") == 1


async def test_tokens_only_surface(tokens_only: Any) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize",
                 "/v1/chat/completions/render", "/v1/completions/render", "/v1/chat/completions/derender"):
        resp = await tokens_only.post(path, json={})
        assert resp.status == 404, path
    assert (await tokens_only.get("/version")).status == 404
    for path in ("/health", "/metrics", "/load", "/v1/models"):
        assert (await tokens_only.get(path)).status == 200, path
    resp = await tokens_only.post("/inference/v1/generate", json={"token_ids": [1, 300], "sampling_params": {
        "max_tokens": 3, "ignore_eos": True}})
    assert resp.status == 200 and len((await resp.json())["choices"][0]["token_ids"]) == 3
    assert (await tokens_only.post("/abort_requests", json={"request_ids": ["nothing"]})).status == 200


async def test_the_default_surface_has_no_scale_out_routes(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_app(config()))
    for path in ("/v1/chat/completions/render", "/v1/completions/derender", "/inference/v1/abort_requests",
                 "/abort_requests"):
        assert (await client.post(path, json={})).status == 404, path
    assert (await client.post("/tokenize", json={"prompt": "x"})).status == 200


# ---- tokens-only refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["end", ["a", "b"]])
async def test_tokens_only_refuses_stop_strings_as_vllm(tokens_only: Any, stop: Any) -> None:
    resp = await tokens_only.post("/inference/v1/generate", json={"token_ids": [1, 300], "sampling_params": {
        "max_tokens": 3, "stop": stop if isinstance(stop, list) else [stop]}})
    assert resp.status == 400
    assert await resp.json() == {"error": {"message": TOKENS_ONLY_STOP_MESSAGE, "type": "BadRequestError",
                                           "param": None, "code": 400}}
    assert TOKENS_ONLY_STOP_MESSAGE == (
        "stop strings are not supported on a --tokens-only server because detokenization is disabled. "
        "Check stop strings on the coordinator, or use stop_token_ids.")
    assert await metric(tokens_only, "vllm:num_requests_running", model_name=NAME) == 0
    # stop token ids are fine
    ok = await tokens_only.post("/inference/v1/generate", json={"token_ids": [1, 300], "sampling_params": {
        "max_tokens": 3, "stop_token_ids": [5]}})
    assert ok.status == 200


async def test_tokens_only_refuses_text_output(tokens_only: Any, scale_out: Any) -> None:
    body = {"token_ids": [1, 300], "sampling_params": {"max_tokens": 3}, "output_mode": "text"}
    resp = await tokens_only.post("/inference/v1/generate", json=body)
    assert resp.status == 400 and "requires a tokenizer" in (await resp.json())["error"]["message"]
    assert (await scale_out.post("/inference/v1/generate", json=body)).status == 200


# ---- generate: vLLM's checks and sampling ------------------------------------------------------------


async def test_generate_checks_as_vllm(tokens_only: Any) -> None:
    async def error(body: dict[str, Any]) -> dict[str, Any]:
        resp = await tokens_only.post("/inference/v1/generate", json=body)
        assert resp.status == 400
        return (await resp.json())["error"]

    oov = await error({"token_ids": [1, 393], "sampling_params": {}})
    assert oov == {"message": "Token id 393 is out of vocabulary", "type": "BadRequestError", "param": None,
                   "code": 400}
    long = await error({"token_ids": [300] * 2048, "sampling_params": {}})
    assert long["message"] == ("This model's maximum context length is 2048 tokens. However, your request has 2048 "
                               "input tokens. Please reduce the length of the input messages. "
                               "(parameter=input_tokens, value=2048)")
    assert long["param"] == "input_tokens"
    too_many = await error({"token_ids": [1], "sampling_params": {"n": 10_000}})
    assert too_many["message"] == "sampling_params.n must be at most the server's max_num_seqs (256), got 10000."


async def test_generate_honours_sampling_params(tokens_only: Any) -> None:
    async def gen(**sp: Any) -> dict[str, Any]:
        resp = await tokens_only.post("/inference/v1/generate", json={"token_ids": [1, 300, 301],
                                                                     "sampling_params": sp})
        assert resp.status == 200, await resp.text()
        return await resp.json()

    # max_tokens left out: the rest of the context (the engine runs to it with ignore_eos)
    rest = await gen(ignore_eos=True, seed=1)
    assert len(rest["choices"][0]["token_ids"]) == 2048 - 3 and rest["choices"][0]["finish_reason"] == "length"
    # seed: the same ids again; n: that many choices
    a, b = await gen(max_tokens=8, seed=5, ignore_eos=True, n=2), await gen(max_tokens=8, seed=5, ignore_eos=True, n=2)
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    assert len(a["choices"]) == 2 and a["choices"][0]["token_ids"] != a["choices"][1]["token_ids"]
    # stop_token_ids end a choice with the id as stop_reason
    target = a["choices"][0]["token_ids"][2]
    stopped = await gen(max_tokens=8, seed=5, ignore_eos=True, stop_token_ids=[target])
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == target and choice["token_ids"][-1] == target
    # without ignore_eos a sequence may end on eos (2); every other id is a word id of the vocabulary
    pool = set(tokens_only.server.app[ENGINE].config.gen_token_ids)
    ended = await gen(max_tokens=2000, seed=9)
    ids = ended["choices"][0]["token_ids"]
    assert ended["choices"][0]["finish_reason"] == "stop" and ids[-1] == 2
    assert set(ids[:-1]) <= pool
    # a max_tokens past the context is capped, not refused (the engine stops with length)
    capped = await gen(max_tokens=5000, ignore_eos=True)
    assert len(capped["choices"][0]["token_ids"]) == 2048 - 3


async def test_the_session_reaches_the_engine_on_generate(tokens_only: Any) -> None:
    body = {"token_ids": [1, 300, 301, 302], "sampling_params": {"max_tokens": 4, "ignore_eos": True}}
    for _ in range(2):
        resp = await tokens_only.post("/inference/v1/generate", json=body, headers={"X-Session-ID": "tok-sess"})
        assert resp.status == 200 and resp.headers["X-Session-ID"] == "tok-sess"
    # a body session_id is not a session on this route (vLLM reads only the header here)
    await tokens_only.post("/inference/v1/generate", json={**body, "session_id": "body-sess"})
    stats = await (await tokens_only.get("/v1/sessions/tok-sess")).json()
    assert stats == {"requests": 2, "prompt_tokens": 8, "cached_tokens": 0, "generated_tokens": 8}
    assert (await tokens_only.get("/v1/sessions/body-sess")).status == 404


# ---- abort ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/inference/v1/abort_requests", "/abort_requests"])
async def test_abort_frees_a_running_generate_stream(aiohttp_client: Any, path: str) -> None:
    app = create_app(config(speed=1.0), tokens_only=True)
    client = await aiohttp_client(app)
    engine = app[ENGINE]
    body = {"token_ids": list(range(300, 380)), "stream": True,
            "sampling_params": {"max_tokens": 1900, "ignore_eos": True}}
    resp = await client.post("/inference/v1/generate", json=body, headers={"X-Request-Id": "long-1"})
    assert resp.status == 200
    first = await resp.content.readline()
    assert first.startswith(b"data: ")
    assert engine.num_running == 1 and engine.core.kv_cache_usage > 0
    assert await metric(client, "vllm:num_requests_running", model_name=NAME) == 1
    aborted = await client.post(path, json={"request_ids": ["generate-tokens-long-1"]})
    assert aborted.status == 200 and await aborted.read() == b""
    rest = await asyncio.wait_for(resp.read(), 10)
    events = [e for e in (first + rest).decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["request_id"] == "generate-tokens-long-1" and last["choices"][0]["finish_reason"] == "abort"
    await eventually(lambda: engine.num_running == 0, timeout=5, what="the engine to drop the request")
    assert engine.core.kv_cache_usage == 0
    assert await metric(client, "vllm:num_requests_running", model_name=NAME) == 0
    assert await metric(client, "vllm:kv_cache_usage_perc", model_name=NAME) == 0
    assert await metric(client, "vllm:request_success_total", model_name=NAME, finished_reason="abort") == 1


async def test_abort_of_a_non_stream_generate_and_of_n_children(aiohttp_client: Any) -> None:
    app = create_app(config(speed=1.0), scale_out=True)
    client = await aiohttp_client(app)
    engine = app[ENGINE]
    body = {"token_ids": list(range(300, 340)), "request_id": "body-id",
            "sampling_params": {"max_tokens": 1900, "ignore_eos": True, "n": 3}}
    task = asyncio.create_task(client.post("/inference/v1/generate", json=body))
    await eventually(lambda: engine.num_running == 3, timeout=5, what="the three children to run")
    # the body request_id names the request when no X-Request-Id header is sent
    assert (await client.post("/inference/v1/abort_requests", json={"request_ids": "generate-tokens-body-id"})).status == 200
    resp = await asyncio.wait_for(task, 10)
    data = await resp.json()
    assert [c["finish_reason"] for c in data["choices"]] == ["abort"] * 3
    assert engine.num_running == 0 and engine.core.kv_cache_usage == 0


async def test_abort_refusals(tokens_only: Any) -> None:
    for raw, fragment in ((b"{}", "Missing 'request_ids' in request body"), (b"{nope", "JSON decode error"),
                          (b'{"request_ids": [1]}', "request_ids")):
        resp = await tokens_only.post("/abort_requests", data=raw, headers={"Content-Type": "application/json"})
        assert resp.status == 400
        assert fragment in (await resp.json())["error"]["message"]

"""session-backend's HTTP routes, in process over real HTTP: shapes, streaming, n > 1, seeds, stop
strings, the tokens-in route, tokenize/detokenize, models/health/load/version/metrics, sessions."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.app import create_app
from backends.engine.config import EngineConfig
from backends.engine.request import SESSION_ID_POSITION
from backends.frontend import ENGINE
from tests.support import cached_of

MODEL = "sim-model"


@pytest.fixture
async def client(aiohttp_client: Any) -> Any:
    return await aiohttp_client(create_app(EngineConfig(speed=0.0, model=MODEL)))


def sse_events(raw: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (``[DONE]`` included)."""
    assert raw.endswith("\n\n"), raw[-80:]
    out = []
    for frame in raw.split("\n\n"):
        if not frame:
            continue
        lines = [ln for ln in frame.split("\n") if ln.startswith("data: ")]
        assert len(lines) == 1, frame
        out.append(lines[0][len("data: "):])
    return out


async def post_json(client: Any, path: str, body: dict[str, Any], **kw: Any) -> tuple[Any, dict[str, Any]]:
    resp = await client.post(path, json=body, **kw)
    return resp, await resp.json()


async def post_stream(client: Any, path: str, body: dict[str, Any], **kw: Any) -> tuple[Any, list[Any]]:
    resp = await client.post(path, json={**body, "stream": True}, **kw)
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    return resp, [json.loads(e) for e in events[:-1]]


def without_nulls(usage: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in usage.items() if v is not None}


async def tokenize(client: Any, **body: Any) -> list[int]:
    resp, data = await post_json(client, "/tokenize", body)
    assert resp.status == 200
    return data["tokens"]


# ---- /v1/completions ---------------------------------------------------------------------


async def test_completion_shape_and_usage(client: Any) -> None:
    resp, data = await post_json(client, "/v1/completions",
                                 {"model": MODEL, "prompt": "Say hello", "max_tokens": 7, "ignore_eos": True})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("application/json")
    assert data["id"].startswith("cmpl-") and data["object"] == "text_completion"
    assert isinstance(data["created"], int) and data["model"] == MODEL
    assert data["system_fingerprint"]
    [choice] = data["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert len(choice["text"].split()) == 7  # every generated id is one readable word
    prompt_ids = await tokenize(client, prompt="Say hello")
    # vLLM's UsageInfo: every key; nothing cached, so no prompt_tokens_details (null), as vLLM's
    # --enable-prompt-tokens-details reports it
    assert data["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 7,
                             "total_tokens": len(prompt_ids) + 7,
                             "prompt_tokens_details": None, "completion_tokens_details": None}
    assert choice["token_ids"] is None  # vLLM writes every key of a whole answer


async def test_completion_prompt_forms_and_return_token_ids(client: Any) -> None:
    ids = await tokenize(client, prompt="the same prompt")
    results = []
    for prompt in ("the same prompt", ["the same prompt"], ids, [ids]):
        resp, data = await post_json(client, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "seed": 3,
                                                                 "ignore_eos": True, "return_token_ids": True})
        assert resp.status == 200, data
        choice = data["choices"][0]
        assert choice["prompt_token_ids"] == ids
        assert len(choice["token_ids"]) == 5
        detok = await post_json(client, "/detokenize", {"tokens": choice["token_ids"]})
        assert detok[1]["prompt"] == choice["text"]
        results.append(choice["text"])
    assert len(set(results)) == 1  # the same prompt ids, the same seed: the same text


async def test_completion_echo(client: Any) -> None:
    _, data = await post_json(client, "/v1/completions", {"prompt": "Echo me", "max_tokens": 2, "echo": True})
    assert data["choices"][0]["text"].startswith("Echo me")


async def test_completion_stream_matches_non_stream(client: Any) -> None:
    body = {"prompt": "stream me", "max_tokens": 6, "seed": 11, "ignore_eos": True}
    _, full = await post_json(client, "/v1/completions", body)
    resp, chunks = await post_stream(client, "/v1/completions",
                                     {**body, "stream_options": {"include_usage": True}})
    *text_chunks, usage_chunk = chunks
    assert all(c["object"] == "text_completion" and c["id"] == text_chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    # the usage event leaves the nulls out (vLLM's exclude_unset)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == without_nulls(full["usage"])
    assert "X-Request-ID" in resp.headers


async def test_completion_stream_without_usage_has_no_usage_chunk(client: Any) -> None:
    _, chunks = await post_stream(client, "/v1/completions", {"prompt": "x", "max_tokens": 3, "ignore_eos": True})
    assert all(c["choices"] for c in chunks)
    assert all("usage" not in c for c in chunks)


async def test_n_greater_than_one(client: Any) -> None:
    _, data = await post_json(client, "/v1/completions",
                              {"prompt": "many", "n": 3, "max_tokens": 4, "ignore_eos": True, "seed": 5})
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert data["usage"]["completion_tokens"] == 12
    assert len({c["text"] for c in data["choices"]}) == 3  # children sample independently
    _, chunks = await post_stream(client, "/v1/completions",
                                  {"prompt": "many", "n": 3, "max_tokens": 4, "ignore_eos": True, "seed": 5,
                                   "stream_options": {"include_usage": True}})
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for c in chunks[:-1]:
        [ch] = c["choices"]
        texts[ch["index"]] += ch["text"]
        if ch["finish_reason"]:
            finished.add(ch["index"])
    assert finished == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c["text"] for c in data["choices"]]
    assert chunks[-1]["usage"]["completion_tokens"] == 12


async def test_seed_determinism(client: Any) -> None:
    async def text(seed: int | None, prompt: str = "determinism") -> str:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True}
        if seed is not None:
            body["seed"] = seed
        _, data = await post_json(client, "/v1/completions", body)
        return data["choices"][0]["text"]

    assert await text(42) == await text(42)
    assert await text(42) != await text(43)
    # without a seed the output is a function of the prompt (deterministic simulator)
    assert await text(None) == await text(None)
    assert await text(None) != await text(None, "another prompt")


async def test_stop_string_truncates(client: Any) -> None:
    base = {"prompt": "stop strings", "max_tokens": 12, "seed": 8, "ignore_eos": True}
    _, full = await post_json(client, "/v1/completions", base)
    words = full["choices"][0]["text"].split(" ")[1:]
    stop = " " + words[4]  # the 5th word, with its leading space
    cut = full["choices"][0]["text"].index(stop)
    _, data = await post_json(client, "/v1/completions", {**base, "stop": [stop, "zzzz-never"]})
    choice = data["choices"][0]
    assert choice["text"] == full["choices"][0]["text"][:cut]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    # streamed: the stop string is never sent, the pieces add up to the same text
    _, chunks = await post_stream(client, "/v1/completions", {**base, "stop": stop})
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == stop
    # the engine counts both stopped requests as "stop" (vLLM's output processor does), not "abort"
    text = await (await client.get("/metrics")).text()
    labels = {"model_name": MODEL, "engine": "0"}
    assert metric_value(text, "vllm:request_success_total", finished_reason="stop", **labels) == 2
    assert metric_value(text, "vllm:request_success_total", finished_reason="abort", **labels) == 0


async def test_stop_strings_on_the_tokens_in_route_and_responses(client: Any) -> None:
    """Where the backend answers text itself (a generate request with stop strings or output_mode "text", the
    Responses route) it applies stop strings with the coordinator's code: cut before the match, the ids up to
    the token that completed it, the choice ended "stop" with the string as stop_reason."""
    gen = {"token_ids": [1, 300, 301], "sampling_params": {"max_tokens": 12, "seed": 8, "ignore_eos": True},
           "output_mode": "text"}
    _, full = await post_json(client, "/inference/v1/generate", gen)
    text, ids = full["choices"][0]["text"], full["choices"][0]["token_ids"]
    stop = " " + text.split(" ")[5]
    cut = text.index(stop)
    stopped_body = {**gen, "sampling_params": {**gen["sampling_params"], "stop": [stop]}}
    _, stopped = await post_json(client, "/inference/v1/generate", stopped_body)
    choice = stopped["choices"][0]
    assert choice["text"] == text[:cut] and (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["token_ids"] == ids[:len(choice["token_ids"])] and len(choice["token_ids"]) < len(ids)
    assert (await detokenized(client, choice["token_ids"])).endswith(stop)  # ends with the completing token
    _, chunks = await post_stream(client, "/inference/v1/generate", stopped_body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text[:cut]
    assert chunks[-1]["choices"][0]["stop_reason"] == stop
    # the Responses route: the answer ends before the stop string too
    _, answer = await post_json(client, "/v1/responses", {"input": "stop here", "max_output_tokens": 12, "seed": 8})
    words = answer["output"][0]["content"][0]["text"]
    stop = " " + words.split(" ")[3]
    _, cut_answer = await post_json(client, "/v1/responses", {"input": "stop here", "max_output_tokens": 12,
                                                                "seed": 8, "stop": [stop]})
    assert cut_answer["output"][0]["content"][0]["text"] == words[:words.index(stop)]


async def detokenized(client: Any, ids: list[int]) -> str:
    return (await post_json(client, "/detokenize", {"tokens": ids}))[1]["prompt"]


async def test_stop_token_ids(client: Any) -> None:
    base = {"prompt": [1, 300, 301], "max_tokens": 10, "seed": 2, "ignore_eos": True, "return_token_ids": True}
    _, full = await post_json(client, "/v1/completions", base)
    ids = full["choices"][0]["token_ids"]
    target = ids[3]
    _, data = await post_json(client, "/v1/completions", {**base, "stop_token_ids": [target]})
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == target
    assert choice["token_ids"] == ids[: ids.index(target) + 1]


# ---- /v1/chat/completions ----------------------------------------------------------------


async def test_chat_shape(client: Any) -> None:
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    resp, data = await post_json(client, "/v1/chat/completions",
                                 {"messages": msgs, "max_completion_tokens": 5, "ignore_eos": True,
                                  "return_token_ids": True})
    assert resp.status == 200, data
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    [choice] = data["choices"]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"].split()) == 5
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert len(choice["token_ids"]) == 5
    chat_ids = await tokenize(client, messages=msgs)
    assert data["prompt_token_ids"] == chat_ids
    assert data["usage"]["prompt_tokens"] == len(chat_ids)
    assert data["usage"]["prompt_tokens_details"] is None  # nothing cached: null, as vLLM


async def test_chat_stream(client: Any) -> None:
    body = {"messages": [{"role": "user", "content": "stream a chat"}], "max_tokens": 5, "ignore_eos": True,
            "seed": 1, "n": 2}
    _, full = await post_json(client, "/v1/chat/completions", body)
    _, chunks = await post_stream(client, "/v1/chat/completions",
                                  {**body, "stream_options": {"include_usage": True}})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # each choice opens with its role
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert {c["choices"][0]["index"] for c in chunks[:2]} == {0, 1}
    texts = {0: "", 1: ""}
    for c in chunks[2:-1]:
        [ch] = c["choices"]
        texts[ch["index"]] += ch["delta"].get("content", "")
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in full["choices"]]
    # the same prompt again: its full blocks now come from the prefix cache
    cached = full["usage"]["prompt_tokens"] // 16 * 16
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {**without_nulls(full["usage"]),
                                                                    "prompt_tokens_details": {"cached_tokens": cached}}


async def test_prompt_tokens_details_turned_off_reports_no_cached_tokens(aiohttp_client: Any) -> None:
    """vLLM's default (no --enable-prompt-tokens-details): usage has no cached tokens, even on a cache hit."""
    client = await aiohttp_client(create_app(EngineConfig(speed=0.0), prompt_tokens_details=False))
    body = {"messages": [{"role": "user", "content": "the same words twice " * 8}], "max_tokens": 2}
    await post_json(client, "/v1/chat/completions", body)
    _, again = await post_json(client, "/v1/chat/completions", body)
    assert again["usage"]["prompt_tokens"] >= 32 and again["usage"]["prompt_tokens_details"] is None
    _, chunks = await post_stream(client, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert "prompt_tokens_details" not in chunks[-1]["usage"]


async def test_chat_max_tokens_default_is_rest_of_context(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_app(EngineConfig(speed=0.0, max_model_len=64)))
    msgs = [{"role": "user", "content": "fill the context"}]
    prompt = await tokenize(client, messages=msgs)
    _, data = await post_json(client, "/v1/chat/completions", {"messages": msgs, "ignore_eos": True})
    assert data["usage"]["completion_tokens"] == 64 - len(prompt)
    assert data["choices"][0]["finish_reason"] == "length"


# ---- /inference/v1/generate ----------------------------------------------------------------


async def test_generate_tokens(client: Any) -> None:
    body = {"token_ids": [1, 300, 301, 302], "sampling_params": {"max_tokens": 5, "seed": 9, "ignore_eos": True},
            "return_token_ids": True, "request_id": "body-rid"}
    resp, data = await post_json(client, "/inference/v1/generate", body)
    assert resp.status == 200, data
    assert data["request_id"] == "generate-tokens-body-rid"
    assert resp.headers["X-Request-Id"] == "body-rid"
    assert data["model"] == MODEL and data["output_mode"] == "tokens"
    assert data["prompt_token_ids"] == body["token_ids"]
    [choice] = data["choices"]
    assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length" and "text" not in choice
    assert data["usage"]["prompt_tokens"] == 4 and data["usage"]["completion_tokens"] == 5
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # the header wins over the body request_id
    resp, data2 = await post_json(client, "/inference/v1/generate", body, headers={"X-Request-Id": "hdr-rid"})
    assert data2["request_id"] == "generate-tokens-hdr-rid" and resp.headers["X-Request-Id"] == "hdr-rid"
    assert data2["choices"][0]["token_ids"] == choice["token_ids"]
    # text mode adds the text
    _, text = await post_json(client, "/inference/v1/generate", {**body, "output_mode": "text"})
    detok = await post_json(client, "/detokenize", {"tokens": choice["token_ids"]})
    assert text["choices"][0]["text"] == detok[1]["prompt"]
    # not asked: no prompt ids
    _, plain = await post_json(client, "/inference/v1/generate", {**body, "return_token_ids": False})
    assert plain["prompt_token_ids"] is None


async def test_generate_stream(client: Any) -> None:
    body = {"token_ids": [1, 300, 301], "sampling_params": {"max_tokens": 6, "seed": 4, "ignore_eos": True, "n": 2}}
    _, full = await post_json(client, "/inference/v1/generate", body)
    _, chunks = await post_stream(client, "/inference/v1/generate",
                                  {**body, "stream_options": {"include_usage": True}, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == body["token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    got: dict[int, list[int]] = {0: [], 1: []}
    for c in chunks[:-1]:
        assert c["request_id"].startswith("generate-tokens-")
        for ch in c["choices"]:
            assert ch["token_ids"] or ch["finish_reason"]  # chunks without new tokens are skipped
            got[ch["index"]] += ch["token_ids"]
    assert [got[0], got[1]] == [c["token_ids"] for c in full["choices"]]
    # vLLM 0.32 writes the last (usage) event without nulls, the whole answer with every key
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {k: v for k, v in full["usage"].items()
                                                                    if v is not None}


async def test_kv_transfer_params_reach_the_engine(client: Any) -> None:
    core = client.server.app[ENGINE].core
    original = core.add_request
    seen: list[Any] = []
    core.add_request = lambda data: (seen.append(msgspec.msgpack.decode(data)), original(data))[1]
    params = {"do_remote_decode": False, "do_remote_prefill": False, "remote_engine_id": None}
    await post_json(client, "/v1/completions", {"prompt": "p", "max_tokens": 1, "kv_transfer_params": params})
    await post_json(client, "/inference/v1/generate",
                    {"token_ids": [1, 5], "sampling_params": {"max_tokens": 1}, "kv_transfer_params": params})
    assert [s[3]["extra_args"]["kv_transfer_params"] for s in seen] == [params, params]
    assert all(s[SESSION_ID_POSITION] is None for s in seen)


async def test_prefill_role_returns_kv_transfer_params(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_app(EngineConfig(speed=0.0, role="prefill")))
    placeholder = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                   "remote_block_ids": None, "remote_host": None, "remote_port": None}
    for path, body in (("/v1/completions", {"prompt": "the sea " * 20, "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the sea " * 20}],
                                                 "max_tokens": 1}),
                       ("/inference/v1/generate", {"token_ids": list(range(3, 60)), "sampling_params": {"max_tokens": 1}})):
        resp, data = await post_json(client, path, {**body, "kv_transfer_params": placeholder})
        assert resp.status == 200, data
        kv = data["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["remote_block_ids"] and kv["remote_engine_id"]
        # without the placeholder nothing is returned
        _, plain = await post_json(client, path, body)
        assert plain["kv_transfer_params"] is None


# ---- X-Request-Id ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "stream": True}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
        ("POST", "/v1/responses", {"input": "x", "max_output_tokens": 1}),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}),
        ("POST", "/v1/nowhere", {}),
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("GET", "/v1/sessions/unknown", None),
    ],
)
async def test_request_id_is_echoed_everywhere(client: Any, method: str, path: str, body: Any) -> None:
    resp = await client.request(method, path, json=body, headers={"X-Request-Id": "rid-echo-1"})
    await resp.read()
    assert resp.headers["X-Request-Id"] == "rid-echo-1"
    resp = await client.request(method, path, json=body)
    await resp.read()
    assert resp.headers["X-Request-Id"]  # a fresh one when none was sent


async def test_request_id_names_the_response(client: Any) -> None:
    _, data = await post_json(client, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                              headers={"X-Request-Id": "abc"})
    assert data["id"] == "cmpl-abc"
    _, data = await post_json(client, "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                               "request_id": "from-body"})
    assert data["id"] == "chatcmpl-from-body"
    # the same X-Request-Id twice at once is fine (the engine's internal ids are unique)
    _, again = await post_json(client, "/v1/completions", {"prompt": "x", "max_tokens": 1, "n": 2},
                               headers={"X-Request-Id": "abc"})
    assert again["id"] == "cmpl-abc"


# ---- tokenize / detokenize -------------------------------------------------------------------


async def test_tokenize_and_detokenize(client: Any) -> None:
    """The renderer's /tokenize and /detokenize (vLLM's answers; the model's tokenizer adds no bos to a
    plain prompt, the chat template writes it)."""
    resp, data = await post_json(client, "/tokenize", {"prompt": "Hello the world", "return_token_strs": True})
    assert resp.status == 200
    assert data["count"] == len(data["tokens"]) and data["max_model_len"] == 8192
    assert len(data["token_strs"]) == data["count"] and data["token_strs"][1] == "e"
    _, plain = await post_json(client, "/tokenize", {"prompt": "Hello the world", "add_special_tokens": False})
    assert plain["tokens"] == data["tokens"] and plain["token_strs"] is None
    _, text = await post_json(client, "/detokenize", {"tokens": plain["tokens"]})
    assert text == {"prompt": "Hello the world"}
    msgs = [{"role": "user", "content": "hi"}]
    _, chat = await post_json(client, "/tokenize", {"messages": msgs})
    _, chat_no_prompt = await post_json(client, "/tokenize", {"messages": msgs, "add_generation_prompt": False})
    assert chat["tokens"][0] == 1 and chat["tokens"][: chat_no_prompt["count"]] == chat_no_prompt["tokens"]
    _, detok = await post_json(client, "/detokenize", {"tokens": chat["tokens"]})
    assert detok["prompt"] == "<s><|user|>\nhi\n<|assistant|>\n"


# ---- models, health, load, version, metrics ------------------------------------------------------


async def test_models(client: Any) -> None:
    resp = await client.get("/v1/models")
    data = await resp.json()
    assert data["object"] == "list"
    [card] = data["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "vllm"
    assert card["root"] == MODEL and card["parent"] is None and card["max_model_len"] == 8192
    assert card["permission"] == [] and isinstance(card["created"], int)


async def test_health_load_version(client: Any) -> None:
    resp = await client.get("/health")
    assert resp.status == 200 and await resp.read() == b""
    assert await (await client.get("/load")).json() == {"server_load": 0}
    version = await (await client.get("/version")).json()
    assert isinstance(version["version"], str) and version["version"]


async def test_health_is_503_when_the_engine_is_stopped(client: Any) -> None:
    await client.server.app[ENGINE].stop()
    assert (await client.get("/health")).status == 503
    for stream in (False, True):
        resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "stream": stream})
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == 503


def metric_value(text: str, name: str, **labels: str) -> float:
    total = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total = (total or 0.0) + sample.value
    assert total is not None, f"{name}{labels} not exported"
    return total


async def test_metrics(client: Any) -> None:
    await post_json(client, "/v1/completions", {"prompt": "count me", "max_tokens": 3, "ignore_eos": True})
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=")
    text = await resp.text()
    labels = {"model_name": MODEL, "engine": "0"}
    assert metric_value(text, "vllm:num_requests_running", **labels) == 0
    assert metric_value(text, "vllm:generation_tokens_total", **labels) == 3
    assert metric_value(text, "vllm:request_success_total", finished_reason="length", **labels) == 1


# ---- /v1/sessions ------------------------------------------------------------------------------


async def test_sessions_list_and_get(client: Any) -> None:
    usage: dict[str, list[dict[str, Any]]] = {}
    for sid in ("s-a", "s-b", "s-c", "s-a"):
        _, data = await post_json(client, "/v1/completions", {"prompt": f"hello {sid}", "max_tokens": 2},
                                  headers={"X-Session-ID": sid})
        usage.setdefault(sid, []).append(data["usage"])
    resp = await client.get("/v1/sessions")
    data = await resp.json()
    assert data["object"] == "list"
    assert [e["session_id"] for e in data["data"]] == ["s-a", "s-c", "s-b"]  # most recently active first
    entry = data["data"][0]
    assert set(entry) == {"session_id", "requests", "prompt_tokens", "cached_tokens", "generated_tokens"}
    assert entry["requests"] == 2
    assert entry["prompt_tokens"] == sum(u["prompt_tokens"] for u in usage["s-a"])
    assert entry["generated_tokens"] == sum(u["completion_tokens"] for u in usage["s-a"])
    limited = await (await client.get("/v1/sessions?limit=2")).json()
    assert [e["session_id"] for e in limited["data"]] == ["s-a", "s-c"]
    one = await (await client.get("/v1/sessions/s-b")).json()
    assert one == {"requests": 1, "prompt_tokens": usage["s-b"][0]["prompt_tokens"],
                   "cached_tokens": cached_of(usage["s-b"][0]),
                   "generated_tokens": usage["s-b"][0]["completion_tokens"]}
    missing = await client.get("/v1/sessions/never-seen")
    assert missing.status == 404
    assert (await missing.json())["error"]["type"] == "NotFoundError"
    for bad in ("0", "-1", "many"):
        resp = await client.get(f"/v1/sessions?limit={bad}")
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "limit"

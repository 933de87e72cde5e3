"""Bad input to session-backend: every listed 4xx in vLLM's error shape, the 500 path without a
traceback, and the server still answering the next good request."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from backends.app import create_app
from backends.engine.config import EngineConfig
from backends.frontend import ENGINE, FRONTEND
from tests.support import eventually

MODEL = "err-model"
GOOD = ("/v1/completions", {"prompt": "fine", "max_tokens": 1})
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def client(aiohttp_client: Any) -> Any:
    return await aiohttp_client(create_app(EngineConfig(speed=0.0, model=MODEL, max_model_len=128)))


async def expect_error(resp: Any, status: int, *fragments: str, param: str | None = "") -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    assert resp.headers["Content-Type"].startswith("application/json")
    assert resp.headers["X-Request-Id"]
    body = await resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    for fragment in fragments:
        assert fragment in err["message"], err["message"]
    if param != "":
        assert err["param"] == param
    assert "Traceback" not in err["message"] and 'File "' not in err["message"]
    return err


async def still_serving(client: Any) -> None:
    resp = await client.post(GOOD[0], json=GOOD[1])
    assert resp.status == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses",
                                  "/inference/v1/generate", "/tokenize", "/detokenize"])
@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "empty"),
        (b"[1, 2]", "Expected `object`, got `array`"),
        (b'"a string"', "Expected `object`, got `str`"),
        (b"null", "Expected `object`, got `null`"),
        (b'{"prompt": "x"', "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
    ],
)
async def test_malformed_bodies(client: Any, path: str, raw: bytes, fragment: str) -> None:
    resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
    await expect_error(resp, 400, fragment)
    await still_serving(client)


@pytest.mark.parametrize(
    ("path", "body", "fragment", "param"),
    [
        # the text routes validate with rendering/ (vLLM's request-validation answers: param body.<path>)
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "Expected `int | null`, got `str`",
         "body.max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 1.5}, "Expected `int`", "body.n"),
        ("/v1/completions", {"prompt": 5}, "Expected `str | array | null`", "body.prompt"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "Expected `bool | null`", "body.stream"),
        ("/v1/completions", {"prompt": "x", "vllm_xargs": [1]}, "Expected `object | null`", "body.vllm_xargs"),
        ("/v1/chat/completions", {"messages": "hi"}, "Expected `array`", "body.messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "missing required field `role`",
         "body.messages.0.role"),
        ("/inference/v1/generate", {"token_ids": ["a"], "sampling_params": {}}, "Expected `int`", "token_ids[0]"),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": "x"}},
         "Expected `int | null`", "sampling_params.max_tokens"),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": 3}, "Expected `object`",
         "sampling_params"),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {}, "output_mode": "bytes"},
         "output_mode must be 'tokens' or 'text', got 'bytes'", "output_mode"),
        ("/detokenize", {"tokens": "abc"}, "tokens", ""),  # the renderer's message and param (tests/rendering)
    ],
)
async def test_wrong_types(client: Any, path: str, body: dict[str, Any], fragment: str, param: str) -> None:
    await expect_error(await client.post(path, json=body), 400, fragment, param=param)
    await still_serving(client)


@pytest.mark.parametrize(
    ("path", "body", "fragment", "param"),
    [
        ("/inference/v1/generate", {"sampling_params": {}}, "missing required field `token_ids`", None),
        ("/v1/completions", {"max_tokens": 3}, "prompt", "prompt"),
        ("/v1/chat/completions", {"max_tokens": 3}, "missing required field `messages`", "body.messages"),
        ("/v1/chat/completions", {"messages": []}, "Cannot apply chat template to an empty conversation", None),
        ("/v1/responses", {"max_output_tokens": 3}, "input", "input"),
        ("/v1/responses", {"input": []}, "input", "input"),
        ("/detokenize", {}, "missing required field `tokens`", None),
        ("/tokenize", {}, "prompt", ""),  # the renderer's message and param (tests/rendering checks them)
    ],
)
async def test_missing_required_fields(client: Any, path: str, body: dict[str, Any], fragment: str,
                                       param: str | None) -> None:
    await expect_error(await client.post(path, json=body), 400, fragment, param=param)


@pytest.mark.parametrize(
    ("path", "body", "fragment", "param"),
    [
        ("/inference/v1/generate", {"token_ids": [], "sampling_params": {}}, "cannot be empty", "token_ids"),
        # vLLM's messages (its input processor's), without a param
        ("/inference/v1/generate", {"token_ids": [1, -5], "sampling_params": {}}, "Token id -5 is out of vocabulary",
         None),
        ("/inference/v1/generate", {"token_ids": [1, 10**6], "sampling_params": {}},
         "Token id 1000000 is out of vocabulary", None),
        ("/inference/v1/generate", {"token_ids": [1, 393], "sampling_params": {}}, "Token id 393 is out of vocabulary",
         None),
        # rendering/'s answers (vLLM's render)
        ("/v1/completions", {"prompt": []}, "You must pass at least one prompt", None),
        ("/v1/completions", {"prompt": [[]]}, "No token_ids rendered", None),
        ("/v1/completions", {"prompt": [1, -2]}, "greater than or equal to 0, got -2", "body.prompt.1"),
        ("/v1/completions", {"prompt": [1, "x"]}, "list of token ids", "body.prompt"),
        ("/v1/completions", {"prompt": [1, True]}, "list of token ids", "body.prompt"),
        ("/v1/completions", {"prompt": [1, 393]}, "out of vocabulary", None),
        ("/v1/completions", {"prompt": ["a", "b"]}, "batch of 2 prompts", "prompt"),
        ("/v1/completions", {"prompt": [[1], [2]]}, "batch of 2 prompts", "prompt"),
        ("/v1/completions", {"prompt": [{"a": 1}]}, "list of token ids", "body.prompt"),
        ("/detokenize", {"tokens": [-1]}, "-1", ""),  # the renderer's message and param (tests/rendering)
    ],
)
async def test_bad_token_ids(client: Any, path: str, body: dict[str, Any], fragment: str, param: str) -> None:
    await expect_error(await client.post(path, json=body), 400, fragment, param=param)


async def test_prompt_longer_than_model_len(client: Any) -> None:
    long_text = "word " * 200
    await expect_error(await client.post("/v1/completions", json={"prompt": long_text}), 400,
                       "maximum context length is 128 tokens")
    await expect_error(await client.post("/v1/chat/completions",
                                         json={"messages": [{"role": "user", "content": long_text}]}),
                       400, "maximum context length is 128 tokens")
    await expect_error(await client.post("/v1/responses", json={"input": long_text}), 400,
                       "maximum context length is 128 tokens")
    await expect_error(await client.post("/inference/v1/generate",
                                         json={"token_ids": [3] * 128, "sampling_params": {}}),
                       400, "your request has 128 input tokens")
    # prompt fits but prompt + max_tokens does not: vLLM caps max_tokens at the context left (get_max_tokens)
    resp = await client.post("/v1/completions", json={"prompt": [3] * 100, "max_tokens": 50, "ignore_eos": True})
    assert resp.status == 200
    capped = await resp.json()
    assert capped["usage"]["completion_tokens"] == 28 and capped["choices"][0]["finish_reason"] == "length"
    await still_serving(client)


async def test_context_is_capped_by_kv_capacity(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_app(EngineConfig(speed=0.0, num_blocks=8, block_size=16)))
    card = (await (await client.get("/v1/models")).json())["data"][0]
    assert card["max_model_len"] == 128
    await expect_error(await client.post("/v1/completions", json={"prompt": [5] * 200, "max_tokens": 5}), 400,
                       "maximum context length is 128 tokens")
    resp = await client.post("/v1/completions", json={"prompt": [5] * 100, "max_tokens": 28, "ignore_eos": True})
    assert (await resp.json())["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("body", "fragment", "param"),
    [
        # rendering/'s checks (vLLM's render: SamplingParams' messages)
        ({"n": 0}, "n must be at least 1, got 0", None),
        ({"n": -3}, "n must be at least 1", None),
        ({"n": 100000}, "n must be at most 16384", None),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0", "max_tokens"),
        ({"max_tokens": -1}, "max_tokens must be at least 1", "max_tokens"),
        ({"temperature": -0.5}, "temperature must be non-negative", "temperature"),
        ({"top_p": 0}, "top_p must be in (0, 1]", "top_p"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]", "top_p"),
        ({"top_k": -2}, "top_k", None),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0", None),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens must be less than or equal", None),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "stop_token_ids"),
        ({"stop": [""]}, "stop cannot contain an empty string", None),
        # the engine's own bound (render does not know max_num_seqs)
        ({"n": 300}, "n must be at most max_num_seqs (256), got 300", "n"),
    ],
)
async def test_bad_sampling_values(client: Any, body: dict[str, Any], fragment: str, param: str) -> None:
    await expect_error(await client.post("/v1/completions", json={"prompt": "x", **body}), 400, fragment, param=param)
    chat = {"messages": CHAT, **body}
    await expect_error(await client.post("/v1/chat/completions", json=chat), 400, fragment, param=param)


async def test_bad_sampling_values_on_other_routes(client: Any) -> None:
    await expect_error(await client.post("/inference/v1/generate",
                                         json={"token_ids": [1], "sampling_params": {"temperature": -1}}),
                       400, "temperature must be non-negative")
    await expect_error(await client.post("/inference/v1/generate",
                                         json={"token_ids": [1], "sampling_params": {"max_tokens": 0}}),
                       400, "sampling_params.max_tokens must be at least 1")
    # vLLM checks max_completion_tokens as the max_tokens it becomes
    await expect_error(await client.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 0}),
                       400, "max_tokens must be at least 1", param="max_tokens")
    await expect_error(await client.post("/v1/responses", json={"input": "x", "top_p": 2}), 400, "top_p")
    await expect_error(await client.post("/v1/responses", json={"input": "x", "max_output_tokens": 0}), 400,
                       "max_output_tokens must be at least 1")


async def test_unsupported_content(client: Any) -> None:
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    await expect_error(await client.post("/v1/chat/completions", json={"messages": image}), 400,
                       "image_url content is not supported")
    await expect_error(await client.post("/v1/responses", json={"input": [{"type": "function_call_output"}]}),
                       400, "only message items")
    await expect_error(await client.post("/inference/v1/generate",
                                         json={"token_ids": [1], "sampling_params": {}, "cache_salt": ""}),
                       400, "cache_salt")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x", "model": "gpt-9"}),
        ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-9"}),
        ("/v1/responses", {"input": "x", "model": "gpt-9"}),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {}, "model": "gpt-9"}),
        ("/tokenize", {"prompt": "x", "model": "gpt-9"}),
    ],
)
async def test_unknown_model_is_404(client: Any, path: str, body: dict[str, Any]) -> None:
    err = await expect_error(await client.post(path, json=body), 404, param="model")
    assert err["message"] == f"The model `gpt-9` does not exist. Valid aliases: {MODEL}."  # vLLM 0.32's
    assert err["type"] == "NotFoundError"
    ok = await client.post(path, json={**body, "model": MODEL})
    assert ok.status == 200


async def test_unknown_response_id_is_404(client: Any) -> None:
    err = await expect_error(await client.get("/v1/responses/resp_missing"), 404)
    assert err["message"] == "Response with id 'resp_missing' not found."
    err = await expect_error(await client.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_gone"}),
                             404)
    assert err["message"] == "Response with id 'resp_gone' not found."


async def test_unknown_route_and_wrong_method(client: Any) -> None:
    err = await expect_error(await client.post("/v1/embeddings", json={}), 404)
    assert err["type"] == "NotFoundError" and "/v1/embeddings" in err["message"]
    resp = await client.get("/v1/completions")
    err = await expect_error(resp, 405)
    assert "POST" in err["message"] and resp.headers["Allow"] == "POST"
    await expect_error(await client.delete("/health"), 405)


async def test_body_too_large_is_413(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_app(EngineConfig(speed=0.0), max_body_bytes=1024))
    await expect_error(await client.post("/v1/completions", json={"prompt": "x" * 4096}), 413, "too large")
    await still_serving(client)


async def test_unexpected_failure_is_a_clean_500(client: Any, caplog: pytest.LogCaptureFixture) -> None:
    engine = client.server.app[ENGINE]
    original = engine.generate

    def broken(request: Any) -> Any:
        raise RuntimeError("simulated bug with a secret detail")

    engine.generate = broken
    err = await expect_error(await client.post(GOOD[0], json=GOOD[1]), 500)
    assert err["type"] == "InternalServerError"
    assert "secret detail" not in err["message"]
    assert "simulated bug" in caplog.text  # logged, with its traceback, for the operator
    engine.generate = original
    await still_serving(client)
    assert client.server.app[FRONTEND].in_flight == 0


async def test_failure_mid_stream_ends_the_stream_with_an_error_event(client: Any) -> None:
    engine = client.server.app[ENGINE]
    original = engine.generate

    async def breaks_after_one(request: Any) -> Any:
        gen = original(request)
        try:
            yield await gen.__anext__()
            raise RuntimeError("engine exploded")
        finally:
            await gen.aclose()

    engine.generate = breaks_after_one
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True})
    assert resp.status == 200
    text = await resp.text()
    frames = [f for f in text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    assert '"error"' in frames[-2] and '"code":500' in frames[-2] and "exploded" not in frames[-2]
    engine.generate = original
    await still_serving(client)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "application/octet-stream", "text/html; charset=utf-8"])
async def test_json_sent_with_a_non_json_content_type_is_a_400(client: Any, content_type: str) -> None:
    # vLLM's FastAPI routes read a body as JSON only for application/json (or +json) or no type at all
    body = b'{"prompt": "fine", "max_tokens": 1}'
    resp = await client.post("/v1/completions", data=body, headers={"Content-Type": content_type})
    await expect_error(resp, 400, "is not JSON", param=None)
    await still_serving(client)


@pytest.mark.parametrize("content_type", [None, "application/json; charset=utf-8", "application/vnd.api+json"])
async def test_json_content_types_and_no_content_type_are_accepted(client: Any, content_type: str | None) -> None:
    body = b'{"prompt": "fine", "max_tokens": 1}'
    headers = {} if content_type is None else {"Content-Type": content_type}
    resp = await client.post("/v1/completions", data=body, headers=headers, skip_auto_headers=["Content-Type"])
    assert resp.status == 200, await resp.text()


# ---- engine exceptions, as the HTTP layer answers them (issue 12: the engine raises plain ones) ----


async def _kill_engine_after_first_step(app: Any) -> None:
    engine = app[ENGINE]
    await eventually(lambda: engine.num_running > 0, timeout=10, what="the request running")

    def boom() -> Any:
        raise RuntimeError("simulated engine bug")

    engine.core.schedule = boom


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_that_dies_mid_request_is_a_503_in_openai_shape(aiohttp_client: Any, stream: bool) -> None:
    config = EngineConfig(speed=1.0, model="sim-model", max_model_len=4096)
    client = await aiohttp_client(create_app(config))
    body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": stream}
    ask = asyncio.ensure_future(client.post("/v1/completions", json=body))
    await _kill_engine_after_first_step(client.server.app)
    resp = await ask
    if stream:  # the headers were out: the error is the last data frame before [DONE]
        assert resp.status == 200
        frames = [f for f in (await resp.text()).split("\n\n") if f]
        assert frames[-1] == "data: [DONE]"
        error = json.loads(frames[-2].removeprefix("data: "))["error"]
    else:
        assert resp.status == 503
        error = (await resp.json())["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert "simulated engine bug" in error["message"]

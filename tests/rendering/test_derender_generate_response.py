"""rendering.generate_response: the wire shapes of /inference/v1/generate answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.errors import UpstreamProtocolError
from rendering.generate_response import (
    STREAM_DONE,
    GenerateChoice,
    GenerateResponse,
    GenerateStreamChoice,
    GenerateStreamChunk,
    GenerateUsage,
    PromptTokensDetails,
    decode_generate_response,
    decode_stream_chunk,
    encode_generate_response,
    encode_stream_chunk,
)

GOLDEN = [json.loads(line) for line in (Path(__file__).parent / "data" / "derender_chat.jsonl").open()]

# what a live vLLM 0.32 answered (vllm-interfaces.md §9), extra keys included
VLLM_ANSWER = (
    b'{"request_id":"generate-tokens-my-req-1","model":"tiny-llama","created":1796118807,'
    b'"usage":{"prompt_tokens":5,"total_tokens":9,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":0}},'
    b'"prompt_token_ids":[1,50,60,70,80],"output_mode":"tokens",'
    b'"choices":[{"index":0,"finish_reason":"length","stop_reason":null,"token_ids":[565,565,874,565],'
    b'"weight_versions":[{"version":"default","start":0,"end":4}],"logprobs":null}]}'
)


def test_decodes_a_vllm_answer() -> None:
    r = decode_generate_response(VLLM_ANSWER)
    assert r.request_id == "generate-tokens-my-req-1"
    assert r.usage == GenerateUsage(
        prompt_tokens=5, total_tokens=9, completion_tokens=4, prompt_tokens_details=PromptTokensDetails(0)
    )
    assert r.prompt_token_ids == [1, 50, 60, 70, 80]
    (c,) = r.choices
    assert (c.index, c.finish_reason, c.stop_reason, c.token_ids) == (0, "length", None, [565, 565, 874, 565])


def test_encodes_back_with_every_key_vllm_dumps() -> None:
    r = decode_generate_response(VLLM_ANSWER)
    raw = json.loads(VLLM_ANSWER)
    again = json.loads(encode_generate_response(r))
    assert again["usage"] == {**raw["usage"], "completion_tokens_details": None}
    assert again["choices"][0] == {**raw["choices"][0], "routed_experts": None, "sampling_mask": None}
    assert again["prompt_token_ids"] == raw["prompt_token_ids"]


@pytest.mark.parametrize("case", range(len(GOLDEN)))
def test_decodes_the_golden_generate_responses(case: int) -> None:
    raw = GOLDEN[case]["request"]["generate_response"]
    r = decode_generate_response(json.dumps(raw).encode())
    assert r.choices[0].token_ids == raw["choices"][0]["token_ids"]
    assert r.choices[0].finish_reason == raw["choices"][0]["finish_reason"]
    assert r.usage is not None and r.usage.prompt_tokens == raw["usage"]["prompt_tokens"]


def test_missing_finish_reason_means_stop_in_a_whole_answer_and_none_in_a_chunk() -> None:
    r = decode_generate_response(b'{"request_id":"x","choices":[{"index":0,"token_ids":[5]}]}')
    assert r.choices[0].finish_reason == "stop"
    c = decode_stream_chunk(b'{"request_id":"x","choices":[{"index":0,"token_ids":[5]}]}')
    assert c.choices[0].finish_reason is None


def test_stream_step_usage_only_and_error_chunks() -> None:
    step = decode_stream_chunk(
        b'{"request_id":"r","usage":null,"output_mode":"tokens",'
        b'"choices":[{"index":1,"finish_reason":null,"token_ids":[565],"logprobs":null}]}'
    )
    assert step.choices == [GenerateStreamChoice(index=1, token_ids=[565])]
    usage = decode_stream_chunk(
        b'{"request_id":"r","usage":{"prompt_tokens":5,"total_tokens":9,"completion_tokens":4},"choices":[]}'
    )
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == 4
    err = decode_stream_chunk(b'{"error":{"message":"engine died","type":"InternalServerError","param":null,"code":500}}')
    assert err.error and err.error.message == "engine died" and err.error.code == 500 and err.choices == []
    assert STREAM_DONE == b"[DONE]"


def test_stream_chunk_encoding_is_an_sse_event_in_vllms_key_order() -> None:
    event = encode_stream_chunk(
        GenerateStreamChunk(request_id="r", choices=[GenerateStreamChoice(index=0, token_ids=[7], finish_reason="stop", stop_reason=None)])
    )
    # vLLM 0.32: model_dump_json(exclude={prompt_token_ids, mm_placeholders, metrics} when None)
    assert event == (
        b'data: {"request_id":"r","usage":null,"output_mode":"tokens","choices":[{"index":0,'
        b'"finish_reason":"stop","stop_reason":null,"token_ids":[7],"routed_experts":null,"sampling_mask":null,'
        b'"weight_versions":null,"logprobs":null}]}\n\n'
    )
    first = encode_stream_chunk(GenerateStreamChunk(request_id="r", prompt_token_ids=[1, 2], choices=[]))
    assert b'"usage":null,"prompt_token_ids":[1,2],"output_mode"' in first


def test_the_usage_only_event_leaves_nulls_out() -> None:
    # vLLM 0.32: model_dump_json(exclude_none=True)
    event = encode_stream_chunk(GenerateStreamChunk(request_id="r", choices=[], usage=GenerateUsage(
        prompt_tokens=5, total_tokens=9, completion_tokens=4)))
    assert event == (b'data: {"request_id":"r","usage":{"prompt_tokens":5,"total_tokens":9,"completion_tokens":4},'
                     b'"output_mode":"tokens","choices":[]}\n\n')
    continuous = encode_stream_chunk(GenerateStreamChunk(
        request_id="r", usage=GenerateUsage(prompt_tokens=5, total_tokens=6, completion_tokens=1),
        choices=[GenerateStreamChoice(index=0, token_ids=[3])]))
    assert b'"completion_tokens":1,"prompt_tokens_details":null,"completion_tokens_details":null}' in continuous


def test_whole_answer_encoding_key_order() -> None:
    body = encode_generate_response(
        GenerateResponse(
            request_id="r",
            model="m",
            created=1,
            usage=GenerateUsage(prompt_tokens=2, total_tokens=3, completion_tokens=1),
            choices=[GenerateChoice(index=0, finish_reason="length", token_ids=[9])],
        )
    )
    # vLLM 0.32: JSONResponse(content=response.model_dump()), every key
    assert list(json.loads(body)) == ["request_id", "model", "created", "usage", "prompt_logprobs",
                                      "prompt_token_id_logprobs", "prompt_token_ids", "mm_placeholders", "metrics",
                                      "kv_transfer_params", "ec_transfer_params", "output_mode", "choices"]
    assert list(json.loads(body)["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens",
                                               "prompt_tokens_details", "completion_tokens_details"]
    assert list(json.loads(body)["choices"][0]) == ["index", "finish_reason", "stop_reason", "token_ids",
                                                    "routed_experts", "sampling_mask", "weight_versions", "logprobs"]


@pytest.mark.parametrize("body", [b"", b"not json", b'{"choices":[]}', b'{"request_id":"x","choices":[{"token_ids":[1]}]}'])
def test_a_broken_answer_is_an_upstream_protocol_error(body: bytes) -> None:
    with pytest.raises(UpstreamProtocolError):
        decode_generate_response(body)


def test_a_broken_event_is_an_upstream_protocol_error() -> None:
    with pytest.raises(UpstreamProtocolError):
        decode_stream_chunk(b'{"choices":[{"index":"zero"}]}')

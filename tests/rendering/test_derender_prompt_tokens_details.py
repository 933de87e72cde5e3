"""rendering.derender's ``prompt_tokens_details`` option (vLLM's ``--enable-prompt-tokens-details``): off by
default (no cached tokens in answers, as vLLM's defaults); on, the engine's cached prompt tokens appear in the
whole answer's and the usage event's ``usage`` when there are some (none cached: null / left out, as vLLM)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rendering.derender import ChatDerender, CompletionDerender, DerenderOptions
from rendering.generate_response import (
    GenerateChoice,
    GenerateResponse,
    GenerateStreamChoice,
    GenerateStreamChunk,
    GenerateUsage,
    PromptTokensDetails,
)
from rendering.model import DEFAULT_MODEL_DIR, load_model

MODEL = load_model(DEFAULT_MODEL_DIR)
IDS = MODEL.tokenizer.encode(" two fox", add_special_tokens=False).ids


def usage(cached: int) -> GenerateUsage:
    return GenerateUsage(prompt_tokens=40, total_tokens=40 + len(IDS), completion_tokens=len(IDS),
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def whole(cached: int) -> GenerateResponse:
    return GenerateResponse(request_id="g", usage=usage(cached),
                            choices=[GenerateChoice(index=0, finish_reason="length", token_ids=IDS)])


def last_usage(raw: bytes) -> dict[str, Any]:
    (event,) = [json.loads(b[6:]) for b in raw.split(b"\n\n") if b.startswith(b"data: {")]
    assert event["choices"] == []
    return event["usage"]


@pytest.mark.parametrize(("enabled", "cached", "details"), [
    (False, 32, None), (True, 32, {"cached_tokens": 32}), (True, 0, None)])
def test_whole_answers(enabled: bool, cached: int, details: Any) -> None:
    chat = ChatDerender(MODEL, DerenderOptions(), request_id="chatcmpl-x", prompt_tokens_details=enabled)
    answer = json.loads(chat.whole(whole(cached)))
    assert answer["usage"]["prompt_tokens_details"] == details and answer["usage"]["prompt_tokens"] == 40
    completion = CompletionDerender(MODEL, DerenderOptions(), request_id="cmpl-x", prompt_tokens_details=enabled)
    assert json.loads(completion.whole([whole(cached)]))["usage"]["prompt_tokens_details"] == details


@pytest.mark.parametrize(("enabled", "cached", "details"), [
    (False, 32, None), (True, 32, {"cached_tokens": 32}), (True, 0, None)])
def test_the_usage_event_of_a_stream(enabled: bool, cached: int, details: Any) -> None:
    opts = DerenderOptions(include_usage=True)
    step = GenerateStreamChunk(request_id="g", choices=[GenerateStreamChoice(index=0, token_ids=IDS,
                                                                             finish_reason="length")])
    for derender in (ChatDerender(MODEL, opts, request_id="chatcmpl-x", prompt_tokens_details=enabled),
                     CompletionDerender(MODEL, opts, request_id="cmpl-x", prompt_tokens_details=enabled)):
        derender.chunk(step)
        derender.chunk(GenerateStreamChunk(request_id="g", choices=[], usage=usage(cached)))  # the engine's usage
        got = last_usage(derender.finish())
        assert got.get("prompt_tokens_details") == details
        assert ("prompt_tokens_details" in got) == (details is not None)  # left out, not null, in a stream event


def test_a_collected_answer_reports_the_cached_tokens_too() -> None:
    derender = ChatDerender(MODEL, DerenderOptions(), request_id="chatcmpl-x", prompt_tokens_details=True)
    derender.collect(GenerateStreamChunk(request_id="g", choices=[GenerateStreamChoice(
        index=0, token_ids=IDS, finish_reason="length")], usage=usage(16)))
    assert json.loads(derender.collected())["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}

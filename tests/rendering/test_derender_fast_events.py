"""rendering.derender's per-token shortcuts give the bytes of the general path: a running completions stream
event written around the text (no Struct) equals the ``CompletionChunk`` encoding of the same event, for any
choice index; ``ChatDerender.step`` / ``CompletionDerender.step`` (one choice's ids, no ``GenerateStreamChunk``)
equal ``chunk``."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from msgspec import UNSET

from rendering.derender import ChatDerender, CompletionDerender, DerenderOptions
from rendering.generate_response import GenerateStreamChoice, GenerateStreamChunk
from rendering.model import DEFAULT_MODEL_DIR, load_model
from rendering.openai_objects import CompletionChunk, CompletionStreamChoice, sse_event

MODEL = load_model(DEFAULT_MODEL_DIR)


def test_running_events_equal_the_struct_encoding() -> None:
    ids = MODEL.tokenizer.encode(" two fox \"quoted\" é", add_special_tokens=False).ids
    derender = CompletionDerender(MODEL, DerenderOptions(n=2), request_id="cmpl-\"x\"", created=9,
                                  prompt_ids=[[1, 2], [3]])
    sent = b""
    expected = b""
    for prompt in (0, 1):
        for index in (0, 1):
            for token in ids:
                event = GenerateStreamChunk(choices=[GenerateStreamChoice(index=index, token_ids=[token])])
                got = derender.chunk(event, prompt=prompt)
                sent += got
                if got:
                    text = got.split(b'"text":', 1)[1].split(b',"logprobs"', 1)[0]
                    expected += sse_event(CompletionChunk(id="cmpl-\"x\"", created=9, model=MODEL.name, choices=[
                        CompletionStreamChoice(index=prompt * 2 + index, text=json.loads(text))]))
    assert sent == expected and sent.count(b"data: ") >= 4 * (len(ids) - 1)


def chat(opts: DerenderOptions) -> ChatDerender:
    return ChatDerender(MODEL, opts, request_id="chatcmpl-x", created=9, prompt_ids=[1, 2], system_fingerprint="fp")


def completion(opts: DerenderOptions) -> CompletionDerender:
    return CompletionDerender(MODEL, opts, request_id="cmpl-x", created=9, prompt_ids=[[1, 2]], prompt_texts=["hi"],
                              system_fingerprint="fp")


@pytest.mark.parametrize("make", [chat, completion])
@pytest.mark.parametrize("opts", [
    DerenderOptions(n=2), DerenderOptions(n=2, stop=("jumps",)), DerenderOptions(n=2, echo=True),
    DerenderOptions(n=2, return_token_ids=True), DerenderOptions(n=2, include_usage=True, continuous_usage=True)])
def test_step_equals_chunk(make: Callable[[DerenderOptions], ChatDerender | CompletionDerender],
                           opts: DerenderOptions) -> None:
    ids = MODEL.tokenizer.encode(" two fox jumps stop here", add_special_tokens=False).ids
    by_chunk, by_step = make(opts), make(opts)
    chunked = stepped = b""
    for i, token in enumerate(ids):
        finish = "length" if i == len(ids) - 1 else None
        for index in (0, 1):
            chunked += by_chunk.chunk(GenerateStreamChunk(choices=[GenerateStreamChoice(
                index=index, token_ids=[token], finish_reason=finish, stop_reason=None if finish else UNSET)]))
            stepped += by_step.step(index, [token], finish, None)
    assert stepped == chunked and by_step.stopped == by_chunk.stopped
    assert stepped.count(b"data: ") >= 2 * 2  # at least one event per choice and step kind
    assert by_step.finish() == by_chunk.finish()

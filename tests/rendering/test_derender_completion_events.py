"""rendering.derender: a running completions stream event is written around the text without a Struct (as
chat's are); its bytes equal the ``CompletionChunk`` encoding of the same event, for any choice index."""

from __future__ import annotations

import json

from rendering.derender import CompletionDerender, DerenderOptions
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
                got = derender.chunk(GenerateStreamChunk(choices=[GenerateStreamChoice(index=index, token_ids=[token])]),
                                     prompt=prompt)
                sent += got
                if got:
                    text = got.split(b'"text":', 1)[1].split(b',"logprobs"', 1)[0]
                    expected += sse_event(CompletionChunk(id="cmpl-\"x\"", created=9, model=MODEL.name, choices=[
                        CompletionStreamChoice(index=prompt * 2 + index, text=json.loads(text))]))
    assert sent == expected and sent.count(b"data: ") >= 4 * (len(ids) - 1)

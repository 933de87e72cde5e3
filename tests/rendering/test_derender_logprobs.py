"""rendering.derender_logprobs and logprobs in derendered answers."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from rendering.derender import ChatDerender, CompletionDerender
from rendering.derender_logprobs import LogprobNamer, repaired_token
from rendering.generate_response import (
    GenerateChoice,
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateResponse,
    GenerateStreamChoice,
    GenerateStreamChunk,
)
from rendering.model import DEFAULT_MODEL_DIR, load_model
from rendering.requests import ChatRequest, CompletionRequest
from tests.rendering.byte_level import BYTE_CHARS

MODEL = load_model(DEFAULT_MODEL_DIR)
TOK = MODEL.tokenizer


def ids_of(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False).ids


def byte_ids(text: str) -> list[int]:
    """One byte-level token per UTF-8 byte of ``text`` (each decodes to a lone byte)."""
    return [TOK.token_to_id(BYTE_CHARS[b]) for b in text.encode()]


def lp(ids: list[int], tops: int = 2) -> GenerateLogProbs:
    """Engine logprobs: the sampled id first in top_logprobs, then other ids."""
    content = []
    for k, token_id in enumerate(ids):
        others = [GenerateLogProb(token_id=(token_id + j) % MODEL.vocab_size, logprob=-1.0 - j, rank=j + 1)
                  for j in range(1, tops)]
        content.append(GenerateLogProbsContent(token_id=token_id, logprob=-0.5 - k, rank=1,
                                               top_logprobs=[GenerateLogProb(token_id=token_id, logprob=-0.5 - k, rank=1),
                                                             *others]))
    return GenerateLogProbs(content=content)


def chat(**fields: Any) -> ChatRequest:
    return msgspec.convert({"model": MODEL.name, "messages": [{"role": "user", "content": "hi"}], **fields}, ChatRequest)


def test_split_character_is_named_on_its_last_byte() -> None:
    euro = byte_ids("€")
    namer = LogprobNamer(TOK)
    names = []
    for token_id in euro:
        names.append(namer.name(token_id))
        namer.advance(token_id)
    assert names == ["", "", "€"]
    assert repaired_token(TOK, euro[2], euro[:2]) == "€"
    assert repaired_token(TOK, euro[2], []) == ""


def test_chat_logprobs_whole_answer() -> None:
    ids = ids_of("hello world")
    response = GenerateResponse(request_id="g", choices=[
        GenerateChoice(index=0, finish_reason="length", token_ids=ids, logprobs=lp(ids, tops=3))])
    answer = json.loads(ChatDerender(MODEL, chat(logprobs=True, top_logprobs=2), request_id="c",
                                     created=1).whole(response))
    content = answer["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [TOK.decode([i]) for i in ids]
    assert "".join(c["token"] for c in content) == "hello world"
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert content[1]["logprob"] == -1.5
    assert len(content[0]["top_logprobs"]) == 2
    assert content[0]["top_logprobs"][0] == {"token": content[0]["token"], "logprob": -0.5,
                                              "bytes": content[0]["bytes"]}
    none = json.loads(ChatDerender(MODEL, chat(logprobs=True), request_id="c", created=1).whole(response))
    assert all(c["top_logprobs"] == [] for c in none["choices"][0]["logprobs"]["content"])
    off = json.loads(ChatDerender(MODEL, chat(), request_id="c", created=1).whole(response))
    assert off["choices"][0]["logprobs"] is None


def test_tokens_as_token_ids() -> None:
    ids = ids_of("hi")
    response = GenerateResponse(request_id="g", choices=[
        GenerateChoice(index=0, finish_reason="length", token_ids=ids, logprobs=lp(ids))])
    answer = json.loads(ChatDerender(MODEL, chat(logprobs=True, return_tokens_as_token_ids=True), request_id="c",
                                     created=1).whole(response))
    assert [c["token"] for c in answer["choices"][0]["logprobs"]["content"]] == [f"token_id:{i}" for i in ids]


def test_chat_stream_logprobs_follow_the_consumed_ids() -> None:
    ids = ids_of("ab cd STOP ef")
    d = ChatDerender(MODEL, chat(stream=True, logprobs=True, stop="STOP"), request_id="c", created=1)
    out = b""
    engine = lp(ids)
    for k, token_id in enumerate(ids):
        out += d.chunk(GenerateStreamChunk(choices=[GenerateStreamChoice(
            index=0, token_ids=[token_id], logprobs=GenerateLogProbs(content=[engine.content[k]]))]))  # type: ignore[index]
        if d.stopped:
            break
    events = [json.loads(b[len(b"data: "):]) for b in out.split(b"\n\n") if b]
    tokens = [c["token"] for e in events[1:] for c in e["choices"][0]["logprobs"]["content"]]
    assert tokens == [TOK.decode([i]) for i in ids[: len(tokens)]]
    assert "".join(tokens).endswith("STOP") or "STOP" in "".join(tokens)
    assert events[0]["choices"][0]["logprobs"] is None


def stream_offsets(d: CompletionDerender, ids: list[int],
                   engine: GenerateLogProbs) -> tuple[list[int], list[str], list[dict[str, Any]]]:
    """Stream ``ids`` through ``d``, one per event with its logprobs: each event's ``text_offset``
    and token, and the events."""
    assert engine.content is not None
    out = b""
    for k, token_id in enumerate(ids):
        out += d.chunk(GenerateStreamChunk(choices=[GenerateStreamChoice(
            index=0, token_ids=[token_id], logprobs=GenerateLogProbs(content=[engine.content[k]]))]))
    events = [json.loads(b[len(b"data: "):]) for b in out.split(b"\n\n") if b]
    offsets = [e["choices"][0]["logprobs"]["text_offset"][0] for e in events]
    tokens = [e["choices"][0]["logprobs"]["tokens"][0] for e in events]
    return offsets, tokens, events


def test_completion_logprobs_offsets_run_on_over_a_stream() -> None:
    ids = ids_of(" hello world")
    request = msgspec.convert({"prompt": "p", "stream": True, "logprobs": 1}, CompletionRequest)
    d = CompletionDerender(MODEL, request, request_id="cmpl", created=1, prompt_ids=[[5]])
    engine = lp(ids)
    offsets, tokens, _ = stream_offsets(d, ids, engine)
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    whole = json.loads(CompletionDerender(MODEL, msgspec.convert({"prompt": "p", "logprobs": 1}, CompletionRequest),
                                          request_id="cmpl", created=1, prompt_ids=[[5]]).whole(
        [GenerateResponse(request_id="g", choices=[GenerateChoice(index=0, finish_reason="length", token_ids=ids,
                                                                  logprobs=engine)])]))
    logprobs = whole["choices"][0]["logprobs"]
    assert list(logprobs) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert logprobs["text_offset"] == offsets
    assert logprobs["token_logprobs"] == [-0.5 - k for k in range(len(ids))]
    assert logprobs["top_logprobs"][0] == {logprobs["tokens"][0]: -0.5, TOK.decode([(ids[0] + 1) % MODEL.vocab_size]): -2.0}


def test_completion_stream_offsets_follow_tokens_while_stop_strings_hold_text_back() -> None:
    ids = ids_of(" hello world")
    request = msgspec.convert({"prompt": "p", "stream": True, "logprobs": 0, "stop": ["zzzzzz"]}, CompletionRequest)
    d = CompletionDerender(MODEL, request, request_id="cmpl", created=1)
    engine = lp(ids)
    offsets, tokens, events = stream_offsets(d, ids, engine)
    # the text sent lags behind the tokens (5 characters held for the stop string) ...
    assert len(events[0]["choices"][0]["text"]) < len(tokens[0])
    # ... the offsets do not
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]


def test_an_id_the_tokenizer_lacks_is_an_empty_token_without_bytes() -> None:
    ids = [*ids_of("a"), MODEL.vocab_size + 3]
    response = GenerateResponse(request_id="g", choices=[
        GenerateChoice(index=0, finish_reason="length", token_ids=ids, logprobs=lp(ids, tops=1))])
    answer = json.loads(ChatDerender(MODEL, chat(logprobs=True, top_logprobs=1), request_id="c",
                                     created=1).whole(response))
    last = answer["choices"][0]["logprobs"]["content"][-1]
    assert (last["token"], last["bytes"]) == ("", None)
    assert last["top_logprobs"] == [{"token": "", "logprob": last["logprob"], "bytes": None}]

"""rendering.derender: SSE chunk sequences, stop strings, n > 1, usage, whole == stream."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract.errors import UpstreamProtocolError
from rendering.derender import ChatDerender, CompletionDerender, DerenderOptions
from rendering.detokenize import detokenize
from rendering.generate_response import (
    GenerateChoice,
    GenerateResponse,
    GenerateStreamChoice,
    GenerateStreamChunk,
    GenerateUsage,
    StreamError,
)
from rendering.model import DEFAULT_MODEL_DIR, load_model
from rendering.requests import ChatRequest, CompletionRequest

MODEL = load_model(DEFAULT_MODEL_DIR)
TOK = MODEL.tokenizer
EOS = MODEL.eos_token_id
RID = "chatcmpl-abc"
HEAD = {"id": RID, "object": "chat.completion.chunk", "created": 7, "model": MODEL.name}


def ids_of(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False).ids


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def event(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def step(index: int, ids: list[int], finish: str | None = None, stop_reason: Any = msgspec.UNSET) -> GenerateStreamChunk:
    return GenerateStreamChunk(request_id="g", choices=[GenerateStreamChoice(
        index=index, token_ids=ids, finish_reason=finish, stop_reason=stop_reason)])


def events(raw: bytes) -> list[Any]:
    """The JSON objects of an SSE byte string ([DONE] as the string "[DONE]")."""
    out: list[Any] = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: ")
        data = block[len(b"data: "):]
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def chat(**fields: Any) -> ChatRequest:
    return msgspec.convert({"model": MODEL.name, "messages": [{"role": "user", "content": "hi"}], **fields}, ChatRequest)


def streamed_text(raw: bytes) -> dict[int, str]:
    texts: dict[int, str] = {}
    for obj in events(raw):
        if obj == "[DONE]":
            continue
        for c in obj["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["delta"].get("content", "")
    return texts


# ---- the exact SSE sequence ---------------------------------------------------------------------


def test_chat_stream_is_vllms_sequence_byte_for_byte() -> None:
    ids = ids_of("hello world")
    d = ChatDerender(MODEL, chat(stream=True, stream_options={"include_usage": True}), request_id=RID,
                     created=7, prompt_ids=[1, 5, 6])
    out = d.chunk(step(0, ids[:1]))
    out += d.chunk(step(0, ids[1:], finish="length"))
    out += d.chunk(GenerateStreamChunk(request_id="g", usage=GenerateUsage(prompt_tokens=3, completion_tokens=len(ids),
                                                                          total_tokens=3 + len(ids))))
    out += d.finish()
    first = detokenize(TOK, ids[:1], prompt_ids=[1, 5, 6])
    rest = detokenize(TOK, ids, prompt_ids=[1, 5, 6])[len(first):]
    assert out == (
        event({**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}], "prompt_token_ids": None, "prompt_text": None})
        + event({**HEAD, "choices": [{"index": 0, "delta": {"content": first}, "logprobs": None, "finish_reason": None,
                                      "token_ids": None}]})
        + event({**HEAD, "choices": [{"index": 0, "delta": {"content": rest}, "logprobs": None,
                                      "finish_reason": "length", "stop_reason": None, "token_ids": None}]})
        + event({**HEAD, "choices": [], "usage": {"prompt_tokens": 3, "total_tokens": 3 + len(ids),
                                                  "completion_tokens": len(ids)}})
        + b"data: [DONE]\n\n"
    )
    assert first + rest == "hello world"


def test_no_usage_event_without_include_usage() -> None:
    d = ChatDerender(MODEL, chat(stream=True), request_id=RID, created=7)
    d.chunk(step(0, ids_of("a"), finish="length"))
    assert d.finish() == b"data: [DONE]\n\n"


def test_start_sends_the_role_events_once() -> None:
    d = ChatDerender(MODEL, chat(stream=True, n=2), request_id=RID, created=7)
    first = events(d.start())
    assert [c["choices"][0]["index"] for c in first] == [0, 1]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in first)
    assert d.start() == b""
    assert all("role" not in c["choices"][0]["delta"] for c in events(d.chunk(step(0, ids_of("x")))))


def test_role_without_a_generation_prompt_is_the_last_messages() -> None:
    d = ChatDerender(MODEL, chat(stream=True, add_generation_prompt=False), request_id=RID, created=7)
    assert events(d.start())[0]["choices"][0]["delta"]["role"] == "user"


def test_continuous_usage_and_return_token_ids() -> None:
    ids = ids_of("hello world")
    d = ChatDerender(MODEL, chat(stream=True, return_token_ids=True,
                                 stream_options={"include_usage": True, "continuous_usage_stats": True}),
                     request_id=RID, created=7, prompt_ids=[1, 5])
    got = events(d.chunk(step(0, ids[:1])) + d.chunk(step(0, ids[1:], finish="length")))
    assert got[0]["prompt_token_ids"] == [1, 5]
    assert got[0]["usage"] == {"prompt_tokens": 2, "total_tokens": 2, "completion_tokens": 0,
                                "completion_tokens_details": None}
    assert list(got[0]) == ["id", "object", "created", "model", "choices", "usage", "prompt_token_ids", "prompt_text"]
    assert got[1]["choices"][0]["token_ids"] == ids[:1]
    assert got[1]["usage"] == {"prompt_tokens": 2, "total_tokens": 3, "completion_tokens": 1,
                                "completion_tokens_details": None}
    assert got[2]["choices"][0]["token_ids"] == ids[1:]
    assert got[2]["usage"]["completion_tokens"] == len(ids)
    assert list(got[1]) == ["id", "object", "created", "model", "choices", "usage"]
    assert list(got[1]["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens", "completion_tokens_details"]


def test_engine_error_event_then_done_only() -> None:
    d = ChatDerender(MODEL, chat(stream=True, stream_options={"include_usage": True}), request_id=RID, created=7)
    d.chunk(step(0, ids_of("a")))
    err = d.chunk(GenerateStreamChunk(error=StreamError(message="boom", type="InternalServerError", code=500)))
    assert events(err) == [{"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}]
    assert d.failed and d.chunk(step(0, ids_of("b"))) == b""
    assert d.finish() == b"data: [DONE]\n\n"


# ---- stop strings -------------------------------------------------------------------------------


def test_stop_string_ends_the_stream_choice_and_asks_for_abort() -> None:
    text = "the quick brown fox"
    ids = ids_of(text)
    d = ChatDerender(MODEL, chat(stream=True, stop=["brown"], stream_options={"include_usage": True}),
                     request_id=RID, created=7)
    out = b""
    fed = 0
    for token in ids:
        out += d.chunk(step(0, [token]))
        fed += 1
        if d.stopped:
            break
    assert d.stopped
    got = events(out + d.finish())
    last = got[-3]["choices"][0]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == "brown"
    assert streamed_text(out)[0] == "the quick "
    # nothing sent ever contained the start of the stop string
    assert all("b" not in c["choices"][0]["delta"].get("content", "") for c in got[:-2])
    # completion tokens: every id up to the one that completed "brown"
    assert got[-2]["usage"]["completion_tokens"] == fed
    assert d.chunk(step(0, ids_of(" more"))) == b""


def test_whole_answer_with_stop_string_and_include() -> None:
    ids = ids_of("the quick brown fox")
    response = GenerateResponse(request_id="g", usage=GenerateUsage(prompt_tokens=4), choices=[
        GenerateChoice(index=0, finish_reason="length", token_ids=ids)])
    cut = json.loads(ChatDerender(MODEL, chat(stop="quick"), request_id=RID, created=7).whole(response))
    assert cut["choices"][0]["message"]["content"] == "the "
    assert (cut["choices"][0]["finish_reason"], cut["choices"][0]["stop_reason"]) == ("stop", "quick")
    kept = json.loads(ChatDerender(MODEL, chat(stop="quick", include_stop_str_in_output=True), request_id=RID,
                                   created=7).whole(response))
    assert kept["choices"][0]["message"]["content"] == "the quick"
    prefix = [t for k, t in enumerate(ids) if detokenize(TOK, ids[: k + 1]).endswith("quick")]
    assert cut["usage"]["completion_tokens"] == ids.index(prefix[0]) + 1
    assert cut["usage"]["prompt_tokens"] == 4


def test_n2_one_choice_stopped_the_other_runs_on() -> None:
    a = ids_of("one STOP two")
    b = ids_of("three four")
    d = ChatDerender(MODEL, chat(stream=True, n=2, stop="STOP", stream_options={"include_usage": True}),
                     request_id=RID, created=7)
    out = b""
    for token in a:
        out += d.chunk(step(0, [token]))
    assert not d.stopped and not d.finished  # choice 1 still runs
    out += d.chunk(step(1, b[:2]))
    out += d.chunk(step(0, ids_of(" ignored")))
    out += d.chunk(step(1, b[2:], finish="length"))
    assert d.finished and d.stopped
    texts = streamed_text(out)
    assert texts == {0: "one ", 1: "three four"}
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"], c["choices"][0].get("stop_reason"))
                for c in events(out) if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == [(0, "stop", "STOP"), (1, "length", None)]


def test_min_tokens_lets_an_early_stop_string_through() -> None:
    ids = ids_of("ab cd ab ef")
    response = GenerateResponse(request_id="g", choices=[GenerateChoice(index=0, finish_reason="length", token_ids=ids)])
    first = json.loads(ChatDerender(MODEL, chat(stop="ab"), request_id=RID, created=7).whole(response))
    assert first["choices"][0]["message"]["content"] == ""
    late = json.loads(ChatDerender(MODEL, chat(stop="ab", min_tokens=2), request_id=RID, created=7).whole(response))
    assert late["choices"][0]["message"]["content"] == "ab cd "


# ---- stop tokens / EOS --------------------------------------------------------------------------


def test_eos_text_is_left_out_as_vllm_does_unless_included() -> None:
    ids = [*ids_of("hi"), EOS]
    response = GenerateResponse(request_id="g", choices=[GenerateChoice(index=0, finish_reason="stop", token_ids=ids)])
    kept = json.loads(ChatDerender(MODEL, chat(skip_special_tokens=False), request_id=RID, created=7).whole(response))
    assert kept["choices"][0]["message"]["content"] == "hi"
    assert kept["usage"]["completion_tokens"] == 3
    with_it = json.loads(ChatDerender(MODEL, chat(skip_special_tokens=False, include_stop_str_in_output=True),
                                      request_id=RID, created=7).whole(response))
    assert with_it["choices"][0]["message"]["content"] == "hi</s>"


def test_stop_token_id_text_is_left_out_and_its_id_is_the_stop_reason() -> None:
    ids = ids_of("hello world")
    response = GenerateResponse(request_id="g", choices=[
        GenerateChoice(index=0, finish_reason="stop", stop_reason=ids[-1], token_ids=ids)])
    answer = json.loads(ChatDerender(MODEL, chat(stop_token_ids=[ids[-1]]), request_id=RID, created=7).whole(response))
    assert answer["choices"][0]["message"]["content"] == detokenize(TOK, ids[:-1])
    assert answer["choices"][0]["stop_reason"] == ids[-1]
    d = ChatDerender(MODEL, chat(stream=True), request_id=RID, created=7)
    out = d.chunk(step(0, ids[:-1])) + d.chunk(step(0, ids[-1:], finish="stop", stop_reason=ids[-1]))
    assert streamed_text(out)[0] == detokenize(TOK, ids[:-1])
    assert events(out)[-1]["choices"][0]["stop_reason"] == ids[-1]


# ---- whole answers ------------------------------------------------------------------------------


def test_whole_answer_n2_return_token_ids_kv_and_echo() -> None:
    a, b = ids_of("one"), ids_of("two")
    response = GenerateResponse(request_id="g", usage=GenerateUsage(prompt_tokens=2), kv_transfer_params={"x": 1},
                                choices=[GenerateChoice(index=1, finish_reason="length", token_ids=b),
                                         GenerateChoice(index=0, finish_reason="length", token_ids=a)])
    request = msgspec.convert({"messages": [{"role": "assistant", "content": "pre "}], "n": 2, "echo": True,
                               "return_token_ids": True, "add_generation_prompt": False}, ChatRequest)
    answer = json.loads(ChatDerender(MODEL, request, request_id=RID, created=7, prompt_ids=[1, 9]).whole(response))
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in answer["choices"]] == ["pre one", "pre two"]
    assert [c["message"]["role"] for c in answer["choices"]] == ["assistant", "assistant"]
    assert [c["token_ids"] for c in answer["choices"]] == [a, b]
    assert answer["prompt_token_ids"] == [1, 9]
    assert answer["kv_transfer_params"] == {"x": 1}
    assert answer["usage"] == {"prompt_tokens": 2, "total_tokens": 2 + len(a) + len(b),
                               "completion_tokens": len(a) + len(b), "prompt_tokens_details": None,
                               "completion_tokens_details": None}


def test_collect_gives_the_whole_answer() -> None:
    ids = ids_of("the quick brown fox")
    request = chat(stop="brown")
    whole = json.loads(ChatDerender(MODEL, request, request_id=RID, created=7, prompt_tokens=3).whole(
        GenerateResponse(request_id="g", choices=[GenerateChoice(index=0, finish_reason="length", token_ids=ids)])))
    d = ChatDerender(MODEL, request, request_id=RID, created=7, prompt_tokens=3)
    for token in ids:
        d.collect(step(0, [token]))
        if d.stopped:
            break
    assert json.loads(d.collected()) == whole


def test_collected_raises_after_an_engine_error() -> None:
    d = ChatDerender(MODEL, chat(), request_id=RID, created=7)
    d.collect(GenerateStreamChunk(error=StreamError(message="boom")))
    with pytest.raises(UpstreamProtocolError):
        d.collected()


def test_plain_options_work_without_a_request() -> None:
    d = ChatDerender(MODEL, DerenderOptions(n=1, stop=("x",)), request_id=RID, created=7)
    answer = json.loads(d.whole(GenerateResponse(request_id="g", choices=[
        GenerateChoice(index=0, finish_reason="length", token_ids=ids_of("abxcd"))])))
    assert answer["choices"][0]["message"]["content"] == "ab"


# ---- completions --------------------------------------------------------------------------------


def completion(**fields: Any) -> CompletionRequest:
    return msgspec.convert({"model": MODEL.name, "prompt": "p", **fields}, CompletionRequest)


def test_completion_whole_answer_shape_two_prompts_and_echo() -> None:
    a, b = ids_of(" one"), ids_of(" two")
    responses = [
        GenerateResponse(request_id="g0", usage=GenerateUsage(prompt_tokens=2),
                         choices=[GenerateChoice(index=0, finish_reason="length", token_ids=a)]),
        GenerateResponse(request_id="g1", usage=GenerateUsage(prompt_tokens=3),
                         choices=[GenerateChoice(index=0, finish_reason="stop", token_ids=b)]),
    ]
    d = CompletionDerender(MODEL, completion(echo=True), request_id="cmpl-1", created=7,
                           prompt_ids=[[5, 6], [7, 8, 9]], prompt_texts=["A", "B"])
    raw = d.whole(responses)
    answer = json.loads(raw)
    assert list(answer) == ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
                            "usage", "kv_transfer_params", "ec_transfer_params", "metrics"]
    assert answer["object"] == "text_completion"
    assert list(answer["choices"][0]) == ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                                          "prompt_logprobs", "prompt_token_ids", "routed_experts"]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]] == [
        (0, "A" + detokenize(TOK, a, prompt_ids=[5, 6]), "length"),
        (1, "B" + detokenize(TOK, b, prompt_ids=[7, 8, 9]), "stop")]
    assert answer["usage"]["prompt_tokens"] == 5
    assert answer["usage"]["completion_tokens"] == len(a) + len(b)


def test_completion_stream_events() -> None:
    ids = ids_of(" hello world")
    d = CompletionDerender(MODEL, completion(stream=True, stream_options={"include_usage": True}),
                           request_id="cmpl-1", created=7, prompt_ids=[[5, 6]])
    out = d.chunk(step(0, ids[:1])) + d.chunk(step(0, ids[1:], finish="length")) + d.finish()
    head = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": MODEL.name}
    first = detokenize(TOK, ids[:1], prompt_ids=[5, 6])
    assert out == (
        event({**head, "choices": [{"index": 0, "text": first, "logprobs": None, "finish_reason": None,
                                    "stop_reason": None, "prompt_token_ids": None, "token_ids": None}]})
        + event({**head, "choices": [{"index": 0, "text": detokenize(TOK, ids, prompt_ids=[5, 6])[len(first):],
                                      "logprobs": None, "finish_reason": "length", "stop_reason": None,
                                      "prompt_token_ids": None, "token_ids": None}]})
        + event({**head, "choices": [], "usage": {"prompt_tokens": 2, "total_tokens": 2 + len(ids),
                                                  "completion_tokens": len(ids)}})
        + b"data: [DONE]\n\n"
    )


def test_completion_stream_second_prompt_is_indexed_after_the_first() -> None:
    d = CompletionDerender(MODEL, completion(stream=True, n=2), request_id="cmpl-1", created=7,
                           prompt_ids=[[5], [6]])
    got = events(d.chunk(step(1, ids_of("x"), finish="length"), prompt=1))
    assert got[0]["choices"][0]["index"] == 3


# ---- whole == stream, for any split and any stop strings ----------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n=st.integers(min_value=1, max_value=2), include=st.booleans())
def test_stream_deltas_concatenated_equal_the_whole_answer(data: st.DataObject, n: int, include: bool) -> None:
    vocab = MODEL.vocab_size
    seqs = [data.draw(st.lists(st.integers(min_value=0, max_value=vocab + 5), min_size=1, max_size=30)) for _ in range(n)]
    texts = [detokenize(TOK, s) for s in seqs]
    pool = [t[i:j] for t in texts for i in range(len(t)) for j in range(i + 1, min(len(t), i + 4) + 1)]
    stops = data.draw(st.lists(st.sampled_from(pool) if pool else st.just("zz"), max_size=3)) + data.draw(
        st.lists(st.text(alphabet="abc ", min_size=1, max_size=3), max_size=1))
    request = chat(stream=True, n=n, stop=stops, include_stop_str_in_output=include,
                   stream_options={"include_usage": True})
    finish = data.draw(st.sampled_from(["length", "stop"]))
    whole = json.loads(ChatDerender(MODEL, request, request_id=RID, created=7, prompt_tokens=3).whole(
        GenerateResponse(request_id="g", choices=[GenerateChoice(index=i, finish_reason=finish, token_ids=s)
                                                  for i, s in enumerate(seqs)])))
    d = ChatDerender(MODEL, request, request_id=RID, created=7, prompt_tokens=3)
    out = b""
    cursors = [0] * n
    while any(c < len(s) for c, s in zip(cursors, seqs)) and not d.stopped:
        i = data.draw(st.sampled_from([k for k in range(n) if cursors[k] < len(seqs[k])]))
        size = data.draw(st.integers(min_value=1, max_value=4))
        part = seqs[i][cursors[i]:cursors[i] + size]
        cursors[i] += len(part)
        out += d.chunk(step(i, part, finish=finish if cursors[i] == len(seqs[i]) else None))
    out += d.finish()
    got = events(out)
    assert got[-1] == "[DONE]"
    texts_streamed = streamed_text(out)
    for choice in whole["choices"]:
        assert texts_streamed[choice["index"]] == choice["message"]["content"]
        ends = [c["choices"][0] for c in got[:-2] if c["choices"] and c["choices"][0]["index"] == choice["index"]
                and c["choices"][0]["finish_reason"] is not None]
        assert len(ends) == 1
        assert (ends[0]["finish_reason"], ends[0]["stop_reason"]) == (choice["finish_reason"], choice["stop_reason"])
    assert got[-2]["usage"] == {k: whole["usage"][k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")}


def test_completion_collect_gives_the_whole_answer() -> None:
    ids = ids_of(" the quick brown fox")
    request = completion(stop=["brown"], return_token_ids=True)
    whole = json.loads(CompletionDerender(MODEL, request, request_id="cmpl-1", created=7, prompt_ids=[[5, 6]]).whole(
        [GenerateResponse(request_id="g", choices=[GenerateChoice(index=0, finish_reason="length", token_ids=ids)])]))
    assert whole["choices"][0]["stop_reason"] == "brown"
    d = CompletionDerender(MODEL, request, request_id="cmpl-1", created=7, prompt_ids=[[5, 6]])
    for token in ids:
        d.collect(step(0, [token]))
        if d.stopped:
            break
    assert d.stopped
    assert json.loads(d.collected()) == whole
    assert whole["choices"][0]["prompt_token_ids"] == [5, 6]
    assert whole["choices"][0]["token_ids"] == ids[: len(whole["choices"][0]["token_ids"])]


def test_system_fingerprint_where_vllm_stamps_it() -> None:
    ids = ids_of("hi there")
    fp = "vllm-0.32.0-0123abcd"
    response = GenerateResponse(request_id="g", choices=[GenerateChoice(index=0, finish_reason="length", token_ids=ids)])
    assert json.loads(ChatDerender(MODEL, chat(), request_id=RID, created=7,
                                   system_fingerprint=fp).whole(response))["system_fingerprint"] == fp
    assert json.loads(ChatDerender(MODEL, chat(), request_id=RID, created=7).whole(response))["system_fingerprint"] is None
    # no usage event: on each choice's last event
    d = ChatDerender(MODEL, chat(stream=True), request_id=RID, created=7, system_fingerprint=fp)
    got = events(d.chunk(step(0, ids[:1])) + d.chunk(step(0, ids[1:], finish="length")) + d.finish())
    assert ["system_fingerprint" in e for e in got[:-1]] == [False, False, True]
    assert list(got[2])[-1] == "system_fingerprint" and got[2]["system_fingerprint"] == fp
    # with a usage event: only there
    d = ChatDerender(MODEL, chat(stream=True, stream_options={"include_usage": True}), request_id=RID, created=7,
                     system_fingerprint=fp)
    got = events(d.chunk(step(0, ids, finish="length")) + d.finish())
    assert ["system_fingerprint" in e for e in got[:-1]] == [False, False, True]
    c = CompletionDerender(MODEL, completion(stream=True), request_id="cmpl-1", created=7, system_fingerprint=fp)
    got = events(c.chunk(step(0, ids[:1])) + c.chunk(step(0, ids[1:], finish="length")) + c.finish())
    assert ["system_fingerprint" in e for e in got[:-1]] == [False, True]
    whole = json.loads(CompletionDerender(MODEL, completion(), request_id="cmpl-1", created=7,
                                          system_fingerprint=fp).whole([response]))
    assert whole["system_fingerprint"] == fp


def test_completion_continuous_usage_has_no_details() -> None:
    d = CompletionDerender(MODEL, completion(stream=True, stream_options={"include_usage": True,
                                                                          "continuous_usage_stats": True}),
                           request_id="cmpl-1", created=7, prompt_ids=[[5, 6]])
    got = events(d.chunk(step(0, ids_of("x"), finish="length")))
    assert got[0]["usage"] == {"prompt_tokens": 2, "total_tokens": 3, "completion_tokens": 1}


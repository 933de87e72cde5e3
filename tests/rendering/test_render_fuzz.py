"""Whatever a client sends, render answers a request or a 4xx in vLLM's shape: never another exception
(which would be a 500 in the router and the render server)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract.errors import ClientError
from rendering.render import Renderer

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3000), st.integers(-(2**70), 2**70),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                       max_leaves=8)
_part = st.one_of(st.text(max_size=10), st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "input_text", "refusal", "thinking", "image_url", "weird", None])},
    optional={"text": st.one_of(st.none(), st.text(max_size=10)), "refusal": st.text(max_size=5),
              "thinking": st.text(max_size=5)}))
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "robot"])},
    optional={"content": st.one_of(st.none(), st.text(max_size=30), st.lists(_part, max_size=3)),
              "name": st.text(max_size=5), "reasoning_content": st.text(max_size=5),
              "tool_calls": st.lists(st.fixed_dictionaries(
                  {"type": st.sampled_from(["function", "other"])},
                  optional={"function": st.fixed_dictionaries(
                      {"name": st.text(max_size=4)},
                      optional={"arguments": st.one_of(st.text(max_size=8), st.just('{"a": 1}'))})}), max_size=2)})
_FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "max_tokens",
           "max_completion_tokens", "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "stream",
           "stream_options", "tools", "tool_choice", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "ignore_eos", "logit_bias", "bad_words", "add_generation_prompt", "continue_final_message",
           "chat_template_kwargs", "documents", "cache_salt", "truncate_prompt_tokens", "truncation_side",
           "response_format", "structured_outputs", "echo", "kv_transfer_params", "vllm_xargs", "priority",
           "request_id", "include_stop_str_in_output", "reasoning_effort", "return_token_offsets", "suffix"]
_extra = st.dictionaries(st.sampled_from(_FIELDS), _values, max_size=4)
_settings = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _outcome(call: Any) -> None:
    try:
        call()
    except ClientError as exc:
        body = json.loads(exc.body())["error"]
        assert 400 <= exc.status < 500 and body["code"] == exc.status and body["message"]


@_settings
@given(messages=st.lists(_message, max_size=4), extra=_extra)
def test_any_chat_body(renderer: Renderer, messages: list[dict[str, Any]], extra: dict[str, Any]) -> None:
    body = json.dumps({"model": "tiny-llama", "messages": messages, **extra}).encode()
    _outcome(lambda: renderer.render_chat(body))


@_settings
@given(prompt=st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3),
                        st.lists(st.integers(-2, 500), max_size=8), _values), extra=_extra)
def test_any_completions_body(renderer: Renderer, prompt: Any, extra: dict[str, Any]) -> None:
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, **extra}).encode()
    _outcome(lambda: renderer.render_completions(body))


@_settings
@given(body=_values)
def test_any_json_to_tokenize_and_detokenize(renderer: Renderer, body: Any) -> None:
    raw = json.dumps(body).encode()
    _outcome(lambda: renderer.tokenize(raw))
    _outcome(lambda: renderer.detokenize(raw))

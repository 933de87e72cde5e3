"""Render rules beyond the golden cases, each as vLLM 0.32's render server applies it: context and
output budgets, request validation, tool choice, sampling defaults, request ids, P/D id reuse,
/tokenize and /detokenize."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from contract.errors import BadRequestError, ClientError, InvalidJSONError, NotFoundError
from rendering.generate_request import encode_generate_request
from rendering.model import RenderModel
from rendering.render import RenderedChat, Renderer

USER = [{"role": "user", "content": "hi"}]


def _chat(renderer: Renderer, **fields: Any) -> RenderedChat:
    body = {"model": "tiny-llama", "messages": USER, **fields}
    return renderer.render_chat(json.dumps(body).encode())


def _sampling(renderer: Renderer, **fields: Any) -> dict[str, Any]:
    """The sampling_params JSON, as it goes on the wire."""
    return json.loads(encode_generate_request(_chat(renderer, **fields).request))["sampling_params"]


def _error(call: Any) -> dict[str, Any]:
    with pytest.raises(ClientError) as caught:
        call()
    body = json.loads(caught.value.body())["error"]
    assert body["code"] == caught.value.status
    return body


def _long_chat(words: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": "hello " * words}]


# --- context and output budgets ---------------------------------------------------------------
def test_a_prompt_longer_than_the_context(renderer: Renderer) -> None:
    error = _error(lambda: _chat(renderer, messages=_long_chat(3000)))
    assert error == {"message": "This model's maximum context length is 2048 tokens. However, your prompt contains "
                                "at least 2049 input tokens, which exceeds this limit even without any output "
                                "tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
                                "value=2049)", "type": "BadRequestError", "param": "input_tokens", "code": 400}


def test_client_token_ids_are_counted_in_full(renderer: Renderer) -> None:
    body = json.dumps({"model": "tiny-llama", "prompt": [5] * 3000}).encode()
    error = _error(lambda: renderer.render_completions(body))
    assert "your prompt contains 3000 input tokens" in error["message"]


def test_a_prompt_too_long_in_characters_is_refused_before_encoding(renderer: Renderer, tiny_model: RenderModel) -> None:
    limit = 2048 * tiny_model.max_chars_per_token
    body = json.dumps({"model": "tiny-llama", "prompt": "x" * (limit + 1)}).encode()
    error = _error(lambda: renderer.render_completions(body))
    assert error["message"] == (
        f"This model's maximum context length is 2048 tokens. However, your prompt contains {limit + 1} characters "
        f"(more than {limit} characters, which is the upper bound for 2048 input tokens). Please reduce the length "
        f"of the input prompt. (parameter=input_text, value={limit + 1})")
    assert error["param"] == "input_text"


def test_an_output_budget_beyond_the_context(renderer: Renderer) -> None:
    error = _error(lambda: _chat(renderer, max_tokens=5000))
    assert error == {"message": "max_tokens=5000 cannot be greater than max_model_len=2048. Please request fewer "
                                "output tokens. (parameter=max_tokens, value=5000)", "type": "BadRequestError",
                     "param": "max_tokens", "code": 400}
    assert _error(lambda: _chat(renderer, max_completion_tokens=4096))["param"] == "max_completion_tokens"


def test_max_tokens_is_capped_by_the_remaining_context(renderer: Renderer) -> None:
    rendered = _chat(renderer, messages=_long_chat(1000), max_tokens=2000)
    assert rendered.request.sampling_params.max_tokens == 2048 - len(rendered.request.token_ids)
    assert _chat(renderer, max_completion_tokens=7, max_tokens=9).request.sampling_params.max_tokens == 7


def test_a_prompt_filling_the_context_leaves_no_output(renderer: Renderer) -> None:
    body = json.dumps({"model": "tiny-llama", "prompt": [5] * 2048}).encode()
    assert _error(lambda: renderer.render_completions(body))["message"] == (
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)")


def test_truncate_prompt_tokens(renderer: Renderer) -> None:
    body = json.dumps({"model": "tiny-llama", "prompt": list(range(10, 40)), "truncate_prompt_tokens": 5}).encode()
    assert renderer.render_completions(body)[0].token_ids == [10, 11, 12, 13, 14]  # the tokenizer's side: right
    body = json.dumps({"model": "tiny-llama", "prompt": list(range(10, 40)), "truncate_prompt_tokens": 5,
                       "truncation_side": "left"}).encode()
    assert renderer.render_completions(body)[0].token_ids == [35, 36, 37, 38, 39]
    body = json.dumps({"model": "tiny-llama", "prompt": "a", "truncate_prompt_tokens": 4096}).encode()
    assert _error(lambda: renderer.render_completions(body))["param"] == "truncate_prompt_tokens"


def test_token_ids_out_of_the_vocabulary(renderer: Renderer) -> None:
    body = json.dumps({"model": "tiny-llama", "prompt": [1, 2, 393]}).encode()
    assert _error(lambda: renderer.render_completions(body)) == {
        "message": "Token id 393 is out of vocabulary", "type": "BadRequestError", "param": None, "code": 400}
    assert renderer.render_completions(json.dumps({"prompt": [1, 2, 392]}).encode())[0].token_ids == [1, 2, 392]
    negative = _error(lambda: renderer.render_completions(json.dumps({"prompt": [[3], [1, -2]]}).encode()))
    assert (negative["type"], negative["param"]) == ("Bad Request", "body.prompt.1.1")


# --- request validation -------------------------------------------------------------------------
def test_wrong_types_are_a_validation_error(renderer: Renderer) -> None:
    error = _error(lambda: _chat(renderer, n="two"))
    assert (error["type"], error["param"], error["code"]) == ("Bad Request", "body.n", 400)
    # lax as pydantic: a numeric string is a number, 1 is true
    assert _chat(renderer, n="2", stream=1).request.sampling_params.n == 2
    error = _error(lambda: renderer.render_chat(b'{"model": "tiny-llama"}'))
    assert (error["type"], error["param"]) == ("Bad Request", "body.messages")
    with pytest.raises(InvalidJSONError):
        renderer.render_chat(b"{not json")


def test_a_model_validator_refusal_reads_as_vllms(renderer: Renderer) -> None:
    error = _error(lambda: _chat(renderer, stream_options={"include_usage": True}))
    assert error == {
        "message": "1 validation error:\n  {'type': 'value_error', 'loc': 'body', 'msg': 'Value error, Stream options "
                   "can only be defined when `stream=True`. (parameter=stream_options)', 'input': '<dict of 3 items>', "
                   "'ctx': {'error': VLLMValidationError('Stream options can only be defined when `stream=True`.')}}",
        "type": "Bad Request", "param": "stream_options", "code": 400}


@pytest.mark.parametrize(("fields", "message", "param"), [
    ({"top_logprobs": 2}, "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"),
    ({"prompt_logprobs": -3}, "`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs"),
    ({"tools": []}, "`tools` must not be an empty array.", "tools"),
    ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set.", "tool_choice"),
    ({"cache_salt": ""}, "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"),
    ({"continue_final_message": True, "add_generation_prompt": True},
     "Cannot set both `continue_final_message` and `add_generation_prompt`", "body"),
])
def test_request_validators(renderer: Renderer, fields: dict[str, Any], message: str, param: str) -> None:
    error = _error(lambda: _chat(renderer, **fields))
    assert (error["type"], error["param"]) == ("Bad Request", param)
    assert f"Value error, {message}" in error["message"]


def test_tool_choice_needs_a_tool_parser(renderer: Renderer) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    auto = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    assert _error(lambda: _chat(renderer, tools=tools))["message"] == auto  # tools alone mean "auto"
    assert _error(lambda: _chat(renderer, tools=tools, tool_choice="required"))["message"] == (
        'tool_choice="required" requires --tool-call-parser to be set')
    named = {"type": "function", "function": {"name": "f"}}
    assert _error(lambda: _chat(renderer, tools=tools, tool_choice=named))["message"] == (
        'tool_choice=function "f" requires --tool-call-parser to be set')
    assert _chat(renderer, tools=tools, tool_choice="none").request.token_ids


def test_request_templates_are_not_trusted(renderer: Renderer) -> None:
    message = ("Chat template is passed with request, but --trust-request-chat-template is not set. Refused request "
               "with untrusted chat template.")
    assert _error(lambda: _chat(renderer, chat_template="{{ 1 }}"))["message"] == message
    assert _error(lambda: _chat(renderer, chat_template_kwargs={"chat_template": "x"}))["message"] == message


def test_model_name_check(renderer: Renderer) -> None:
    with pytest.raises(NotFoundError):
        _chat(renderer, model="gpt-4")
    body = json.dumps({"messages": USER}).encode()  # no model: vLLM takes it
    assert renderer.render_chat(body).request.model is None


def test_beam_search_and_suffix_are_refused(renderer: Renderer) -> None:
    assert _error(lambda: _chat(renderer, use_beam_search=True))["message"] == (
        "Beam search is not supported by the render endpoint")
    body = json.dumps({"model": "tiny-llama", "prompt": "a", "suffix": "b"}).encode()
    assert _error(lambda: renderer.render_completions(body)) == {
        "message": "suffix is only supported for models with FIM completion rendering", "type": "BadRequestError",
        "param": "suffix", "code": 400}


# --- sampling params ---------------------------------------------------------------------------
def test_sampling_values_and_their_checks(renderer: Renderer) -> None:
    sp = _sampling(renderer, top_k=5, min_p=0.1, seed=-1, logprobs=True, top_logprobs=3,
                   stop=["ab", "abcd"], stop_token_ids=[7, 7, 3], logit_bias={"5": 200})
    assert (sp["top_k"], sp["min_p"], sp["logprobs"], sp["output_text_buffer_length"]) == (5, 0.1, 3, 3)
    assert "seed" not in sp  # -1 means none
    assert sp["stop_token_ids"] == [7, 3]
    assert sp["logit_bias"] == {"5": 100.0}  # clamped, keys as ids
    sp = _sampling(renderer, stop=["abcd"], include_stop_str_in_output=True, skip_special_tokens=False)
    assert sp["include_stop_str_in_output"] is True and sp["skip_special_tokens"] is False
    assert "output_text_buffer_length" not in sp
    assert _sampling(renderer, temperature=0.001)["temperature"] == 0.01
    greedy = _sampling(renderer, temperature=0, top_p=0.5, top_k=3)
    assert not {"top_p", "top_k", "min_p"} & greedy.keys()
    error = _error(lambda: _chat(renderer, temperature=3))
    assert error["message"] == "temperature must be in [0, 2], got 3.0. (parameter=temperature, value=3.0)"
    assert _error(lambda: _chat(renderer, stop=["a", ""]))["message"] == "stop cannot contain an empty string."
    assert _error(lambda: _chat(renderer, min_tokens=50, max_tokens=10))["message"] == (
        "min_tokens must be less than or equal to max_tokens=10, got 50.")


def test_the_wire_keys_follow_vllms_order(renderer: Renderer) -> None:
    sp = _sampling(renderer, n=2, top_k=4, seed=1, ignore_eos=True, max_tokens=9, min_tokens=1, logprobs=True,
                   stop="xy")
    assert list(sp) == ["n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
                        "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
                        "logprobs", "output_kind", "skip_clone", "output_text_buffer_length", "bad_words",
                        "skip_reading_prefix_cache"]


def test_generation_config_defaults(tiny_model: RenderModel) -> None:
    model = dataclasses.replace(tiny_model, default_sampling={"temperature": 0.3, "top_k": 20, "max_tokens": 50})
    sp = _sampling(Renderer(model))
    assert (sp["temperature"], sp["top_k"], sp["max_tokens"]) == (0.3, 20, 50)
    assert _sampling(Renderer(model), temperature=0.9, max_tokens=70)["temperature"] == 0.9
    assert _sampling(Renderer(model), max_tokens=70)["max_tokens"] == 70


def test_completions_max_tokens(renderer: Renderer) -> None:
    def sp(**fields: Any) -> dict[str, Any]:
        body = json.dumps({"model": "tiny-llama", "prompt": "a b", **fields}).encode()
        return json.loads(encode_generate_request(renderer.render_completions(body)[0]))["sampling_params"]

    assert "max_tokens" not in sp() and "max_tokens" not in sp(max_tokens=None)  # 16, vLLM's default
    assert sp(max_tokens=0, echo=True)["max_tokens"] == 1


def test_extra_args_carry_vllm_xargs_and_transfer_params(renderer: Renderer) -> None:
    sp = _sampling(renderer, vllm_xargs={"a": 1}, kv_transfer_params={"do_remote_decode": True})
    assert sp["extra_args"] == {"a": 1, "kv_transfer_params": {"do_remote_decode": True}}


# --- ids, reuse, reasoning ------------------------------------------------------------------------
def test_request_ids(renderer: Renderer) -> None:
    assert _chat(renderer, request_id="abc").request.request_id == "chatcmpl-abc"
    assert _chat(renderer, request_id="abc").request.request_id == "chatcmpl-abc"
    body = json.dumps({"model": "tiny-llama", "messages": USER}).encode()
    assert renderer.render_chat(body, request_id="chatcmpl-hdr").request.request_id == "chatcmpl-hdr"
    two = json.dumps({"prompt": ["a", "b"], "request_id": "r"}).encode()
    assert [g.request_id for g in renderer.render_completions(two)] == ["cmpl-r-0", "cmpl-r-1"]


def test_pd_decode_side_reuses_the_forwarded_prompt_ids(renderer: Renderer) -> None:
    rendered = _chat(renderer, kv_transfer_params={"do_remote_prefill": True, "prompt_token_ids": [1, 5, 6]})
    assert rendered.request.token_ids == [1, 5, 6]
    assert rendered.request.sampling_params.extra_args == {"kv_transfer_params": {"do_remote_prefill": True}}
    error = _error(lambda: _chat(renderer, kv_transfer_params={"prompt_token_ids": [1, 999]}))
    assert (error["message"], error["param"]) == (
        "Token id 999 is out of vocabulary (parameter=kv_transfer_params.prompt_token_ids)",
        "kv_transfer_params.prompt_token_ids")


def test_reasoning_ended_when_reasoning_is_not_wanted(renderer: Renderer) -> None:
    assert _chat(renderer).request.reasoning_ended is None
    assert _chat(renderer, include_reasoning=False).request.reasoning_ended is True


def test_the_prompt_state_is_the_rendered_prompt(renderer: Renderer, tiny_model: RenderModel) -> None:
    first = _chat(renderer)
    assert list(first.prompt.token_ids) == first.request.token_ids
    assert first.prompt.text == "<s><|user|>\nhi\n<|assistant|>\n"
    longer = USER + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    body = json.dumps({"model": "tiny-llama", "messages": longer}).encode()
    second = renderer.render_chat(body, previous=first.prompt)
    assert second.request.token_ids == tiny_model.tokenizer.encode(second.prompt.text, add_special_tokens=False).ids


# --- tokenize / detokenize ------------------------------------------------------------------------
def test_tokenize_and_detokenize(renderer: Renderer, tiny_model: RenderModel) -> None:
    answer = json.loads(renderer.tokenize(json.dumps({"model": "tiny-llama", "prompt": "hello world"}).encode()))
    ids = tiny_model.tokenizer.encode("hello world").ids
    assert answer == {"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None}
    chat = json.loads(renderer.tokenize(json.dumps({"messages": USER, "return_token_strs": True}).encode()))
    assert chat["tokens"] == _chat(renderer).request.token_ids
    assert len(chat["token_strs"]) == chat["count"]
    text = json.loads(renderer.detokenize(json.dumps({"tokens": ids}).encode()))
    assert text == {"prompt": tiny_model.tokenizer.decode(ids, skip_special_tokens=False)}
    with pytest.raises(NotFoundError):
        renderer.detokenize(json.dumps({"model": "x", "tokens": ids}).encode())
    with pytest.raises(BadRequestError):
        renderer.detokenize(json.dumps({"tokens": [-1]}).encode())


def test_token_offsets_on_request(renderer: Renderer, tiny_model: RenderModel) -> None:
    assert _chat(renderer).request.token_offsets is None
    rendered = _chat(renderer, return_token_offsets=True)
    offsets, text = rendered.request.token_offsets, rendered.prompt.text
    encoding = tiny_model.tokenizer.encode(text, add_special_tokens=False)
    assert offsets == encoding.offsets and len(offsets) == len(rendered.request.token_ids)
    assert "".join(text[s:e] for s, e in offsets if e > s).replace(" ", "") == text.replace(" ", "")
    body = json.dumps({"prompt": "hello world again", "return_token_offsets": True,
                       "truncate_prompt_tokens": 2, "truncation_side": "left"}).encode()
    wire = json.loads(encode_generate_request(renderer.render_completions(body)))[0]
    assert wire["token_offsets"] == [list(o) for o in tiny_model.tokenizer.encode("hello world again").offsets[-2:]]
    assert len(wire["token_ids"]) == 2


def test_max_tokens_can_be_written_explicitly_for_an_engine(renderer: Renderer) -> None:
    """vLLM leaves max_tokens=16 out of its JSON; its generate route reads a missing max_tokens as
    'the remaining context', so what goes to an engine can say it."""
    from rendering.generate_request import decode_generate_request

    request = _chat(renderer, max_tokens=16, temperature=0.5).request
    assert "max_tokens" not in json.loads(encode_generate_request(request))["sampling_params"]
    explicit = encode_generate_request(request, explicit_max_tokens=True)
    assert json.loads(explicit)["sampling_params"]["max_tokens"] == 16
    assert decode_generate_request(explicit) == request
    body = json.dumps({"model": "tiny-llama", "prompt": ["a", "b"]}).encode()
    both = json.loads(encode_generate_request(renderer.render_completions(body), explicit_max_tokens=True))
    assert [g["sampling_params"]["max_tokens"] for g in both] == [16, 16]
    other = _chat(renderer, max_tokens=20).request
    assert encode_generate_request(other, explicit_max_tokens=True) == encode_generate_request(other)


def test_validators_run_in_vllms_order_and_count_what_they_see(renderer: Renderer) -> None:
    # check_logprobs runs before validate_stream_options (pydantic: last defined, first run)
    error = _error(lambda: _chat(renderer, stream_options={"include_usage": True}, top_logprobs=2))
    assert error["param"] == "top_logprobs"
    # check_tool_usage ran first and added tool_choice: the message counts 5 keys for a body of 4
    tools = [{"type": "function", "function": {"name": "f"}}]
    error = _error(lambda: _chat(renderer, tools=tools, top_logprobs=2))
    assert "'input': '<dict of 5 items>'" in error["message"]
    # an empty stream_options is none to vLLM's validator
    assert _chat(renderer, stream_options={}).request.stream_options is None


def test_continue_final_message_with_the_default_generation_prompt(renderer: Renderer) -> None:
    """vLLM's validator sees only flags the body wrote; the default add_generation_prompt=true then
    meets transformers' own refusal."""
    messages = USER + [{"role": "assistant", "content": "Hel"}]
    error = _error(lambda: _chat(renderer, messages=messages, continue_final_message=True))
    assert (error["type"], error["param"]) == ("BadRequestError", None)
    assert error["message"].startswith("continue_final_message and add_generation_prompt are not compatible.")
    rendered = _chat(renderer, messages=messages, continue_final_message=True, add_generation_prompt=False)
    assert rendered.prompt.text.endswith("<|assistant|>\nHel")


def test_completions_validators(renderer: Renderer) -> None:
    def error(**fields: Any) -> dict[str, Any]:
        body = json.dumps({"model": "tiny-llama", **fields}).encode()
        return _error(lambda: renderer.render_completions(body))

    empty = error(prompt="")
    assert (empty["type"], empty["param"]) == ("Bad Request", "prompt")
    assert "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)" in empty["message"]
    assert error()["param"] == "prompt"
    assert "`logprobs` must be a positive value or -1." in error(prompt="a", logprobs=-2)["message"]
    # normalize_null_max_tokens ran before the cache salt check: max_tokens counted
    assert "'input': '<dict of 4 items>'" in error(prompt="a", cache_salt="")["message"]
    assert error(prompt=[])["message"] == "You must pass at least one prompt"

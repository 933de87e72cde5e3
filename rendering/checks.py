"""Checks vLLM's request models make while parsing a body (pydantic field bounds and model
validators), and the render-time tool-choice refusal; answered as vLLM answers them.

A failed field bound or validator is vLLM's validation handler's 400 (``RequestValidationError``,
type "Bad Request", ``"1 validation error: ..."``); the tool-choice refusal (no tool parser here) is
a plain ``BadRequestError``. ``completion_prompts`` sorts a completions ``prompt`` into its prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from contract.errors import BadRequestError
from rendering.conversation import Tool
from rendering.requests import ChatRequest, CompletionRequest, field_error, validator_error

_CORRECT_TOOL_CHOICE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def body_items(body: bytes) -> int:
    """How many top-level keys the body has (vLLM's validation message counts them)."""
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return 0
    return len(decoded) if isinstance(decoded, dict) else 0


def _validate_common(req: ChatRequest | CompletionRequest, body: bytes) -> None:
    """Field bounds and the model validators chat and completions share (vLLM's request model)."""
    if req.seed is not None and not -(2**63) <= req.seed <= 2**63 - 1:
        raise field_error("seed", f"Input should be between -2**63 and 2**63 - 1, got {req.seed}")
    if not -(2**63) <= req.priority <= 2**63 - 1:
        raise field_error("priority", f"Input should be between -2**63 and 2**63 - 1, got {req.priority}")
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens < -1:
        raise field_error("truncate_prompt_tokens", "Input should be greater than or equal to -1")
    if req.truncation_side not in (None, "left", "right"):
        raise field_error("truncation_side", "Input should be 'left' or 'right'")
    if req.stream_interval is not None and req.stream_interval < 1:
        raise field_error("stream_interval", "Input should be greater than or equal to 1")
    if req.routed_experts_prompt_start < 0:
        raise field_error("routed_experts_prompt_start", "Input should be greater than or equal to 0")
    if req.cache_salt is not None:
        if not req.cache_salt:
            raise validator_error("Parameter 'cache_salt' must be a non-empty string if provided.",
                                  parameter="cache_salt", body_items=body_items(body))
        if len(req.cache_salt) > 128 or any(c in "@/\\\x00" for c in req.cache_salt):
            raise validator_error("Parameter 'cache_salt' must be at most 128 characters and must not contain "
                                  "'@', '/', '\\\\', or NUL.", parameter="cache_salt", body_items=body_items(body))
    fmt = req.response_format
    if fmt is not None and fmt.get("type") == "json_schema" and fmt.get("json_schema") is None:
        raise validator_error("When response_format type is 'json_schema', the 'json_schema' field must be "
                              "provided.", parameter="response_format", body_items=body_items(body))
    if req.stream_options is not None and not req.stream:
        raise validator_error("Stream options can only be defined when `stream=True`.",
                              parameter="stream_options", body_items=body_items(body))
    if req.logprob_token_ids and req.use_beam_search:
        raise validator_error("`logprob_token_ids` is not supported with beam search.",
                              parameter="logprob_token_ids", body_items=body_items(body))
    if req.prompt_logprobs is not None:
        if req.stream and (req.prompt_logprobs > 0 or req.prompt_logprobs == -1):
            raise validator_error("`prompt_logprobs` are not available when `stream=True`.",
                                  parameter="prompt_logprobs", body_items=body_items(body))
        if req.prompt_logprobs < 0 and req.prompt_logprobs != -1:
            raise validator_error("`prompt_logprobs` must be a positive value or -1.", parameter="prompt_logprobs",
                                  value=req.prompt_logprobs, body_items=body_items(body))
    structured = req.structured_outputs
    if structured is not None and sum(structured.get(k) is not None for k in ("json", "regex", "choice")) > 1:
        raise validator_error("You can only use one kind of constraints for structured outputs ('json', 'regex' "
                              "or 'choice').", parameter="structured_outputs", body_items=body_items(body))


def validate_chat(chat: ChatRequest, body: bytes) -> None:
    """``ChatCompletionRequest``'s validators; settles ``tool_choice`` ("auto" when tools came alone)."""
    _validate_common(chat, body)
    if chat.reasoning_effort not in (None, "none", "minimal", "low", "medium", "high", "xhigh", "max"):
        raise field_error("reasoning_effort", "Input should be 'none', 'minimal', 'low', 'medium', 'high', "
                                              "'xhigh' or 'max'")
    if chat.logprob_token_ids and not chat.logprobs:
        raise validator_error("when using `logprob_token_ids`, `logprobs` must be set to true.",
                              parameter="logprob_token_ids", body_items=body_items(body))
    top = chat.top_logprobs
    if top is not None:
        if top < 0 and top != -1:
            raise validator_error("`top_logprobs` must be a positive value or -1.", parameter="top_logprobs",
                                  value=top, body_items=body_items(body))
        if (top == -1 or top > 0) and not chat.logprobs:
            raise validator_error("when using `top_logprobs`, `logprobs` must be set to true.",
                                  parameter="top_logprobs", body_items=body_items(body))
    _validate_tools(chat, body)
    if chat.continue_final_message and chat.add_generation_prompt:
        raise validator_error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              body_items=body_items(body))


def _validate_tools(chat: ChatRequest, body: bytes) -> None:
    if chat.tools == []:
        raise validator_error("`tools` must not be an empty array. Either provide at least one tool or omit the "
                              "field entirely.", parameter="tools", body_items=body_items(body))
    if chat.tools is not None:
        try:
            msgspec.convert(chat.tools, list[Tool])
        except msgspec.ValidationError as exc:
            text = str(exc)
            raise field_error("tools", text.split(" - at `", 1)[0]) from exc
    choice = chat.tool_choice
    if choice is msgspec.UNSET:
        chat.tool_choice = choice = "auto" if chat.tools else "none"
    if choice == "none" or choice is None:
        return
    if chat.tools is None:
        raise validator_error("When using `tool_choice`, `tools` must be set.", parameter="tool_choice",
                              body_items=body_items(body))
    if isinstance(choice, str):
        if choice not in ("auto", "required"):
            raise validator_error(f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
                                  '"required" are supported.', parameter="tool_choice", body_items=body_items(body))
        return
    function = choice.get("function")
    if not isinstance(function, dict):
        raise validator_error(f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT_TOOL_CHOICE}",
                              parameter="tool_choice.function", body_items=body_items(body))
    if "name" not in function:
        raise validator_error(f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_TOOL_CHOICE}",
                              parameter="tool_choice.function.name", body_items=body_items(body))
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise validator_error(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_TOOL_CHOICE}",
                              parameter="tool_choice.function.name", body_items=body_items(body))
    if not any((tool.get("function") or {}).get("name") == name for tool in chat.tools):
        raise validator_error("The tool specified in `tool_choice` does not match any of the specified `tools`",
                              parameter="tool_choice", body_items=body_items(body))


def validate_completion(req: CompletionRequest, body: bytes) -> None:
    _validate_common(req, body)
    if req.use_beam_search and req.echo and req.logprobs is not None:
        raise validator_error("`echo` with `logprobs` is not supported with beam search because beam search does "
                              "not compute prompt logprobs.", parameter="echo", body_items=body_items(body))


def refuse_tool_choice(chat: ChatRequest) -> None:
    """No tool parser here: "auto", "required" and named tools are refused as vLLM refuses them."""
    choice = chat.tool_choice
    if choice in (None, "none"):
        return
    if choice == "auto":
        raise BadRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    if isinstance(choice, dict):
        described = f'function "{(choice.get("function") or {}).get("name")}"'
    else:
        described = f'"{choice}"'
    raise BadRequestError(f"tool_choice={described} requires --tool-call-parser to be set")


def completion_prompts(prompt: str | list[Any] | None) -> list[str | list[int]]:
    """The prompt field's prompts: a string, strings, token ids, or lists of token ids."""
    if prompt is None:
        raise BadRequestError("You must pass at least one prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequestError("You must pass at least one prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(_is_token(p) for p in prompt):
        _check_non_negative(prompt, "prompt")
        return [prompt]
    if all(isinstance(p, list) and all(_is_token(t) for t in p) for p in prompt):
        for index, ids in enumerate(prompt):
            _check_non_negative(ids, f"prompt.{index}")
        return list(prompt)
    raise field_error("prompt", "Input should be a valid string, a list of strings, a list of token ids or a "
                                "list of lists of token ids")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_non_negative(ids: Sequence[int], path: str) -> None:
    for index, token in enumerate(ids):
        if token < 0:
            raise field_error(f"{path}.{index}", f"Input should be greater than or equal to 0, got {token}")

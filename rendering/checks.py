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
from rendering.requests import (
    ChatRequest,
    CompletionRequest,
    RequestValidationError,
    field_error,
    validator_error,
)

_CORRECT_TOOL_CHOICE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def body_items(body: bytes) -> int:
    """How many top-level keys the body has (vLLM's validation message counts them)."""
    return len(_Body(body).data)


class _Body:
    """The raw body as a dict, decoded only when a refusal's message (it counts the keys) or a test of
    what the client wrote (not what the defaults make of it) needs it."""

    __slots__ = ("_raw", "_data")

    def __init__(self, raw: bytes) -> None:
        self._raw = raw
        self._data: dict[str, Any] | None = None

    @property
    def data(self) -> dict[str, Any]:
        if self._data is None:
            try:
                decoded = msgspec.json.decode(self._raw)
            except msgspec.DecodeError:
                decoded = None
            self._data = decoded if isinstance(decoded, dict) else {}
        return self._data

    def refuse(self, message: str, *, parameter: str | None = None, value: Any = None,
               added: tuple[str, ...] = ()) -> RequestValidationError:
        """``added``: keys validators that ran before this one put into the body vLLM validates."""
        data = self.data
        count = len(data) + sum(key not in data for key in added)
        return validator_error(message, parameter=parameter, value=value, body_items=count)


# vLLM's request models run their before-validators last-defined first; the checks below follow
# that order, then the field bounds pydantic checks after them.

def check_generation_prompt(continue_final_message: bool, add_generation_prompt: bool, body: bytes) -> None:
    """Both asked for in the body (vLLM tests what was written: an absent add_generation_prompt, true
    by default, passes here and is the template's refusal later)."""
    if continue_final_message and add_generation_prompt:
        raw = _Body(body)
        if raw.data.get("continue_final_message") and raw.data.get("add_generation_prompt"):
            raise raw.refuse("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")


def validate_chat(chat: ChatRequest, body: bytes) -> None:
    """``ChatCompletionRequest``'s validators; settles ``tool_choice`` ("auto" when tools came alone)."""
    raw = _Body(body)
    check_generation_prompt(chat.continue_final_message, chat.add_generation_prompt, body)
    added = _check_tool_usage(chat, raw)
    structured = chat.structured_outputs
    if structured is not None:
        count = sum(structured.get(k) is not None for k in ("json", "regex", "choice"))
        if count > 1:
            raise raw.refuse("You can only use one kind of constraints for structured outputs ('json', 'regex' "
                             "or 'choice').", added=added)
        if count > 0 and not (isinstance(chat.tool_choice, str) and chat.tool_choice in ("none", "auto", "required")):
            raise raw.refuse("You can only either use constraints for structured outputs or tools, not both.",
                             added=added)
    if chat.logprob_token_ids and chat.use_beam_search:
        raise raw.refuse("`logprob_token_ids` is not supported with beam search.", parameter="logprob_token_ids",
                         added=added)
    if chat.logprob_token_ids and not chat.logprobs:
        raise raw.refuse("when using `logprob_token_ids`, `logprobs` must be set to true.",
                         parameter="logprob_token_ids", added=added)
    _check_prompt_logprobs(chat, raw, added)
    top = chat.top_logprobs
    if top is not None:
        if top < 0 and top != -1:
            raise raw.refuse("`top_logprobs` must be a positive value or -1.", parameter="top_logprobs", value=top,
                             added=added)
        if (top == -1 or top > 0) and not chat.logprobs:
            raise raw.refuse("when using `top_logprobs`, `logprobs` must be set to true.", parameter="top_logprobs",
                             added=added)
    _check_stream_options(chat, raw, added)
    _check_response_format(chat, raw, added)
    _check_cache_salt(chat, raw, added)
    _check_bounds(chat)
    if chat.reasoning_effort not in (None, "none", "minimal", "low", "medium", "high", "xhigh", "max"):
        raise field_error("reasoning_effort", "Input should be 'none', 'minimal', 'low', 'medium', 'high', "
                                              "'xhigh' or 'max'")
    if chat.tools is not None:
        try:
            msgspec.convert(chat.tools, list[Tool])
        except msgspec.ValidationError as exc:
            raise field_error("tools", str(exc).split(" - at `", 1)[0]) from exc


def validate_completion(req: CompletionRequest, body: bytes) -> None:
    """``CompletionRequest``'s validators (``max_tokens: null`` is already its default 16)."""
    raw = _Body(body)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not all(_is_token(p) for p in prompt) and len(prompt) > MAX_PROMPTS:
        raise raw.refuse(f"prompt list length {len(prompt)} exceeds the maximum allowed count of {MAX_PROMPTS}. "
                         "To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable.",
                         parameter="prompt")
    if (prompt is None or prompt == "") and req.prompt_embeds in (None, []):
        raise raw.refuse("Either prompt or prompt_embeds must be provided and non-empty.", parameter="prompt")
    _check_stream_options(req, raw, ())
    if req.logprob_token_ids and req.use_beam_search:
        raise raw.refuse("`logprob_token_ids` is not supported with beam search.", parameter="logprob_token_ids")
    if req.use_beam_search and req.echo and req.logprobs is not None:
        raise raw.refuse("`echo` with `logprobs` is not supported with beam search because beam search does not "
                         "compute prompt logprobs.", parameter="echo")
    if req.logprob_token_ids and req.echo and raw.data.get("max_tokens") == 0:
        raise raw.refuse("`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no "
                         "output tokens are generated.", parameter="logprob_token_ids")
    if req.logprob_token_ids and req.logprobs is None:
        raise raw.refuse("when using `logprob_token_ids`, `logprobs` must be set.", parameter="logprob_token_ids")
    _check_prompt_logprobs(req, raw, ())
    if req.logprobs is not None and req.logprobs < 0 and req.logprobs != -1:
        raise raw.refuse("`logprobs` must be a positive value or -1.", parameter="logprobs", value=req.logprobs)
    structured = req.structured_outputs
    if structured is not None and sum(structured.get(k) is not None for k in ("json", "regex", "choice")) > 1:
        raise raw.refuse("You can only use one kind of constraints for structured outputs ('json', 'regex' or "
                         "'choice').", parameter="structured_outputs")
    _check_response_format(req, raw, ())
    _check_cache_salt(req, raw, ("max_tokens",))  # normalize_null_max_tokens ran before: it sets max_tokens
    _check_bounds(req)


#: vLLM's VLLM_MAX_COMPLETION_PROMPTS default
MAX_PROMPTS = 1024


def _check_tool_usage(chat: ChatRequest, raw: _Body) -> tuple[str, ...]:
    """``check_tool_usage``; the keys it adds to the body the later validators see."""
    if chat.tools == []:
        raise raw.refuse("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                         "entirely.", parameter="tools")
    added: tuple[str, ...] = ()
    if chat.tool_choice is msgspec.UNSET:
        if chat.tools:
            chat.tool_choice, added = "auto", ("tool_choice",)
        else:
            chat.tool_choice = "none"
            return added
    choice = chat.tool_choice
    if choice == "none" or choice is None:
        return added
    if chat.tools is None:
        raise raw.refuse("When using `tool_choice`, `tools` must be set.", parameter="tool_choice")
    if isinstance(choice, str):
        if choice not in ("auto", "required"):
            raise raw.refuse(f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
                             '"required" are supported.', parameter="tool_choice")
        return added
    function = choice.get("function")
    if not isinstance(function, dict):
        raise raw.refuse(f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT_TOOL_CHOICE}",
                         parameter="tool_choice.function")
    if "name" not in function:
        raise raw.refuse(f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_TOOL_CHOICE}",
                         parameter="tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise raw.refuse(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_TOOL_CHOICE}",
                         parameter="tool_choice.function.name")
    if not any(isinstance(tool, dict) and (tool.get("function") or {}).get("name") == name for tool in chat.tools):
        raise raw.refuse("The tool specified in `tool_choice` does not match any of the specified `tools`",
                         parameter="tool_choice")
    return added


def _check_prompt_logprobs(req: ChatRequest | CompletionRequest, raw: _Body, added: tuple[str, ...]) -> None:
    value = req.prompt_logprobs
    if value is None:
        return
    if req.stream and (value > 0 or value == -1):
        raise raw.refuse("`prompt_logprobs` are not available when `stream=True`.", parameter="prompt_logprobs",
                         added=added)
    if value < 0 and value != -1:
        raise raw.refuse("`prompt_logprobs` must be a positive value or -1.", parameter="prompt_logprobs",
                         value=value, added=added)


def _check_stream_options(req: ChatRequest | CompletionRequest, raw: _Body, added: tuple[str, ...]) -> None:
    # vLLM tests what the client wrote: an empty {} is no stream options
    if req.stream_options is not None and not req.stream and raw.data.get("stream_options"):
        raise raw.refuse("Stream options can only be defined when `stream=True`.", parameter="stream_options",
                         added=added)


def _check_response_format(req: ChatRequest | CompletionRequest, raw: _Body, added: tuple[str, ...]) -> None:
    fmt = req.response_format
    if fmt is not None and fmt.get("type") == "json_schema" and fmt.get("json_schema") is None:
        raise raw.refuse("When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                         parameter="response_format", added=added)


def _check_cache_salt(req: ChatRequest | CompletionRequest, raw: _Body, added: tuple[str, ...]) -> None:
    salt = req.cache_salt
    if salt is None:
        return
    if not salt:
        raise raw.refuse("Parameter 'cache_salt' must be a non-empty string if provided.", parameter="cache_salt",
                         added=added)
    if len(salt) > 128 or any(c in "@/\\\x00" for c in salt):
        raise raw.refuse("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
                         "'\\\\', or NUL.", parameter="cache_salt", added=added)


def _check_bounds(req: ChatRequest | CompletionRequest) -> None:
    """The field bounds of vLLM's request models (checked by pydantic after the validators)."""
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

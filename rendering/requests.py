"""The client request bodies render and derender read, as msgspec Structs (decoded once per request).

``ChatRequest`` is ``/v1/chat/completions``'s body, ``CompletionRequest`` ``/v1/completions``'s: the
fields vLLM 0.32's render and answer objects use, with vLLM's types and defaults (unknown fields are
ignored, as vLLM ignores them; a body ``session_id`` is accepted and not carried).

Errors come in vLLM's two kinds. A body that does not fit the request model (a field of the wrong
type, a missing ``messages``) or that one of the model's validators refuses is answered by vLLM's
request-validation handler: 400, type ``"Bad Request"``, the message listing the errors
(``"1 validation error:\\n  {...}"``), ``param`` the field. Checks vLLM makes later, while rendering,
raise plain ``BadRequestError`` (type ``"BadRequestError"``): see ``rendering.sampling``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from contract.errors import BadRequestError, InvalidJSONError
from rendering.generate_request import StreamOptions

__all__ = ["ChatRequest", "CompletionRequest", "ContentPart", "Message", "RequestValidationError",
           "StreamOptions", "decode_chat_request", "decode_completion_request", "field_error", "validator_error",
           "vllm_validation_text"]


class RequestValidationError(BadRequestError):
    """A body vLLM's request model rejects: its validation handler's 400 (type "Bad Request")."""

    error_type = "Bad Request"


class VLLMValidationError(ValueError):
    """Named as vLLM's, so that ``repr()`` inside a validation message reads as vLLM's does."""


def vllm_validation_text(message: str, *, parameter: str | None = None, value: Any = None) -> str:
    """``message`` as vLLM's ``VLLMValidationError`` words it: ``(parameter=..., value=...)`` appended,
    each part only when given."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    return f"{message} ({', '.join(extras)})" if extras else message


def validator_error(message: str, *, parameter: str | None = None, value: Any = None,
                    body_items: int = 0) -> RequestValidationError:
    """A request-model validator's refusal, worded as vLLM's handler words it.

    vLLM raises these while pydantic parses the body, so the answer is pydantic's error list::

        1 validation error:
          {'type': 'value_error', 'loc': 'body', 'msg': 'Value error, <message> (parameter=...)',
           'input': '<dict of N items>', 'ctx': {'error': VLLMValidationError('<message>')}}
    """
    full = vllm_validation_text(message, parameter=parameter, value=value)
    entry = {"type": "value_error", "loc": "body", "msg": f"Value error, {full}",
             "input": f"<dict of {body_items} items>", "ctx": {"error": VLLMValidationError(message)}}
    return RequestValidationError(f"1 validation error:\n  {entry}", param=parameter if parameter else "body")


def field_error(path: str, problem: str) -> RequestValidationError:
    """A field that does not fit the request model (wrong type, missing): ``param`` is ``body.<path>``."""
    param = f"body.{path}" if path else "body"
    return RequestValidationError(f"1 validation error:\n  {param}: {problem}", param=param)


class ContentPart(msgspec.Struct, kw_only=True):
    """One typed part of a message's content list (``{"type": "text", "text": ...}``, ...)."""

    type: str | None = None
    text: str | None = None
    refusal: str | None = None
    thinking: str | None = None
    name: str | None = None
    image_url: Any = None


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart | str] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tools: list[dict[str, Any]] | None = None
    task: str | None = None


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields chat and completions requests share (vLLM's names, types and defaults)."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = msgspec.field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = 0
    request_id: str | None = None
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    routed_experts_prompt_start: int = 0
    #: render only: per-token (start, end) character offsets into the prompt text, in ``token_offsets``
    return_token_offsets: bool | None = False
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = None


class ChatRequest(_SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``: what render and derender read of it."""

    messages: list[Message]
    n: int | None = 1
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    #: UNSET until the body is checked: then "auto" when tools came without a choice, else "none"
    tool_choice: str | dict[str, Any] | None | msgspec.UnsetType = msgspec.UNSET
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/completions``: what render and derender read of it."""

    #: a string, a list of strings, a list of token ids or a list of those (checked by render)
    prompt: str | list[Any] | None = None
    prompt_embeds: Any = None
    n: int = 1
    echo: bool | None = False
    best_of: int | None = None
    logprobs: int | None = None
    #: ``null`` means the default, as vLLM normalizes it
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True


# lax, as pydantic's default mode: "2" is an int, 1 a bool, 2.0 an int (a mismatch is still an error)
_chat_decoder = msgspec.json.Decoder(ChatRequest, strict=False)
_completion_decoder = msgspec.json.Decoder(CompletionRequest, strict=False)


def decode_chat_request(body: bytes | str) -> ChatRequest:
    """The chat body as a ``ChatRequest``; a 400 in vLLM's shape when it is not one."""
    return _decode(_chat_decoder, body)


def decode_completion_request(body: bytes | str) -> CompletionRequest:
    """The completions body as a ``CompletionRequest``; a 400 in vLLM's shape when it is not one."""
    request: CompletionRequest = _decode(_completion_decoder, body)
    if request.max_tokens is None:
        request.max_tokens = 16
    return request


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes | str) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        path = _path_of(text)
        problem = text.split(" - at `", 1)[0]
        raise field_error(path, problem) from exc
    except msgspec.DecodeError as exc:
        raise InvalidJSONError(f"The request body is not valid JSON: {exc}") from exc


def _path_of(message: str) -> str:
    """msgspec's ``... - at `$.messages[0].role``` -> ``messages.0.role``."""
    missing = message.split("`")[1] if message.startswith("Object missing required field `") else None
    marker = " - at `$"
    at = message.rfind(marker)
    path = ""
    if at >= 0:
        path = message[at + len(marker):].rstrip("`").lstrip(".")
        path = path.replace("][", ".").replace("[", ".").replace("]", "")
    if missing:
        path = f"{path}.{missing}" if path else missing
    return path

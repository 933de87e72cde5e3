"""The client request bodies render and derender read, as msgspec Structs (decoded once per request).

``ChatRequest`` is ``/v1/chat/completions``'s body, ``CompletionRequest`` ``/v1/completions``'s: the
fields vLLM's render and the answer objects use, with vLLM's types and defaults (unknown fields are
ignored, as vLLM ignores them; a body ``session_id`` is accepted and not carried). A field of the
wrong type is a 400 naming it, as vLLM's request validation answers.
"""

from __future__ import annotations

from typing import Any

import msgspec

from contract.errors import BadRequestError, InvalidJSONError
from rendering.generate_request import StreamOptions

__all__ = ["ChatRequest", "CompletionRequest", "ContentPart", "Message", "StreamOptions",
           "decode_chat_request", "decode_completion_request"]


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content list (``{"type": "text", "text": ...}``, ...)."""

    type: str = "text"
    text: str | None = None
    refusal: str | None = None


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tools: list[dict[str, Any]] | None = None


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields chat and completions requests share (vLLM's names, types and defaults)."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    n: int | None = 1
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
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = 0
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    echo: bool = False


class ChatRequest(_SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``: what render and derender read of it."""

    messages: list[Message]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None | msgspec.UnsetType = msgspec.UNSET
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
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
    best_of: int | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True


_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def decode_chat_request(body: bytes | str) -> ChatRequest:
    """The chat body as a ``ChatRequest``; a 400 in vLLM's shape when it is not one."""
    return _decode(_chat_decoder, body)


def decode_completion_request(body: bytes | str) -> CompletionRequest:
    """The completions body as a ``CompletionRequest``; a 400 in vLLM's shape when it is not one."""
    return _decode(_completion_decoder, body)


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes | str) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequestError(f"1 validation error: {exc}", param=_param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise InvalidJSONError(f"The request body is not valid JSON: {exc}") from exc


def _param_of(message: str) -> str | None:
    """``Expected `int`, got `str` - at `$.n`` -> ``n`` (the field a client got wrong)."""
    marker = " - at `$."
    at = message.rfind(marker)
    if at < 0:
        if message.startswith("Object missing required field `"):
            return message.split("`")[1]
        return None
    path = message[at + len(marker):].rstrip("`")
    return path.replace("][", ".").replace("[", ".").replace("]", "")

"""The OpenAI answer objects exactly as vLLM 0.32's chat/completions routes serialize them.

Whole answers (``chat.completion``, ``text_completion``) carry every key, nulls included, in
vLLM's order (the golden ``derender_chat.jsonl`` answers are this shape). Stream chunks are
what vLLM writes with pydantic's ``exclude_unset=True``: only the fields its code set, so a key
typed with ``UnsetType`` here appears only when given. vLLM's own stream shapes:

- chat, first event per choice: ``delta: {"role": "assistant", "content": ""}``, ``logprobs``
  and ``finish_reason`` null, ``prompt_token_ids`` (null unless ``return_token_ids``) and
  ``prompt_text`` (null) at the top; then ``delta: {"content": ...}`` with ``token_ids`` (null unless
  ``return_token_ids``); the last event of a choice adds ``finish_reason`` and
  ``stop_reason``; one event per choice and engine step;
- completions: every event has ``text``, ``logprobs``, ``finish_reason``, ``stop_reason``,
  ``prompt_token_ids`` and ``token_ids``; no role event;
- with ``stream_options.include_usage`` a last event with ``choices: []`` and the usage
  (nulls left out); with ``continuous_usage_stats`` every event carries the usage so far;
- ``system_fingerprint`` (when the server has one) on the usage event, else on each choice's
  last event;
- ``data: [DONE]`` ends every stream.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

from rendering.generate_response import PromptTokensDetails

# ---- usage -----------------------------------------------------------------------------------


class UsageInfo(Struct, kw_only=True):
    """``usage`` of a whole answer (vLLM's ``UsageInfo``, every key)."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: dict[str, Any] | None = None


class StreamUsage(Struct, kw_only=True):
    """``usage`` of a stream event: what vLLM set (the last event leaves the nulls out; a chat
    event's continuous usage carries ``completion_tokens_details: null``)."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET
    completion_tokens_details: dict[str, Any] | None | UnsetType = UNSET


# ---- chat.completion -------------------------------------------------------------------------


class ChatMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None
    reasoning: str | None = None


class ChatCompletionChoice(Struct, kw_only=True):
    index: int
    message: ChatMessage
    logprobs: Any = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_logprobs: Any = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: Any = None


# ---- chat.completion.chunk -------------------------------------------------------------------


class DeltaMessage(Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatStreamChoice(Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None | UnsetType = UNSET
    token_ids: list[int] | None | UnsetType = UNSET


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: StreamUsage | UnsetType = UNSET
    system_fingerprint: str | UnsetType = UNSET
    prompt_token_ids: list[int] | None | UnsetType = UNSET
    prompt_text: str | None | UnsetType = UNSET


# ---- text_completion -------------------------------------------------------------------------


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: Any = None
    prompt_token_ids: list[int] | None = None
    routed_experts: str | None = None


class CompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: Any = None


class CompletionStreamChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: StreamUsage | UnsetType = UNSET
    system_fingerprint: str | UnsetType = UNSET
    metrics: Any = UNSET


# ---- SSE ---------------------------------------------------------------------------------------

#: the event that ends every stream
DONE_EVENT = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()
encode = _encoder.encode


def sse_event(obj: Any) -> bytes:
    """``data: <json>\\n\\n`` for one stream object."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


#: decoders for clients and tests (the router itself only encodes these)
chat_completion_decoder = msgspec.json.Decoder(ChatCompletionResponse)
completion_decoder = msgspec.json.Decoder(CompletionResponse)

"""Request and response bodies of session-backend's HTTP API, as msgspec Structs.

Request structs ignore unknown fields (as vLLM does); a wrong type is a msgspec
``ValidationError`` that the server turns into a 400 naming the field. ``session_id`` is typed
``Any`` on purpose: the session contract (``contract.session``) decides what a non-string value
means (a 400 with its own message). Response structs mirror vLLM's JSON; fields typed with
``UnsetType`` appear only when set (e.g. ``token_ids`` with ``return_token_ids``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

# ---------------------------------------------------------------------------------------------
# requests


class StreamOptions(Struct):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ContentPart(Struct):
    type: str = "text"
    text: str | None = None


class ChatMessage(Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _OpenAISampling(Struct):
    """Fields shared by the completion and chat requests."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None  # accepted and ignored
    return_token_ids: bool | None = None
    request_id: str | None = None
    session_id: Any = None
    vllm_xargs: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    user: str | None = None


class CompletionRequest(_OpenAISampling):
    #: a string, or a list of: one string, token ids, or one list of token ids
    prompt: str | list[Any] | None = None
    max_tokens: int | None = 16
    echo: bool = False


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


# ---------------------------------------------------------------------------------------------
# responses


class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_token_ids: list[int] | None | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    object: str = "text_completion"
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    system_fingerprint: str | None = None
    usage: Usage | None | UnsetType = UNSET


class AssistantMessage(Struct):
    content: str
    role: str = "assistant"
    tool_calls: list[Any] = msgspec.field(default_factory=list)
    reasoning_content: None = None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None
    object: str = "chat.completion"
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None | UnsetType = UNSET
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionStreamResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None
    usage: Usage | None | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET


# ---- misc -------------------------------------------------------------------------------------


class ModelCard(Struct):
    id: str
    created: int
    root: str
    max_model_len: int
    object: str = "model"
    owned_by: str = "vllm"
    parent: str | None = None
    permission: list[Any] = msgspec.field(default_factory=list)


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class SessionEntry(Struct):
    session_id: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int


class SessionList(Struct):
    data: list[SessionEntry]
    object: str = "list"
    limit: int = 0
    max_tracked_sessions: int = 0

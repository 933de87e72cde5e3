"""The bodies of session-backend's own endpoints (``/v1/models``, ``/v1/sessions``) as msgspec Structs.

The OpenAI request and answer shapes are ``rendering/``'s (``rendering.requests``,
``rendering.openai_objects``, ``rendering.responses_objects``): one implementation for the router and
the backends.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

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

"""What the engine core hands back to the HTTP frontend, step by step."""

from __future__ import annotations

from typing import Any

import msgspec


class CompletionDelta(msgspec.Struct):
    """New tokens of one sequence (child ``index`` of an n > 1 request) in one engine step."""

    index: int
    token_ids: list[int]
    #: "stop" | "length" | "abort" once this sequence has finished, else None
    finish_reason: str | None = None
    #: the stop token id that ended the sequence, when one did
    stop_reason: int | str | None = None


class RequestOutput(msgspec.Struct):
    """One step's progress of one EngineCoreRequest (all its child sequences)."""

    request_id: str
    deltas: list[CompletionDelta]
    #: every child sequence has finished
    finished: bool
    num_prompt_tokens: int
    #: prompt tokens that were not computed here (local prefix-cache hits, plus tokens pulled
    #: from a remote prefill instance); reported as usage.prompt_tokens_details.cached_tokens
    num_cached_tokens: int
    #: set on the final output of a prefill-role request finished for remote decode (P/D)
    kv_transfer_params: dict[str, Any] | None = None

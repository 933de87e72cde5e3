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


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Engine options (CLI flags of ``session-backend``)."""

    model: str = "session-sim"
    #: "both" | "prefill" | "decode"
    role: str = "both"
    block_size: int = 16
    num_blocks: int = 4096
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    #: latency-model scale: 1 = a small model on one GPU, 0 = no sleeping
    speed: float = 1.0
    #: generated ids are drawn from [gen_token_min, gen_token_max); eos ends a sequence early
    gen_token_min: int = 3
    gen_token_max: int = 1000
    eos_token_id: int = 2
    #: per-session accounting table bound (most recently active kept)
    max_tracked_sessions: int = 10000
    #: per-session Prometheus series are kept for this many most recently active sessions
    session_metrics_top_k: int = 50
    engine_index: int = 0
    #: per-token probability that a sequence ends with eos_token_id (unless ignore_eos)
    eos_probability: float = 0.01
    #: P/D: this engine's id in kv_transfer_params (empty: "<model>-engine-<engine_index>")
    kv_engine_id: str = ""
    #: P/D: side-channel address reported as remote_host/remote_port (set by the server)
    kv_host: str | None = None
    kv_port: int | None = None
    #: P/D: held blocks of a prefill-role request are freed after this long if never pulled
    kv_hold_timeout_s: float = 480.0
    #: P/D: a request over this many blocks is not held for remote decode (0 = only the total bound)
    kv_hold_max_blocks: int = 0
    #: P/D: all holds together stay within this fraction of num_blocks (oldest freed first)
    kv_hold_max_fraction: float = 0.5

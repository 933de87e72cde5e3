"""``EngineConfig``: the engine's options (the CLI flags of ``session-backend``)."""

from __future__ import annotations

import msgspec


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
    #: when set, generated ids are drawn from this list instead (the model's readable word ids,
    #: ``backends.vocabulary``); the range above is then ignored
    gen_token_ids: tuple[int, ...] | None = None
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

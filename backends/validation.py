"""The engine's checks of a generation request's sampling values, and the ``EngineCoreRequest`` they become.

Sampling values (``n`` within ``max_num_seqs``, temperature, top_p, top_k, min/max tokens, stops): a bad
value is a 400 (the text routes' requests were checked by ``rendering.render`` before, with vLLM's
render messages; the tokens-in route's come straight from the client). ``engine_request`` builds the
request that crosses the wire boundary into the engine.
"""

from __future__ import annotations

import time
from typing import Any

from backends.engine.config import EngineConfig
from backends.engine.request import EngineCoreRequest, SamplingParams
from backends.frontend import Frontend
from contract.errors import BadRequestError

#: vLLM's RequestOutputKind.DELTA: each output carries only the new tokens
OUTPUT_KIND_DELTA = 1
#: vLLM's RequestOutputKind.FINAL_ONLY: one output when the request finishes (non-streaming)
OUTPUT_KIND_FINAL_ONLY = 2


def sampling_params(
    config: EngineConfig,
    *,
    n: int = 1,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    max_tokens: int,
    min_tokens: int = 0,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    kv_transfer_params: dict[str, Any] | None = None,
    final_only: bool = False,
    extra_args: dict[str, Any] | None = None,
) -> SamplingParams:
    """Validate sampling values (400 on a bad one) and build the engine's SamplingParams.

    ``extra_args``: the request's ``vllm_xargs`` (the engine reads e.g. ``kv_cache_report_mode``), as
    vLLM passes them; its ``kv_transfer_params`` entry is replaced by ``kv_transfer_params``."""
    if n < 1:
        raise BadRequestError(f"n must be at least 1, got {n}.", param="n")
    if n > config.max_num_seqs:
        raise BadRequestError(
            f"n must be at most max_num_seqs ({config.max_num_seqs}), got {n}.", param="n"
        )
    if temperature is None:
        temperature = 1.0
    elif temperature < 0:
        raise BadRequestError(f"temperature must be non-negative, got {temperature}.", param="temperature")
    if top_p is None:
        top_p = 1.0
    elif not 0.0 < top_p <= 1.0:
        raise BadRequestError(f"top_p must be in (0, 1], got {top_p}.", param="top_p")
    if top_k is None:
        top_k = 0
    elif top_k < -1:
        raise BadRequestError(f"top_k must be -1 (disable), 0 or at least 1, got {top_k}.", param="top_k")
    if min_tokens < 0:
        raise BadRequestError(f"min_tokens must be non-negative, got {min_tokens}.", param="min_tokens")
    if min_tokens > max_tokens:
        raise BadRequestError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            param="min_tokens",
        )
    if stop_token_ids and any(t < 0 for t in stop_token_ids):
        raise BadRequestError("stop_token_ids must be non-negative.", param="stop_token_ids")
    if stop is not None and any(not s for s in stop):
        raise BadRequestError("stop strings must not be empty.", param="stop")
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    if extra_args:
        extra = {k: v for k, v in extra_args.items() if k != "kv_transfer_params"} | (extra or {}) or None
    return SamplingParams(
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=stop or None,
        stop_token_ids=stop_token_ids or None,
        ignore_eos=ignore_eos,
        # stop strings are applied here, token by token, so they need every step's delta
        output_kind=OUTPUT_KIND_FINAL_ONLY if final_only and not stop else OUTPUT_KIND_DELTA,
        extra_args=extra,
    )


def engine_request(
    fe: Frontend,
    *,
    external_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    session_id: str | None,
    cache_salt: str | None = None,
    priority: int = 0,
) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=fe.engine_request_id(external_id),
        prompt_token_ids=prompt_ids,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=cache_salt,
        data_parallel_rank=None,
        priority=priority,
        external_req_id=external_id,
        session_id=session_id,
    )

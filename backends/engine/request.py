"""The engine core's wire contract: ``EngineCoreRequest`` in vLLM 0.32.0's field order.

The struct is encoded as a msgpack *array* (``array_like=True``), so the field order is the
wire contract: never reorder, never insert in the middle; a new field is appended at the end
with a default. Positions 0-8 are required; ``session_id`` (PR #48048) sits at 20 and
``kv_hints`` at 21. ``forbid_unknown_fields`` stays off so that a newer peer's extra trailing
elements are skipped, and an older peer's missing trailing fields take their defaults.

``SamplingParams`` is nested as a msgpack *map* (not array_like), as in vLLM, so peers may
add or drop sampling keys freely.
"""

from __future__ import annotations

from typing import Any

import msgspec

#: request-type frame that precedes an ADD message on vLLM's ZMQ socket
REQUEST_TYPE_ADD = b"\x00"
REQUEST_TYPE_ABORT = b"\x01"


class SamplingParams(msgspec.Struct, omit_defaults=True, dict=True):
    """The subset of vLLM's SamplingParams the simulated engine honours (a msgpack map)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    detokenize: bool = True
    #: 0 = cumulative, 1 = delta, 2 = final only (vLLM's RequestOutputKind values)
    output_kind: int = 0
    extra_args: dict[str, Any] | None = None


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    # 0-8: required
    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: list[Any] | None
    sampling_params: SamplingParams | None
    pooling_params: Any | None
    arrival_time: float
    lora_request: Any | None
    cache_salt: str | None
    data_parallel_rank: int | None
    # 9-21: defaulted
    prompt_embeds: Any | None = None
    prompt_is_token_ids: list[bool] | None = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: dict[str, str] | None = None
    resumable: bool = False
    external_req_id: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    abort_immediately: bool = False
    session_id: str | None = None  # 20: PR #48048
    kv_hints: Any | None = None  # 21: appended after session_id
    # Private fields of ours would go here, after kv_hints, never before.


#: number of positions on the wire; a test pins it
WIRE_FIELD_COUNT = 22
SESSION_ID_POSITION = 20

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)


def encode_request(request: EngineCoreRequest) -> bytes:
    """Serialise ``request`` to the msgpack bytes that cross the frontend/core boundary."""
    return _encoder.encode(request)


def decode_request(data: bytes) -> EngineCoreRequest:
    """Parse msgpack bytes from any compatible peer (older or newer field count)."""
    return _decoder.decode(data)

"""What an engine's ``POST /inference/v1/generate`` answers (vLLM 0.32, ``output_mode: "tokens"``).

Non-stream: one ``GenerateResponse``. Stream: SSE events ``data: <GenerateStreamChunk>`` (one per
engine step, ``token_ids`` being the step's new ids), a usage-only chunk with ``choices: []``
when ``stream_options.include_usage`` is set, ``data: {"error": {...}}`` for an error, and
``data: [DONE]``. Decoding ignores fields it does not know (as pydantic does in vLLM), so an
engine newer than these Structs still decodes, and fills what an older one leaves out.

Encoding writes what vLLM 0.32's ``ServingTokens`` writes, keys in its order: the whole answer is
its full ``model_dump()`` (every key, nulls included); a stream event leaves out
``prompt_token_ids`` / ``mm_placeholders`` / ``metrics`` unless set (``UnsetType`` here); the
usage-only last event leaves out every null (``encode_stream_chunk`` does that); ``text`` appears
only with ``output_mode: "text"``.

The backends encode with these Structs and the router decodes with them: one implementation.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

from contract.errors import UpstreamProtocolError


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class GenerateUsage(Struct, kw_only=True):
    """vLLM's ``UsageInfo`` as the generate route writes it."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None | UnsetType = None
    completion_tokens_details: dict[str, Any] | None | UnsetType = None


class GenerateLogProb(Struct, kw_only=True):
    """One (token id, logprob) candidate: the generate server has no tokenizer."""

    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb, kw_only=True):
    """The sampled token at one position, then its top-k candidates in the engine's order."""

    top_logprobs: list[GenerateLogProb] = msgspec.field(default_factory=list)


class GenerateLogProbs(Struct):
    content: list[GenerateLogProbsContent] | None = None


class GenerateChoice(Struct, kw_only=True):
    """One choice of a non-stream answer. ``token_ids`` keeps every generated id."""

    index: int
    #: vLLM's default when the engine leaves it out ("per OpenAI spec")
    finish_reason: str | None = "stop"
    #: the stop token id (``stop_token_ids``) or stop string that ended the choice; None for EOS
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[Any] | None = None
    #: only with ``output_mode: "text"``
    text: str | UnsetType = UNSET
    logprobs: GenerateLogProbs | None = None


class GenerateResponse(Struct, kw_only=True):
    """The non-stream answer of ``/inference/v1/generate``."""

    request_id: str
    model: str | None = None
    created: int | None = None
    usage: GenerateUsage | None = None
    prompt_logprobs: Any = None
    prompt_token_id_logprobs: str | None = None
    #: set with ``return_token_ids``
    prompt_token_ids: list[int] | None | UnsetType = None
    mm_placeholders: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None | UnsetType = None
    output_mode: str = "tokens"
    choices: list[GenerateChoice] = msgspec.field(default_factory=list)


class GenerateStreamChoice(Struct, kw_only=True):
    """One choice of one stream step: ``token_ids`` are the step's new ids only."""

    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None | UnsetType = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    #: set on the final chunk only
    weight_versions: list[Any] | None = None
    text: str | UnsetType = UNSET
    logprobs: GenerateLogProbs | None = None


class StreamError(Struct, kw_only=True):
    """The ``error`` object of an error event (vLLM's error shape; every field optional)."""

    message: str = ""
    type: str | None = None
    param: str | None = None
    code: int | None = None


class GenerateStreamChunk(Struct, kw_only=True):
    """One ``data:`` object of a generate stream: a step, the usage-only chunk, or an error."""

    request_id: str | UnsetType = UNSET
    usage: GenerateUsage | None = None
    #: only on the first chunk, with ``return_token_ids``
    prompt_token_ids: list[int] | None | UnsetType = UNSET
    mm_placeholders: dict[str, Any] | None | UnsetType = UNSET
    metrics: dict[str, Any] | None | UnsetType = UNSET
    #: not in vLLM's stream events; read when an engine sends it (P/D hand-off on a stream)
    kv_transfer_params: dict[str, Any] | None | UnsetType = UNSET
    output_mode: str = "tokens"
    choices: list[GenerateStreamChoice] = msgspec.field(default_factory=list)
    #: set on an error event (``data: {"error": {...}}``); nothing else is then
    error: StreamError | UnsetType = UNSET


#: the payload of the stream's last event, ``data: [DONE]``
STREAM_DONE = b"[DONE]"


class RunningStep(Struct):
    """The one choice of a stream event that only carries new token ids (``running_steps``)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: Any = None


class _RunningEvent(Struct):
    """The fields that tell a running step from the other events; the rest is skipped unread."""

    choices: list[RunningStep] = []
    usage: Any = None
    error: Any = UNSET


_response_decoder = msgspec.json.Decoder(GenerateResponse)
_chunk_decoder = msgspec.json.Decoder(GenerateStreamChunk)
_running_decoder = msgspec.json.Decoder(_RunningEvent)
_encoder = msgspec.json.Encoder()


def decode_generate_response(body: bytes | bytearray | memoryview) -> GenerateResponse:
    """Decode a non-stream generate answer; a body that is not one is an upstream fault."""
    try:
        return _response_decoder.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise UpstreamProtocolError(f"the engine's generate answer is not valid: {exc}") from None


def decode_stream_chunk(data: bytes | bytearray | memoryview) -> GenerateStreamChunk:
    """Decode one SSE ``data:`` payload (without the ``data: `` prefix; not ``[DONE]``)."""
    try:
        return _chunk_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise UpstreamProtocolError(f"the engine's generate stream event is not valid: {exc}") from None


def running_steps(datas: list[bytes]) -> list[RunningStep]:
    """The choices of the leading events of ``datas`` (SSE ``data`` payloads, in order) that are each one
    running step of the same choice with new token ids and nothing else (no end, no logprobs, no usage,
    no error): the bulk of a stream, decoded lean. Stops at the first other event (another choice's
    step too), and at one that does not decode here (``decode_stream_chunk`` then reads it in full, or
    reports it)."""
    steps: list[RunningStep] = []
    decode = _running_decoder.decode
    for data in datas:
        try:
            event = decode(data)
        except msgspec.DecodeError:  # [DONE] too
            break
        choices = event.choices
        if len(choices) != 1 or event.usage is not None or event.error is not UNSET:
            break
        step = choices[0]
        if step.finish_reason is not None or step.logprobs is not None or not step.token_ids:
            break
        if steps and step.index != steps[0].index:
            break
        steps.append(step)
    return steps


def encode_generate_response(response: GenerateResponse) -> bytes:
    """The JSON body of a non-stream generate answer."""
    return _encoder.encode(response)


def encode_stream_chunk(chunk: GenerateStreamChunk) -> bytes:
    """One SSE event ``data: {...}\\n\\n`` of a generate stream.

    The usage-only last event (no choices) is written as vLLM writes it, without nulls.
    """
    if not chunk.choices and chunk.usage is not None:
        usage = chunk.usage
        chunk = msgspec.structs.replace(chunk, usage=msgspec.structs.replace(
            usage,
            prompt_tokens_details=UNSET if usage.prompt_tokens_details is None else usage.prompt_tokens_details,
            completion_tokens_details=(UNSET if usage.completion_tokens_details is None
                                       else usage.completion_tokens_details),
        ))
    return b"data: " + _encoder.encode(chunk) + b"\n\n"


#: the event that ends every generate stream
STREAM_DONE_EVENT = b"data: [DONE]\n\n"

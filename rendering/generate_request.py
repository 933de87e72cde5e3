"""``GenerateRequest``: what a render produces and ``/inference/v1/generate`` takes, byte for byte.

The JSON is the one vLLM 0.32's render server answers (golden cases in tests/rendering/data): the
same keys in the same order. ``GenerateRequest`` writes every field (vLLM's is a pydantic model
dumped whole). ``SamplingParams`` is, as vLLM's own, a msgspec Struct with ``omit_defaults``: a
field is left out when it holds its default *object* (msgspec compares by identity). That is why
vLLM's answers always carry ``presence_penalty: 0.0`` (a float made per request) but never
``top_k: 0`` (the cached small int) or ``n: 1``, and drop ``top_p``/``min_p`` under greedy sampling
(reset to the defaults). ``rendering.sampling`` builds the values the same way, so our bytes match.

``decode_generate_request`` reads one (the backends' generate route, the remote-render client).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

#: ``output_kind`` values (vLLM's ``RequestOutputKind``)
OUTPUT_CUMULATIVE = 0
OUTPUT_DELTA = 1
OUTPUT_FINAL_ONLY = 2
#: ``SamplingParams.max_tokens``'s default (a JSON without ``max_tokens`` means it to a decoder)
DEFAULT_MAX_TOKENS = 16


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's ``SamplingParams`` as JSON: its field order and defaults (private fields are not sent)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    watermarking: bool | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprob_token_ids: list[int] | None = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: int = OUTPUT_CUMULATIVE
    stream_interval: int | None = None
    skip_clone: bool = False
    output_text_buffer_length: int = 0
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: dict[str, Any] | None = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (a client of the generate route may send a string or nothing)."""
        stop = self.stop
        if stop is None:
            return []
        return [stop] if isinstance(stop, str) else stop


class StreamOptions(msgspec.Struct, kw_only=True):
    """vLLM's ``StreamOptions`` (both fields are always written)."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def random_id() -> str:
    """16 hex digits, as vLLM 0.32's ``random_uuid`` (the low 64 bits of a uuid4)."""
    return f"{uuid.uuid4().int & 0xFFFF_FFFF_FFFF_FFFF:016x}"


class GenerateRequest(msgspec.Struct, kw_only=True):
    """The body of ``POST /inference/v1/generate`` (and of a render server's chat answer)."""

    request_id: str = msgspec.field(default_factory=random_id)
    token_ids: list[int]
    token_offsets: Any = None
    features: Any = None
    content_parts: Any = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    output_mode: str = "tokens"
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


_request_decoder = msgspec.json.Decoder(GenerateRequest)
_list_decoder = msgspec.json.Decoder(list[GenerateRequest])
_encoder = msgspec.json.Encoder()


def decode_generate_request(body: bytes | str) -> GenerateRequest:
    """One ``GenerateRequest`` from JSON; ``msgspec.ValidationError``/``DecodeError`` when it is not one."""
    return _request_decoder.decode(body)


def decode_generate_requests(body: bytes | str) -> list[GenerateRequest]:
    """A completions render answer: a JSON list of ``GenerateRequest``."""
    return _list_decoder.decode(body)


def encode_generate_request(
    request: GenerateRequest | list[GenerateRequest], *, explicit_max_tokens: bool = False
) -> bytes:
    """The JSON bytes vLLM's render server would answer for ``request`` (or a list of them).

    ``explicit_max_tokens``: write ``max_tokens`` even when it is 16, the default vLLM's JSON leaves
    out. vLLM 0.32's ``/inference/v1/generate`` (and our backends' route, which follows it) gives a
    request without ``max_tokens`` the whole remaining context, so a render answer for a client
    that asked for 16 tokens (or a completions request that left it at its default 16) generates far
    more once sent to an engine as it is. A coordinator sending its own renders to engines sets it.
    """
    if explicit_max_tokens:
        if isinstance(request, list):
            request = [_with_max_tokens(one) for one in request]
        else:
            request = _with_max_tokens(request)
    return _encoder.encode(request)


def _with_max_tokens(request: GenerateRequest) -> GenerateRequest:
    params = request.sampling_params
    if params.max_tokens != DEFAULT_MAX_TOKENS:
        return request  # written anyway
    encoded = _encoder.encode(params)
    body = b'{"max_tokens":%d' % params.max_tokens + (b"," + encoded[1:] if encoded != b"{}" else b"}")
    # the encoder writes a Raw value as it is: the same request with these sampling_params bytes
    return msgspec.structs.replace(request, sampling_params=msgspec.Raw(body))  # type: ignore[arg-type]

"""A client body's sampling fields -> the engine's ``SamplingParams``, with vLLM's defaults and checks.

As vLLM 0.32's render builds them (``to_sampling_params`` + ``SamplingParams.from_optional`` +
``__post_init__`` + ``_verify_args``): unset fields take the model's generation_config defaults,
then vLLM's; ``stop`` becomes a list and, unless ``include_stop_str_in_output``,
``output_text_buffer_length`` is the longest stop string's length - 1 (what a streaming
detokenizer holds back); greedy sampling (temperature < 1e-5) resets ``top_p``/``top_k``/``min_p``
and refuses ``n > 1``; ``output_kind`` is DELTA when streaming, FINAL_ONLY otherwise;
``skip_clone`` is set. Bad values raise ``BadRequestError`` with vLLM's message
(``... (parameter=x, value=y)``) and ``param``.

Which fields appear in the JSON follows from which values are passed (see ``generate_request``):
the ones vLLM always writes are always passed here as values made per request; the others are
passed only when vLLM's would differ from the default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from contract.errors import BadRequestError
from rendering.generate_request import OUTPUT_DELTA, OUTPUT_FINAL_ONLY, SamplingParams
from rendering.requests import ChatRequest, CompletionRequest, vllm_validation_text

_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2
#: vLLM's VLLM_MAX_N_SEQUENCES default
MAX_N_SEQUENCES = 16384

#: vLLM's defaults for fields a client left unset (after generation_config's), in its order
_DEFAULTS: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}
_REPETITION, _PRESENCE, _FREQUENCY, _TEMPERATURE, _TOP_P, _TOP_K, _MIN_P = _DEFAULTS.values()
#: StructuredOutputsParams' public fields, in its order (vLLM writes them all)
_STRUCTURED_FIELDS: dict[str, Any] = {
    "json": None, "regex": None, "choice": None, "grammar": None, "json_object": None,
    "disable_any_whitespace": False, "disable_additional_properties": False,
    "whitespace_pattern": None, "structural_tag": None,
}


def validation_error(message: str, *, parameter: str | None = None, value: Any = None) -> BadRequestError:
    """vLLM's ``VLLMValidationError`` as a 400: the message ends with ``(parameter=..., value=...)``."""
    return BadRequestError(vllm_validation_text(message, parameter=parameter, value=value), param=parameter)


def chat_sampling_params(chat: ChatRequest, *, max_tokens: int, defaults: Mapping[str, Any]) -> SamplingParams:
    """``ChatCompletionRequest.to_sampling_params`` for ``chat`` with the computed ``max_tokens``."""
    prompt_logprobs = chat.prompt_logprobs
    if prompt_logprobs is None and chat.echo:
        prompt_logprobs = chat.top_logprobs
    logprobs = chat.top_logprobs if chat.logprobs and not chat.logprob_token_ids else None
    return _build(chat, n=1 if chat.n is None else chat.n, max_tokens=max_tokens, defaults=defaults,
                  logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def completion_sampling_params(
    request: CompletionRequest, *, max_tokens: int, defaults: Mapping[str, Any]
) -> SamplingParams:
    """``CompletionRequest.to_sampling_params`` for ``request`` with the computed ``max_tokens``."""
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and request.echo:
        prompt_logprobs = request.logprobs
    if request.echo and request.max_tokens == 0:  # echo without generation still samples one token
        max_tokens = 1
    return _build(request, n=request.n, max_tokens=max_tokens, defaults=defaults,
                  logprobs=None if request.logprob_token_ids else request.logprobs,
                  prompt_logprobs=prompt_logprobs)


def _build(
    req: ChatRequest | CompletionRequest,
    *,
    n: int,
    max_tokens: int,
    defaults: Mapping[str, Any],
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    # each unset field: generation_config's default, else vLLM's (the _DEFAULTS objects themselves)
    repetition_penalty = req.repetition_penalty
    if repetition_penalty is None:
        repetition_penalty = defaults.get("repetition_penalty", _REPETITION)
    presence_penalty = req.presence_penalty
    if presence_penalty is None:
        presence_penalty = defaults.get("presence_penalty", _PRESENCE)
    frequency_penalty = req.frequency_penalty
    if frequency_penalty is None:
        frequency_penalty = defaults.get("frequency_penalty", _FREQUENCY)
    temperature = req.temperature
    if temperature is None:
        temperature = defaults.get("temperature", _TEMPERATURE)
    top_p = req.top_p
    if top_p is None:
        top_p = defaults.get("top_p", _TOP_P)
    top_k = req.top_k
    if top_k is None:
        top_k = defaults.get("top_k", _TOP_K)
    min_p = req.min_p
    if min_p is None:
        min_p = defaults.get("min_p", _MIN_P)
    if 0 < temperature < _MAX_TEMP:
        temperature = _MAX_TEMP
    seed = None if req.seed == -1 else req.seed
    thinking_budget = _thinking_budget(req.thinking_token_budget)

    stop = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else list(req.stop)
    stop_token_ids = list(dict.fromkeys(_stop_token_ids(req.stop_token_ids, defaults)))
    bad_words = list(dict.fromkeys(req.bad_words))
    logit_bias = _logit_bias(req.logit_bias) if req.logit_bias is not None else None
    extra_args: dict[str, Any] = dict(req.vllm_xargs) if req.vllm_xargs else {}
    if req.kv_transfer_params:
        extra_args["kv_transfer_params"] = req.kv_transfer_params
    if req.ec_transfer_params:
        extra_args["ec_transfer_params"] = req.ec_transfer_params

    _verify(n=n, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty, temperature=temperature, top_p=top_p,
            top_k=top_k, min_p=min_p, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stream_interval=req.stream_interval, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            stop=stop, bad_words=bad_words, extra_args=extra_args)
    greedy = temperature < _SAMPLING_EPS
    if greedy and n > 1:
        raise validation_error(f"n must be 1 when using greedy sampling, got {n}.")

    fields: dict[str, Any] = {
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "repetition_penalty": repetition_penalty,
        "temperature": temperature,
        "stop": stop,
        "stop_token_ids": stop_token_ids,
        "output_kind": OUTPUT_DELTA if req.stream else OUTPUT_FINAL_ONLY,
        "skip_clone": True,
        "bad_words": bad_words,
        "skip_reading_prefix_cache": prompt_logprobs is not None,
    }
    # the rest only when it differs from vLLM's default (vLLM's JSON leaves the defaults out)
    if n != 1:
        fields["n"] = n
    if req.watermarking is not None:
        fields["watermarking"] = req.watermarking
    if not greedy:  # greedy sampling resets these to the defaults
        fields["top_p"] = top_p
        fields["min_p"] = min_p
        if top_k != 0:
            fields["top_k"] = top_k
    if seed is not None:
        fields["seed"] = seed
    if req.ignore_eos:
        fields["ignore_eos"] = True
    if max_tokens != 16:
        fields["max_tokens"] = max_tokens
    if req.min_tokens:
        fields["min_tokens"] = req.min_tokens
    if logprobs is not None:
        fields["logprobs"] = 1 if logprobs is True else logprobs
    if prompt_logprobs is not None:
        fields["prompt_logprobs"] = 1 if prompt_logprobs is True else prompt_logprobs
    if req.logprob_token_ids:
        fields["logprob_token_ids"] = list(req.logprob_token_ids)
    if not req.skip_special_tokens:
        fields["skip_special_tokens"] = False
    if not req.spaces_between_special_tokens:
        fields["spaces_between_special_tokens"] = False
    if req.include_stop_str_in_output:
        fields["include_stop_str_in_output"] = True
    elif stop:
        buffer = max(len(s) for s in stop) - 1
        if buffer:
            fields["output_text_buffer_length"] = buffer
    if req.stream_interval is not None:
        fields["stream_interval"] = req.stream_interval
    structured = _structured_outputs(req)
    if structured is not None:
        fields["structured_outputs"] = structured
    if logit_bias is not None:
        fields["logit_bias"] = logit_bias
    if req.allowed_token_ids is not None:
        fields["allowed_token_ids"] = list(req.allowed_token_ids)
    if extra_args:
        fields["extra_args"] = extra_args
    if thinking_budget is not None:
        fields["thinking_token_budget"] = thinking_budget
    if req.repetition_detection is not None:
        fields["repetition_detection"] = req.repetition_detection
    if req.routed_experts_prompt_start:
        fields["routed_experts_prompt_start"] = req.routed_experts_prompt_start
    return SamplingParams(**fields)


def _stop_token_ids(requested: list[int] | None, defaults: Mapping[str, Any]) -> list[int]:
    """The request's stop ids, merged with the server's default ones (vLLM's order)."""
    default_ids = defaults.get("stop_token_ids")
    if not default_ids:
        return list(requested or [])
    if not requested:
        return list(default_ids)
    return [*requested, *default_ids]


def _thinking_budget(value: int | None) -> int | None:
    if value is None or value == -1:
        return None
    if value < 0:
        raise validation_error("`thinking_token_budget` must be a non-negative integer or -1 for unlimited.",
                               parameter="thinking_token_budget", value=value)
    return value


def _verify(
    *, n: int, presence_penalty: float, frequency_penalty: float, repetition_penalty: float, temperature: float,
    top_p: float, top_k: int, min_p: float, max_tokens: int | None, min_tokens: int, stream_interval: int | None,
    logprobs: int | None, prompt_logprobs: int | None, stop: list[str], bad_words: list[str],
    extra_args: dict[str, Any],
) -> None:
    """``SamplingParams._verify_args``: the same checks, order and messages."""
    if n < 1:
        raise validation_error(f"n must be at least 1, got {n}.")
    if n > MAX_N_SEQUENCES:
        raise validation_error(f"n must be at most {MAX_N_SEQUENCES}, got {n}. To increase this limit, set "
                               "the VLLM_MAX_N_SEQUENCES environment variable.")
    if extra_args:
        _verify_extra_args(extra_args)
    if not -2.0 <= presence_penalty <= 2.0:
        raise validation_error(f"presence_penalty must be in [-2, 2], got {presence_penalty}.")
    if not -2.0 <= frequency_penalty <= 2.0:
        raise validation_error(f"frequency_penalty must be in [-2, 2], got {frequency_penalty}.")
    if not math.isfinite(repetition_penalty):
        raise validation_error(f"repetition_penalty must be a finite number, got {repetition_penalty}.")
    if repetition_penalty <= 0.0:
        raise validation_error(f"repetition_penalty must be greater than zero, got {repetition_penalty}.")
    if not math.isfinite(temperature):
        raise validation_error(f"temperature must be a finite number, got {temperature}.",
                               parameter="temperature", value=temperature)
    if temperature < 0.0:
        raise validation_error(f"temperature must be non-negative, got {temperature}.",
                               parameter="temperature", value=temperature)
    if temperature > 2.0:
        raise validation_error(f"temperature must be in [0, 2], got {temperature}.",
                               parameter="temperature", value=temperature)
    if not 0.0 < top_p <= 1.0:
        raise validation_error(f"top_p must be in (0, 1], got {top_p}.", parameter="top_p", value=top_p)
    if top_k < -1:
        raise validation_error(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    if not 0.0 <= min_p <= 1.0:
        raise validation_error(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens is not None and max_tokens < 1:
        raise validation_error(f"max_tokens must be at least 1, got {max_tokens}.",
                               parameter="max_tokens", value=max_tokens)
    if min_tokens < 0:
        raise validation_error(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if max_tokens is not None and min_tokens > max_tokens:
        raise validation_error(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    if stream_interval is not None and stream_interval < 1:
        raise validation_error(f"stream_interval must be at least 1, got {stream_interval}.",
                               parameter="stream_interval", value=stream_interval)
    if logprobs is not None and logprobs != -1 and logprobs < 0:
        raise validation_error(f"logprobs must be non-negative or -1, got {logprobs}.",
                               parameter="logprobs", value=logprobs)
    if prompt_logprobs is not None and prompt_logprobs != -1 and prompt_logprobs < 0:
        raise validation_error(f"prompt_logprobs must be non-negative or -1, got {prompt_logprobs}.",
                               parameter="prompt_logprobs", value=prompt_logprobs)
    if any(not s for s in stop):
        raise validation_error("stop cannot contain an empty string.")
    if any(not w for w in bad_words):
        raise validation_error(f"bad_words cannot contain an empty string. Got bad_words={bad_words}")


def _verify_extra_args(extra_args: dict[str, Any]) -> None:
    """The engine's MessagePack transport carries 64-bit integers only."""
    pending: list[Any] = [extra_args]
    while pending:
        value = pending.pop()
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
            raise validation_error("extra_args integers must be between -2**63 and 2**64 - 1.",
                                   parameter="extra_args")
        if isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)


def _logit_bias(bias: Mapping[str, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    invalid: list[str] = []
    for token, value in bias.items():
        try:
            out[int(token)] = min(100.0, max(-100.0, value))
        except ValueError:
            invalid.append(token)
    if invalid:
        raise validation_error(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid!r}",
            parameter="logit_bias", value=invalid)
    return out


def _structured_outputs(req: ChatRequest | CompletionRequest) -> dict[str, Any] | None:
    """``response_format`` folded into ``structured_outputs`` (json_object / json_schema), as vLLM does."""
    given = req.structured_outputs
    fmt = req.response_format
    overrides: dict[str, Any] = {}
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            overrides = {"json_object": True}
        elif kind == "json_schema":
            schema = fmt.get("json_schema")
            overrides = {"json": schema.get("schema") if isinstance(schema, dict) else None}
        elif kind not in ("text", None):
            raise BadRequestError(f"response_format type {kind!r} is not supported by this renderer",
                                  param="response_format")
    if given is None and not overrides:
        return None
    merged = {**_STRUCTURED_FIELDS, **{k: v for k, v in (given or {}).items() if k in _STRUCTURED_FIELDS},
              **overrides}
    return merged

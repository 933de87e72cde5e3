"""A client body's sampling fields -> the engine's ``SamplingParams``, with vLLM's defaults and checks.

As vLLM's render builds them (``to_sampling_params`` + ``SamplingParams.__post_init__`` +
``_verify_args``): unset fields take the model's generation_config defaults, then vLLM's; ``stop``
becomes a list and, unless ``include_stop_str_in_output``, ``output_text_buffer_length`` is the
longest stop string's length - 1 (what a streaming detokenizer holds back); greedy sampling
(temperature < 1e-5) resets ``top_p``/``top_k``/``min_p`` and refuses ``n > 1``; ``output_kind`` is
DELTA when streaming, FINAL_ONLY otherwise; ``skip_clone`` is set. Bad values raise
``BadRequestError`` with vLLM's message (``... (parameter=x, value=y)``) and ``param``.

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
from rendering.requests import ChatRequest, CompletionRequest

_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

#: vLLM's defaults for fields a client left unset (per request, before generation_config's)
_DEFAULT_REPETITION_PENALTY = 1.0
_DEFAULT_TEMPERATURE = 1.0
_DEFAULT_TOP_P = 1.0
_DEFAULT_TOP_K = 0
_DEFAULT_MIN_P = 0.0
_ZERO = 0.0


def validation_error(message: str, *, parameter: str | None = None, value: Any = None) -> BadRequestError:
    """vLLM's ``VLLMValidationError`` as a 400: the message ends with ``(parameter=..., value=...)``."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return BadRequestError(text, param=parameter)


def chat_sampling_params(chat: ChatRequest, *, max_tokens: int, defaults: Mapping[str, Any]) -> SamplingParams:
    """``ChatCompletionRequest.to_sampling_params`` for ``chat`` with the computed ``max_tokens``."""
    prompt_logprobs = chat.prompt_logprobs
    if prompt_logprobs is None and chat.echo:
        prompt_logprobs = chat.top_logprobs
    return _build(chat, max_tokens=max_tokens, defaults=defaults,
                  logprobs=chat.top_logprobs if chat.logprobs else None, prompt_logprobs=prompt_logprobs)


def completion_sampling_params(
    request: CompletionRequest, *, max_tokens: int, defaults: Mapping[str, Any]
) -> SamplingParams:
    """``CompletionRequest.to_sampling_params`` for ``request`` with the computed ``max_tokens``."""
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and request.echo:
        prompt_logprobs = request.logprobs
    return _build(request, max_tokens=max_tokens, defaults=defaults,
                  logprobs=request.logprobs, prompt_logprobs=prompt_logprobs)


def _build(
    req: ChatRequest | CompletionRequest,
    *,
    max_tokens: int,
    defaults: Mapping[str, Any],
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    n = 1 if req.n is None else req.n
    presence_penalty = _ZERO if req.presence_penalty is None else req.presence_penalty
    frequency_penalty = _ZERO if req.frequency_penalty is None else req.frequency_penalty
    repetition_penalty = _pick(req.repetition_penalty, defaults, "repetition_penalty", _DEFAULT_REPETITION_PENALTY)
    temperature = _pick(req.temperature, defaults, "temperature", _DEFAULT_TEMPERATURE)
    top_p = _pick(req.top_p, defaults, "top_p", _DEFAULT_TOP_P)
    top_k = _pick(req.top_k, defaults, "top_k", _DEFAULT_TOP_K)
    min_p = _pick(req.min_p, defaults, "min_p", _DEFAULT_MIN_P)

    seed = req.seed
    if seed is not None and not _INT64_MIN <= seed <= _INT64_MAX:
        raise BadRequestError(f"seed must be a 64-bit signed integer, got {seed}.", param="seed")
    if seed == -1:
        seed = None

    if 0 < temperature < _MAX_TEMP:
        temperature = _MAX_TEMP

    stop = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else list(req.stop)
    stop_token_ids = [] if req.stop_token_ids is None else list(dict.fromkeys(req.stop_token_ids))
    bad_words = list(dict.fromkeys(req.bad_words))

    _verify(n=n, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, stop=stop, bad_words=bad_words)

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
        fields["logprobs"] = logprobs
    if prompt_logprobs is not None:
        fields["prompt_logprobs"] = prompt_logprobs
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
    structured = _structured_outputs(req)
    if structured is not None:
        fields["structured_outputs"] = structured
    if req.logit_bias is not None:
        fields["logit_bias"] = _logit_bias(req.logit_bias)
    if req.allowed_token_ids is not None:
        fields["allowed_token_ids"] = list(req.allowed_token_ids)
    extra_args: dict[str, Any] = dict(req.vllm_xargs) if req.vllm_xargs else {}
    if req.kv_transfer_params:
        extra_args["kv_transfer_params"] = req.kv_transfer_params
    if extra_args:
        fields["extra_args"] = extra_args
    return SamplingParams(**fields)


def _pick(value: Any, defaults: Mapping[str, Any], key: str, fallback: Any) -> Any:
    if value is not None:
        return value
    return defaults.get(key, fallback)


def _verify(
    *, n: int, presence_penalty: float, frequency_penalty: float, repetition_penalty: float, temperature: float,
    top_p: float, top_k: int, min_p: float, max_tokens: int | None, min_tokens: int, logprobs: int | None,
    prompt_logprobs: int | None, stop: list[str], bad_words: list[str],
) -> None:
    """``SamplingParams._verify_args``: the same checks, order and messages."""
    if n < 1:
        raise validation_error(f"n must be at least 1, got {n}.")
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
    structured = dict(req.structured_outputs) if req.structured_outputs is not None else None
    fmt = req.response_format
    if fmt is None:
        return structured
    kind = fmt.get("type")
    extra: dict[str, Any] = {}
    if kind == "json_object":
        extra["json_object"] = True
    elif kind == "json_schema":
        schema = fmt.get("json_schema")
        if not isinstance(schema, dict):
            raise BadRequestError("response_format of type 'json_schema' needs a 'json_schema' object",
                                  param="response_format")
        extra["json"] = schema.get("schema")
    elif kind not in ("text", None):
        raise BadRequestError(f"response_format type {kind!r} is not supported by this renderer",
                              param="response_format")
    if not extra:
        return structured
    return {**(structured or {}), **extra}

"""One ``GenerateRequest`` on this backend's engine, as the tokens-in route and the text routes run it.

vLLM's full server is render -> engine -> derender; so is this one: ``/inference/v1/generate`` takes a
``GenerateRequest`` from the client, ``/v1/chat/completions`` and ``/v1/completions`` from
``rendering.render.Renderer``, and both run it here:

- ``engine_request_for``: the ``EngineCoreRequest`` (sampling values checked, ``kv_transfer_params`` to
  the engine as ``extra_args``) and the ``GenerationRun`` that folds the engine's outputs;
- ``generate_response`` / ``stream_chunk`` / ``usage_of``: the engine's outputs as
  ``rendering.generate_response`` Structs (what the tokens-in route encodes and what
  ``rendering.derender`` turns into OpenAI answers);
- P/D: ``pull_remote_prefill`` (a decode leg pulls the prompt's blocks before the engine runs it),
  ``returned_params`` (a prefill leg's answer names this instance's side channel);
- ``reply_headers``, ``stream_answer``: the answer's headers, and a streamed answer's life.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from backends.engine.request import EngineCoreRequest
from backends.frontend import REQUEST_ID_HEADER, Frontend
from backends.generation import StepRenderer, StopCheck, TailRenderer, stream_run
from backends.generation_run import Choice, GenerationRun
from backends.sse import open_stream
from backends.validation import engine_request, sampling_params
from contract.session import SESSION_HEADER
from rendering.derender import DerenderOptions
from rendering.generate_request import GenerateRequest
from rendering.generate_response import (
    GenerateChoice,
    GenerateResponse,
    GenerateStreamChoice,
    GenerateStreamChunk,
    GenerateUsage,
    PromptTokensDetails,
)


def reply_headers(request_id: str, session_id: str | None) -> dict[str, str]:
    if session_id is None:
        return {REQUEST_ID_HEADER: request_id}
    return {REQUEST_ID_HEADER: request_id, SESSION_HEADER: session_id}


def engine_request_for(fe: Frontend, body: GenerateRequest, *, request_id: str, session: str | None,
                       max_tokens: int, text: bool, kv_transfer_params: dict[str, Any] | None,
                       engine_stream: bool) -> tuple[EngineCoreRequest, GenerationRun]:
    """The engine request of ``body`` and its run state.

    ``text``: the run answers text itself and applies the stop strings (``rendering.derender.ChoiceText``
    with the request's detokenize and stop options: a tokens-in request with stop strings or
    ``output_mode`` "text", the Responses route); False when a derenderer answers. ``engine_stream``: the
    engine sends every step (a stream, or stop strings to watch), else only the final output."""
    sp = body.sampling_params
    stops = (sp.stop_strings or None) if text else None
    params = sampling_params(
        fe.config, n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=sp.seed,
        max_tokens=max_tokens, min_tokens=sp.min_tokens, stop=stops, stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos, kv_transfer_params=kv_transfer_params, final_only=not engine_stream,
        extra_args=sp.extra_args,
    )
    ecr = engine_request(fe, external_id=request_id, prompt_ids=body.token_ids, params=params, session_id=session,
                         cache_salt=body.cache_salt, priority=body.priority)
    options = None
    if text:
        options = DerenderOptions(n=sp.n, stop=tuple(stops or ()),
                                  include_stop_str_in_output=sp.include_stop_str_in_output,
                                  skip_special_tokens=sp.skip_special_tokens,
                                  spaces_between_special_tokens=sp.spaces_between_special_tokens,
                                  min_tokens=sp.min_tokens)
    return ecr, GenerationRun(fe.tokenizer, sp.n, options)


async def pull_remote_prefill(fe: Frontend, params: dict[str, Any] | None, prompt_ids: list[int],
                              cache_salt: str | None, run: GenerationRun, request_id: str) -> None:
    """P/D decode: for ``do_remote_prefill`` params, pull the prompt's KV from the prefill instance
    into the prefix cache before the request enters the engine (a failed pull recomputes)."""
    kv = fe.kv
    if kv is not None and params is not None:
        run.remote = await kv.load_remote(params, prompt_ids, cache_salt, request_id)


def returned_params(fe: Frontend, run: GenerationRun, request: web.Request) -> dict[str, Any] | None:
    """P/D prefill: the ``kv_transfer_params`` to return, naming this instance's side channel."""
    params = run.kv_transfer_params
    if params is None or fe.kv is None:
        return params
    return fe.kv.advertise(params, request)


def usage_of(run: GenerationRun) -> GenerateUsage:
    return GenerateUsage(
        prompt_tokens=run.prompt_tokens,
        total_tokens=run.prompt_tokens + run.generated,
        completion_tokens=run.generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=run.cached_tokens),
    )


def generate_response(run: GenerationRun, *, request_id: str, model: str, prompt_ids: list[int] | None,
                      kv_transfer_params: dict[str, Any] | None, text_mode: bool = False,
                      output_mode: str = "tokens") -> GenerateResponse:
    """The whole answer of a finished run (``prompt_ids``: echoed, with ``return_token_ids``)."""
    return GenerateResponse(
        request_id=request_id, model=model, created=int(time.time()), usage=usage_of(run),
        prompt_token_ids=prompt_ids, kv_transfer_params=kv_transfer_params, output_mode=output_mode,
        choices=[
            GenerateChoice(index=c.index, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                           token_ids=c.token_ids, text=run.final_text(c) if text_mode else msgspec.UNSET)
            for c in run.choices
        ],
    )


def stream_chunk(run: GenerationRun, moved: list[Choice], *, request_id: str, text_mode: bool = False,
                 output_mode: str = "tokens", usage: bool = False,
                 prompt_ids: list[int] | msgspec.UnsetType = msgspec.UNSET) -> GenerateStreamChunk | None:
    """One engine step as a generate stream event (None: no choice has anything to say). Steps with no
    new tokens are left out; a finish never is."""
    choices = [
        GenerateStreamChoice(index=c.index, finish_reason=c.finish_reason if c.done else None,
                             stop_reason=c.stop_reason if c.done else msgspec.UNSET, token_ids=c.last_ids,
                             text=run.stream_text(c) if text_mode else msgspec.UNSET)
        for c in moved if c.last_ids or c.done
    ]
    if not choices:
        return None
    return GenerateStreamChunk(request_id=request_id, choices=choices, output_mode=output_mode,
                               usage=usage_of(run) if usage else None, prompt_token_ids=prompt_ids)


async def stream_answer(request: web.Request, fe: Frontend, kv_transfer_params: dict[str, Any] | None,
                        cache_salt: str | None, prompt_ids: list[int], ecr: EngineCoreRequest, run: GenerationRun,
                        headers: dict[str, str], step: StepRenderer, tail: TailRenderer,
                        stopped: StopCheck | None = None) -> web.StreamResponse:
    """A streamed answer: pull a remote prefill's blocks if the params name them, then relay the
    engine's steps as SSE frames."""
    fe.check_engine()
    await pull_remote_prefill(fe, kv_transfer_params, prompt_ids, cache_salt, run, ecr.request_id)
    resp = await open_stream(request, headers)
    await stream_run(resp, fe, ecr, run, step, tail, stopped=stopped)
    return resp


__all__ = ["engine_request_for", "generate_response", "pull_remote_prefill", "reply_headers", "returned_params",
           "stream_answer", "stream_chunk", "usage_of"]

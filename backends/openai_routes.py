"""``POST /v1/completions`` and ``/v1/chat/completions``: render, run on the engine, derender.

As vLLM's full server does, in three steps, each with the code the router's tokens mode and the render
servers use (one implementation of rendering and of the answers):

1. **render**: ``rendering.render.Renderer`` validates the body as vLLM does (its messages and error
   shape) and makes the ``GenerateRequest`` (the model's chat template and tokenizer, sampling values
   with the model's defaults, ``max_tokens`` = the remaining context unless asked);
2. **generate**: ``backends.engine_run`` runs it on the engine (as ``/inference/v1/generate`` does), with
   the session (the shared contract: body > ``X-Session-ID`` > ``vllm_xargs``) and P/D's
   ``kv_transfer_params`` (a decode leg pulls the prompt's blocks first);
3. **derender**: ``rendering.derender`` (``ChatDerender`` / ``CompletionDerender``) turns the engine's
   answer or steps into vLLM 0.32's ``chat.completion`` / ``text_completion`` objects and SSE chunks,
   applies stop strings (the engine request is aborted when they end every choice) and reports usage.

What this backend adds to vLLM's defaults: ``system_fingerprint`` (``session-backend-<version>``), and
``usage.prompt_tokens_details.cached_tokens`` when the prefix cache served part of the prompt (vLLM's
``--enable-prompt-tokens-details``, on by default here: the router's session accounting and the
benchmarks read it; ``--no-enable-prompt-tokens-details`` turns it off). A prefill leg's answer carries
the ``kv_transfer_params`` naming this instance's side channel. A completions request takes one prompt
(a batch of several is a 400).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from backends.engine.outputs import RequestOutput
from backends.engine_run import (
    engine_request_for,
    generate_response,
    pull_remote_prefill,
    reply_headers,
    returned_params,
    stream_answer,
    stream_chunk,
    usage_of,
)
from backends.frontend import FRONTEND, Frontend
from backends.generation import run_to_end
from backends.generation_run import Choice, GenerationRun
from backends.json_body import read_json_body
from contract.errors import BadRequestError
from contract.session import SESSION_HEADER, resolve_session_id
from rendering.derender import ChatDerender, CompletionDerender, echo_texts
from rendering.generate_request import GenerateRequest
from rendering.generate_response import GenerateStreamChunk
from rendering.openai_objects import DONE_EVENT
from rendering.requests import decode_completion_request


class _Identity(msgspec.Struct):
    """What is read of a body before rendering: the session channels and the client's request id. Typed
    ``Any``: the session contract and render judge the values."""

    session_id: Any = None
    vllm_xargs: Any = None
    request_id: Any = None


_identity_decoder = msgspec.json.Decoder(_Identity)

Derenderer = ChatDerender | CompletionDerender


async def _begin(request: web.Request, fe: Frontend) -> tuple[bytes, str | None, str]:
    """The body's bytes, its session and the base request id (``X-Request-Id``, else the body's, else new)."""
    ids: _Identity = await read_json_body(request, _identity_decoder)
    session = resolve_session_id(ids.session_id, request.headers.getall(SESSION_HEADER, ()), ids.vllm_xargs)
    base = fe.base_request_id(request, ids.request_id if isinstance(ids.request_id, str) else None)
    return await request.read(), session, base


def _engine_call(fe: Frontend, generate: GenerateRequest, session: str | None,
                 kv_transfer_params: dict[str, Any] | None, stream: bool) -> tuple[Any, GenerationRun, bool]:
    """The engine request of a rendered request (stop strings stay with the derenderer)."""
    sp = generate.sampling_params
    stop_strings = bool(sp.stop_strings)
    room = fe.config.max_model_len - len(generate.token_ids)
    max_tokens = room if sp.max_tokens is None else sp.max_tokens
    ecr, run = engine_request_for(fe, generate, request_id=generate.request_id, session=session,
                                  max_tokens=max_tokens, text=False, kv_transfer_params=kv_transfer_params,
                                  engine_stream=stream or stop_strings)
    return ecr, run, stop_strings


async def _answer(request: web.Request, fe: Frontend, generate: GenerateRequest, derender: Derenderer,
                  session: str | None, base: str, kv_transfer_params: dict[str, Any] | None,
                  stream: bool) -> web.StreamResponse:
    """Run ``generate`` and answer through ``derender``: whole, collected (stop strings may end it
    early), or streamed."""
    ecr, run, stop_strings = _engine_call(fe, generate, session, kv_transfer_params, stream)
    prompt_ids = generate.token_ids
    headers = reply_headers(base, session)
    request_id = generate.request_id

    if not stream:
        await pull_remote_prefill(fe, kv_transfer_params, prompt_ids, generate.cache_salt, run, ecr.request_id)
        if not stop_strings:
            await run_to_end(request, fe, ecr, run)
            whole = generate_response(run, request_id=request_id, model=fe.config.model, prompt_ids=None,
                                      kv_transfer_params=returned_params(fe, run, request))
            body = derender.whole([whole]) if isinstance(derender, CompletionDerender) else derender.whole(whole)
        else:
            def take(out: RequestOutput, moved: list[Choice]) -> None:
                chunk = stream_chunk(run, moved, request_id=request_id)
                if chunk is not None:
                    derender.collect(chunk)

            await run_to_end(request, fe, ecr, run, take, lambda: derender.stopped)
            derender.collect(GenerateStreamChunk(request_id=request_id, choices=[], usage=usage_of(run),
                                                 kv_transfer_params=returned_params(fe, run, request)))
            body = derender.collected()
        return web.Response(body=body, content_type="application/json", headers=headers)

    def step(out: RequestOutput, moved: list[Choice]) -> bytes:  # per token: no generate Structs
        frames = b""
        for c in moved:
            if c.last_ids or c.done:
                frames += derender.step(c.index, c.last_ids, c.finish_reason, c.stop_reason)
        return frames

    def tail() -> bytes:
        # the engine's usage (cached prompt tokens), then the usage event; [DONE] is stream_run's
        derender.chunk(GenerateStreamChunk(request_id=request_id, choices=[], usage=usage_of(run)))
        return derender.finish().removesuffix(DONE_EVENT)

    return await stream_answer(request, fe, kv_transfer_params, generate.cache_salt, prompt_ids, ecr, run, headers,
                               step, tail, stopped=(lambda: derender.stopped) if stop_strings else None)


# ---- /v1/chat/completions ---------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND]
    body, session, base = await _begin(request, fe)
    rendered = fe.renderer.render_chat(body, request_id=f"chatcmpl-{base}")
    chat, generate = rendered.chat, rendered.request
    derender = ChatDerender(fe.model, chat, request_id=generate.request_id, created=int(time.time()),
                            prompt_ids=generate.token_ids, system_fingerprint=fe.fingerprint,
                            prompt_tokens_details=fe.prompt_tokens_details)
    return await _answer(request, fe, generate, derender, session, base, chat.kv_transfer_params, bool(chat.stream))


# ---- /v1/completions --------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND]
    body, session, base = await _begin(request, fe)
    generates = fe.renderer.render_completions(body, request_id=f"cmpl-{base}")
    if len(generates) != 1:
        raise BadRequestError(f"This backend takes one prompt per request; got a batch of {len(generates)} prompts.",
                              param="prompt")
    completion = decode_completion_request(body)  # the client fields derender reads (render checked them)
    (generate,) = generates
    texts = echo_texts(fe.model, completion.prompt, [generate.token_ids]) if completion.echo else None
    derender = CompletionDerender(fe.model, completion, request_id=generate.request_id, created=int(time.time()),
                                  prompt_ids=[generate.token_ids], prompt_texts=texts,
                                  system_fingerprint=fe.fingerprint, prompt_tokens_details=fe.prompt_tokens_details)
    return await _answer(request, fe, generate, derender, session, base, completion.kv_transfer_params,
                         bool(completion.stream))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)


__all__ = ["add_routes"]

"""``POST /v1/completions`` and ``/v1/chat/completions`` (``/inference/v1/generate``: ``generate_route``).

Each handler decodes its body Struct, resolves the session (the shared contract: body >
``X-Session-ID`` > ``vllm_xargs`` on the OpenAI routes; the header only on the tokens route),
builds ONE ``EngineCoreRequest`` (``n`` children are fanned out by the engine) and answers in
vLLM's shapes, streaming or not.

Prompts are the model's: its tokenizer and its chat template through ``rendering.template`` (the code
the router and render servers use), so a chat prompt here has exactly the ids ``/v1/chat/completions/render``
gives for text messages. Validation and the answers are this module's own (``GenerationRun``), not
``rendering.render``/``rendering.derender``: the backends' answers carry what the router and the benchmarks
read and vLLM's derender leaves out (``usage.prompt_tokens_details.cached_tokens``, ``system_fingerprint``),
and their 4xx messages stay the ones the router's tests know. The scale-out routes (``render_routes``) are
``rendering/``'s throughout.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from backends.engine.outputs import RequestOutput
from backends.engine.request import EngineCoreRequest
from backends.frontend import FRONTEND, REQUEST_ID_HEADER, Frontend
from backends.generation import json_response, run_to_end, stream_run
from backends.generation_run import Choice, GenerationRun
from backends.json_body import read_json_body
from backends.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
)
from backends.sse import data_frame, open_stream
from backends.tokenizer import Tokenizer
from backends.validation import check_prompt_ids, engine_request, resolve_max_tokens, sampling_params, stop_list
from contract.errors import BadRequestError
from contract.session import SESSION_HEADER, resolve_session_id

_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_enc = msgspec.json.Encoder()


def reply_headers(request_id: str, session_id: str | None) -> dict[str, str]:
    if session_id is None:
        return {REQUEST_ID_HEADER: request_id}
    return {REQUEST_ID_HEADER: request_id, SESSION_HEADER: session_id}


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


# ---- prompts -----------------------------------------------------------------------------------


def completion_prompt(tokenizer: Tokenizer, prompt: str | list[Any] | None) -> tuple[list[int], str | None]:
    """Token ids (and text, when given as text) of a completion ``prompt``."""
    if prompt is None:
        raise BadRequestError("Field required: prompt (a string or a list of token ids).", param="prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_bos=True), prompt
    if not prompt:
        raise BadRequestError("The prompt cannot be empty; send a string or token ids.", param="prompt")
    first = prompt[0]
    if type(first) is int:
        ids = prompt
    elif len(prompt) != 1:
        raise BadRequestError(
            f"This backend takes one prompt per request; got a batch of {len(prompt)} prompts.",
            param="prompt",
        )
    elif isinstance(first, str):
        return tokenizer.encode(first, add_bos=True), first
    elif isinstance(first, list):
        ids = first
    else:
        ids = prompt  # reported below as not a token id
    for t in ids:
        if type(t) is not int:
            raise BadRequestError(
                "prompt must be a string, a list of token ids (integers) or a list holding one of these; "
                f"found {msgspec.json.encode(t).decode()[:40]}.",
                param="prompt",
            )
    check_prompt_ids(tokenizer, ids, "prompt")
    return ids, None


def message_text(message: ChatMessage, index: int, param: str = "messages") -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content:
        if part.type not in ("text", "input_text", "output_text") or part.text is None:
            raise BadRequestError(
                f"{param}[{index}].content: only text parts are supported by this backend, got a "
                f"part of type {part.type!r}.",
                param=param,
            )
        texts.append(part.text)
    return "\n".join(texts)


def chat_prompt(
    tokenizer: Tokenizer, messages: list[ChatMessage] | None, add_generation_prompt: bool = True
) -> list[int]:
    if not messages:
        raise BadRequestError("messages must be a non-empty list of chat messages.", param="messages")
    conversation = [(m.role, message_text(m, i)) for i, m in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt)
    except ValueError as exc:
        raise BadRequestError(f"messages: {exc}.", param="messages") from None


def _identify(request: web.Request, fe: Frontend,
              body: CompletionRequest | ChatCompletionRequest) -> tuple[str | None, str]:
    """The session (the shared contract) and the base request id, after checking the model."""
    session = resolve_session_id(body.session_id, request.headers.getall(SESSION_HEADER, ()), body.vllm_xargs)
    fe.check_model(body.model)
    return session, fe.base_request_id(request, body.request_id)


def _prepare(fe: Frontend, body: CompletionRequest | ChatCompletionRequest, session: str | None, base: str,
             prompt_ids: list[int], max_tokens: int | None, id_prefix: str,
             ) -> tuple[str, EngineCoreRequest, GenerationRun, dict[str, str]]:
    """What completions and chat share once the prompt is known: the engine request and run state."""
    stops = stop_list(body.stop)
    params = sampling_params(
        fe.config, n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        seed=body.seed, max_tokens=max_tokens, min_tokens=body.min_tokens, stop=stops,
        stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
        kv_transfer_params=body.kv_transfer_params, final_only=not body.stream,
    )
    response_id = id_prefix + base
    ecr = engine_request(fe, external_id=response_id, prompt_ids=prompt_ids, params=params,
                         session_id=session, cache_salt=body.cache_salt, priority=body.priority)
    return response_id, ecr, GenerationRun(fe.tokenizer, body.n, stops), reply_headers(base, session)


def usage_flags(opts: Any) -> tuple[bool, bool]:
    """``stream_options``: (a final usage chunk, usage on every chunk too)."""
    include_usage = bool(opts and opts.include_usage)
    return include_usage, include_usage and bool(opts.continuous_usage_stats)


async def stream_answer(request: web.Request, fe: Frontend, body: Any, prompt_ids: list[int], ecr: EngineCoreRequest,
                  run: GenerationRun, headers: dict[str, str], step: Any, tail: Any) -> web.StreamResponse:
    """A streamed answer: pull a remote prefill's blocks if the body names them, then relay the
    engine's steps as SSE frames."""
    fe.check_engine()
    await pull_remote_prefill(fe, body.kv_transfer_params, prompt_ids, body.cache_salt, run, ecr.request_id)
    resp = await open_stream(request, headers)
    await stream_run(resp, fe, ecr, run, step, tail)
    return resp


# ---- /v1/completions --------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND]
    body: CompletionRequest = await read_json_body(request, _completion_decoder)
    session, base = _identify(request, fe, body)
    prompt_ids, prompt_text = completion_prompt(fe.tokenizer, body.prompt)
    max_tokens = resolve_max_tokens(fe.config, len(prompt_ids), body.max_tokens, "max_tokens")
    response_id, ecr, run, headers = _prepare(fe, body, session, base, prompt_ids, max_tokens, "cmpl-")
    created = int(time.time())
    model = fe.config.model
    want_ids = bool(body.return_token_ids)
    echo = prompt_text if body.echo else None
    if body.echo and prompt_text is None:
        echo = fe.tokenizer.decode(prompt_ids)

    if not body.stream:
        await pull_remote_prefill(fe, body.kv_transfer_params, prompt_ids, body.cache_salt, run, ecr.request_id)
        await run_to_end(request, fe, ecr, run)
        choices = [
            CompletionChoice(
                index=c.index,
                text=(echo + run.final_text(c)) if echo is not None else run.final_text(c),
                logprobs=None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_token_ids=prompt_ids if want_ids else msgspec.UNSET,
                token_ids=c.token_ids if want_ids else msgspec.UNSET,
            )
            for c in run.choices
        ]
        return json_response(
            CompletionResponse(id=response_id, created=created, model=model, choices=choices, usage=run.usage(),
                               system_fingerprint=fe.fingerprint,
                               kv_transfer_params=returned_params(fe, run, request)),
            headers,
        )

    include_usage, continuous = usage_flags(body.stream_options)
    started: set[int] = set()

    def step(out: RequestOutput, moved: list[Choice]) -> bytes:
        frames = b""
        for c in moved:
            text = run.stream_text(c)
            first = c.index not in started
            if first:
                started.add(c.index)
                if echo is not None:
                    text = echo + text
            if not text and not c.done and not want_ids:
                continue
            chunk = CompletionStreamResponse(
                id=response_id, created=created, model=model, system_fingerprint=fe.fingerprint,
                choices=[CompletionChoice(
                    index=c.index, text=text, logprobs=None,
                    finish_reason=c.finish_reason if c.done else None,
                    stop_reason=c.stop_reason if c.done else None,
                    prompt_token_ids=prompt_ids if (want_ids and first) else msgspec.UNSET,
                    token_ids=c.last_ids if want_ids else msgspec.UNSET,
                )],
                usage=run.usage() if continuous else msgspec.UNSET,
            )
            frames += data_frame(_enc.encode(chunk))
        return frames

    def tail() -> bytes:
        if not include_usage:
            return b""
        chunk = CompletionStreamResponse(id=response_id, created=created, model=model, choices=[],
                                         system_fingerprint=fe.fingerprint, usage=run.usage())
        return data_frame(_enc.encode(chunk))

    return await stream_answer(request, fe, body, prompt_ids, ecr, run, headers, step, tail)


# ---- /v1/chat/completions ---------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND]
    body: ChatCompletionRequest = await read_json_body(request, _chat_decoder)
    session, base = _identify(request, fe, body)
    prompt_ids = chat_prompt(fe.tokenizer, body.messages, body.add_generation_prompt)
    if body.max_completion_tokens is not None:
        max_tokens = resolve_max_tokens(fe.config, len(prompt_ids), body.max_completion_tokens, "max_completion_tokens")
    else:
        max_tokens = resolve_max_tokens(fe.config, len(prompt_ids), body.max_tokens, "max_tokens")
    response_id, ecr, run, headers = _prepare(fe, body, session, base, prompt_ids, max_tokens, "chatcmpl-")
    created = int(time.time())
    model = fe.config.model
    want_ids = bool(body.return_token_ids)

    if not body.stream:
        await pull_remote_prefill(fe, body.kv_transfer_params, prompt_ids, body.cache_salt, run, ecr.request_id)
        await run_to_end(request, fe, ecr, run)
        choices = [
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=run.final_text(c)),
                logprobs=None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if want_ids else msgspec.UNSET,
            )
            for c in run.choices
        ]
        return json_response(
            ChatCompletionResponse(id=response_id, created=created, model=model, choices=choices,
                                   usage=run.usage(), system_fingerprint=fe.fingerprint,
                                   prompt_token_ids=prompt_ids if want_ids else msgspec.UNSET,
                                   kv_transfer_params=returned_params(fe, run, request)),
            headers,
        )

    include_usage, continuous = usage_flags(body.stream_options)
    first_step = [True]

    def chunk(choices: list[ChatStreamChoice], usage: bool = False, prompt: bool = False) -> bytes:
        obj = ChatCompletionStreamResponse(
            id=response_id, created=created, model=model, choices=choices, system_fingerprint=fe.fingerprint,
            usage=run.usage() if usage else msgspec.UNSET,
            prompt_token_ids=prompt_ids if prompt else msgspec.UNSET,
        )
        return data_frame(_enc.encode(obj))

    def step(out: RequestOutput, moved: list[Choice]) -> bytes:
        frames = b""
        if first_step[0]:  # vLLM sends each choice's role once the first output is there
            first_step[0] = False
            for i in range(body.n):
                frames += chunk(
                    [ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""),
                                      logprobs=None, finish_reason=None)],
                    usage=continuous, prompt=want_ids and i == 0,
                )
        for c in moved:
            text = run.stream_text(c)
            if not text and not c.done and not want_ids:
                continue
            frames += chunk(
                [ChatStreamChoice(
                    index=c.index, delta=DeltaMessage(content=text) if text else DeltaMessage(),
                    logprobs=None,
                    finish_reason=c.finish_reason if c.done else None,
                    stop_reason=c.stop_reason if c.done else None,
                    token_ids=c.last_ids if want_ids else msgspec.UNSET,
                )],
                usage=continuous,
            )
        return frames

    def tail() -> bytes:
        return chunk([], usage=True) if include_usage else b""

    return await stream_answer(request, fe, body, prompt_ids, ecr, run, headers, step, tail)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)


__all__ = ["add_routes", "completion_prompt", "chat_prompt", "message_text", "pull_remote_prefill", "reply_headers",
           "returned_params", "stream_answer"]

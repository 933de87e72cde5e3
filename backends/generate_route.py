"""``POST /inference/v1/generate``: vLLM's tokens-in, tokens-out route.

The body is a ``GenerateRequest`` (what a render server answers); the answer is a
``rendering.generate_response`` object, or SSE chunks of them: the same Structs the router decodes.
The session comes from the ``X-Session-ID`` header ONLY (a ``GenerateRequest`` has no session field);
the engine request id is vLLM's ``generate-tokens-{X-Request-Id header, else body request_id}``, which
``POST /inference/v1/abort_requests`` takes. P/D works here as on the OpenAI routes:
``kv_transfer_params`` goes to the engine, a decode leg pulls the prompt's blocks first, a prefill
leg answers with the params naming its side channel.

vLLM's checks, with its messages: token ids in the vocabulary, a prompt that leaves room to generate,
``n`` within ``max_num_seqs``; on a ``--tokens-only`` server stop strings and ``output_mode`` "text"
are refused (it does not detokenize). A ``max_tokens`` that overruns the context is not refused: the
engine stops at ``max_model_len`` ("length"), as vLLM's scheduler does.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from backends.engine.outputs import RequestOutput
from backends.frontend import FRONTEND, Frontend
from backends.generation import run_to_end
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
from backends.generation_run import Choice
from backends.json_body import read_json_body
from contract.errors import BadRequestError
from contract.session import SESSION_HEADER, session_from_headers
from rendering.generate_request import GenerateRequest
from rendering.generate_response import GenerateStreamChunk, encode_generate_response, encode_stream_chunk

TOKENS_ONLY_STOP_MESSAGE = (
    "stop strings are not supported on a --tokens-only server because detokenization is disabled. "
    "Check stop strings on the coordinator, or use stop_token_ids."
)

_generate_decoder = msgspec.json.Decoder(GenerateRequest)


class _GivenMaxTokens(msgspec.Struct):
    max_tokens: int | None | msgspec.UnsetType = msgspec.UNSET


class _MaxTokensProbe(msgspec.Struct):
    """Whether the body's ``sampling_params`` names ``max_tokens`` (the decoded Struct says 16 when it
    does not; vLLM then gives the rest of the context, as render servers leave it out by default)."""

    sampling_params: _GivenMaxTokens = msgspec.field(default_factory=_GivenMaxTokens)


_probe_decoder = msgspec.json.Decoder(_MaxTokensProbe)


def check_prompt(fe: Frontend, ids: list[int]) -> None:
    """vLLM's input checks of a token prompt: not empty, in the vocabulary, room to generate."""
    if not ids:
        raise BadRequestError("The decoder prompt cannot be empty", param="token_ids")
    low, high = min(ids), max(ids)
    vocab = fe.model.vocab_size
    if high >= vocab or low < 0:
        raise BadRequestError(f"Token id {high if high >= vocab else low} is out of vocabulary")
    limit = fe.config.max_model_len
    if len(ids) >= limit:
        raise BadRequestError(
            f"This model's maximum context length is {limit} tokens. However, your request has {len(ids)} "
            f"input tokens. Please reduce the length of the input messages. "
            f"(parameter=input_tokens, value={len(ids)})",
            param="input_tokens",
        )


async def generate(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND]
    body: GenerateRequest = await read_json_body(request, _generate_decoder)
    given_max_tokens = _probe_decoder.decode(await request.read()).sampling_params.max_tokens
    session = session_from_headers(request.headers.getall(SESSION_HEADER, ()))
    fe.check_model(body.model)
    base = fe.base_request_id(request, body.request_id)
    sp = body.sampling_params
    stops = sp.stop_strings or None
    if body.output_mode not in ("tokens", "text"):
        raise BadRequestError(f"output_mode must be 'tokens' or 'text', got {body.output_mode!r}.",
                              param="output_mode")
    text_mode = body.output_mode == "text"
    if fe.tokens_only:
        if stops:
            raise BadRequestError(TOKENS_ONLY_STOP_MESSAGE)
        if text_mode:
            raise BadRequestError(
                "output_mode='text' requires a tokenizer, but this server does not load one (--tokens-only or "
                "--skip-tokenizer-init). Send the request to a server that loads a tokenizer, or use "
                "output_mode='tokens'."
            )
    prompt_ids = body.token_ids
    check_prompt(fe, prompt_ids)
    if sp.n > fe.config.max_num_seqs:
        raise BadRequestError(
            f"sampling_params.n must be at most the server's max_num_seqs ({fe.config.max_num_seqs}), got {sp.n}."
        )
    if body.cache_salt is not None and not 1 <= len(body.cache_salt) <= 1024:
        raise BadRequestError("cache_salt must be 1 to 1024 characters long.", param="cache_salt")
    room = fe.config.max_model_len - len(prompt_ids)
    if given_max_tokens is msgspec.UNSET or given_max_tokens is None:
        max_tokens = room
    elif given_max_tokens < 1:
        raise BadRequestError(f"sampling_params.max_tokens must be at least 1, got {given_max_tokens}.",
                              param="sampling_params.max_tokens")
    else:
        max_tokens = min(given_max_tokens, room)  # the engine stops at the context's end ("length")
    request_id = f"generate-tokens-{base}"
    ecr, run = engine_request_for(fe, body, request_id=request_id, session=session, max_tokens=max_tokens,
                                  text=text_mode or bool(stops), kv_transfer_params=body.kv_transfer_params,
                                  engine_stream=bool(body.stream))
    headers = reply_headers(base, session)
    want_prompt = bool(body.return_token_ids)
    model = fe.config.model

    if not body.stream:
        await pull_remote_prefill(fe, body.kv_transfer_params, prompt_ids, body.cache_salt, run, ecr.request_id)
        await run_to_end(request, fe, ecr, run)
        answer = generate_response(run, request_id=request_id, model=model,
                                   prompt_ids=prompt_ids if want_prompt else None,
                                   kv_transfer_params=returned_params(fe, run, request), text_mode=text_mode,
                                   output_mode=body.output_mode)
        return web.Response(body=encode_generate_response(answer), content_type="application/json", headers=headers)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats)
    first = [True]

    def step(out: RequestOutput, moved: list[Choice]) -> bytes:
        chunk = stream_chunk(run, moved, request_id=request_id, text_mode=text_mode, output_mode=body.output_mode,
                             usage=continuous, prompt_ids=prompt_ids if (want_prompt and first[0]) else msgspec.UNSET)
        if chunk is None:
            return b""
        first[0] = False
        return encode_stream_chunk(chunk)

    def tail() -> bytes:
        if not include_usage:
            return b""
        return encode_stream_chunk(GenerateStreamChunk(request_id=request_id, choices=[],
                                                       output_mode=body.output_mode, usage=usage_of(run)))

    return await stream_answer(request, fe, body.kv_transfer_params, body.cache_salt, prompt_ids, ecr, run, headers,
                               step, tail)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/inference/v1/generate", generate)

"""The routes of session-backend besides generation: what the instance says about itself and its
tokenizer (vLLM's, where a client or router can see them).

``GET /v1/models``, ``/health``, ``/load``, ``/version``, ``/metrics``, ``/v1/sessions``,
``/v1/sessions/{id}``; ``POST /tokenize``, ``/detokenize``.
"""

from __future__ import annotations

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backends.frontend import ENGINE, FRONTEND
from backends.generation import json_response
from backends.json_body import read_json_body
from backends.openai_routes import chat_prompt
from backends.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    SessionEntry,
    SessionList,
    TokenizeRequest,
    TokenizeResponse,
)
from contract.errors import BadRequestError, NotFoundError

DEFAULT_SESSIONS_LIMIT = 100


async def health(request: web.Request) -> web.Response:
    """200 with an empty body while the engine loop runs; 503 once it is dead (as vLLM)."""
    return web.Response(status=200 if request.app[ENGINE].is_running else 503)


async def load(request: web.Request) -> web.Response:
    return json_response({"server_load": request.app[FRONTEND].in_flight}, {})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": request.app[FRONTEND].version}, {})


async def models(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND]
    card = ModelCard(id=fe.config.model, created=fe.created, root=fe.config.model,
                     max_model_len=fe.config.max_model_len)
    return json_response(ModelList(data=[card]), {})


async def metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app[FRONTEND].registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def list_sessions(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND]
    raw = request.query.get("limit")
    limit = DEFAULT_SESSIONS_LIMIT
    if raw is not None:
        try:
            limit = int(raw)
        except ValueError:
            limit = 0
        if limit < 1:
            raise BadRequestError(f"limit must be a positive integer, got {raw!r}.", param="limit")
    limit = min(limit, fe.config.max_tracked_sessions)
    data = [
        SessionEntry(session_id=sid, requests=s.requests, prompt_tokens=s.prompt_tokens,
                     cached_tokens=s.cached_tokens, generated_tokens=s.generated_tokens)
        for sid, s in fe.engine.sessions.recent(limit)
    ]
    return json_response(SessionList(data=data, limit=limit, max_tracked_sessions=fe.config.max_tracked_sessions), {})


async def get_session(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND]
    session_id = request.match_info["session_id"]
    stats = fe.engine.sessions.get(session_id)
    if stats is None:
        raise NotFoundError(
            f"Session '{session_id}' is unknown to this backend (no finished request carried it, "
            f"or it left the table of the {fe.config.max_tracked_sessions} most recently active sessions).",
            param="session_id",
        )
    return json_response(
        {"requests": stats.requests, "prompt_tokens": stats.prompt_tokens,
         "cached_tokens": stats.cached_tokens, "generated_tokens": stats.generated_tokens},
        {},
    )


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


async def tokenize(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND]
    body: TokenizeRequest = await read_json_body(request, _tokenize_decoder)
    fe.check_model(body.model)
    tok = fe.tokenizer
    if body.messages is not None:
        # the chat form's add_special_tokens is moot: the template itself starts with <s>
        ids = chat_prompt(tok, body.messages, body.add_generation_prompt)
    elif body.prompt is not None:
        ids = tok.encode(body.prompt, add_bos=body.add_special_tokens is not False)
    else:
        raise BadRequestError("Send either prompt (a string) or messages (a chat).", param="prompt")
    return json_response(
        TokenizeResponse(
            count=len(ids), max_model_len=fe.config.max_model_len, tokens=ids,
            token_strs=[tok.token_str(i) for i in ids] if body.return_token_strs else msgspec.UNSET,
        ),
        {},
    )


async def detokenize(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND]
    body: DetokenizeRequest = await read_json_body(request, _detokenize_decoder)
    fe.check_model(body.model)
    try:
        text = fe.tokenizer.decode(body.tokens)
    except ValueError as exc:
        raise BadRequestError(f"tokens: {exc}.", param="tokens") from None
    return json_response(DetokenizeResponse(prompt=text), {})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/load", load)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/sessions", list_sessions)
    app.router.add_get("/v1/sessions/{session_id}", get_session)

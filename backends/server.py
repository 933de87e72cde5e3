"""The aiohttp application of session-backend: app factory, error middleware, small routes.

Routes (vLLM's, where a client or router can see them):

- ``POST /v1/completions``, ``/v1/chat/completions``, ``/inference/v1/generate``  (``openai_routes``)
- ``POST /v1/responses``, ``GET /v1/responses/{id}``                               (``responses_api``)
- ``POST /tokenize``, ``/detokenize``; ``GET /v1/models``, ``/health``, ``/load``, ``/version``,
  ``/metrics``, ``/v1/sessions``, ``/v1/sessions/{id}``                              (here)
- ``POST /internal/kv/pull``: the P/D side channel of a prefill (or ``both``) instance, unless it is
  served on a dedicated listener (``create_side_channel_app``); ``POST /internal/kv/release``
  (the router's "the decode leg will not come") on both                           (``kv_transfer``)

Every error is vLLM's JSON ``{"error": {"message", "type", "param", "code"}}``, produced in ONE
place (``backends.http_errors.error_middleware``). Every response carries ``X-Request-Id``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from backends import openai_routes, responses_api
from backends.engine.client import AsyncEngine
from backends.engine.outputs import EngineConfig
from backends.generation import json_response
from backends.http_errors import error_middleware
from backends.kv_transfer import DEFAULT_PULL_TIMEOUT_S, AllowList, KVTransfer
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
from backends.responses_store import DEFAULT_MAX_ENTRIES, ResponseStore
from backends.serving import REQUEST_ID_HEADER, REQUEST_ID_KEY, Frontend, read_json_body
from backends.state import ENGINE, FRONTEND
from backends.tokenizer import Tokenizer
from contract.errors import BadRequestError, NotFoundError

log = logging.getLogger(__name__)

#: request bodies above this are a 413 (prompts of a long context fit easily)
MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_SESSIONS_LIMIT = 100

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
EngineFactory = Callable[[EngineConfig, CollectorRegistry], AsyncEngine]


# ---- small routes ---------------------------------------------------------------------------


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


# ---- the app factory ------------------------------------------------------------------------


def engine_config_for(config: EngineConfig, tokenizer: Tokenizer) -> EngineConfig:
    """``config`` with the generated-token range and eos taken from the tokenizer, and
    ``max_model_len`` lowered to the KV-cache capacity when that cannot hold one full sequence
    (vLLM refuses to start then; here the served context shrinks, with a warning)."""
    capacity = config.num_blocks * config.block_size
    max_model_len = config.max_model_len
    if capacity < max_model_len:
        log.warning("KV cache holds %d tokens (%d blocks of %d), less than max_model_len %d: serving "
                    "max_model_len %d", capacity, config.num_blocks, config.block_size, max_model_len, capacity)
        max_model_len = capacity
    return msgspec.structs.replace(
        config,
        max_model_len=max_model_len,
        gen_token_min=tokenizer.gen_token_min,
        gen_token_max=tokenizer.gen_token_max,
        eos_token_id=tokenizer.eos_token_id,
    )


def create_app(
    config: EngineConfig,
    *,
    registry: CollectorRegistry | None = None,
    max_stored_responses: int = DEFAULT_MAX_ENTRIES,
    max_body_bytes: int = MAX_BODY_BYTES,
    engine_factory: EngineFactory | None = None,
    kv_allow: Sequence[str] = (),
    kv_pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
    kv_side_channel_on_data_port: bool = True,
) -> web.Application:
    """Build a backend app; the engine starts and stops with the app (``cleanup_ctx``).

    The generated-token range of ``config`` is replaced by the tokenizer's (every generated id
    decodes to a readable word). ``registry`` defaults to a fresh one (never the global registry).

    P/D: ``kv_allow`` lists the ``HOST:PORT`` side channels a decode instance may pull from (empty:
    loopback hosts only; ``ValueError`` for a malformed entry); an engine without a
    ``kv_engine_id`` gets a unique one. A prefill (or ``both``) instance serves the side channel
    on this app unless ``kv_side_channel_on_data_port`` is false (then serve
    ``create_side_channel_app(app)`` on its own listener and set ``config.kv_host/kv_port``).
    """
    tokenizer = Tokenizer()
    config = engine_config_for(config, tokenizer)
    if not config.kv_engine_id:
        unique = f"{config.model}-engine-{config.engine_index}-{secrets.token_hex(4)}"
        config = msgspec.structs.replace(config, kv_engine_id=unique)
    registry = registry if registry is not None else CollectorRegistry()
    engine = (engine_factory or AsyncEngine)(config, registry)
    kv = KVTransfer(config, engine, registry, allow=AllowList(kv_allow), pull_timeout_s=kv_pull_timeout_s)
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes)
    app[FRONTEND] = Frontend(config=config, tokenizer=tokenizer, engine=engine, registry=registry,
                             store=ResponseStore(max_stored_responses), kv=kv)
    app[ENGINE] = engine
    app.cleanup_ctx.append(_engine_lifecycle)
    if kv.serves_pulls:  # the release is served on the data port even with a dedicated side channel
        kv.add_routes(app, pull=kv_side_channel_on_data_port)

    openai_routes.add_routes(app)
    responses_api.add_routes(app)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/load", load)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/sessions", list_sessions)
    app.router.add_get("/v1/sessions/{session_id}", get_session)
    return app


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE]
    await engine.start()
    try:
        yield
    finally:
        kv = app[FRONTEND].kv
        if kv is not None:
            await kv.close()
        await engine.stop()


def create_side_channel_app(main_app: web.Application) -> web.Application:
    """An app serving only the P/D side channel (``POST /internal/kv/pull``) of ``main_app``'s
    engine, for a dedicated ``--kv-port`` listener. Run it while ``main_app`` runs."""
    fe = main_app[FRONTEND]
    if fe.kv is None or not fe.kv.serves_pulls:
        raise ValueError("only a prefill or both-role backend serves the KV side channel")
    app = web.Application(middlewares=[error_middleware], client_max_size=1024 * 1024)
    app[FRONTEND] = fe
    app[ENGINE] = fe.engine
    fe.kv.add_routes(app)
    return app


__all__ = [
    "create_app", "create_side_channel_app", "engine_config_for", "error_middleware", "ENGINE", "FRONTEND", "Frontend",
]

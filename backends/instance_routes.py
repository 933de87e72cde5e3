"""The routes of session-backend besides generation: what the instance says about itself
(vLLM's, where a client or router can see them).

``GET /v1/models``, ``/health``, ``/load``, ``/version``, ``/metrics``, ``/v1/sessions``,
``/v1/sessions/{id}``.
"""

from __future__ import annotations

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backends.frontend import ENGINE, FRONTEND
from backends.generation import json_response
from backends.json_body import read_json_body
from backends.protocol import ModelCard, ModelList, SessionEntry, SessionList
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


def add_instance_routes(app: web.Application) -> None:
    """What every engine serves, ``--tokens-only`` included."""
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/sessions", list_sessions)
    app.router.add_get("/v1/sessions/{session_id}", get_session)


def add_text_routes(app: web.Application) -> None:
    """What a server with a tokenizer adds (not ``--tokens-only``; ``/tokenize`` is ``render_routes``')."""
    app.router.add_get("/version", version)

"""The router's own endpoints: /health, /v1/models (tokens mode: the rendered model, ``tokens_models``), /metrics, /v1/sessions (the listing through router.admin).

Errors are raised (``contract.errors``); the app's ``error_middleware`` answers them."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from contract.errors import BadRequestError, NotFoundError
from router.state import ROUTER_STATE, RouterState
from router.tokens.render_client import POOL_RENDER

if TYPE_CHECKING:
    from rendering.model import RenderModel

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()
#: the ``created`` of the router's own model card (vLLM's is its start time too)
_STARTED = int(time.time())


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(payload), status=status, content_type="application/json")


#: tokens mode: the model the router renders for (set by the app factory; absent in text mode)
TOKENS_MODEL: web.AppKey[RenderModel] = web.AppKey("tokens_model")


async def health(request: web.Request) -> web.Response:
    """``ok`` (200) when the serving pool has a backend to take requests and, in tokens mode with render
    servers, the render pool has one too; else ``unavailable`` (503). Every pool is listed."""
    state = request.app[ROUTER_STATE]
    pool = state.serving_pool
    render = state.pools.get(POOL_RENDER)
    available = len(pool.available()) > 0 and (render is None or len(render.available()) > 0)
    payload = {
        "status": "ok" if available else "unavailable",
        "pools": {name: {"healthy": len(p.available()), "total": len(p)} for name, p in state.pools.items()},
    }
    return json_response(payload, 200 if available else 503)


async def models(request: web.Request) -> web.Response:
    """The union of the healthy backends' model cards (the first card of each id): those the health
    checker learned (what the router routes by), and for a backend whose models are not known
    yet, its ``GET /v1/models`` now. Tokens mode: ``tokens_models``."""
    state = request.app[ROUTER_STATE]
    assert state.http is not None
    model = request.app.get(TOKENS_MODEL)
    if model is not None:
        return json_response(tokens_models(model, state, _STARTED))
    available = [b for name, pool in state.pools.items() if name != POOL_RENDER for b in pool.available()]
    backends = [b for b in available if b.models is None]
    timeout = aiohttp.ClientTimeout(total=state.config.health.timeout_s * 2)

    async def fetch(url: str) -> list[dict[str, Any]]:
        try:
            async with state.http.get(url + "/v1/models", timeout=timeout) as resp:  # type: ignore[union-attr]
                if resp.status != 200:
                    return []
                data = msgspec.json.decode(await resp.read())
                cards = data.get("data") if isinstance(data, dict) else None
                return [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []
        except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError):
            return []

    merged: dict[str, dict[str, Any]] = {}
    learned = [list(b.model_cards) for b in available if b.models is not None]
    for cards in learned + list(await asyncio.gather(*(fetch(b.url) for b in backends))):
        for card in cards:
            model_id = card.get("id")
            if isinstance(model_id, str) and model_id not in merged:
                merged[model_id] = card
    return json_response({"object": "list", "data": list(merged.values())})


def tokens_models(model: "RenderModel", state: RouterState, created: int) -> dict[str, Any]:
    """Tokens mode's model list: the one model the router renders for (any other name is render's 404).
    Its card is an engine's when a healthy engine lists it (learned by the health checks, as in text
    mode), else the router's own, built from the model folder: a ``--tokens-only`` vLLM serves no
    ``/v1/models``, so the engines may list nothing, and the router is the one that knows the model
    then. The engines are not asked per call (they would answer 404)."""
    for name, pool in state.pools.items():
        if name == POOL_RENDER:
            continue
        for backend in pool.available():
            for card in backend.model_cards:
                if card.get("id") == model.name:
                    return {"object": "list", "data": [card]}
    card = {
        "id": model.name, "object": "model", "created": created, "owned_by": "vllm", "root": str(model.path),
        "parent": None, "max_model_len": model.max_model_len,
        "permission": [{
            "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False,
        }],
    }
    return {"object": "list", "data": [card]}


async def metrics(request: web.Request) -> web.Response:
    state = request.app[ROUTER_STATE]
    state.sessions.sweep()
    return web.Response(body=generate_latest(state.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def list_sessions(request: web.Request) -> web.Response:
    """Every session, most recently active first: an admin action, routed through ``router.admin``."""
    state = request.app[ROUTER_STATE]
    try:
        limit = int(request.query.get("limit", "100"))
        offset = int(request.query.get("offset", "0"))
        if limit < 1 or offset < 0:
            raise ValueError
    except ValueError:
        raise BadRequestError("limit must be a positive integer and offset a non-negative one") from None
    state.sessions.sweep()
    entries = state.sessions.recent(min(limit, 10_000), offset)
    return json_response({
        "object": "list",
        "data": [e.to_json(kv=_kv_of(state, e.session_id)) for e in entries],
        "total": len(state.sessions),
        "offset": offset,
        "limit": limit,
    })


async def get_session(request: web.Request) -> web.Response:
    state = request.app[ROUTER_STATE]
    session_id = request.match_info["session_id"]
    entry = state.sessions.get(session_id)
    if entry is None:
        raise NotFoundError(f"session {session_id!r} is not in the router's session table")
    return json_response(entry.to_json(kv=_kv_of(state, session_id)))


def _kv_of(state: RouterState, session_id: str) -> Mapping[str, int] | None:
    """The session's resident tokens per backend in the KV index (None when the index is off)."""
    kv = state.kv
    if kv is None:
        return None
    kv.catch_up()
    return kv.session_tokens(session_id)


async def delete_session(request: web.Request) -> web.Response:
    state = request.app[ROUTER_STATE]
    session_id = request.match_info["session_id"]
    if not state.sessions.delete(session_id):
        raise NotFoundError(f"session {session_id!r} is not in the router's session table")
    return json_response({"id": session_id, "object": "session", "deleted": True})

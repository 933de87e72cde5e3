"""The router's own endpoints: /health, /v1/models, /metrics, /v1/sessions (the listing through router.admin).

Errors are raised (``contract.errors``); the app's ``error_middleware`` answers them."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from contract.errors import BadRequestError, NotFoundError
from router.state import ROUTER_STATE

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(payload), status=status, content_type="application/json")


async def health(request: web.Request) -> web.Response:
    state = request.app[ROUTER_STATE]
    pool = state.serving_pool
    available = len(pool.available())
    payload = {
        "status": "ok" if available else "unavailable",
        "pools": {name: {"healthy": len(p.available()), "total": len(p)} for name, p in state.pools.items()},
    }
    return json_response(payload, 200 if available else 503)


async def models(request: web.Request) -> web.Response:
    """The union of the healthy backends' model cards (the first card of each id): those the health
    checker learned (what the router routes by), and for a backend whose models are not known
    yet, its ``GET /v1/models`` now."""
    state = request.app[ROUTER_STATE]
    assert state.http is not None
    available = [b for pool in state.pools.values() for b in pool.available()]
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
        "data": [e.to_json() for e in entries],
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
    return json_response(entry.to_json())


async def delete_session(request: web.Request) -> web.Response:
    state = request.app[ROUTER_STATE]
    session_id = request.match_info["session_id"]
    if not state.sessions.delete(session_id):
        raise NotFoundError(f"session {session_id!r} is not in the router's session table")
    return json_response({"id": session_id, "object": "session", "deleted": True})

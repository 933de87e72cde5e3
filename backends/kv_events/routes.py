"""The routes of the KV-event feature: ``GET /kv_event_sources`` and ``POST /reset_prefix_cache``.

- ``GET /kv_event_sources`` (vLLM's ``instrumentator/basic.py``): the publisher's resolved
  ``KVEventsConfig`` keyed by data-parallel rank, ``{"0": {...}}``; ``{}`` when events are off.
  Served by every engine, ``--tokens-only`` included.
- ``POST /reset_prefix_cache`` (vLLM's ``serve/dev/cache``, which vLLM serves only with
  ``VLLM_SERVER_DEV_MODE=1``; here always, the router never forwards it to clients): drops the
  prefix cache and publishes ``AllBlocksCleared``. Answers ``{"success": bool}``: false, with
  nothing changed, while any block is in use (running requests, P/D holds), as vLLM; retry.
  ``reset_running_requests=true`` (preempt everything first) is not supported here: a 400.
  ``reset_external`` is accepted: there is no connector-side cache to reset.
"""

from __future__ import annotations

from aiohttp import web

from backends.frontend import ENGINE
from backends.generation import json_response
from backends.kv_events.service import KV_EVENTS
from contract.errors import BadRequestError
from contract.kv_events import KV_EVENT_SOURCES_PATH, encode_event_sources

_TRUE = ("true", "1", "yes", "on")


async def kv_event_sources(request: web.Request) -> web.Response:
    body = encode_event_sources(request.app[KV_EVENTS].sources())
    return web.Response(body=body, content_type="application/json")


async def reset_prefix_cache(request: web.Request) -> web.Response:
    if request.query.get("reset_running_requests", "false").lower() in _TRUE:
        raise BadRequestError("reset_running_requests=true is not supported by session-backend; let the running "
                              "requests finish and retry without it", param="reset_running_requests")
    success = request.app[ENGINE].core.reset_prefix_cache()
    return json_response({"success": success}, {})


def add_routes(app: web.Application) -> None:
    app.router.add_get(KV_EVENT_SOURCES_PATH, kv_event_sources)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)

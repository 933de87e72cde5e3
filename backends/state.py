"""Typed application keys of session-backend (kept apart so route modules can import them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from backends.serving import Frontend

if TYPE_CHECKING:
    from backends.engine.client import AsyncEngine

#: the frontend state: config, tokenizer, engine, response store, ids, in-flight count
FRONTEND = web.AppKey("frontend", Frontend)
#: the engine (also reachable as ``app[FRONTEND].engine``)
ENGINE: web.AppKey[AsyncEngine] = web.AppKey("engine")

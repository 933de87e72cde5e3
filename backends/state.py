"""Typed application keys of session-backend (kept apart so route modules can import them)."""

from __future__ import annotations

from aiohttp import web

from backends.engine.client import AsyncEngine
from backends.serving import Frontend

#: the frontend state: config, tokenizer, engine, response store, ids, in-flight count
FRONTEND = web.AppKey("frontend", Frontend)
#: the engine (also reachable as ``app[FRONTEND].engine``)
ENGINE = web.AppKey("engine", AsyncEngine)

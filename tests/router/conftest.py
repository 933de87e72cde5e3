"""``serve``: the in-process router of the model-routing and catch-all tests, on either front exactly
as ``router.serve`` assembles it (the aiohttp app on a loopback port, and for ``raw`` the
``RawFront`` before it), in front of the fakes of ``tests.router.routing_support``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.conftest import MakeRouter
from tests.router.routing_support import ModelBackend, Routed, Serve
from tests.support import eventually


@pytest.fixture
async def serve(make_router: MakeRouter) -> AsyncIterator[Serve]:
    """``await serve(front, backends=[...], prefill=[...], decode=[...], extra_urls=[...], **config)``:
    the fakes served, a router before them (and ``extra_urls``) on ``front``, after its first
    health round (models learned)."""
    sessions: list[aiohttp.ClientSession] = []

    async def start(front: str, *, backends: list[ModelBackend] | None = None,
                    prefill: list[ModelBackend] | None = None, decode: list[ModelBackend] | None = None,
                    extra_urls: list[str] | None = None, **overrides: Any) -> Routed:
        router = await make_router(front, fakes=backends or [], prefill=prefill or [], decode=decode or [],
                                   urls=extra_urls or [], named=True, **overrides)
        state = router.state
        await eventually(lambda: state.health is not None and state.health.rounds >= 1, timeout=10.0,
                         what="the router's first health round")
        http = aiohttp.ClientSession(auto_decompress=False)
        sessions.append(http)
        return Routed(router.url, state, http, {f.name: f for f in router.fakes})

    yield start
    for http in reversed(sessions):
        await http.close()

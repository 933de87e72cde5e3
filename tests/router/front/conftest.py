"""The in-process raw front both front test files use: ``served`` makes a router as
``router.serve.serve`` does with ``front = "raw"`` (its aiohttp app on an internal listener,
``RawFront`` before it) in front of ``tests.fakes.EchoBackend`` servers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from router.front.server import RawFront
from router.state import RouterState
from tests.conftest import MakeRouter
from tests.fakes import EchoBackend
from tests.raw_http import Answer, Conn

LIMIT = 4096  # max_body_bytes of the in-process routers


@dataclass
class Served:
    """A router served as ``router.serve.serve`` does with ``front = "raw"``."""

    front: RawFront
    port: int
    aiohttp_port: int
    state: RouterState
    fakes: list[EchoBackend]
    opened: list[Conn] = field(default_factory=list)

    async def conn(self) -> Conn:
        conn = await Conn.open(self.port)
        self.opened.append(conn)
        return conn

    async def once(self, data: bytes, *, head_only: bool = False) -> Answer:
        conn = await self.conn()
        try:
            return await conn.ask(data, head_only=head_only)
        finally:
            conn.close()


Factory = Callable[..., Awaitable[Served]]


@pytest.fixture
async def served(make_router: MakeRouter) -> AsyncIterator[Factory]:
    made: list[Served] = []

    async def make(*, backends: list[str] | None = None, n: int = 1, **overrides: Any) -> Served:
        settings: dict[str, Any] = {"max_body_bytes": LIMIT}
        settings.update(overrides)
        router = await make_router("raw", n=0 if backends is not None else n, urls=backends or [], **settings)
        assert router.raw is not None
        result = Served(router.raw, router.port, router.aiohttp_port, router.state, router.fakes)
        made.append(result)
        return result

    yield make
    for result in made:
        for conn in result.opened:
            conn.close()

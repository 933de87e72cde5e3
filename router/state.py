"""The router's state: one object created by the app factory, stored under a typed AppKey."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from router.config import RouterConfig
from router.health import HealthChecker
from router.metrics import RouterMetrics
from router.placement.base import Policy
from router.pool import BackendPool
from router.responses import ResponseIndex
from router.sessions import SessionTable
from router.upstream import UpstreamPool


class RequestIds:
    """Request ids: a per-process random prefix and a counter (cheaper than uuid4)."""

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}-{next(self._counter)}"


@dataclass(eq=False)
class RouterState:
    config: RouterConfig
    pools: dict[str, BackendPool]
    policy: Policy
    sessions: SessionTable
    responses: ResponseIndex
    metrics: RouterMetrics
    upstream: UpstreamPool
    health: HealthChecker | None = None
    #: aiohttp client for everything off the hot path (health checks, /v1/models, admin)
    http: aiohttp.ClientSession | None = None
    request_ids: RequestIds = field(default_factory=RequestIds)

    def all_pools(self) -> list[BackendPool]:
        return list(self.pools.values())

    def find_backend(self, name_or_url: str):  # type: ignore[no-untyped-def]
        for pool in self.pools.values():
            backend = pool.find(name_or_url)
            if backend is not None:
                return backend
        return None


ROUTER_STATE: web.AppKey[RouterState] = web.AppKey("router_state", RouterState)

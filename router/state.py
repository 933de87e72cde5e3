"""The router's state: one object created by the app factory, stored under a typed AppKey.

The aiohttp handlers (``router.endpoints``, ``router.admin``) read it; the data path does not: the
factory hands ``Proxy`` and ``PDHandoff`` their collaborators one by one."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from contract.ids import IdGenerator
from router.access_log import AccessLog
from router.backend_changes import BackendChanges
from router.config import RouterConfig
from router.health import HealthChecker
from router.kv.index import KVIndex
from router.membership import POOL_DECODE, POOL_DEFAULT, Backend, BackendPool
from router.metrics import RouterMetrics
from router.placement.base import Policy
from router.sessions.responses import ResponseIndex
from router.sessions.table import SessionTable
from router.upstream import UpstreamPool


@dataclass(eq=False)
class RouterState:
    config: RouterConfig
    pools: dict[str, BackendPool]
    policy: Policy
    sessions: SessionTable
    responses: ResponseIndex
    metrics: RouterMetrics
    upstream: UpstreamPool
    #: started and stopped by the app's lifecycle (``cleanup_ctx``)
    health: HealthChecker
    #: adds and removes backends at runtime: the one path of the admin API and of discovery
    changes: BackendChanges
    #: aiohttp client for everything off the hot path (health checks, /v1/models, admin)
    http: aiohttp.ClientSession | None = None
    request_ids: IdGenerator = field(default_factory=IdGenerator)
    #: the access log (None when access_log = "off")
    access_log: AccessLog | None = None
    #: where each session's KV is resident, from the engines' KV events (None: [kv_events] enabled = false)
    kv: KVIndex | None = None

    def all_pools(self) -> list[BackendPool]:
        return list(self.pools.values())

    @property
    def serving_pool(self) -> BackendPool:
        """The pool that answers clients: the decode pool in P/D mode, else the only one."""
        return self.pools[POOL_DECODE if POOL_DECODE in self.pools else POOL_DEFAULT]

    def find_backend(self, name_or_url: str) -> Backend | None:
        for pool in self.pools.values():
            backend = pool.find(name_or_url)
            if backend is not None:
                return backend
        return None


ROUTER_STATE: web.AppKey[RouterState] = web.AppKey("router_state", RouterState)

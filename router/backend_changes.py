"""Adding and removing backends at runtime: the one path for the admin API and for discovery.

``POST``/``DELETE /admin/backends`` (``router.admin``) and the discovery sources
(``router.discovery``) change a pool only through ``BackendChanges``, so that both do the same:

- ``add``: the joiner is health-checked *before* it enters the pool (``HealthChecker.check_backend``:
  ``GET /health``, and its ``GET /v1/models``), so it takes no traffic before its first check and
  enters with its models known. One that fails the check enters unhealthy; the periodic checks
  bring it in when it answers.
- ``remove``: the leaver drains: ``draining`` at once (placement sends it nothing new; sessions pinned
  to it are re-pinned on their next request, ``repin_unhealthy``, then ``repin_removed`` once it is
  gone), its in-flight requests finish (up to ``drain_timeout_s``), then it leaves the pool. Nothing
  in flight fails because the list changed. A removal is cancellable while it drains (``undrain``):
  a pod that turns Ready again before its drain ended stays, without a new health check.
- listeners (``subscribe``) hear of every backend that entered or left a pool, whoever changed it:
  the KV-event service (``router.kv``) subscribes to a joiner's events and forgets a leaver's blocks.
  A listener is called synchronously, must not block, and its exceptions are logged, not raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from contract.errors import ConfigError
from router.health import HealthChecker
from router.membership import Backend, BackendPool

logger = logging.getLogger(__name__)

#: how often a drain looks at the leaver's in-flight count
DRAIN_POLL_S = 0.05


class MembershipListener(Protocol):
    """Told of every backend that entered (``backend_added``) or left (``backend_removed``) a pool."""

    def backend_added(self, backend: Backend) -> None: ...

    def backend_removed(self, backend: Backend) -> None: ...


class BackendChanges:
    """Runtime changes to ``pools`` (the module docstring says what each does)."""

    def __init__(self, pools: Mapping[str, BackendPool], health: HealthChecker, drain_timeout_s: float) -> None:
        self.pools = pools
        self.health = health
        self.drain_timeout_s = drain_timeout_s
        self._listeners: list[MembershipListener] = []

    def subscribe(self, listener: MembershipListener) -> Callable[[], None]:
        """Add ``listener``; returns the call that removes it again."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    async def add(self, pool_name: str, backend: Backend,
                  recheck: Callable[[], None] | None = None) -> Backend:
        """Health-check ``backend``, then add it to pool ``pool_name`` and tell the listeners.

        ``recheck`` runs after the check, right before the backend enters the pool (nothing awaits
        between them): the caller's own conditions, which may have changed while the check ran (e.g.
        the admin API's unique names); it raises to abandon the add. ``ConfigError`` when the URL is
        in the pool by then."""
        pool = self.pools[pool_name]
        backend.pool = pool_name
        await self.health.check_backend(backend)
        if recheck is not None:
            recheck()
        if pool.get(backend.url) is not None:
            raise ConfigError(f"backend {backend.url} is already in pool {pool_name!r}")
        pool.add(backend)
        logger.info("backend %s joined pool %s (%s)", backend.name, pool_name,
                    "healthy" if backend.healthy else "unhealthy: it takes traffic once its health check passes")
        self._tell("backend_added", backend)
        return backend

    async def remove(self, backend: Backend) -> bool:
        """Drain ``backend`` (no new requests; in-flight ones finish, up to ``drain_timeout_s``), then
        remove it from its pool and tell the listeners. Returns whether it drained (no request was
        left in flight). Cancelled while draining, the backend stays in its pool, no longer draining."""
        backend.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        try:
            while backend.in_flight > 0 and loop.time() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
        except asyncio.CancelledError:
            backend.draining = False
            raise
        drained = backend.in_flight == 0
        pool = self.pools.get(backend.pool)
        if pool is not None and pool.remove(backend.url) is not None:
            logger.info("backend %s left pool %s (%s)", backend.name, backend.pool,
                        "drained" if drained else f"{backend.in_flight} requests still in flight after "
                        f"{self.drain_timeout_s:g}s")
            self._tell("backend_removed", backend)
        return drained

    def _tell(self, event: str, backend: Backend) -> None:
        for listener in list(self._listeners):
            try:
                getattr(listener, event)(backend)
            except Exception:
                logger.exception("membership listener %r failed on %s(%s)", listener, event, backend.name)

"""The one place discovered backends meet a pool: the discovered set diffed against what discovery added.

A source calls ``PoolReconciler.update(urls)`` with the *whole* set it sees now (every Ready pod, every
resolved record); nothing else. The reconciler's task works the difference off, one pass after another
until it is caught up, through ``BackendChanges`` (``router.backend_changes``), the admin API's path:

- a URL that is new: health-checked, then added (joiners are checked concurrently);
- a URL that is gone: drained in the background (no new requests at once; in-flight ones finish;
  sessions pinned there re-pinned on their next request), then removed;
- a URL that comes back while its drain runs: the drain is cancelled and the backend stays;
- a URL already in the pool that discovery did not add (the configured list, ``POST /admin/backends``):
  left alone, now and when it disappears from the discovered set. Discovery removes only what it added.

``update`` never awaits and only records the latest set, so a burst of events costs one pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from contract.errors import ConfigError
from router.backend_changes import BackendChanges
from router.discovery.metrics import DiscoveryMetrics
from router.membership import Backend

logger = logging.getLogger(__name__)


class PoolReconciler:
    """Keeps pool ``pool_name`` in step with the latest discovered set (module docstring)."""

    def __init__(self, pool_name: str, changes: BackendChanges, metrics: DiscoveryMetrics) -> None:
        self.pool_name = pool_name
        self.changes = changes
        self.metrics = metrics
        self._desired: frozenset[str] | None = None
        self._wake = asyncio.Event()
        #: URL -> the backend discovery added and that is still in the pool
        self._owned: dict[str, Backend] = {}
        #: URL -> its drain-and-remove task
        self._removing: dict[str, asyncio.Task[bool]] = {}
        self._task: asyncio.Task[None] | None = None
        #: completed passes (tests wait on it)
        self.passes = 0

    @property
    def owned(self) -> frozenset[str]:
        """URLs of the backends discovery added and has not removed (draining ones included)."""
        return frozenset(self._owned)

    @property
    def idle(self) -> bool:
        """Caught up with the latest set, no drain running."""
        return not self._wake.is_set() and not self._removing and self._desired is not None and \
            self._caught_up(self._desired)

    def update(self, urls: frozenset[str]) -> None:
        """The source's whole current set (normalized backend URLs). Never awaits."""
        if urls != self._desired:
            self._desired = urls
            self._wake.set()

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"discovery {self.pool_name}")

    async def stop(self) -> None:
        """Stop reconciling; drains under way are cancelled (their backends stay: the router is stopping)."""
        tasks = [t for t in (self._task, *self._removing.values()) if t is not None]
        self._task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._pass(self._desired or frozenset())
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one pass must not end discovery; the next update retries
                logger.exception("discovery for pool %s: reconciling failed", self.pool_name)
            self.passes += 1

    def _caught_up(self, desired: frozenset[str]) -> bool:
        pool = self.changes.pools[self.pool_name]
        return all(pool.get(url) is not None for url in desired) and \
            all(url in desired or url in self._removing for url in self._owned)

    async def _pass(self, desired: frozenset[str]) -> None:
        pool = self.changes.pools[self.pool_name]
        for url, backend in list(self._owned.items()):
            if pool.get(url) is not backend:  # removed by someone else (DELETE /admin/backends)
                del self._owned[url]
        for url in desired & self._removing.keys():  # back before its drain ended: it stays
            task = self._removing.pop(url)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if not task.cancelled():
                continue  # the drain had finished: the backend left, it joins again below
            logger.info("backend %s is back in pool %s's discovered set: its drain is cancelled", url, self.pool_name)
        for url in [u for u in self._owned if u not in desired and u not in self._removing]:
            self._removing[url] = asyncio.get_running_loop().create_task(
                self._remove(url, self._owned[url]), name=f"discovery drain {url}")
        joiners = sorted(url for url in desired if pool.get(url) is None)
        if joiners:
            await asyncio.gather(*(self._add(url) for url in joiners))

    async def _add(self, url: str) -> None:
        try:
            backend = await self.changes.add(self.pool_name, Backend(url))
        except ConfigError as exc:  # added meanwhile by someone else (the admin API): theirs, not ours
            logger.info("discovery for pool %s: %s", self.pool_name, exc.message)
            return
        self._owned[url] = backend
        self.metrics.changed(self.pool_name, "added")

    async def _remove(self, url: str, backend: Backend) -> bool:
        try:
            drained = await self.changes.remove(backend)
        finally:
            if self._removing.get(url) is asyncio.current_task():
                del self._removing[url]
        if self._owned.get(url) is backend:
            del self._owned[url]
        self.metrics.changed(self.pool_name, "removed")
        return drained

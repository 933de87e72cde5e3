"""``Discovery``: the sources and reconcilers of every pool whose ``[discovery.<pool>]`` source is not
static, built from the configuration, started and stopped by the app's lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from router.backend_changes import BackendChanges
from router.config.schema import DiscoveryConfig
from router.discovery.backoff import Backoff
from router.discovery.metrics import DiscoveryMetrics
from router.discovery.reconcile import PoolReconciler

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

logger = logging.getLogger(__name__)


class Discovery:
    """One reconciler and one source (a ``PodWatch`` or a ``DnsWatch``) per discovered pool."""

    def __init__(self, settings: DiscoveryConfig, changes: BackendChanges, metrics: DiscoveryMetrics) -> None:
        self.settings = settings
        self.changes = changes
        self.metrics = metrics
        self.reconcilers: dict[str, PoolReconciler] = {}
        #: pool -> its source's ``run`` (a PodWatch or a DnsWatch)
        self.sources: dict[str, object] = {}
        self._runs: dict[str, Callable[[], Awaitable[None]]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._api: ApiClient | None = None
        self._api_lock: asyncio.Lock | None = None
        for pool, pool_settings in settings.pools().items():
            if pool not in changes.pools:
                continue  # validated away (e.g. render outside tokens mode); nothing to fill
            reconciler = self.reconcilers[pool] = PoolReconciler(pool, changes, metrics)
            backoff = Backoff(settings.backoff_initial_s, settings.backoff_max_s)
            if pool_settings.source == "kubernetes":
                from router.discovery.kubernetes import PodWatch

                assert pool_settings.kubernetes is not None  # validated
                watch: object = PodWatch(pool, pool_settings.kubernetes, self._kubernetes_api, reconciler.update,
                                         metrics, backoff)
            else:
                from router.discovery.dns import DnsWatch

                assert pool_settings.dns is not None  # validated
                watch = DnsWatch(pool, pool_settings.dns, reconciler.update, metrics, backoff)
            self.sources[pool] = watch
            self._runs[pool] = watch.run  # type: ignore[attr-defined]

    @property
    def enabled(self) -> bool:
        return bool(self.reconcilers)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for pool, reconciler in self.reconcilers.items():
            reconciler.start()
            self._tasks.append(loop.create_task(self._runs[pool](), name=f"discovery source {pool}"))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for reconciler in self.reconcilers.values():
            await reconciler.stop()
        api, self._api = self._api, None
        if api is not None:
            await api.close()

    async def _kubernetes_api(self) -> ApiClient:
        """The one API client of every pod watch (made on first use; a failure is retried by the watch)."""
        if self._api_lock is None:
            self._api_lock = asyncio.Lock()
        async with self._api_lock:
            if self._api is None:
                from router.discovery.kubernetes import api_client

                self._api = await api_client(self.settings.kubeconfig, self.settings.kubernetes_context)
            return self._api

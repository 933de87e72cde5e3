"""Backend health: active ``GET /health`` checks plus passive ejection on request failures.

One ``HealthChecker`` watches every backend of the given pools and flips ``Backend.healthy``;
placement skips backends that are not healthy. Signals, and what each does:

- active check, every ``interval_s``, all backends concurrently, each bounded by ``timeout_s``:
  200 -> healthy (the half-open probe of a down backend), anything else or no answer -> unhealthy.
  A good check does not reset the passive failure count of a healthy backend (only a good
  request does), so a backend that answers ``/health`` but fails requests is still ejected.
  A passively ejected backend stays down until ``ejected_until`` even if its check answers 200
  (a backend can answer ``/health`` while failing requests); the first good check after that
  brings it back.
- ``record_failure(connect_error=True)`` from the proxy (refused/unreachable): unhealthy at once;
  the next good check brings it back.
- ``record_failure(connect_error=False)`` (5xx, timeout): counted; ``eject_after_failures``
  consecutive ones eject it for ``eject_s``.
- ``record_success``: resets the count; a down backend whose ejection window is over becomes
  healthy (a half-open success).

Every transition calls ``on_change(backend, healthy)`` and logs one WARNING.
With ``scrape_load`` each good check also reads ``GET /load`` (``{"server_load": N}``) into
``Backend.reported_load``. With ``engine_load`` (``router.engine_load.EngineLoad``, made when the
placement policy reads the engines' load) each good check also scrapes the backend's ``GET /metrics``
into its engine-load fields, through the same client and with the same timeout.

Models: each good check also reads ``GET /v1/models`` and records the ids it lists with
``BackendPool.set_models`` (which rebuilds the pool's per-model candidate sets when they changed;
one INFO line per change). A backend is placed for any model until its first model list arrives
(the first round runs at start-up, and ``POST /admin/backends`` checks a new backend at once);
an answer that is not a model list (no answer, not a 200, e.g. a backend without the route, or
not JSON) keeps what was known.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec

from router.membership import Backend, BackendPool

if TYPE_CHECKING:
    from router.config import RouterConfig
    from router.engine_load import EngineLoad

logger = logging.getLogger(__name__)

HEALTH_PATH = "/health"
LOAD_PATH = "/load"
MODELS_PATH = "/v1/models"


class LoadReport(msgspec.Struct):
    """vLLM's ``GET /load`` body."""

    server_load: float


_load_decoder = msgspec.json.Decoder(LoadReport)


class ModelList(msgspec.Struct):
    """vLLM's ``GET /v1/models`` body, as far as routing reads it (each card is kept as received)."""

    data: list[dict[str, Any]]


_models_decoder = msgspec.json.Decoder(ModelList)


class HealthChecker:
    """Active and passive health of the backends of ``pools``; see the module docstring."""

    def __init__(
        self,
        pools: list[BackendPool],
        interval_s: float,
        timeout_s: float,
        eject_after_failures: int,
        eject_s: float,
        session: aiohttp.ClientSession | None = None,
        on_change: Callable[[Backend, bool], None] | None = None,
        *,
        scrape_load: bool = False,
        engine_load: EngineLoad | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pools = pools
        self._pools_by_name = {pool.name: pool for pool in pools}
        self.interval_s = interval_s
        self.eject_after_failures = eject_after_failures
        self.eject_s = eject_s
        self.scrape_load = scrape_load
        #: scrapes each healthy backend's /metrics after its check (None: not read)
        self.engine_load = engine_load
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        #: the client the checks go through (given here or to ``start``)
        self._session = session
        self._on_change = on_change
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        #: completed active-check rounds (tests and the admin view read it)
        self.rounds = 0

    @classmethod
    def from_config(
        cls,
        config: RouterConfig,
        pools: list[BackendPool],
        session: aiohttp.ClientSession | None = None,
        on_change: Callable[[Backend, bool], None] | None = None,
        engine_load: EngineLoad | None = None,
    ) -> HealthChecker:
        return cls(
            pools,
            interval_s=config.health.interval_s,
            timeout_s=config.health.timeout_s,
            eject_after_failures=config.health.eject_after_failures,
            eject_s=config.health.eject_s,
            session=session,
            on_change=on_change,
            scrape_load=config.placement.reported_load_weight > 0,
            engine_load=engine_load,
        )

    def add_change_hook(self, hook: Callable[[Backend, bool], None]) -> None:
        """Call ``hook(backend, healthy)`` too on every transition, after the hooks set before."""
        first = self._on_change
        if first is None:
            self._on_change = hook
            return
        earlier: Callable[[Backend, bool], None] = first

        def both(backend: Backend, healthy: bool) -> None:
            earlier(backend, healthy)
            hook(backend, healthy)

        self._on_change = both

    # ---------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self, session: aiohttp.ClientSession | None = None) -> None:
        """Start the periodic checks (one task; the first round runs at once), through ``session``
        when given (the app factory makes the checker before an event loop runs, so before the
        client exists; its lifecycle hands the client over here)."""
        if session is not None:
            self._session = session
        if self._session is None:
            raise RuntimeError("HealthChecker.start needs an aiohttp.ClientSession (none was given)")
        if self.running:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="session-router health checks")

    async def stop(self) -> None:
        """Stop the periodic checks and wait for the task to end. Safe to call twice."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        while True:
            try:
                await self.check_now()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one round must not end health checking
                logger.exception("health check round failed")
            await asyncio.sleep(self.interval_s)

    # ------------------------------------------------------------ active checks

    async def check_now(self) -> None:
        """Run one round of active checks over every backend of every pool, concurrently."""
        backends = [backend for pool in self.pools for backend in list(pool.members)]
        if backends:
            await asyncio.gather(*(self.check_backend(backend) for backend in backends))
        self.rounds += 1

    async def check_backend(self, backend: Backend) -> bool:
        """Check one backend now, apply the result and return whether the check passed."""
        reason = await self._probe(backend)
        if reason is None:
            await self._fetch_models(backend)
            if not backend.healthy:
                if self._clock() < backend.ejected_until:
                    return True  # ejected by passive failures: keep it out until the window ends
                # Half-open probe passed. The passive count restarts here, but a good check
                # of a healthy backend leaves it alone: /health can pass while requests fail.
                backend.consecutive_failures = 0
                backend.ejected_until = 0.0
                self._set(backend, True, "GET /health answered 200")
            if self.scrape_load:
                await self._scrape_load(backend)
            if self.engine_load is not None:
                await self.engine_load.scrape(backend, self._client(), self._timeout)
            return True
        self._set(backend, False, reason)
        return False

    async def _probe(self, backend: Backend) -> str | None:
        """``None`` when ``GET /health`` answered 200, else why not."""
        try:
            async with self._client().get(backend.url + HEALTH_PATH, timeout=self._timeout) as resp:
                await resp.read()
                if resp.status == 200:
                    return None
                return f"GET /health answered {resp.status}"
        except asyncio.TimeoutError:
            return f"GET /health gave no answer within {self._timeout.total:g}s"
        except aiohttp.ClientError as exc:
            return f"GET /health failed: {exc.__class__.__name__}: {exc}"

    async def _scrape_load(self, backend: Backend) -> None:
        try:
            async with self._client().get(backend.url + LOAD_PATH, timeout=self._timeout) as resp:
                body = await resp.read()
                if resp.status != 200:
                    return
            backend.reported_load = max(0.0, _load_decoder.decode(body).server_load)
        except (asyncio.TimeoutError, aiohttp.ClientError, msgspec.DecodeError):
            return  # the load signal is optional: keep the last value

    async def _fetch_models(self, backend: Backend) -> None:
        try:
            async with self._client().get(backend.url + MODELS_PATH, timeout=self._timeout) as resp:
                body = await resp.read()
                status = resp.status
            if status != 200:
                return
            cards = tuple(card for card in _models_decoder.decode(body).data if isinstance(card.get("id"), str))
        except (asyncio.TimeoutError, aiohttp.ClientError, msgspec.DecodeError):
            return  # no model list: keep what was known (nothing: any model may go there)
        models = frozenset(card["id"] for card in cards)
        pool = self._pools_by_name.get(backend.pool)
        if pool is not None and pool.set_models(backend, models, cards):
            logger.info("backend %s (pool %s) serves models: %s", backend.name, backend.pool,
                        ", ".join(sorted(models)) or "none")

    def _client(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None:
            raise RuntimeError("the health checker has no aiohttp.ClientSession yet: call start(session) first")
        return session

    # ---------------------------------------------------------- passive signals

    def record_success(self, backend: Backend) -> None:
        """A request to ``backend`` succeeded (called by the proxy; cheap when nothing changes)."""
        if backend.consecutive_failures:
            backend.consecutive_failures = 0
        if not backend.healthy and self._clock() >= backend.ejected_until:
            backend.ejected_until = 0.0
            self._set(backend, True, "a request succeeded (half-open)")

    def record_failure(self, backend: Backend, *, connect_error: bool) -> None:
        """A request to ``backend`` failed: a connect error downs it at once, others are counted."""
        if connect_error:
            self._set(backend, False, "connection failed")
            return
        backend.consecutive_failures += 1
        if backend.consecutive_failures >= self.eject_after_failures and backend.healthy:
            backend.ejected_until = self._clock() + self.eject_s
            self._set(
                backend,
                False,
                f"{backend.consecutive_failures} consecutive failed requests; ejected for {self.eject_s:g}s",
            )

    # ----------------------------------------------------------------- helpers

    def _set(self, backend: Backend, healthy: bool, reason: str) -> None:
        if backend.healthy == healthy:
            return
        backend.healthy = healthy
        logger.warning(
            "backend %s (pool %s) is now %s: %s",
            backend.name,
            backend.pool,
            "healthy" if healthy else "unhealthy",
            reason,
        )
        if self._on_change is not None:
            try:
                self._on_change(backend, healthy)
            except Exception:
                logger.exception("health on_change callback failed for backend %s", backend.name)

"""``KVEvents``: the router's subscriptions to every backend's KV events, feeding one ``KVIndex``.

Started and stopped by the app's lifecycle (``cleanup_ctx``). It follows the pools as they change
at runtime (``router.backend_changes`` tells it of every backend that joins or leaves, and a
one-second look at the pools catches any other change): a joiner's sources are found and
subscribed, a leaver's streams closed and its index entries dropped.

Where a backend publishes (its ``EventSource`` list):

- its ``kv_events`` (+ ``kv_replay``, ``kv_topic``) in the configuration's backend table: used as
  given, nothing asked;
- else (``[kv_events] enabled = "auto"`` or true) its ``GET /kv_event_sources`` (vLLM 0.32's, and
  ours): one source per data-parallel rank whose config publishes on ZMQ. Read when the backend
  joins, when it turns healthy again (``health_changed``, the health checker's hook: an engine that
  restarted may publish elsewhere, ``tcp://*:0``), and every ``sources_refresh_s``. A read that
  fails keeps what the backend had; an answer that changed re-subscribes (and resets the backend's entries). With ``enabled = true`` a backend that
  publishes nothing is logged as a warning (once until it does).

Several data-parallel ranks of one backend feed the same index entries; a reset caused by one rank
(its restart, a gap it could not fill) drops the whole backend's entries.

When the sockets are read: nothing wakes the router for a batch. Placement calls the index's
``catch_up`` (this service's ``catch_up``) before it reads the index, and the sockets are drained
then when they were last read ``min_read_interval_s`` ago or more: a placement sees every batch that
arrived up to that long before it. While no request comes, a timer drains them every
``idle_read_interval_s`` (so replays, resets and the index's view on ``/v1/sessions`` stay current,
and ZMQ's queue stays short).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from contract.kv_events import KV_EVENT_SOURCES_PATH, decode_event_sources
from router.config.schema import BackendConfig, KVEventsSettings
from router.kv.index import KVIndex
from router.kv.metrics import KVMetrics
from router.kv.subscriber import EventSource, Stream, SubSocket, subscriber_address
from router.membership import Backend, BackendPool

logger = logging.getLogger(__name__)

#: how often the service looks at the pools (members, health) between the change notices
FOLLOW_S = 1.0


@dataclass(eq=False)
class _Tracked:
    """One backend the service follows: its sources and the streams subscribed to them."""

    backend: Backend
    sources: tuple[EventSource, ...] = ()
    streams: list[Stream] = field(default_factory=list)
    #: loop time of the last /kv_event_sources read (0: never)
    read_at: float = 0.0
    reading: asyncio.Task[None] | None = None
    read_again: bool = False
    warned: bool = False


class KVEvents:
    """Subscriptions to the backends' KV events, applied to ``index`` (module docstring)."""

    def __init__(self, index: KVIndex, settings: KVEventsSettings, pools: Callable[[], Iterable[BackendPool]],
                 metrics: KVMetrics, *, configured: Mapping[str, BackendConfig] | None = None,
                 request_timeout_s: float = 2.0) -> None:
        self.index = index
        self.settings = settings
        self._pools = pools
        self.metrics = metrics
        #: backends whose endpoints the configuration gives (the others are asked)
        self._configured = {url: given for url, given in (configured or {}).items() if given.kv_events}
        self._request_timeout_s = request_timeout_s
        self._tracked: dict[str, _Tracked] = {}
        self._sockets: dict[tuple[bool, str], SubSocket] = {}
        self._context: zmq.asyncio.Context | None = None
        self._http: aiohttp.ClientSession | None = None
        self._follow_task: asyncio.Task[None] | None = None
        self._idle_task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        #: ``time.monotonic()`` of the last drain of every socket
        self._read_at = 0.0
        metrics.sources = self.sources_by_backend

    # ------------------------------------------------------------------ lifecycle

    def start(self, http: aiohttp.ClientSession) -> None:
        """Subscribe to the current backends and follow the pools from now on."""
        self._http = http
        self._context = zmq.asyncio.Context()
        self._sync_members()
        self._follow_task = asyncio.create_task(self._follow(), name="kv-events follow")
        self._idle_task = asyncio.create_task(self._read_idle(), name="kv-events idle reads")
        self._hook_catch_up()

    async def stop(self) -> None:
        self.index.set_catch_up(None)
        tasks = [t for t in (self._follow_task, self._idle_task, *(tr.reading for tr in self._tracked.values()))
                 if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for socket in list(self._sockets.values()):
            await socket.close()
        self._sockets.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    # ------------------------------------------------------------------ membership (router.backend_changes)

    def backend_added(self, backend: Backend) -> None:
        if self._context is not None and backend.url not in self._tracked:
            self._follow_backend(backend)

    def backend_removed(self, backend: Backend) -> None:
        tracked = self._tracked.get(backend.url)
        if tracked is not None and tracked.backend is backend:
            self._forget_backend(backend.url)

    def health_changed(self, backend: Backend, healthy: bool) -> None:
        """``HealthChecker`` hook: a backend down whose engine disconnected is reset
        (``Stream.engine_down``); one healthy again may be a restarted engine publishing elsewhere
        (``tcp://*:0``): its sources are read again."""
        tracked = self._tracked.get(backend.url)
        if tracked is None or tracked.backend is not backend:
            return
        if not healthy:
            for stream in tracked.streams:
                stream.engine_down()
        elif backend.url not in self._configured:
            self._read_sources(tracked)

    async def refresh(self, backend_url: str) -> None:
        """Read ``backend_url``'s ``/kv_event_sources`` again now, and wait for it (and what it changed)."""
        tracked = self._tracked.get(backend_url)
        if tracked is None or backend_url in self._configured:
            return
        self._read_sources(tracked)
        if tracked.reading is not None:
            await asyncio.shield(tracked.reading)

    # ------------------------------------------------------------------ reading the sockets

    def catch_up(self) -> None:
        """Drain every socket unless they were drained less than ``min_read_interval_s`` ago (module
        docstring): one clock read when not due."""
        now = time.monotonic()
        if now - self._read_at >= self.settings.min_read_interval_s:
            self._read(now)

    def _hook_catch_up(self) -> None:
        """Have the index's readers drain the sockets (``catch_up``) while there are any: without, a
        placement's ``KVIndex.catch_up`` costs nothing (no backend publishes, or none was found yet)."""
        self.index.set_catch_up(self.catch_up if self._sockets and self._context is not None else None)

    def _read(self, now: float) -> None:
        self._read_at = now
        for socket in self._sockets.values():
            socket.drain()

    async def _read_idle(self) -> None:
        """Drain the sockets when ``idle_read_interval_s`` passed without a drain."""
        idle = self.settings.idle_read_interval_s
        wait = idle
        while True:
            await asyncio.sleep(wait)
            now = time.monotonic()
            wait = self._read_at + idle - now
            if wait <= 0:
                self._read(now)
                wait = idle

    # ------------------------------------------------------------------ views

    def sources_of(self, backend_url: str) -> tuple[EventSource, ...]:
        tracked = self._tracked.get(backend_url)
        return () if tracked is None else tracked.sources

    def subscribed(self, backend_url: str) -> bool:
        """Whether events of ``backend_url`` are subscribed to (its index entries may be trusted)."""
        tracked = self._tracked.get(backend_url)
        return tracked is not None and bool(tracked.streams)

    def batches_applied(self, backend_url: str) -> int:
        """Batches applied by the streams subscribed now for ``backend_url`` (0 after a re-subscribe)."""
        tracked = self._tracked.get(backend_url)
        return 0 if tracked is None else sum(stream.applied for stream in tracked.streams)

    def streams_of(self, backend_url: str) -> tuple[Stream, ...]:
        tracked = self._tracked.get(backend_url)
        return () if tracked is None else tuple(tracked.streams)

    def sources_by_backend(self) -> dict[str, int]:
        return {t.backend.name: len(t.streams) for t in self._tracked.values()}

    # ------------------------------------------------------------------ following the pools

    async def _follow(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(FOLLOW_S)
            try:
                self._sync_members()
                now = loop.time()
                for url, tracked in self._tracked.items():
                    if url not in self._configured and now - tracked.read_at >= self.settings.sources_refresh_s:
                        self._read_sources(tracked)
            except Exception:  # the follower must outlive any one bad round
                logger.exception("KV events: following the pools failed")

    def _sync_members(self) -> None:
        members: dict[str, Backend] = {}
        for pool in self._pools():
            for backend in pool.members:
                members.setdefault(backend.url, backend)  # one engine, one stream, even if listed twice
        for url in [u for u, t in self._tracked.items() if members.get(u) is not t.backend]:
            self._forget_backend(url)
        for url, backend in members.items():
            if url not in self._tracked:
                self._follow_backend(backend)

    def _follow_backend(self, backend: Backend) -> None:
        tracked = self._tracked[backend.url] = _Tracked(backend)
        given = self._configured.get(backend.url)
        if given is not None:
            source = EventSource(backend.url, given.kv_events, given.kv_replay or None, given.kv_topic, 0,
                                 backend.name)
            self._subscribe(tracked, (source,))
        else:
            self._read_sources(tracked)

    def _forget_backend(self, url: str) -> None:
        tracked = self._tracked.pop(url)
        if tracked.reading is not None:
            tracked.reading.cancel()
        self._unsubscribe(tracked)
        self.index.remove_backend(url)

    # ------------------------------------------------------------------ sources

    def _read_sources(self, tracked: _Tracked) -> None:
        if tracked.reading is not None and not tracked.reading.done():
            tracked.read_again = True
            return
        tracked.reading = asyncio.create_task(self._read_loop(tracked), name=f"kv sources {tracked.backend.name}")

    async def _read_loop(self, tracked: _Tracked) -> None:
        while True:
            tracked.read_again = False
            tracked.read_at = asyncio.get_running_loop().time()
            sources = await self._fetch_sources(tracked.backend)
            if sources is not None and self._tracked.get(tracked.backend.url) is tracked:
                if sources != tracked.sources:
                    self._subscribe(tracked, sources)
                self._warn_if_silent(tracked)
            if not tracked.read_again:
                return

    async def _fetch_sources(self, backend: Backend) -> tuple[EventSource, ...] | None:
        """The backend's publishers from ``GET /kv_event_sources``; () when it lists none (or has no such
        route); None when it could not be asked (keep what it had)."""
        assert self._http is not None
        url = backend.url + KV_EVENT_SOURCES_PATH
        try:
            async with self._http.get(url, timeout=aiohttp.ClientTimeout(total=self._request_timeout_s)) as answer:
                if answer.status in (404, 405):
                    return ()
                if answer.status != 200:
                    logger.info("KV events: %s answered %d", url, answer.status)
                    return None
                body = await answer.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            logger.debug("KV events: %s not read: %s", url, exc)
            return None
        try:
            configs = decode_event_sources(body)
        except msgspec.DecodeError as exc:
            logger.warning("KV events: %s is not vLLM's kv_event_sources answer (%s); ignored", url, exc)
            return ()
        return tuple(EventSource(backend.url, config.endpoint, config.replay_endpoint, config.topic, rank, backend.name)
                     for rank, config in sorted(configs.items()) if config.publishes)

    def _warn_if_silent(self, tracked: _Tracked) -> None:
        if self.settings.enabled is not True:
            return
        if tracked.sources:
            tracked.warned = False
        elif not tracked.warned:
            tracked.warned = True
            logger.warning("KV events: backend %s publishes none (its %s lists no ZMQ publisher): placement cannot "
                           "see its KV; start it with --kv-events-config, or give kv_events in its backend table",
                           tracked.backend.name, KV_EVENT_SOURCES_PATH)

    # ------------------------------------------------------------------ subscriptions

    def _subscribe(self, tracked: _Tracked, sources: tuple[EventSource, ...]) -> None:
        """Subscribe ``tracked`` to ``sources`` instead of what it had (its entries reset if it had any)."""
        had = bool(tracked.streams) or self.index.backend_blocks(tracked.backend.url) > 0
        self._unsubscribe(tracked)
        if had:
            if sources:
                self.index.reset_backend(tracked.backend.url)
            else:  # it publishes no more: its (empty) index entry must not vouch for it (``has_events``)
                self.index.remove_backend(tracked.backend.url)
            self.metrics.reset(tracked.backend.name, "sources_changed")
        tracked.sources = sources
        assert self._context is not None
        for source in sources:
            bind, address = subscriber_address(source.endpoint, source.backend_url)
            backend = tracked.backend
            stream = Stream(source, self.index, self.metrics, self._context,
                            replay_timeout_s=self.settings.replay_timeout_s, is_down=lambda: not backend.healthy)
            socket = self._sockets.get((bind, address))
            fresh = socket is None
            if socket is None:
                socket = SubSocket(self._context, bind, address, self.metrics)
            try:
                socket.add(stream)
                if fresh:
                    socket.start()
            except (ValueError, zmq.ZMQError) as exc:
                logger.error("KV events of %s: cannot %s %s: %s", source.label, "bind" if bind else "connect to",
                             address, exc)
                if fresh:
                    self._close_later(socket)
                else:
                    socket.discard(stream)
                continue
            self._sockets[(bind, address)] = socket
            tracked.streams.append(stream)
            logger.info("KV events of %s: %s %s (topic %r, replay %s)", source.label,
                        "bound" if bind else "connected to", address, source.topic, stream.replay or "none")
        self._hook_catch_up()

    def _unsubscribe(self, tracked: _Tracked) -> None:
        for stream in tracked.streams:
            for key, socket in list(self._sockets.items()):
                if stream in socket.streams.values() and socket.discard(stream):
                    del self._sockets[key]
                    self._close_later(socket)
        tracked.streams = []
        self._hook_catch_up()

    def _close_later(self, socket: SubSocket) -> None:
        task = asyncio.create_task(socket.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

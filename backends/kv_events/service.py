"""``KVEvents``: a backend's KV-event feature as one object (config, engine sink, publisher), under ``KV_EVENTS``.

Built by the app factory from ``--kv-events-config``. When the config publishes (vLLM's rule:
``enable_kv_cache_events`` and publisher ``"zmq"``), ``sink`` is the engine's ``StepEvents`` feeding
a ``ZmqPublisher``; otherwise there is no sink, the engine's hooks stay off, and ``sources()`` is
empty. ``lifecycle`` opens the sockets before the engine starts and closes them after it stops.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CollectorRegistry

from backends.kv_events.publisher import PublisherMetrics, ZmqPublisher
from backends.kv_events.recorder import DATA_PARALLEL_RANK, StepEvents
from contract.kv_events import KVEventsConfig


class KVEvents:
    """The backend's KV-event publisher, or nothing when events are off."""

    def __init__(self, config: KVEventsConfig | None, *, block_size: int, host: str = "127.0.0.1",
                 registry: CollectorRegistry | None = None, int_hashes: bool = True) -> None:
        """``int_hashes``: block hashes as vLLM's default ints (``recorder.int_block_hashes`` reads
        ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), else bytes."""
        self.publisher: ZmqPublisher | None = None
        self.sink: StepEvents | None = None
        if config is not None and config.publishes:
            metrics = PublisherMetrics(registry) if registry is not None else None
            self.publisher = ZmqPublisher(config, host=host, metrics=metrics)
            self.sink = StepEvents(block_size, self.publisher.publish, int_hashes=int_hashes)
        self._started = False

    def start(self) -> None:
        if self.publisher is not None:
            self.publisher.start()
            self._started = True

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

    def sources(self) -> dict[int, KVEventsConfig]:
        """What ``GET /kv_event_sources`` answers: this engine's resolved config by DP rank, or nothing."""
        if self.publisher is None or not self._started:
            return {}
        return {DATA_PARALLEL_RANK: self.publisher.config}


KV_EVENTS = web.AppKey("kv_events", KVEvents)


async def lifecycle(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: put it before the engine's, so the sockets outlive the engine loop."""
    kv_events = app[KV_EVENTS]
    kv_events.start()
    try:
        yield
    finally:
        kv_events.close()

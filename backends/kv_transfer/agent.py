"""``KVTransfer``: one backend's P/D agent, what the app and the generation routes talk to.

It owns the side channel it serves (prefill, ``both``), the client it pulls with (decode,
``both``) and the metrics. On the decode side ``load_remote`` pulls a request's prompt blocks and
preloads them into the prefix cache, never failing the request (a failed pull is logged, counted
by reason, and the prompt recomputed); ``count_prompt`` counts every finished prompt by source.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from backends.engine.config import EngineConfig
from backends.kv_transfer.allow_list import AllowList
from backends.kv_transfer.metrics import KVTransferMetrics
from backends.kv_transfer.pull_client import DEFAULT_PULL_TIMEOUT_S, PullClient, PullFailed
from backends.kv_transfer.side_channel import SideChannel, advertise

if TYPE_CHECKING:
    from backends.engine.client import AsyncEngine

log = logging.getLogger(__name__)


class RemoteLoad:
    """What a decode request got from a remote prefill (kept on its ``GenerationRun``)."""

    __slots__ = ("local_before", "loaded")

    def __init__(self, local_before: int = 0, loaded: int = 0) -> None:
        #: prompt tokens already in this instance's prefix cache before the pull
        self.local_before = local_before
        #: prompt tokens the pull added to the prefix cache
        self.loaded = loaded


class KVTransfer:
    """One backend's P/D agent: serves pulls (prefill, both) and pulls (decode, both)."""

    def __init__(
        self,
        config: EngineConfig,
        engine: "AsyncEngine",
        registry: CollectorRegistry,
        *,
        allow: AllowList | None = None,
        pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
    ) -> None:
        self.config = config
        self.engine = engine
        self.block_size = config.block_size
        self.serves_pulls = config.role in ("prefill", "both")
        self.pulls_enabled = config.role in ("decode", "both")
        self.metrics = KVTransferMetrics(registry, config.model, config.engine_index)
        self.metrics.held_requests = lambda: engine.core.num_held
        self.metrics.holds = engine.core.holds
        self.side_channel = SideChannel(engine, self.metrics, self.block_size)
        self.client = PullClient(allow if allow is not None else AllowList(), self.block_size,
                                 engine.core.engine_id, pull_timeout_s)

    @property
    def engine_id(self) -> str:
        return self.engine.core.engine_id

    async def close(self) -> None:
        await self.client.close()

    # -- prefill side ----------------------------------------------------------------------------
    def advertise(self, params: dict[str, Any] | None, request: web.Request) -> dict[str, Any] | None:
        """Returned params with the side channel's address filled in (``side_channel.advertise``)."""
        return advertise(params, request)

    def add_routes(self, app: web.Application, *, pull: bool = True) -> None:
        """The side channel's routes: pull (unless ``pull`` is false: a data port whose side channel
        is on a dedicated listener) and release."""
        self.side_channel.add_routes(app, pull=pull)

    # -- decode side: pull and preload -----------------------------------------------------------
    def wants_pull(self, params: dict[str, Any] | None) -> bool:
        return self.pulls_enabled and params is not None and bool(params.get("do_remote_prefill"))

    async def load_remote(
        self, params: dict[str, Any] | None, prompt: list[int], cache_salt: str | None, request_id: str
    ) -> RemoteLoad | None:
        """For a ``do_remote_prefill`` request: pull the prompt's blocks from the prefill instance
        and put them in the prefix cache. Never raises for a failed pull (recompute instead)."""
        if not self.wants_pull(params):
            return None
        assert params is not None
        m = self.metrics
        m.external_queries += len(prompt)
        try:
            reply = await self.client.pull(params, prompt, cache_salt)
        except PullFailed as failed:
            m.failures[failed.reason] += 1
            log.warning("P/D: no KV pulled for %s (%s: %s); recomputing the prompt locally",
                        request_id, failed.reason, failed.detail)
            return None
        bs = self.block_size
        keys = reply.block_hashes
        kv = self.engine.core.kv_cache
        local_before = 0
        for key in keys:
            if kv.cached_block(key) is None:
                break
            local_before += bs
        present = self.engine.preload_blocks(reply.token_ids, cache_salt)
        loaded = max(present - local_before, 0)
        m.pulls += 1
        m.pulled_tokens += len(keys) * bs
        m.external_hits += loaded
        return RemoteLoad(local_before, loaded)

    # -- accounting ------------------------------------------------------------------------------
    def count_prompt(self, prompt_tokens: int, cached_tokens: int, remote: RemoteLoad | None) -> None:
        """One finished request's prompt tokens by source (vLLM's ``prompt_tokens_by_source``)."""
        if prompt_tokens <= 0:
            return
        cached = min(max(cached_tokens, 0), prompt_tokens)
        external = 0
        if remote is not None and remote.loaded:
            external = min(max(cached - remote.local_before, 0), remote.loaded)
        by_source = self.metrics.by_source
        by_source["local_compute"] += prompt_tokens - cached
        by_source["local_cache_hit"] += cached - external
        by_source["external_kv_transfer"] += external

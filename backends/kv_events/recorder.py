"""``StepEvents``: the engine's KV-cache changes of one step, as vLLM 0.32's event Structs.

The engine's ``KVCacheManager`` reports plain data (``backends.engine.kv_cache.KVEventSink``); this
turns each report into the event vLLM's ``BlockPool`` would queue, in the same order, and at the
step's end (``flush``) hands the step's events as one ``KVEventBatch`` to ``publish``. A step with
no event publishes nothing (as vLLM).

The events are shaped as vLLM emits them for a plain decoder model (one full-attention KV-cache
group): ``BlockStored`` with ``lora_id``/``lora_name`` None, ``medium`` "GPU", ``extra_keys`` one
entry per block (the cache salt as ``(salt,)`` on block 0 of a salted prompt, else None),
``group_idx`` 0, ``kv_cache_spec_kind`` "full_attention" and the request's ``session_id``;
``BlockRemoved`` one per key with ``group_idx`` 0. The hashes are our 16-byte blake2b block keys
(``backends.engine.kv_cache``), not vLLM's sha256: a consumer that needs engine-independent keys
chains its own from ``token_ids`` and ``parent_block_hash``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from contract.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

#: vLLM's ``KVCacheSpecKind.FULL_ATTENTION``: the kind of our one KV-cache group
FULL_ATTENTION = "full_attention"
GROUP_IDX = 0
DATA_PARALLEL_RANK = 0


class StepEvents:
    """Collects one step's events; ``flush`` publishes them as one batch (the engine's ``KVEventSink``)."""

    __slots__ = ("block_size", "events", "_publish", "_clock")

    def __init__(self, block_size: int, publish: Callable[[KVEventBatch], None],
                 clock: Callable[[], float] = time.time) -> None:
        self.block_size = block_size
        self.events: list[KVEvent] = []
        self._publish = publish
        self._clock = clock

    def stored(self, keys: list[bytes], parent: bytes | None, token_ids: list[int], session_id: str | None,
               cache_salt: str | None) -> None:
        extra: list[tuple[object, ...] | None] = [None] * len(keys)
        if cache_salt:
            extra[0] = (cache_salt,)
        self.events.append(BlockStored(
            block_hashes=list(keys),
            parent_block_hash=parent,
            token_ids=token_ids,
            block_size=self.block_size,
            lora_id=None,
            medium=MEDIUM_GPU,
            lora_name=None,
            extra_keys=extra,
            group_idx=GROUP_IDX,
            kv_cache_spec_kind=FULL_ATTENTION,
            session_id=session_id,
        ))

    def removed(self, key: bytes) -> None:
        self.events.append(BlockRemoved(block_hashes=[key], medium=MEDIUM_GPU, group_idx=GROUP_IDX))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def flush(self) -> None:
        events = self.events
        if not events:
            return
        self.events = []
        self._publish(KVEventBatch(ts=self._clock(), events=events, data_parallel_rank=DATA_PARALLEL_RANK))

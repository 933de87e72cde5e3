"""``StepEvents``: the engine's KV-cache changes of one step, as vLLM 0.32's event Structs.

The engine's ``KVCacheManager`` reports plain data (``backends.engine.kv_cache.KVEventSink``); this
turns each report into the event vLLM's ``BlockPool`` would queue, in the same order, and at the
step's end (``flush``) hands the step's events as one ``KVEventBatch`` to ``publish``. A step with
no event publishes nothing (as vLLM).

The events are shaped as vLLM emits them for a plain decoder model (one full-attention KV-cache
group): ``BlockStored`` with ``lora_id``/``lora_name`` None, ``medium`` "GPU", ``extra_keys`` one
entry per block (the cache salt as ``(salt,)`` on block 0 of a salted prompt, else None),
``group_idx`` 0, ``kv_cache_spec_kind`` "full_attention" and the request's ``session_id``;
``BlockRemoved`` one per key with ``group_idx`` 0.

Block hashes: vLLM 0.32 publishes by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) each hash
as an int, the low 64 bits of the digest read big-endian; with ``=0`` the digest's bytes. We do the
same with our 16-byte blake2b block keys (``backends.engine.kv_cache``; vLLM's digests are sha256):
by default ``int.from_bytes(key, "big") & (2**64 - 1)``, with the variable at 0 the 16 bytes. A
consumer that needs engine-independent keys chains its own from ``token_ids`` and
``parent_block_hash``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from contract.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    ExternalBlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

#: vLLM's switch between int (1, its default) and bytes (0) block hashes in events
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
_LOW_64 = (1 << 64) - 1


def int_block_hashes(environ: Mapping[str, str]) -> bool:
    """vLLM's reading of ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (unset: 1); ValueError if not an integer."""
    raw = environ.get(INT_HASHES_ENV, "1")
    try:
        return bool(int(raw))
    except ValueError:
        raise ValueError(f"{INT_HASHES_ENV} must be 0 (bytes block hashes) or 1 (ints, vLLM's default), "
                         f"got {raw!r}") from None


def external_hash(key: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash``: the low 64 bits of the key, read big-endian."""
    return int.from_bytes(key, "big") & _LOW_64


#: vLLM's ``KVCacheSpecKind.FULL_ATTENTION``: the kind of our one KV-cache group
FULL_ATTENTION = "full_attention"
GROUP_IDX = 0
DATA_PARALLEL_RANK = 0


class StepEvents:
    """Collects one step's events; ``flush`` publishes them as one batch (the engine's ``KVEventSink``)."""

    __slots__ = ("block_size", "events", "_publish", "_clock", "_convert")

    def __init__(self, block_size: int, publish: Callable[[KVEventBatch], None], *, int_hashes: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        self.block_size = block_size
        self.events: list[KVEvent] = []
        self._publish = publish
        self._clock = clock
        self._convert: Callable[[bytes], ExternalBlockHash] | None = external_hash if int_hashes else None

    def stored(self, keys: list[bytes], parent: bytes | None, token_ids: list[int], session_id: str | None,
               cache_salt: str | None) -> None:
        extra: list[tuple[object, ...] | None] = [None] * len(keys)
        if cache_salt:
            extra[0] = (cache_salt,)
        convert = self._convert
        hashes: list[ExternalBlockHash] = list(keys) if convert is None else [convert(k) for k in keys]
        if convert is not None and parent is not None:
            parent_hash: ExternalBlockHash | None = convert(parent)
        else:
            parent_hash = parent
        self.events.append(BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent_hash,
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
        convert = self._convert
        ehash: ExternalBlockHash = key if convert is None else convert(key)
        self.events.append(BlockRemoved(block_hashes=[ehash], medium=MEDIUM_GPU, group_idx=GROUP_IDX))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def flush(self) -> None:
        events = self.events
        if not events:
            return
        self.events = []
        self._publish(KVEventBatch(ts=self._clock(), events=events, data_parallel_rank=DATA_PARALLEL_RANK))

"""vLLM 0.32's KV-cache events on the wire: the one implementation the backends and the router share.

What vLLM does (``vllm/distributed/kv_events.py``, ``vllm/config/kv_events.py``, read for facts):

- With ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`` the
  scheduler collects the KV-cache manager's events of one engine step into one ``KVEventBatch`` and
  hands it to a ``ZmqEventPublisher``; steps without events publish nothing.
- When (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``): ``BlockStored`` when the
  scheduler caches a request's newly full blocks (one event per request and step, for the run of
  blocks that became full, ``parent_block_hash`` = the hash of the block before them; output tokens
  fill blocks too); on a prefix-cache hit, a ``BlockStored`` for the hit blocks (parent ``None``,
  tagged with the *hitting* request's session) **only** when the request asks for it with
  ``vllm_xargs: {"kv_cache_report_mode": "full"}`` (the default, ``"incremental"``, reports no
  hit); ``BlockRemoved`` per block whose hash leaves the cache (evicted when the pool hands the
  block out again); ``AllBlocksCleared`` on a successful ``reset_prefix_cache``. Nothing at start.
- The publisher sends each batch on a ZMQ ``PUB`` socket as a 3-frame multipart message
  ``(topic, seq, payload)``: ``topic`` is the config's topic in UTF-8 (``b""`` by default), ``seq``
  the batch's number as 8 bytes big-endian, counting 0, 1, 2, ... from the publisher's start (one per
  batch), ``payload`` the msgpack of the batch. The publisher's thread sets
  ``data_parallel_rank`` (0 on a single engine) before encoding.
- Bind or connect (``publisher_binds``): an endpoint containing ``*`` or ``::``, or one starting
  ``ipc://`` or ``inproc://``, is **bound** by the PUB socket; any other (``tcp://10.0.0.5:5557``,
  a concrete host) is **connected to**, so the subscriber binds there. ``tcp://*:0`` binds an
  ephemeral port on the node's IP and the resolved endpoint is what the engine reports.
- Replay: when ``replay_endpoint`` is set, a ``ROUTER`` socket is always **bound** there and keeps
  the last ``buffer_steps`` batches ``(seq, payload)``. A client (use a ``DEALER``: the answer is
  many messages, which a ``REQ`` socket would not accept) sends ``(b"", start_seq)``, start_seq as
  8 bytes big-endian; the ROUTER sees exactly 3 frames ``(client_id, b"", start_seq)`` (anything
  else is ignored) and answers, per buffered batch with ``seq >= start_seq`` in order,
  ``(client_id, b"", topic, seq, payload)`` -- the client reads ``(b"", topic, seq, payload)`` --
  then the end marker ``(b"", b"", END_SEQ, b"")`` where ``END_SEQ`` is -1 as 8 signed big-endian
  bytes (``b"\\xff" * 8``). A batch older than the buffer is gone: the replay starts at the oldest
  it still holds (a client that sees its first replayed seq above ``start_seq`` lost batches).
- ``GET /kv_event_sources`` answers, per ready engine, keyed by its data-parallel rank (a JSON
  object key, so a string: ``{"0": {...}}``), the publisher's resolved ``KVEventsConfig`` (all
  eight fields); ``{}`` when events are off (the null publisher reports no config) or on a
  server without an engine.

The payload (msgspec msgpack):

- ``KVEventBatch`` is an array ``[ts: float64, events: array, data_parallel_rank]`` (``array_like``;
  msgspec omits no default in an array, so a ``None`` rank is sent as ``nil`` -- the publisher sets it,
  0 on a single engine).
- Each event is a msgpack **map** (the events are *not* ``array_like``; only the batch is), tagged
  with the class name under the key ``"type"``: ``{"type": "BlockStored", "block_hashes": ...}``.
  ``omit_defaults`` leaves out every field that has a default and holds it; fields without a
  default are always sent, ``nil`` included. Keys come in field order after ``"type"``.
- ``BlockStored``: ``block_hashes`` (ints by default: the low 64 bits of each sha256 digest read
  big-endian, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``; the digests' bytes with ``=0``),
  ``parent_block_hash`` (the hash of the block before the
  first one, ``None`` at the start of a prompt), ``token_ids`` (all the blocks' tokens, in order),
  ``block_size``, ``lora_id``, ``medium`` (``"GPU"``), ``lora_name`` -- these seven always sent --
  then, only when set: ``extra_keys``, ``group_idx`` (vLLM sets the KV-cache group, 0),
  ``kv_cache_spec_kind`` (e.g. ``"full_attention"``), ``kv_cache_spec_sliding_window``,
  ``locality``, ``ownership``, ``session_id`` (the session of the request that stored, or reported
  reusing, the blocks).
- ``BlockRemoved``: ``block_hashes``, ``medium`` (always sent), then when set ``group_idx``,
  ``locality``, ``ownership``. vLLM sends one ``BlockRemoved`` per evicted block.
- ``AllBlocksCleared``: ``{"type": "AllBlocksCleared"}`` (``reset_prefix_cache``).

What we do: these Structs are declared with vLLM's field order, defaults and struct options, so
msgspec encodes them to the same bytes vLLM does and decodes vLLM's bytes (the golden recordings
under ``tests/data/kv_events/`` pin both directions; so does a batch encoded by vLLM's own Structs,
``tests/contract/data/kv_event_batch_vllm_0_32.msgpack``). ``encode_batch``/``decode_batch`` are the only
codec; ``seq_to_bytes``/``seq_from_bytes`` the seq frame; ``parse_kv_events_config`` checks the
flag's JSON the way vLLM's config class does (unknown fields refused, types checked).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from contract.errors import ConfigError

ExternalBlockHash = bytes | int

MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks entered the prefix cache (or, on a reported hit, were reused) for ``session_id``'s request."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks left the prefix cache (evicted for reuse, or replaced)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """The whole prefix cache was dropped (``reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step, in the order they happened."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_batch_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload vLLM would send for ``batch``."""
    return _batch_encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload frame; raises ``msgspec.DecodeError`` (or its ``ValidationError``) on garbage."""
    return _batch_decoder.decode(payload)


SEQ_BYTES: Final = 8
END_SEQ: Final = (-1).to_bytes(SEQ_BYTES, "big", signed=True)


def seq_to_bytes(seq: int) -> bytes:
    """The seq frame: 8 bytes big-endian (``END_SEQ`` for -1)."""
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def seq_from_bytes(raw: bytes) -> int:
    """Read a seq frame (signed: ``END_SEQ`` reads -1); ValueError unless it is 8 bytes."""
    if len(raw) != SEQ_BYTES:
        raise ValueError(f"a seq frame is {SEQ_BYTES} bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


PUBLISHERS: Final = ("null", "zmq")
_ENDPOINT_SCHEMES: Final = ("tcp://", "ipc://", "inproc://")


class KVEventsConfig(msgspec.Struct, kw_only=True):
    """vLLM's ``--kv-events-config`` (``vllm.config.KVEventsConfig``), its fields, order and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        # vLLM: an unset publisher is "zmq" when events are on, "null" otherwise.
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    @property
    def publishes(self) -> bool:
        """True when this config makes the engine publish on ZMQ."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


_FIELDS: Final = frozenset(KVEventsConfig.__struct_fields__)


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """Parse the flag's JSON; ``ConfigError`` naming what is wrong (bad JSON, unknown field, bad type or value)."""
    flag = "--kv-events-config"
    try:
        raw = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{flag}: not valid JSON ({exc}); pass a JSON object such as "
                          '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\'') from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{flag}: expected a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ConfigError(f"{flag}: unknown field(s) {', '.join(map(repr, unknown))}; "
                          f"the fields are {', '.join(KVEventsConfig.__struct_fields__)}")
    try:
        config = msgspec.convert(raw, KVEventsConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    _check(config, flag)
    return config


def _check(config: KVEventsConfig, flag: str) -> None:
    if config.publisher not in PUBLISHERS:
        raise ConfigError(f"{flag}: publisher must be one of {', '.join(PUBLISHERS)}, got {config.publisher!r}")
    for name in ("endpoint", "replay_endpoint"):
        value = getattr(config, name)
        if value is not None and not value.startswith(_ENDPOINT_SCHEMES):
            raise ConfigError(f"{flag}: {name} {value!r} must start with one of {', '.join(_ENDPOINT_SCHEMES)}")
    for name in ("buffer_steps", "max_queue_size"):
        if getattr(config, name) < 1:
            raise ConfigError(f"{flag}: {name} must be at least 1, got {getattr(config, name)}")
    if config.hwm < 0:
        raise ConfigError(f"{flag}: hwm must be 0 (no limit) or more, got {config.hwm}")


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule: the PUB socket binds ``*``/``::``/``ipc://``/``inproc://`` endpoints and connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


KV_EVENT_SOURCES_PATH: Final = "/kv_event_sources"

_sources_decoder = msgspec.json.Decoder(dict[int, KVEventsConfig])
_sources_encoder = msgspec.json.Encoder()


def encode_event_sources(sources: dict[int, KVEventsConfig]) -> bytes:
    """``GET /kv_event_sources``'s body: ``{"<dp rank>": {config}}``, ``{}`` when nothing publishes."""
    return _sources_encoder.encode(sources)


def decode_event_sources(body: bytes) -> dict[int, KVEventsConfig]:
    """Read ``GET /kv_event_sources``: DP rank -> the publisher's config; raises ``msgspec.DecodeError``."""
    return _sources_decoder.decode(body)

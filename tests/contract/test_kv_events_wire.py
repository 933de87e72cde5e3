"""vLLM 0.32's KV-event wire (``contract/kv_events.py``) against an INDEPENDENT decoder.

The decoder here is written from the reference text (``/work/shared/reference/scale-out.md`` §5 and
vLLM's ``distributed/kv_events.py``), not from our Structs: it reads a payload with plain
``msgspec.msgpack.decode`` (no type) and checks what is where -- the batch is an array ``[ts,
events, data_parallel_rank]``; each event is a map tagged ``"type": <class name>``; the fields
without a default are always present (``nil`` included) and every defaulted field that holds its
default is absent (``omit_defaults``); keys come in vLLM's field order. It also builds payloads
the way a vLLM peer lays them out (plain lists and dicts) and checks our codec gives the same bytes.

When helper V's recordings of a live vLLM 0.32 are in ``tests/data/kv_events/``, every recorded
payload must decode with our decoder and re-encode byte for byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from contract.errors import ConfigError
from contract.kv_events import (
    END_SEQ,
    KV_EVENT_SOURCES_PATH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    decode_batch,
    decode_event_sources,
    encode_batch,
    encode_event_sources,
    parse_kv_events_config,
    publisher_binds,
    seq_from_bytes,
    seq_to_bytes,
)

RECORDINGS = Path(__file__).resolve().parents[1] / "data" / "kv_events"

# ---- the independent decoder (from the reference text) ------------------------------------------

#: vLLM 0.32's field order; (name, has a default)
BLOCK_STORED_FIELDS = (
    ("block_hashes", False), ("parent_block_hash", False), ("token_ids", False), ("block_size", False),
    ("lora_id", False), ("medium", False), ("lora_name", False), ("extra_keys", True), ("group_idx", True),
    ("kv_cache_spec_kind", True), ("kv_cache_spec_sliding_window", True), ("locality", True),
    ("ownership", True), ("session_id", True),
)
BLOCK_REMOVED_FIELDS = (
    ("block_hashes", False), ("medium", False), ("group_idx", True), ("locality", True), ("ownership", True),
)
FIELDS = {"BlockStored": BLOCK_STORED_FIELDS, "BlockRemoved": BLOCK_REMOVED_FIELDS, "AllBlocksCleared": ()}


def independent_decode(payload: bytes) -> dict[str, Any]:
    """Read a KVEventBatch payload without our Structs; assert the layout vLLM's encoder produces."""
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3, raw  # array-like: no default omitted, even a None rank
    ts, events, rank = raw
    assert isinstance(ts, float)
    assert rank is None or isinstance(rank, int)
    out = []
    for event in events:
        assert isinstance(event, dict), event
        keys = list(event)
        assert keys[0] == "type", keys
        kind = event["type"]
        assert kind in FIELDS, kind
        fields = FIELDS[kind]
        order = [name for name, _ in fields]
        present = keys[1:]
        assert present == [name for name in order if name in event], (kind, present)  # vLLM's order
        for name, has_default in fields:
            if has_default:
                assert name not in event or event[name] is not None, (kind, name)  # defaults omitted
            else:
                assert name in event, (kind, name)  # required fields always sent
        for h in event.get("block_hashes", ()):
            assert isinstance(h, bytes | int)
        out.append(event)
    return {"ts": ts, "events": out, "data_parallel_rank": rank}


def vllm_layout(ts: float, events: list[dict[str, Any]], rank: int | None) -> bytes:
    """The bytes a vLLM peer sends, built from plain lists and dicts in vLLM's field order."""
    ordered = []
    for event in events:
        kind = event["type"]
        fields = FIELDS[kind]
        item: dict[str, Any] = {"type": kind}
        for name, has_default in fields:
            value = event.get(name)
            if has_default and value is None:
                continue
            item[name] = value
        ordered.append(item)
    return msgspec.msgpack.encode([ts, ordered, rank])


# ---- our events through the independent decoder -------------------------------------------------

H0, H1, H2 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16


def sample_batch() -> KVEventBatch:
    return KVEventBatch(ts=1767225600.125, data_parallel_rank=0, events=[
        BlockStored(block_hashes=[H0, H1], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
                    lora_id=None, medium="GPU", lora_name=None, extra_keys=[("salt-1",), None], group_idx=0,
                    kv_cache_spec_kind="full_attention", session_id="sess-1"),
        BlockStored(block_hashes=[H2], parent_block_hash=H1, token_ids=list(range(32, 48)), block_size=16,
                    lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[H0], medium="GPU", group_idx=0),
        AllBlocksCleared(),
    ])


def test_our_batch_reads_as_vllm_lays_it_out() -> None:
    seen = independent_decode(encode_batch(sample_batch()))
    assert seen["ts"] == 1767225600.125 and seen["data_parallel_rank"] == 0
    stored, chained, removed, cleared = seen["events"]
    assert stored == {
        "type": "BlockStored", "block_hashes": [H0, H1], "parent_block_hash": None, "token_ids": list(range(32)),
        "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [["salt-1"], None],
        "group_idx": 0, "kv_cache_spec_kind": "full_attention", "session_id": "sess-1",
    }
    # every defaulted field left out; the seven required ones sent, nil included
    assert list(chained) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                             "medium", "lora_name"]
    assert chained["parent_block_hash"] == H1
    assert removed == {"type": "BlockRemoved", "block_hashes": [H0], "medium": "GPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}


def test_session_id_is_sent_after_omitted_defaults() -> None:
    """Not array-like: a session with every other optional field unset is just one more key."""
    event = BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[1], block_size=1, lora_id=None,
                        medium="GPU", lora_name=None, session_id="s")
    [seen] = independent_decode(encode_batch(KVEventBatch(ts=0.5, events=[event])))["events"]
    assert list(seen)[-2:] == ["lora_name", "session_id"] and seen["session_id"] == "s"
    assert seen["block_hashes"] == [7]  # int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) pass as ints


def test_a_none_rank_is_sent_as_nil() -> None:
    """``omit_defaults`` omits nothing in an array-like struct: the batch is always three elements."""
    raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(ts=1.0, events=[])))
    assert raw == [1.0, [], None]


def test_our_bytes_equal_a_vllm_peers_bytes_both_ways() -> None:
    """``sample_batch`` written by hand as a vLLM peer lays it out (no Struct involved)."""
    plain = [
        {"type": "BlockStored", "block_hashes": [H0, H1], "parent_block_hash": None, "token_ids": list(range(32)),
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [("salt-1",), None],
         "group_idx": 0, "kv_cache_spec_kind": "full_attention", "session_id": "sess-1"},
        {"type": "BlockStored", "block_hashes": [H2], "parent_block_hash": H1, "token_ids": list(range(32, 48)),
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [H0], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ]
    peer = vllm_layout(1767225600.125, plain, 0)
    batch = sample_batch()
    assert encode_batch(batch) == peer
    assert decode_batch(peer) == batch


def test_a_peer_with_a_future_field_still_decodes() -> None:
    """A newer vLLM adding a defaulted field: maps, so we ignore the key instead of misreading positions."""
    peer = msgspec.msgpack.encode([2.0, [{"type": "BlockRemoved", "block_hashes": [H0], "medium": "GPU",
                                          "future_field": 1}], 0])
    assert decode_batch(peer).events == [BlockRemoved(block_hashes=[H0], medium="GPU")]


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode({"ts": 1}),
                                     msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]])])
def test_garbage_is_a_decode_error(payload: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_batch(payload)


#: ``sample_batch()`` encoded by vLLM 0.32.0's own Structs (``vllm.distributed.kv_events``, msgspec's
#: Encoder, in /work/vllm-venv), so the golden bytes come from vLLM's code, not ours
GOLDEN_VLLM = Path(__file__).parent / "data" / "kv_event_batch_vllm_0_32.msgpack"


def test_vllms_own_encoder_gives_our_bytes() -> None:
    golden = GOLDEN_VLLM.read_bytes()
    assert encode_batch(sample_batch()) == golden
    assert decode_batch(golden) == sample_batch()
    independent_decode(golden)


# ---- frames ----------------------------------------------------------------------------------------

def test_seq_frames_are_8_byte_big_endian() -> None:
    assert seq_to_bytes(0) == b"\x00" * 8
    assert seq_to_bytes(258) == b"\x00" * 6 + b"\x01\x02"
    assert seq_to_bytes(258) == (258).to_bytes(8, "big")  # what vLLM's thread sends (unsigned)
    assert seq_from_bytes(seq_to_bytes(2**40 + 3)) == 2**40 + 3
    assert END_SEQ == b"\xff" * 8 and seq_from_bytes(END_SEQ) == -1
    with pytest.raises(ValueError, match="8 bytes"):
        seq_from_bytes(b"\x00")


@pytest.mark.parametrize(("endpoint", "binds"), [
    ("tcp://*:5557", True), ("tcp://*:0", True), ("tcp://[::]:5557", True), ("ipc:///tmp/kv.sock", True),
    ("inproc://kv", True), ("tcp://127.0.0.1:5557", False), ("tcp://router.svc:5557", False),
])
def test_bind_or_connect_is_vllms_rule(endpoint: str, binds: bool) -> None:
    assert publisher_binds(endpoint) is binds


# ---- the config and /kv_event_sources --------------------------------------------------------------

def test_config_defaults_are_vllms() -> None:
    off = parse_kv_events_config("{}")
    assert off == KVEventsConfig(enable_kv_cache_events=False, publisher="null", endpoint="tcp://*:5557",
                                 replay_endpoint=None, buffer_steps=10_000, hwm=100_000, max_queue_size=100_000,
                                 topic="")
    assert not off.publishes
    on = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert on.publisher == "zmq" and on.publishes  # vLLM: an unset publisher is zmq when enabled
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').publishes


@pytest.mark.parametrize(("text", "message"), [
    ("{nope", "not valid JSON"),
    ("[1]", "expected a JSON object"),
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown field(s) 'endpont'"),
    ('{"buffer_steps": "many"}', "Expected `int`, got `str` - at `$.buffer_steps`"),
    ('{"publisher": "kafka"}', "publisher must be one of null, zmq"),
    ('{"endpoint": "http://x:1"}', "endpoint 'http://x:1' must start with"),
    ('{"max_queue_size": 0}', "max_queue_size must be at least 1"),
])
def test_bad_config_is_a_clear_config_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_kv_events_config(text)
    assert message in str(err.value) and "--kv-events-config" in str(err.value)


def test_event_sources_is_vllms_dict_keyed_by_dp_rank() -> None:
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://10.0.0.5:5557", '
                                    '"replay_endpoint": "tcp://*:5558", "topic": "kv@a"}')
    body = encode_event_sources({0: config})
    assert msgspec.json.decode(body) == {"0": {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://10.0.0.5:5557",
        "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
        "topic": "kv@a"}}
    assert decode_event_sources(body) == {0: config}
    assert decode_event_sources(b"{}") == {} and encode_event_sources({}) == b"{}"
    assert KV_EVENT_SOURCES_PATH == "/kv_event_sources"


# ---- real vLLM's bytes (helper V's recordings) -----------------------------------------------------

def _recorded_lines() -> list[tuple[str, dict[str, Any]]]:
    """Every JSON line of the recordings (``*.jsonl``), named ``file:line``."""
    found: list[tuple[str, dict[str, Any]]] = []
    if not RECORDINGS.is_dir():
        return found
    for path in sorted(RECORDINGS.glob("*.jsonl")):
        for i, line in enumerate(path.read_text().splitlines()):
            if line.strip():
                record = msgspec.json.decode(line)
                if isinstance(record, dict):
                    found.append((f"{path.name}:{i + 1}", record))
    return found


def _recorded_payloads() -> list[tuple[str, bytes]]:
    """Every recorded batch payload: a PUB message's ``payload`` (hex), or the payload frame of a
    replay answer's ``frames`` (hex ``["", topic, seq, payload]``; the end marker has none)."""
    found: list[tuple[str, bytes]] = []
    for name, record in RECORDED_LINES:
        if isinstance(record.get("payload"), str):
            found.append((name, bytes.fromhex(record["payload"])))
        frames = record.get("frames")
        if isinstance(frames, list) and len(frames) == 4 and bytes.fromhex(frames[2]) != END_SEQ:
            found.append((name, bytes.fromhex(frames[3])))
    return found


RECORDED_LINES = _recorded_lines()
RECORDED = _recorded_payloads()
SOURCES = sorted(RECORDINGS.glob("*kv_event_sources*.json")) if RECORDINGS.is_dir() else []
NO_RECORDINGS = "no recordings of a live vLLM 0.32 in tests/data/kv_events/ yet"


@pytest.mark.skipif(not RECORDED, reason=NO_RECORDINGS)
@pytest.mark.parametrize(("name", "payload"), RECORDED, ids=[name for name, _ in RECORDED] or None)
def test_real_vllm_payloads_decode_and_reencode_byte_for_byte(name: str, payload: bytes) -> None:
    independent_decode(payload)
    batch = decode_batch(payload)
    assert encode_batch(batch) == payload, name


@pytest.mark.skipif(not RECORDED_LINES, reason=NO_RECORDINGS)
def test_real_vllm_frames_are_ours() -> None:
    """The seq frames, the topic and the replay's end marker, as recorded."""
    ends = 0
    for name, record in RECORDED_LINES:
        if isinstance(record.get("seq"), str):
            raw = bytes.fromhex(record["seq"])
            assert len(raw) == 8 and seq_to_bytes(seq_from_bytes(raw)) == raw, name
        frames = record.get("frames")
        if isinstance(frames, list) and len(frames) == 4:
            if bytes.fromhex(frames[2]) == END_SEQ:
                assert [bytes.fromhex(f) for f in frames] == [b"", b"", END_SEQ, b""], name
                ends += 1
            else:
                assert frames[0] == "" and seq_from_bytes(bytes.fromhex(frames[2])) >= 0, name
    assert ends > 0  # the recordings hold replays


@pytest.mark.skipif(not SOURCES, reason=NO_RECORDINGS)
@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES] or None)
def test_real_vllm_kv_event_sources_decode_and_reencode_byte_for_byte(path: Path) -> None:
    body = path.read_bytes().strip()
    sources = decode_event_sources(body)
    assert list(sources) == [0] and sources[0].publishes
    assert encode_event_sources(sources) == body

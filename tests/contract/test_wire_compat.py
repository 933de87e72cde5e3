"""The engine core's wire contract (DESIGN.md §4): ``EngineCoreRequest`` as vLLM 0.32.0 sends it.

- golden bytes in ``tests/contract/data/`` pin the exact encoding (regenerate, only on purpose, with
  ``python tests/contract/test_wire_compat.py --write-golden``);
- the 22-field order is pinned (``session_id`` at 20, ``kv_hints`` at 21);
- peers with 20 fields (before PR #48048), 21 fields (PR #48048 as merged) and 23 fields (a future
  field appended) decode our messages and we decode theirs;
- a peer that inserts a field in the middle breaks decoding: a ``ValidationError`` when the types
  differ, a silently wrong ``session_id`` when they match (the hazard raised in PR #48048's review).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from backends.engine.config import EngineConfig
from backends.engine.core import EngineCore
from backends.engine.metrics import EngineMetrics
from backends.engine.request import (
    SESSION_ID_POSITION,
    WIRE_FIELD_COUNT,
    EngineCoreRequest,
    SamplingParams,
    decode_request,
    encode_request,
)

DATA = Path(__file__).parent / "data"
GOLDEN_FULL = DATA / "engine_core_request_v0_32_full.msgpack"
GOLDEN_MINIMAL = DATA / "engine_core_request_v0_32_minimal.msgpack"

EXPECTED_ORDER = (
    "request_id",
    "prompt_token_ids",
    "mm_features",
    "sampling_params",
    "pooling_params",
    "arrival_time",
    "lora_request",
    "cache_salt",
    "data_parallel_rank",
    "prompt_embeds",
    "prompt_is_token_ids",
    "client_index",
    "current_wave",
    "priority",
    "trace_headers",
    "resumable",
    "external_req_id",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "abort_immediately",
    "session_id",
    "kv_hints",
)


def full_request() -> EngineCoreRequest:
    """The documented fixed request behind the 'full' golden file: every position set."""
    return EngineCoreRequest(
        request_id="cmpl-golden-0001-a1b2c3d4",
        prompt_token_ids=[1, 15043, 29892, 3186, 29991, 2],
        mm_features=None,
        sampling_params=SamplingParams(
            n=2,
            temperature=0.0,
            seed=1234,
            max_tokens=8,
            min_tokens=1,
            stop_token_ids=[13],
            extra_args={"kv_transfer_params": {"do_remote_decode": True}},
        ),
        pooling_params=None,
        arrival_time=1767225600.25,
        lora_request=None,
        cache_salt="salt-1",
        data_parallel_rank=0,
        prompt_embeds=None,
        prompt_is_token_ids=[True],
        client_index=1,
        current_wave=2,
        priority=-1,
        trace_headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        resumable=True,
        external_req_id="cmpl-golden-0001",
        reasoning_ended=False,
        reasoning_parser_kwargs={"chat_template_kwargs": {"enable_thinking": False}},
        abort_immediately=False,
        session_id="sess-golden-42",
        kv_hints={"protocol_version": 1, "message_id": "m-1", "actions": []},
    )


def minimal_request() -> EngineCoreRequest:
    """The 'minimal' golden request: required fields only, defaults elsewhere (no session)."""
    return EngineCoreRequest("r-min", [7, 8, 9], None, SamplingParams(), None, 0.5, None, None, None)


# -- peers -----------------------------------------------------------------------------------
class Peer20(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A frontend/core from before PR #48048: ends at ``abort_immediately``."""

    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: list[Any] | None
    sampling_params: SamplingParams | None
    pooling_params: Any | None
    arrival_time: float
    lora_request: Any | None
    cache_salt: str | None
    data_parallel_rank: int | None
    prompt_embeds: Any | None = None
    prompt_is_token_ids: list[bool] | None = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: dict[str, str] | None = None
    resumable: bool = False
    external_req_id: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    abort_immediately: bool = False


class Peer21(Peer20, array_like=True, omit_defaults=True, gc=False):
    """PR #48048 as merged: ``session_id`` appended at 20."""

    session_id: str | None = None


class Peer22(Peer21, array_like=True, omit_defaults=True, gc=False):
    kv_hints: Any | None = None


class Peer23(Peer22, array_like=True, omit_defaults=True, gc=False):
    """A future peer: one more field appended after ``kv_hints``."""

    future_field: str | None = None


class PeerInsertedTypeClash(msgspec.Struct, array_like=True, gc=False):
    """A peer that inserted a ``str`` field at 11, where we expect ``client_index: int``."""

    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: list[Any] | None
    sampling_params: SamplingParams | None
    pooling_params: Any | None
    arrival_time: float
    lora_request: Any | None
    cache_salt: str | None
    data_parallel_rank: int | None
    prompt_embeds: Any | None = None
    prompt_is_token_ids: list[bool] | None = None
    tenant: str | None = None  # <- inserted in the middle
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: dict[str, str] | None = None
    resumable: bool = False
    external_req_id: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    abort_immediately: bool = False
    session_id: str | None = None
    kv_hints: Any | None = None


class PeerInsertedBeforeSession(Peer20, array_like=True, gc=False):
    """A peer that inserted a ``str | None`` field at 20, pushing ``session_id`` to 21."""

    tenant: str | None = None  # <- inserted where session_id belongs
    session_id: str | None = None
    kv_hints: Any | None = None


def _peer_message(cls: type, **extra: Any) -> bytes:
    base = {f: getattr(full_request(), f) for f in EXPECTED_ORDER[:20]}
    return msgspec.msgpack.encode(cls(**base, **extra))


# -- the contract ----------------------------------------------------------------------------
def test_field_order_is_pinned() -> None:
    assert EngineCoreRequest.__struct_fields__ == EXPECTED_ORDER
    assert len(EXPECTED_ORDER) == WIRE_FIELD_COUNT == 22
    assert EXPECTED_ORDER.index("session_id") == SESSION_ID_POSITION == 20
    assert EXPECTED_ORDER.index("kv_hints") == 21
    config = EngineCoreRequest.__struct_config__
    assert config.array_like and config.omit_defaults and not config.forbid_unknown_fields
    # positions 0-8 required, 9-21 defaulted
    assert EngineCoreRequest.__struct_defaults__.__len__() == 13


def test_golden_bytes_are_stable() -> None:
    for request, path in ((full_request(), GOLDEN_FULL), (minimal_request(), GOLDEN_MINIMAL)):
        data = encode_request(request)
        assert data == path.read_bytes(), f"{path.name} changed: the wire encoding moved"
        assert decode_request(path.read_bytes()) == request


def test_golden_bytes_are_a_22_element_array_with_session_at_20() -> None:
    data = GOLDEN_FULL.read_bytes()
    # msgpack array16 header: omit_defaults has no effect on array_like structs, all 22 are sent
    assert data[:3] == b"\xdc\x00\x16"
    raw = msgspec.msgpack.decode(data)
    assert len(raw) == 22
    assert raw[20] == "sess-golden-42"
    assert raw[21] == {"protocol_version": 1, "message_id": "m-1", "actions": []}
    minimal = msgspec.msgpack.decode(GOLDEN_MINIMAL.read_bytes())
    assert len(minimal) == 22 and minimal[20] is None and minimal[21] is None


def test_minimal_golden_matches_hand_written_msgpack() -> None:
    """Independent of our encoder: the minimal message, position by position."""
    expected = bytes.fromhex(
        "dc0016"  # array of 22
        "a5722d6d696e"  # 0 request_id "r-min"
        "93070809"  # 1 prompt_token_ids [7, 8, 9]
        "c0"  # 2 mm_features None
        "80"  # 3 sampling_params {} (a map; its defaults are omitted)
        "c0"  # 4 pooling_params None
        "cb3fe0000000000000"  # 5 arrival_time 0.5 (float64)
        "c0c0c0"  # 6-8 lora_request, cache_salt, data_parallel_rank None
        "c0c0"  # 9-10 prompt_embeds, prompt_is_token_ids None
        "000000"  # 11-13 client_index, current_wave, priority 0
        "c0"  # 14 trace_headers None
        "c2"  # 15 resumable False
        "c0c0c0"  # 16-18 external_req_id, reasoning_ended, reasoning_parser_kwargs None
        "c2"  # 19 abort_immediately False
        "c0"  # 20 session_id None
        "c0"  # 21 kv_hints None
    )
    assert GOLDEN_MINIMAL.read_bytes() == expected
    assert decode_request(expected) == minimal_request()


def test_too_short_message_is_rejected() -> None:
    short = msgspec.msgpack.encode(["r", [1], None, None, None, 0.0, None, None])  # 8 < 9 required
    with pytest.raises(msgspec.ValidationError, match="at least length 9"):
        decode_request(short)


# -- compatible peers ------------------------------------------------------------------------
@pytest.mark.parametrize("peer", [Peer20, Peer21, Peer22, Peer23])
def test_peers_decode_our_messages(peer: type) -> None:
    ours = full_request()
    theirs = msgspec.msgpack.decode(encode_request(ours), type=peer)
    for field in peer.__struct_fields__:
        if field in EXPECTED_ORDER:
            assert getattr(theirs, field) == getattr(ours, field), field
    if "session_id" in peer.__struct_fields__:
        assert theirs.session_id == "sess-golden-42"
    if peer is Peer23:
        assert theirs.future_field is None


def test_we_decode_a_20_field_peer_session_defaults_to_none() -> None:
    data = _peer_message(Peer20)
    assert len(msgspec.msgpack.decode(data)) == 20
    ours = decode_request(data)
    assert ours.session_id is None and ours.kv_hints is None
    assert ours.request_id == full_request().request_id and ours.abort_immediately is False


def test_we_decode_a_21_field_peer_session_lands() -> None:
    data = _peer_message(Peer21, session_id="sess-from-21")
    assert len(msgspec.msgpack.decode(data)) == 21
    ours = decode_request(data)
    assert ours.session_id == "sess-from-21"
    assert ours.kv_hints is None


def test_we_decode_a_23_field_peer_extra_field_skipped() -> None:
    data = _peer_message(Peer23, session_id="sess-from-23", kv_hints={"a": 1}, future_field="new")
    assert len(msgspec.msgpack.decode(data)) == 23
    ours = decode_request(data)
    assert ours.session_id == "sess-from-23"
    assert ours.kv_hints == {"a": 1}
    assert ours.priority == full_request().priority


@pytest.mark.parametrize(
    ("peer", "extra", "expected_session"),
    [(Peer20, {}, None), (Peer21, {"session_id": "s-21"}, "s-21"), (Peer23, {"session_id": "s-23"}, "s-23")],
)
def test_engine_core_accepts_peer_bytes(peer: type, extra: dict[str, Any], expected_session: str | None) -> None:
    """The bytes go through the real core: the session lands in its accounting (or nowhere)."""
    core = EngineCore(EngineConfig(speed=0), EngineMetrics(CollectorRegistry(), "m", 0, 10))
    core.add_request(_peer_message(peer, **extra))
    (req,) = core.requests.values()
    assert req.session_id == expected_session
    assert [c.session_id for c in req.children] == [expected_session] * req.n
    while core.requests:
        core.step()
    if expected_session is None:
        assert len(core.sessions) == 0
    else:
        assert core.sessions.get(expected_session) is not None


# -- incompatible peers ----------------------------------------------------------------------
def test_field_inserted_in_the_middle_with_other_type_fails_loudly() -> None:
    base = {f: getattr(full_request(), f) for f in EXPECTED_ORDER}
    data = msgspec.msgpack.encode(PeerInsertedTypeClash(**base, tenant="acme"))
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int`, got `str` - at `\$\[11\]`"):
        decode_request(data)


def test_field_inserted_in_the_middle_with_same_type_is_silently_wrong() -> None:
    data = _peer_message(PeerInsertedBeforeSession, tenant="tenant-a", session_id="sess-real")
    ours = decode_request(data)  # no error at all ...
    assert ours.session_id == "tenant-a"  # ... but the session is the peer's tenant
    assert ours.kv_hints == "sess-real"  # and the real session id sits in kv_hints
    # the other direction: our session_id lands in their inserted field, and their session_id
    # takes our kv_hints (None here), so they see no session at all
    ours_msg = encode_request(msgspec.structs.replace(full_request(), kv_hints=None))
    theirs = msgspec.msgpack.decode(ours_msg, type=PeerInsertedBeforeSession)
    assert theirs.tenant == "sess-golden-42"
    assert theirs.session_id is None


def _write_golden() -> None:  # pragma: no cover - run by hand only
    DATA.mkdir(exist_ok=True)
    GOLDEN_FULL.write_bytes(encode_request(full_request()))
    GOLDEN_MINIMAL.write_bytes(encode_request(minimal_request()))
    print(f"wrote {GOLDEN_FULL} and {GOLDEN_MINIMAL}")


if __name__ == "__main__":  # pragma: no cover
    if "--write-golden" in sys.argv:
        _write_golden()
    else:
        print("usage: python tests/contract/test_wire_compat.py --write-golden")

"""``contract/kv_events.py`` against what a live vLLM 0.32 sent (``tests/data/kv_events/``, see its README).

Every recorded payload (live stream and replay) decodes with our codec and re-encodes to the same bytes; the
frames around it (topic, seq, replay envelope, END_SEQ) read with our helpers; and the behaviour the router's
index relies on is pinned to the recordings: int block hashes, parents that were stored before, one
``BlockRemoved`` per evicted block of a stored hash, the session tag per request channel, prefix hits reported
only in ``kv_cache_report_mode=full``, ``AllBlocksCleared`` on a reset, seq from 0 after a restart. Last, the
recorded stream goes through the router's ``KVIndex`` (``router.kv.index``), which must find every chain vLLM
stored.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from contract.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    decode_batch,
    decode_event_sources,
    encode_batch,
    publisher_binds,
    seq_from_bytes,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "kv_events"
RUNS = ("ipc", "tcp")
TOPIC = b"kv@tiny"


@dataclass(frozen=True)
class Message:
    run: str           # "ipc" / "tcp": which recording
    engine_run: int    # engine start within the recording
    phase: str
    topic: bytes
    seq: int
    payload: bytes

    @property
    def batch(self) -> KVEventBatch:
        return decode_batch(self.payload)


def _stream(run: str) -> list[Message]:
    out = []
    for line in (DATA / f"vllm032_{run}_stream.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.append(Message(run, r["engine_run"], r["phase"], bytes.fromhex(r["topic"]),
                           seq_from_bytes(bytes.fromhex(r["seq"])), bytes.fromhex(r["payload"])))
    return out


def _replays(run: str) -> dict[str, list[list[bytes]]]:
    out: dict[str, list[list[bytes]]] = collections.defaultdict(list)
    for line in (DATA / f"vllm032_{run}_replay.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["source"]].append([bytes.fromhex(f) for f in r["frames"]])
    return dict(out)


def _http(run: str) -> list[dict[str, Any]]:
    return json.loads((DATA / f"vllm032_{run}_http.json").read_text())


STREAMS = {run: _stream(run) for run in RUNS}
REPLAYS = {run: _replays(run) for run in RUNS}


def _all_payloads() -> list[tuple[str, bytes]]:
    found = [(f"{m.run}:seq{m.seq}:run{m.engine_run}", m.payload) for run in RUNS for m in STREAMS[run]]
    for run in RUNS:
        for source, messages in REPLAYS[run].items():
            for i, frames in enumerate(messages):
                if frames[-1]:  # the END marker's payload frame is empty
                    found.append((f"{run}:{source}:{i}", frames[-1]))
    return found


PAYLOADS = _all_payloads()


def test_the_recordings_are_there_and_not_trivial() -> None:
    assert len(STREAMS["ipc"]) > 50 and len(STREAMS["tcp"]) > 50
    kinds = collections.Counter(type(e).__name__ for run in RUNS for m in STREAMS[run] for e in m.batch.events)
    assert kinds["BlockStored"] > 50 and kinds["BlockRemoved"] > 100 and kinds["AllBlocksCleared"] == 1


@pytest.mark.parametrize(("name", "payload"), PAYLOADS, ids=[n for n, _ in PAYLOADS])
def test_every_recorded_payload_decodes_and_reencodes_byte_for_byte(name: str, payload: bytes) -> None:
    batch = decode_batch(payload)
    assert isinstance(batch, KVEventBatch)
    assert encode_batch(batch) == payload, name


@pytest.mark.parametrize("run", RUNS)
def test_stream_frames_topic_and_contiguous_seq_from_zero_per_engine_start(run: str) -> None:
    by_engine: dict[int, list[int]] = collections.defaultdict(list)
    for m in STREAMS[run]:
        assert m.topic == TOPIC
        assert m.batch.data_parallel_rank == 0
        by_engine[m.engine_run].append(m.seq)
    for seqs in by_engine.values():
        assert seqs == list(range(len(seqs)))
    # the tcp recording restarted the engine: the second engine counts from 0 again, with no event marking it
    assert len(by_engine) == (2 if run == "tcp" else 1)


@pytest.mark.parametrize("run", RUNS)
def test_block_hashes_are_uint64_ints_and_stored_events_have_vllms_shape(run: str) -> None:
    for m in STREAMS[run]:
        for e in m.batch.events:
            if isinstance(e, BlockStored):
                assert all(type(h) is int and 0 <= h < 1 << 64 for h in e.block_hashes)
                assert e.parent_block_hash is None or type(e.parent_block_hash) is int
                assert e.block_size == 32 and len(e.token_ids) == e.block_size * len(e.block_hashes)
                assert e.medium == "GPU" and e.group_idx == 0 and e.kv_cache_spec_kind == "full_attention"
                assert e.lora_id is None and e.lora_name is None and e.extra_keys == [None] * len(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert len(e.block_hashes) == 1 and type(e.block_hashes[0]) is int
                assert e.medium == "GPU" and e.group_idx == 0


@pytest.mark.parametrize("run", RUNS)
def test_parents_were_stored_before_and_removals_never_outnumber_stores(run: str) -> None:
    """Applied in order per engine run: a non-nil parent is a hash stored earlier (since the last clear), and
    counting stores +1 / removals -1 per hash never goes negative (the same hash can live in several blocks)."""
    live: collections.Counter[int] = collections.Counter()
    engine = None
    duplicates = 0
    for m in STREAMS[run]:
        if m.engine_run != engine:
            engine, live = m.engine_run, collections.Counter()
        for e in m.batch.events:
            if isinstance(e, AllBlocksCleared):
                live = collections.Counter()
            elif isinstance(e, BlockStored):
                assert e.parent_block_hash is None or e.parent_block_hash in live
                for h in e.block_hashes:
                    duplicates += live[h] > 0
                    live[h] += 1
            else:
                (h,) = e.block_hashes
                assert live[h] > 0, f"seq {m.seq}: removed {h} that was not stored"
                live[h] -= 1
    if run == "ipc":
        assert duplicates > 0  # identical prompts re-store their recomputed last block under the same hash


def _window_session(http: list[dict[str, Any]], ts: float) -> tuple[bool, str | None]:
    hits = [r for r in http if r["path"] in ("/v1/chat/completions", "/v1/completions")
            and r["t_start"] - 0.002 <= ts <= r["t_end"] + 0.002]
    if len(hits) != 1:
        return False, None
    return True, hits[0]["session"]


@pytest.mark.parametrize("run", RUNS)
def test_block_stored_carries_the_session_of_the_request_that_ran(run: str) -> None:
    http = _http(run)
    checked = collections.Counter()
    for m in STREAMS[run]:
        batch = m.batch
        single, session = _window_session(http, batch.ts)
        if not single:
            continue
        for e in batch.events:
            if isinstance(e, BlockStored):
                assert e.session_id == session, (m.seq, m.phase)
                checked[m.phase] += 1
    if run == "ipc":
        for phase in ("multiturn_body", "multiturn_header", "multiturn_xargs", "multiturn_none",
                      "body_beats_header", "completions_header", "full_report_xargs_session"):
            assert checked[phase] > 0, phase
        tags = {e.session_id for m in STREAMS[run] if m.phase == "body_beats_header"
                for e in m.batch.events if isinstance(e, BlockStored)}
        assert tags == {"sess-prec-body", "sess-prec-body2"}  # the body's id, not the header's
        assert {e.session_id for m in STREAMS[run] if m.phase == "multiturn_none"
                for e in m.batch.events if isinstance(e, BlockStored)} == {None}


def _stored(run: str, phase: str) -> list[BlockStored]:
    return [e for m in STREAMS[run] if m.phase == phase for e in m.batch.events if isinstance(e, BlockStored)]


def test_a_prefix_hit_is_reported_only_in_full_mode_with_the_new_session() -> None:
    first = _stored("ipc", "first_turn_body")
    first_hashes = [h for e in first for h in e.block_hashes]
    assert first[0].parent_block_hash is None and first[0].session_id == "sess-body-1"
    # another session, same prompt, default (incremental) mode: only the recomputed last block, with its parent
    other = _stored("ipc", "shared_prefix_other_session")
    assert [(e.block_hashes, e.parent_block_hash, e.session_id) for e in other] == [
        ([first_hashes[-1]], first_hashes[-2], "sess-body-2")]
    # kv_cache_report_mode=full: the hit blocks come again from block 0 (parent nil) tagged with the new session
    full = _stored("ipc", "full_report_other_session")
    assert full[0].parent_block_hash is None and full[0].session_id == "sess-full-1"
    assert full[0].block_hashes == first_hashes[:len(full[0].block_hashes)] and len(full[0].block_hashes) == 6
    # later turns of one conversation in default mode: never a block-0 report
    for phase in ("multiturn_body", "multiturn_header", "multiturn_xargs", "multiturn_none"):
        assert all(e.parent_block_hash is not None for e in _stored("ipc", phase)[2:]), phase


def test_eviction_removes_per_block_before_the_store_that_needed_room() -> None:
    mixed = 0
    for m in STREAMS["ipc"]:
        kinds = [type(e).__name__ for e in m.batch.events]
        if "BlockRemoved" in kinds and "BlockStored" in kinds:
            mixed += 1
            last_removed = max(i for i, k in enumerate(kinds) if k == "BlockRemoved")
            assert last_removed < kinds.index("BlockStored")
    assert mixed > 5
    assert sum(isinstance(e, BlockRemoved) for m in STREAMS["ipc"] if m.phase == "eviction"
               for e in m.batch.events) > 90


def test_reset_prefix_cache_publishes_all_blocks_cleared_with_the_next_step() -> None:
    http = _http("tcp")
    (reset,) = [r for r in http if r["path"] == "/reset_prefix_cache"]
    assert reset["status"] == 200 and json.loads(reset["response"]) == {"success": True}
    (msg,) = [m for m in STREAMS["tcp"] if any(isinstance(e, AllBlocksCleared) for e in m.batch.events)]
    events = msg.batch.events
    assert isinstance(events[0], AllBlocksCleared) and msg.payload.count(b"AllBlocksCleared") == 1
    assert msg.batch.ts > reset["t_end"] and msg.phase == "tcp_after_reset"
    # the conversation's first blocks are stored again from block 0 in that same batch
    assert isinstance(events[1], BlockStored) and events[1].parent_block_hash is None
    # without dev mode vLLM has no such route
    (ipc_reset,) = [r for r in _http("ipc") if r["path"] == "/reset_prefix_cache"]
    assert ipc_reset["status"] == 404


def test_identical_content_hashes_alike_across_engines_and_restarts() -> None:
    firsts = [m.batch.events[0] for run in RUNS for m in STREAMS[run] if m.seq == 0]
    assert len(firsts) == 3  # ipc engine, tcp engine, tcp engine after restart
    assert all(isinstance(e, BlockStored) for e in firsts)
    assert len({tuple(e.block_hashes) for e in firsts if isinstance(e, BlockStored)}) == 1


def _split_replay(messages: list[list[bytes]]) -> tuple[list[tuple[bytes, int, bytes]], list[bytes]]:
    *batches, end = messages
    out = []
    for frames in batches:
        assert len(frames) == 4 and frames[0] == b""
        out.append((frames[1], seq_from_bytes(frames[2]), frames[3]))
    return out, end


@pytest.mark.parametrize(("run", "source", "start", "engine_run"), [
    ("ipc", "replay_from_0", 0, 0), ("ipc", "replay_from_5", 5, 0),
    ("tcp", "tcp_replay_from_0", 0, 0), ("tcp", "tcp_replay_from_3", 3, 0),
    ("tcp", "tcp_replay_after_restart", 0, 1),
])
def test_replay_resends_the_live_bytes_from_start_seq_then_end_seq(run: str, source: str, start: int,
                                                                    engine_run: int) -> None:
    batches, end = _split_replay(REPLAYS[run][source])
    assert end == [b"", b"", END_SEQ, b""]
    live = {m.seq: m.payload for m in STREAMS[run] if m.engine_run == engine_run}
    assert [seq for _, seq, _ in batches] == [s for s in sorted(live) if s >= start][:len(batches)]
    assert batches and batches[0][1] == start
    for topic, seq, payload in batches:
        assert topic == TOPIC and payload == live[seq]


def test_a_req_socket_gets_the_end_marker_without_the_delimiter() -> None:
    (frames,) = REPLAYS["ipc"]["replay_req_beyond"]
    assert frames == [b"", END_SEQ, b""]
    assert seq_from_bytes(END_SEQ) == -1


@pytest.mark.parametrize("run", RUNS)
def test_kv_event_sources_body_and_the_bind_rule(run: str) -> None:
    sources = decode_event_sources((DATA / f"vllm032_{run}_kv_event_sources.json").read_bytes())
    assert list(sources) == [0]
    cfg = sources[0]
    assert isinstance(cfg, KVEventsConfig) and cfg.publishes and cfg.topic == "kv@tiny"
    assert (cfg.buffer_steps, cfg.hwm, cfg.max_queue_size) == (10_000, 100_000, 100_000)
    assert cfg.replay_endpoint is not None
    # ipc: vLLM bound it and the recorder's SUB connected; tcp://127.0.0.1:<port>: vLLM connected, the SUB bound
    assert publisher_binds(cfg.endpoint) is (run == "ipc")
    assert cfg.endpoint.startswith("ipc://" if run == "ipc" else "tcp://127.0.0.1:")


def _samples(name: str) -> dict[str, float]:
    text = (DATA / name).read_text()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("vllm:") and not s.labels.get("le") and "reason" not in s.labels}


@pytest.mark.parametrize("name", ["vllm032_metrics_idle.txt", "vllm032_metrics_load.txt"])
def test_metrics_samples_carry_the_load_series(name: str) -> None:
    s = _samples(name)
    for series in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total",
                   "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count",
                   "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"):
        assert series in s, series
    assert 0.0 <= s["vllm:kv_cache_usage_perc"] <= 1.0
    if name.endswith("load.txt"):
        assert s["vllm:num_requests_running"] >= 1 and s["vllm:num_requests_waiting"] >= 1
        assert s["vllm:kv_cache_usage_perc"] > 0.1


@pytest.mark.parametrize("run", RUNS)
def test_the_routers_index_finds_every_chain_vllm_stored(run: str) -> None:
    """Real vLLM bytes through the router's ``KVIndex``: each stored run of blocks, rebuilt from block 0 along
    its parents, is found whole by ``prefix_tokens`` right after it arrives (the index keys content by token
    ids, so vLLM's int hashes only need to resolve parents), and the block size is learned from the events."""
    from router.kv.index import KVIndex

    url = "http://127.0.0.1:9"
    index = KVIndex(max_blocks=100_000, block_size_hint=16)
    chains: dict[int, list[int]] = {}
    engine = None
    checked = 0
    for m in STREAMS[run]:
        if m.engine_run != engine:
            if engine is not None:
                index.reset_backend(url)
            engine, chains = m.engine_run, {}
        index.apply(url, m.batch)
        for e in m.batch.events:
            if not isinstance(e, BlockStored):
                continue
            head = [] if e.parent_block_hash is None else chains[e.parent_block_hash]
            tokens = head + list(e.token_ids)
            for i, h in enumerate(e.block_hashes):
                assert isinstance(h, int)
                chains[h] = tokens[:len(head) + (i + 1) * e.block_size]
            assert index.prefix_tokens(tokens).get(url, 0) == len(tokens), (m.seq, m.phase)
            checked += 1
    assert index.block_size == 32 and checked > 30
    if run == "ipc":
        # the first turn: 6 prefill blocks + 1 filled while decoding, all tagged with its session
        first = KVIndex(max_blocks=1_000, block_size_hint=16)
        for m in STREAMS[run][:2]:
            first.apply(url, m.batch)
        assert dict(first.session_tokens("sess-body-1")) == {url: 224}

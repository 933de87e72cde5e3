"""``session-backend --kv-events-config`` as a real process: start-up errors (exit 2 for a bad flag,
1 for a socket that cannot be bound), then a live engine publishing to a SUB socket over ipc://,
``GET /kv_event_sources``, the replay socket, and a clean SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
import zmq

from backends.__main__ import main, parse_args
from contract.kv_events import END_SEQ, BlockStored, decode_batch, decode_event_sources, seq_from_bytes, seq_to_bytes
from tests.backends.kv_event_client import IpcDir
from tests.backends.test_backend_process import REPO, Backend


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "backends", "--host", "127.0.0.1", "--port", "0", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("flag", "message"), [
    ("{not json", "--kv-events-config: not valid JSON"),
    ('{"enable_kv_cache_events": true, "replay": "x"}', "--kv-events-config: unknown field(s) 'replay'"),
    ('{"enable_kv_cache_events": "yes"}', "Expected `bool`, got `str` - at `$.enable_kv_cache_events`"),
])
def test_a_bad_kv_events_config_stops_start_up_with_status_2(flag: str, message: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--kv-events-config", flag])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_render_servers_refuse_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--role", "render", "--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert stop.value.code == 2 and "needs an engine" in capsys.readouterr().err


def test_a_good_flag_is_parsed_into_vllms_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    args = parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "topic": "kv@a"}'])
    assert args.kv_events_config.publishes and args.kv_events_config.topic == "kv@a"
    assert args.kv_events_int_hashes is True
    assert parse_args([]).kv_events_config is None
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert parse_args(["--kv-events-config", '{"enable_kv_cache_events": true}']).kv_events_int_hashes is False


def test_a_bad_int_hashes_variable_stops_start_up(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "maybe")
    with pytest.raises(SystemExit) as stop:
        main(["--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert stop.value.code == 2 and "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES must be 0" in capsys.readouterr().err


@pytest.fixture
def ipc() -> Iterator[IpcDir]:
    folder = IpcDir()
    yield folder
    folder.remove()


@pytest.mark.slow
def test_an_endpoint_that_cannot_be_bound_exits_1(ipc: IpcDir) -> None:
    config = {"enable_kv_cache_events": True, "endpoint": ipc.endpoint("no/such/dir/pub")}
    out = run_cli("--speed", "0", "--kv-events-config", json.dumps(config))
    assert out.returncode == 1 and "cannot bind ipc://" in out.stderr, out.stderr


@pytest.mark.slow
def test_a_backend_process_publishes_its_kv_events(ipc: IpcDir) -> None:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ipc.endpoint("pub"),
              "replay_endpoint": ipc.endpoint("replay"), "topic": "kv@proc"}
    backend = Backend("--speed", "0", "--block-size", "16", "--kv-events-config", json.dumps(config))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        status, body = backend.get("/kv_event_sources")
        assert status == 200 and {k: v.endpoint for k, v in decode_event_sources(body).items()} == {
            0: ipc.endpoint("pub")}
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@proc")
        sub.connect(ipc.endpoint("pub"))
        deadline = time.monotonic() + 10
        while not sub.poll(50):  # the subscription is live once a reset's batch arrives
            assert time.monotonic() < deadline, "no KV event reached the subscriber"
            backend.post("/reset_prefix_cache", {})
        sub.recv_multipart()
        while sub.poll(50):  # resets sent while the subscription came up
            sub.recv_multipart()
        req = urllib.request.Request(backend.url + "/v1/chat/completions", data=json.dumps({
            "model": "tiny-llama", "max_tokens": 3,
            "messages": [{"role": "user", "content": "Say something about rivers and lakes, at length. " * 3}],
        }).encode(), headers={"Content-Type": "application/json", "X-Session-ID": "proc-session"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
        seen: list[tuple[int, BlockStored]] = []
        while not any(e.session_id == "proc-session" for _, e in seen):
            assert sub.poll(5000), "no BlockStored for the chat request"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@proc"
            seen += [(seq_from_bytes(seq), e) for e in decode_batch(payload).events if isinstance(e, BlockStored)]
        seq, event = next((s, e) for s, e in seen if e.session_id == "proc-session")
        assert event.parent_block_hash is None and event.block_size == 16 and len(event.token_ids) >= 16
        # the replay socket has that batch, then the end marker
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(ipc.endpoint("replay"))
        dealer.send_multipart([b"", seq_to_bytes(seq)])
        answers = []
        while not answers or answers[-1][2] != END_SEQ:
            assert dealer.poll(5000), "the replay socket did not answer"
            answers.append(dealer.recv_multipart())
        dealer.close(linger=0)
        assert seq_from_bytes(answers[0][2]) == seq and answers[0][1] == b"kv@proc"
        assert any(e == event for e in decode_batch(answers[0][3]).events)
        assert backend.stop(signal.SIGTERM) == 0
        assert not any("Traceback" in line for line in backend.stderr), "".join(backend.stderr)
    finally:
        sub.close(linger=0)
        ctx.term()
        if backend.proc.poll() is None:
            os.kill(backend.proc.pid, signal.SIGKILL)
            backend.proc.wait(10)

"""session-backend as a real process: start (``--port 0`` prints the bound port), serve, no
per-request logs, graceful SIGTERM/SIGINT (in-flight streams finish), abort on a real disconnect."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.slow

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "../.."))


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` until true; fail after ``timeout`` seconds (a bound, not a sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


class Backend:
    """A backend process started by a test, stopped by its PID."""

    def __init__(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "backends", "--host", "127.0.0.1", "--port", "0", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.stderr: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines), daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()
        try:
            line = self._lines.get(timeout=20)
        except queue.Empty:
            self.stop(signal.SIGKILL)
            raise AssertionError(f"backend printed nothing: {''.join(self.stderr)}") from None
        assert line.startswith("session-backend listening on http://127.0.0.1:"), line
        self.first_line = line
        self.port = int(line.split("http://127.0.0.1:")[1].split()[0])
        self.url = f"http://127.0.0.1:{self.port}"

    @staticmethod
    def _pump(stream: Any, sink: queue.Queue[str]) -> None:
        for line in stream:
            sink.put(line)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)
                raise AssertionError("backend did not stop in time") from None
        return int(self.proc.returncode)

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def post(self, path: str, body: dict[str, Any], timeout: float = 10) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())

    def metric(self, name: str, **labels: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        _, text = self.get("/metrics")
        for family in text_string_to_metric_families(text.decode()):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        return 0.0


@pytest.fixture
def backends() -> Iterator[list[Backend]]:
    started: list[Backend] = []
    yield started
    for b in started:
        b.stop(signal.SIGKILL)


def test_start_serve_and_stop(backends: list[Backend]) -> None:
    b = Backend("--speed", "0", "--model", "proc-model", "--role", "both", "--block-size", "16",
                "--num-blocks", "512", "--max-model-len", "2048", "--max-num-seqs", "64",
                "--max-num-batched-tokens", "4096", "--log-level", "INFO")
    backends.append(b)
    assert "model=proc-model" in b.first_line
    assert b.get("/health") == (200, b"")
    status, models = b.get("/v1/models")
    assert status == 200 and json.loads(models)["data"][0]["max_model_len"] == 2048
    for i in range(20):
        status, data = b.post("/v1/completions", {"prompt": f"hello {i}", "max_tokens": 3})
        assert status == 200 and data["usage"]["completion_tokens"] >= 1
    assert b.stop(signal.SIGTERM) == 0
    err = "".join(b.stderr)
    assert "POST /v1/completions" not in err  # no access log, no per-request INFO lines
    assert "Traceback" not in err


def test_sigint_stops_too(backends: list[Backend]) -> None:
    b = Backend("--speed", "0")
    backends.append(b)
    assert b.get("/health")[0] == 200
    assert b.stop(signal.SIGINT) == 0


def test_bad_arguments_fail_fast() -> None:
    for args in (["--speed", "-1"], ["--role", "sideways"], ["--num-blocks", "0"]):
        proc = subprocess.run([sys.executable, "-m", "backends", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=30)
        assert proc.returncode == 2 and "error" in proc.stderr, (args, proc.stderr)


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "backends", "--port", str(port), "--speed", "0"], cwd=REPO,
                              capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "cannot listen" in proc.stderr


def test_sigterm_lets_an_in_flight_stream_finish(backends: list[Backend]) -> None:
    b = Backend("--speed", "1", "--shutdown-timeout", "20")
    backends.append(b)
    body = json.dumps({"prompt": "finish me", "max_tokens": 40, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(b.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        first = resp.readline()
        assert first.startswith(b"data: ")
        os.kill(b.proc.pid, signal.SIGTERM)
        rest = resp.read()
    frames = [f for f in (first + rest).split(b"\n\n") if f.strip()]
    assert frames[-1] == b"data: [DONE]"
    tokens = sum(len(json.loads(f[6:])["choices"][0]["text"].split()) for f in frames[:-1])
    assert tokens == 40
    assert b.proc.wait(20) == 0


def test_real_disconnect_aborts_in_the_process(backends: list[Backend]) -> None:
    b = Backend("--speed", "1", "--model", "m")
    backends.append(b)
    labels = {"model_name": "m", "engine": "0"}
    for stream in (False, True):
        before = b.metric("vllm:request_success_total", finished_reason="abort", **labels)
        sock = socket.create_connection(("127.0.0.1", b.port), timeout=5)
        payload = json.dumps({"prompt": "long", "max_tokens": 2000, "ignore_eos": True, "stream": stream}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        wait_until(lambda: b.metric("vllm:num_requests_running", **labels) == 1, timeout=10,
                   what="the request to run")
        sock.close()
        wait_until(lambda: b.metric("vllm:request_success_total", finished_reason="abort", **labels) == before + 1
                   and b.metric("vllm:num_requests_running", **labels) == 0, timeout=10,
                   what="the abort")
    assert b.stop() == 0

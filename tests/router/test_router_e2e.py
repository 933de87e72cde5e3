"""The router and real backends as separate processes: stickiness, prefix-cache hits, disconnects."""

from __future__ import annotations

import http.client
import json
import socket
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import Proc, cached_of, metric_sum, start_backend, start_router, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def topology() -> Iterator[tuple[Proc, list[Proc]]]:
    log_dir = tempfile.mkdtemp(prefix="router-e2e-")
    backends = [start_backend(log_dir, speed="0") for _ in range(3)]
    slow = start_backend(log_dir, speed="1")
    router = start_router(log_dir, *[a for b in backends for a in ("--backend", b.url)])
    slow_router = start_router(log_dir, "--backend", slow.url)
    try:
        yield router, backends + [slow, slow_router]
    finally:
        for proc in [router, slow_router, slow, *backends]:
            proc.stop()


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, dict(resp.getheaders()), json.loads(data) if data else None
    finally:
        conn.close()


def get_json(url: str) -> Any:
    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    path = "/" + url.removeprefix("http://").split("/", 1)[1]
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, (json.loads(data) if resp.getheader("Content-Type", "").startswith("application/json") else data.decode())
    finally:
        conn.close()


def metric(url: str, name: str, **labels: str) -> float:
    _, text = get_json(url + "/metrics")
    return metric_sum(text, name, **labels)


def test_multi_turn_sessions_stick_and_hit_the_prefix_cache(topology: tuple[Proc, list[Proc]]) -> None:
    router, procs = topology
    backends = procs[:3]
    conversations: dict[str, list[dict[str, str]]] = {}
    for s in range(6):
        conversations[f"e2e-{s}"] = [{"role": "system", "content": "You are terse. " * 8},
                                     {"role": "user", "content": f"conversation {s}: tell me something long"}]
    cached_by_turn: dict[str, list[int]] = {sid: [] for sid in conversations}
    for _turn in range(4):
        for sid, messages in conversations.items():
            status, headers, data = post(router.url, "/v1/chat/completions",
                                         {"model": "session-sim", "messages": messages, "max_tokens": 24},
                                         {"X-Session-ID": sid})
            assert status == 200, data
            assert headers["X-Session-ID"] == sid
            cached_by_turn[sid].append(cached_of(data["usage"]))
            messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
            messages.append({"role": "user", "content": "and then?"})
    for sid in conversations:
        holders = [b for b in backends if get_json(b.url + f"/v1/sessions/{sid}")[0] == 200]
        assert len(holders) == 1, f"{sid} reached {len(holders)} backends"
        stats = get_json(holders[0].url + f"/v1/sessions/{sid}")[1]
        assert stats["requests"] == 4
        # every later turn finds at least the previous turn's prompt in the cache: cached tokens rise
        assert all(later > earlier for earlier, later in zip(cached_by_turn[sid], cached_by_turn[sid][1:]))
        _, view = get_json(router.url + f"/v1/sessions/{sid}")
        assert view["requests"] == 4 and view["pins"]["default"] == holders[0].url
        assert view["cached_tokens"] == stats["cached_tokens"] == sum(cached_by_turn[sid])
    hits = sum(metric(b.url, "vllm:prefix_cache_hits_total") for b in backends)
    assert hits > 0


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_on_the_backend(topology: tuple[Proc, list[Proc]], stream: bool) -> None:
    _, procs = topology
    slow, slow_router = procs[3], procs[4]
    labels = {"finished_reason": "abort"}
    before = metric(slow.url, "vllm:request_success_total", **labels)
    payload = json.dumps({"model": "session-sim", "prompt": "a long story please", "max_tokens": 2000,
                          "ignore_eos": True, "stream": stream}).encode()
    host, port = slow_router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     b"X-Session-ID: gone\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        wait_until(lambda: metric(slow.url, "vllm:num_requests_running") == 1, timeout=10,
                   what="the request running on the backend")
    # the client is gone: the router must close its upstream connection, and the backend abort
    wait_until(lambda: metric(slow.url, "vllm:request_success_total", **labels) == before + 1, timeout=15,
               what="the backend to count the abort")
    wait_until(lambda: metric(slow.url, "vllm:num_requests_running") == 0, timeout=5, what="nothing running")
    wait_until(lambda: metric(slow_router.url, "session_router_backend_in_flight") == 0, timeout=5,
               what="the router's in-flight count back to 0")

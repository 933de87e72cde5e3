"""Tokens mode with real processes: ``session-backend --tokens-only`` engines (and a P/D pair), a
``session-backend --role render`` render server, ``session-router --upstream-api tokens`` (local and
remote render, both fronts), and the OpenAI SDK as the client.

What the engines saw is read from the engines themselves: their per-session table
(``GET /v1/sessions/{id}``: the session reached the engine core on every leg) and their metrics
(``vllm:num_requests_running`` back at 0, ``vllm:request_success_total{finished_reason="abort"}``).
"""

from __future__ import annotations

import http.client
import json
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from tests.router.tokens.conftest import MODEL_DIR
from tests.support import Proc, metric_sum, start_process, start_router, wait_until

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to ten."}]


def start_engine(log_dir: str, *extra: str, speed: str = "0") -> Proc:
    from tests.support import free_port

    port = free_port()
    return start_process("backends", ["--host", "127.0.0.1", "--port", str(port), "--model-dir", MODEL_DIR,
                                      "--speed", speed, *extra], port, log_dir)


@dataclass
class Stack:
    engines: list[Proc]
    slow: Proc
    prefill: Proc
    decode: Proc
    render: Proc
    local: Proc  # raw front, local render, before the two engines
    remote: Proc  # aiohttp front, remote render, before the same engines
    slow_router: Proc  # before the slow engine
    pd: Proc  # P/D before the prefill/decode pair


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    log_dir = tempfile.mkdtemp(prefix="tokens-e2e-")
    procs: list[Proc] = []
    try:
        engines = [start_engine(log_dir, "--tokens-only") for _ in range(2)]
        procs += engines
        slow = start_engine(log_dir, "--tokens-only", speed="1")
        prefill = start_engine(log_dir, "--tokens-only", "--role", "prefill")
        decode = start_engine(log_dir, "--tokens-only", "--role", "decode")
        render = start_engine(log_dir, "--role", "render")
        procs += [slow, prefill, decode, render]
        tokens = ["--upstream-api", "tokens", "--model-dir", MODEL_DIR]
        backends = [a for e in engines for a in ("--backend", e.url)]
        local = start_router(log_dir, *tokens, "--front", "raw", *backends)
        remote = start_router(log_dir, *tokens, "--front", "aiohttp", "--render", render.url, *backends)
        slow_router = start_router(log_dir, *tokens, "--backend", slow.url)
        pd = start_router(log_dir, *tokens, "--prefill", prefill.url, "--decode", decode.url)
        procs += [local, remote, slow_router, pd]
        yield Stack(engines, slow, prefill, decode, render, local, remote, slow_router, pd)
    finally:
        for proc in reversed(procs):
            proc.stop()


def sdk(router: Proc, session: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=30,
                         default_headers={"X-Session-ID": session} if session else None)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def engine_metric(engine: Proc, name: str, **labels: str) -> float:
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as response:
        return metric_sum(response.read().decode(), name, **labels)


def engine_session(engine: Proc, session: str) -> dict[str, Any] | None:
    try:
        return get_json(f"{engine.url}/v1/sessions/{urllib.parse.quote(session)}")
    except urllib.error.HTTPError as exc:
        assert exc.code == 404
        return None


def idle(engine: Proc) -> bool:
    return (engine_metric(engine, "vllm:num_requests_running") == 0
            and engine_metric(engine, "vllm:num_requests_waiting") == 0)


def seeded(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="tiny-llama", messages=MESSAGES, seed=11, **kwargs)


@pytest.mark.parametrize("which", ["local", "remote"])
def test_chat_reaches_the_engine_core_with_the_session(stack: Stack, which: str) -> None:
    router = stack.local if which == "local" else stack.remote
    session = f"e2e-{which}"
    with sdk(router, session) as client:
        answers = [seeded(client, max_tokens=8) for _ in range(3)]
    assert all(a.choices[0].message.content == answers[0].choices[0].message.content for a in answers)
    assert answers[0].usage.completion_tokens == 8 and answers[0].model == "tiny-llama"
    seen = [engine_session(engine, session) for engine in stack.engines]
    served = [s for s in seen if s is not None]
    assert len(served) == 1 and served[0]["requests"] == 3  # sticky: one engine took every turn
    assert served[0]["prompt_tokens"] == 3 * answers[0].usage.prompt_tokens
    pins = get_json(f"{router.url}/v1/sessions/{session}")
    assert pins["requests"] == 3 and pins["completion_tokens"] == 24


def test_local_and_remote_render_give_the_same_answers(stack: Stack) -> None:
    with sdk(stack.local) as local, sdk(stack.remote) as remote:
        a = seeded(local, max_tokens=12, n=2)
        b = seeded(remote, max_tokens=12, n=2)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage == b.usage


@pytest.mark.parametrize("which", ["local", "remote"])
def test_streaming_n2_with_usage(stack: Stack, which: str) -> None:
    router = stack.local if which == "local" else stack.remote
    with sdk(router) as client:
        whole = seeded(client, max_tokens=10, n=2)
        texts = {0: "", 1: ""}
        usage = None
        for chunk in seeded(client, max_tokens=10, n=2, stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert usage is not None and usage.completion_tokens == 20


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_trim_and_leave_nothing_running(stack: Stack, stream: bool) -> None:
    with sdk(stack.local) as fast:
        text = seeded(fast, max_tokens=40).choices[0].message.content
    stop = " " + text.split(" ")[4]
    aborted = engine_metric(stack.slow, "vllm:request_success_total", finished_reason="abort")
    with sdk(stack.slow_router) as client:
        if stream:
            got = "".join(c.choices[0].delta.content or "" for c in seeded(client, max_tokens=2000, stop=[stop],
                                                                           stream=True) if c.choices)
        else:
            answer = seeded(client, max_tokens=2000, stop=[stop])
            got = answer.choices[0].message.content
            assert answer.choices[0].finish_reason == "stop" and answer.choices[0].model_extra["stop_reason"] == stop
    assert got == text[:text.index(stop)]
    wait_until(lambda: idle(stack.slow), timeout=10, what="the slow engine has nothing running")
    assert engine_metric(stack.slow, "vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_a_client_that_disconnects_aborts_the_engine(stack: Stack) -> None:
    aborted = engine_metric(stack.slow, "vllm:request_success_total", finished_reason="abort")
    host, port = stack.slow_router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    body = json.dumps({"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 2000, "stream": True})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    while b'"content"' not in response.readline():
        pass
    assert not idle(stack.slow)
    conn.close()  # the client goes away mid-stream
    wait_until(lambda: idle(stack.slow), timeout=10, what="the engine request aborted")
    assert engine_metric(stack.slow, "vllm:request_success_total", finished_reason="abort") == aborted + 1


@pytest.mark.parametrize("stream", [False, True])
def test_pd_pair_both_legs_carry_the_session(stack: Stack, stream: bool) -> None:
    session = f"e2e-pd-{stream}"
    with sdk(stack.pd, session) as client:
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in seeded(client, max_tokens=6, stream=True)
                           if c.choices)
        else:
            text = seeded(client, max_tokens=6).choices[0].message.content
    assert text
    for engine in (stack.prefill, stack.decode):
        seen = engine_session(engine, session)
        assert seen is not None and seen["requests"] == 1, engine.url
    assert metric_sum(urllib.request.urlopen(stack.pd.url + "/metrics").read().decode(),
                      "session_router_pd_fallback_total") == 0


def test_render_errors_are_answered_without_an_engine(stack: Stack) -> None:
    for router in (stack.local, stack.remote):
        with sdk(router, "e2e-bad") as client:
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="tiny-llama", messages=[], max_tokens=3)
            assert info.value.body["message"].startswith("Cannot apply chat template to an empty conversation")
    assert all(engine_session(engine, "e2e-bad") is None for engine in stack.engines)

"""P/D end to end with real processes: 1 prefill + 2 decode ``session-backend`` processes behind a
``session-router`` process (``--prefill``/``--decode``), on 127.0.0.1 ephemeral ports.

- Multi-turn chat and tokens-in sessions: a session's decode legs always land on one decode
  instance; the prefill's prefix cache hits on later turns; the decode instance pulls every full
  block of the prompt (nothing prefilled locally but the tail); both legs account the session.
- Fallback: the prefill process is killed -> requests still succeed decode-only and
  ``session_router_pd_fallback_total`` rises; with ``pd_fallback = false`` the client gets a 502.
- Held blocks are freed after ``--kv-hold-timeout`` when nobody pulls them.
- ``config/router-pd.toml`` loads as a P/D configuration.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.config import load_config
from tests.support import LOOPBACK, Proc, cached_of, start_backend, start_router, wait_until

BS = 16
REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
PLACEHOLDER = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}


# ---- HTTP helpers (stdlib; the processes are real) -------------------------------------------------


def request(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
            timeout: float = 20.0) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def post(url: str, body: Any, session: str | None = None) -> tuple[int, dict[str, str], Any]:
    status, headers, raw = request("POST", url, body, {"X-Session-ID": session} if session else None)
    return status, headers, json.loads(raw) if raw else None


def get_json(url: str) -> tuple[int, Any]:
    status, _, raw = request("GET", url)
    return status, json.loads(raw) if raw else None


def scrape(url: str) -> dict[tuple[str, str], float]:
    """``/metrics`` as {(sample name, the one extra label value or ""): value}."""
    _, _, raw = request("GET", url + "/metrics")
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(raw.decode()):
        for s in family.samples:
            extra = [v for k, v in s.labels.items() if k not in ("model_name", "engine")]
            out[(s.name, extra[0] if extra else "")] = s.value
    return out


def fallbacks(router_url: str) -> float:
    return sum(v for (name, _), v in scrape(router_url).items() if name == "session_router_pd_fallback_total")


def write_config(tmp_dir: str, name: str, text: str) -> str:
    path = os.path.join(tmp_dir, name)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


# ---- the cluster --------------------------------------------------------------------------------


class Cluster:
    def __init__(self, prefill: Proc, decodes: list[Proc], router: Proc) -> None:
        self.prefill = prefill
        self.decodes = decodes
        self.router = router
        self.by_url = {d.url: d for d in decodes}

    def procs(self) -> list[Proc]:
        return [self.router, *self.decodes, self.prefill]


def stop_all(procs: list[Proc]) -> None:
    for proc in procs:
        proc.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = str(tmp_path_factory.mktemp("pd-e2e"))
    procs: list[Proc] = []
    try:
        prefill = start_backend(log_dir, "--role", "prefill", "--block-size", str(BS))
        procs.append(prefill)
        allow = f"{LOOPBACK}:{prefill.port}"
        decodes = [start_backend(log_dir, "--role", "decode", "--block-size", str(BS), "--kv-allow", allow)
                   for _ in range(2)]
        procs += decodes
        router = start_router(log_dir, "--prefill", prefill.url, *[a for d in decodes for a in ("--decode", d.url)])
        procs.append(router)
        yield Cluster(prefill, decodes, router)
    finally:
        stop_all(list(reversed(procs)))


def check_turn(cluster: Cluster, session: str, usage: dict[str, Any], decode_url: str,
               before: dict[tuple[str, str], float]) -> None:
    """The decode leg of one request pulled every full block and prefilled only the tail."""
    after = scrape(decode_url)
    prompt = usage["prompt_tokens"]
    cached = cached_of(usage)

    def delta(name: str, label: str = "") -> float:
        return after[(name, label)] - before[(name, label)]

    assert delta("session_backend_kv_pulls_total") == 1
    assert delta("session_backend_kv_pulled_tokens_total") == prompt // BS * BS
    assert cached >= (prompt - 1) // BS * BS
    assert 1 <= delta("vllm:prompt_tokens_by_source_total", "local_compute") == prompt - cached <= BS
    assert sum(delta("session_backend_kv_pull_failures_total", r) for r in
               ("invalid_params", "not_allowed", "unreachable", "timeout", "not_found", "mismatch", "rejected",
                "bad_reply")) == 0


def run_sessions(cluster: Cluster, sessions: dict[str, list[int]], send: Any) -> None:
    """Drive each session turn by turn; ``send(session, turn)`` returns (usage, next state)."""
    router = cluster.router.url
    prefill = cluster.prefill.url
    pins: dict[str, str] = {}
    prev_prompt: dict[str, int] = {}
    turns = len(next(iter(sessions.values())))
    for turn in range(turns):
        for session in sessions:
            status, info = get_json(f"{router}/v1/sessions/{session}")
            decode_url = info["pins"]["decode"] if status == 200 else None
            before = {d.url: scrape(d.url) for d in cluster.decodes}
            prefill_before = get_json(f"{prefill}/v1/sessions/{session}")[1] if turn else None
            usage = send(session, turn)
            status, info = get_json(f"{router}/v1/sessions/{session}")
            assert status == 200
            pinned = info["pins"]["decode"]
            assert info["pins"]["prefill"] == prefill
            if decode_url is not None:
                assert pinned == decode_url == pins[session], "a session's decode leg moved"
            pins[session] = pinned
            check_turn(cluster, session, usage, pinned, before[pinned])
            other = next(d.url for d in cluster.decodes if d.url != pinned)
            assert scrape(other)[("session_backend_kv_pulls_total", "")] == before[other][
                ("session_backend_kv_pulls_total", "")]
            if turn:
                # the prefill instance found the previous turn's prompt in its prefix cache
                now = get_json(f"{prefill}/v1/sessions/{session}")[1]
                assert now["cached_tokens"] - prefill_before["cached_tokens"] >= prev_prompt[session] // BS * BS > 0
            prev_prompt[session] = usage["prompt_tokens"]

    for session, decode_url in pins.items():
        # both legs saw the session id: the prefill and that one decode account every turn of it
        status, p = get_json(f"{prefill}/v1/sessions/{session}")
        assert status == 200 and p["requests"] == turns and p["generated_tokens"] == turns
        status, d = get_json(f"{decode_url}/v1/sessions/{session}")
        assert status == 200 and d["requests"] == turns and d["prompt_tokens"] == p["prompt_tokens"]
        assert d["cached_tokens"] >= d["prompt_tokens"] - turns * BS
        other = next(x.url for x in cluster.decodes if x.url != decode_url)
        assert get_json(f"{other}/v1/sessions/{session}")[0] == 404
    p = scrape(prefill)
    assert p[("session_backend_kv_held_requests", "")] == 0  # every hand-off was pulled (and freed)
    assert p[("vllm:prefix_cache_hits_total", "")] > 0


@pytest.mark.slow
def test_multi_turn_chat_sessions_stick_to_their_decode_instance(cluster: Cluster) -> None:
    convs: dict[str, list[dict[str, str]]] = {
        f"pd-chat-{i}": [{"role": "system", "content": "You answer about the sea and the mountain. " * 3},
                         {"role": "user", "content": f"Session {i}: tell me about the river and the sea."}]
        for i in range(6)
    }
    served = scrape(cluster.prefill.url)[("session_backend_kv_pulls_served_total", "")]

    def send(session: str, turn: int) -> dict[str, Any]:
        messages = convs[session]
        status, headers, data = post(cluster.router.url + "/v1/chat/completions",
                                     {"messages": messages, "max_tokens": 12, "ignore_eos": True}, session)
        assert status == 200, data
        assert headers["X-Session-ID"] == session and data["usage"]["completion_tokens"] == 12
        messages += [{"role": "assistant", "content": data["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"Turn {turn + 2}: and what about the mountain?"}]
        return data["usage"]

    run_sessions(cluster, {s: [0, 1, 2, 3] for s in convs}, send)
    assert scrape(cluster.prefill.url)[("session_backend_kv_pulls_served_total", "")] - served == 24
    assert fallbacks(cluster.router.url) == 0


@pytest.mark.slow
def test_tokens_in_sessions_through_generate(cluster: Cluster) -> None:
    prompts = {f"pd-tokens-{i}": [1] + [4 + (i * 31 + j) % 389 for j in range(70)] for i in range(4)}

    def send(session: str, turn: int) -> dict[str, Any]:
        tokens = prompts[session]
        status, headers, data = post(
            cluster.router.url + "/inference/v1/generate",
            {"token_ids": tokens, "sampling_params": {"max_tokens": 9, "ignore_eos": True}}, session)
        assert status == 200, data
        assert headers["X-Session-ID"] == session and data["request_id"].startswith("generate-tokens-")
        assert len(data["choices"][0]["token_ids"]) == 9
        prompts[session] = tokens + data["choices"][0]["token_ids"] + [300 + turn, 301, 302]
        return data["usage"]

    run_sessions(cluster, {s: [0, 1, 2] for s in prompts}, send)
    assert fallbacks(cluster.router.url) == 0


@pytest.mark.slow
def test_streamed_decode_leg_through_the_router(cluster: Cluster) -> None:
    body = {"messages": [{"role": "user", "content": "Stream me a story about the river and the sea. " * 4}],
            "max_tokens": 20, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    status, headers, raw = request("POST", cluster.router.url + "/v1/chat/completions", body,
                                   {"X-Session-ID": "pd-stream"})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text and chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 20  # the client's max_tokens, not the prefill leg's 1
    assert cached_of(usage) >= (usage["prompt_tokens"] - 1) // BS * BS
    assert fallbacks(cluster.router.url) == 0


@pytest.mark.slow
def test_prefill_loss_falls_back_to_decode_only(tmp_path: Any) -> None:
    log_dir = str(tmp_path)
    procs: list[Proc] = []
    try:
        prefill = start_backend(log_dir, "--role", "prefill", "--kv-hold-timeout", "1")
        procs.append(prefill)
        decode = start_backend(log_dir, "--role", "decode", "--kv-allow", f"{LOOPBACK}:{prefill.port}")
        procs.append(decode)
        pools = f'[[prefill]]\nurl = "{prefill.url}"\n[[decode]]\nurl = "{decode.url}"\n'
        lenient = write_config(log_dir, "lenient.toml", "health_interval_s = 0.5\n" + pools)
        strict = write_config(log_dir, "strict.toml", "health_interval_s = 0.5\npd_fallback = false\n" + pools)
        router = start_router(log_dir, "--config", lenient)
        procs.append(router)
        router_strict = start_router(log_dir, "--config", strict)
        procs.append(router_strict)

        # blocks that nobody pulls are freed after --kv-hold-timeout
        body = {"prompt": "the river and the sea " * 12, "max_tokens": 6}
        status, _, data = post(prefill.url + "/v1/completions",
                               {**body, "max_tokens": 1, "kv_transfer_params": PLACEHOLDER}, "pd-orphan")
        assert status == 200 and data["kv_transfer_params"]["remote_port"] == prefill.port
        assert scrape(prefill.url)[("session_backend_kv_held_requests", "")] == 1
        wait_until(lambda: scrape(prefill.url)[("session_backend_kv_held_requests", "")] == 0, timeout=10,
                   what="held blocks to expire")
        assert scrape(prefill.url)[("vllm:kv_cache_usage_perc", "")] == 0
        late_body = {**body, "kv_transfer_params": data["kv_transfer_params"]}
        status, _, late = post(decode.url + "/v1/completions", late_body)
        assert status == 200 and cached_of(late["usage"]) == 0
        assert scrape(decode.url)[("session_backend_kv_pull_failures_total", "not_found")] == 1

        # both routers hand off while the prefill is up
        for url in (router.url, router_strict.url):
            status, _, data = post(url + "/v1/completions", {**body, "prompt": f"{url} " + body["prompt"]}, "pd-fb")
            assert status == 200, data
        assert scrape(decode.url)[("session_backend_kv_pulls_total", "")] == 2
        assert fallbacks(router.url) == fallbacks(router_strict.url) == 0

        prefill.kill()
        for i in range(3):
            status, _, data = post(router.url + "/v1/completions", {**body, "prompt": f"turn {i} " + body["prompt"]},
                                   "pd-fb")
            assert status == 200, data
            assert data["usage"]["completion_tokens"] == 6
        assert fallbacks(router.url) == 3
        assert scrape(decode.url)[("session_backend_kv_pulls_total", "")] == 2  # decode-only: nothing pulled
        # decode-only forwards the client's body without its own kv_transfer_params (issue 11): they reach
        # no backend, so the decode instance neither connects anywhere (a loopback trap that records
        # connections) nor even refuses them (nothing counted)
        failures_before = sum(v for (name, _), v in scrape(decode.url).items()
                              if name == "session_backend_kv_pull_failures_total")
        with socket.socket() as trap:
            trap.bind(("127.0.0.77", 0))
            trap.listen(8)
            trap.setblocking(False)
            aimed = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "y",
                     "remote_block_ids": [0], "remote_host": "127.0.0.77", "remote_port": trap.getsockname()[1]}
            status, _, data = post(router.url + "/v1/completions", {**body, "kv_transfer_params": aimed}, "pd-fb")
            assert status == 200, data
            with pytest.raises(BlockingIOError):
                trap.accept()
        assert sum(v for (name, _), v in scrape(decode.url).items()
                   if name == "session_backend_kv_pull_failures_total") == failures_before
        assert scrape(router.url)[("session_router_kv_params_stripped_total", "completions")] == 1
        assert fallbacks(router.url) == 4
        status, _, err = post(router_strict.url + "/v1/completions", body, "pd-fb")
        assert status == 502 and "pd_fallback" in err["error"]["message"] and err["error"]["code"] == 502
        assert fallbacks(router_strict.url) == 1
        # the router stays healthy while a decode instance is: prefill loss only degrades it
        wait_until(lambda: get_json(router.url + "/health")[1]["pools"]["prefill"]["healthy"] == 0, timeout=10,
                   what="the router to mark the prefill down")
        assert get_json(router.url + "/health")[0] == 200
        status, _, data = post(router.url + "/inference/v1/generate",
                               {"token_ids": list(range(300, 340)), "sampling_params": {"max_tokens": 3}}, "pd-fb")
        assert status == 200 and len(data["choices"][0]["token_ids"]) == 3
        assert fallbacks(router.url) == 5
    finally:
        stop_all(list(reversed(procs)))


def test_example_pd_config_loads() -> None:
    config = load_config(os.path.join(REPO, "config", "router-pd.toml"))
    assert config.pd_mode and not config.backends
    assert [b.url for b in config.prefill] == ["http://127.0.0.1:8200"]
    assert [b.url for b in config.decode] == ["http://127.0.0.1:8201", "http://127.0.0.1:8202"]
    assert config.pd.fallback is True and config.placement.policy == "session"

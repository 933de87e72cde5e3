"""Does session placement pay? The multi-turn routing benchmark (issue 6).

For each workload variant, each placement policy of our router (and each peer router that
installs here) gets a cell: four fresh ``session-backend`` processes at ``--speed 1`` whose KV
capacity (``--num-blocks``) holds only part of the working set, the router in front of them, and
the same seeded multi-turn chat workload (``bench.workload``) replayed through it. Every request
streams (with ``include_usage``, ``ignore_eos``), so each one yields a time to first token.

Per cell it measures:

- prefix-cache hit ratio: the backends' ``vllm:prefix_cache_hits_total / queries_total``
  (delta over the cell, summed over the backends), and the oracle: the ratio if every turn found
  its whole previous prompt + answer cached (first turns: the shared system prompt), counted in
  full blocks as the backend counts (``min(prev_prompt + prev_answer - 1, prompt - 1)`` tokens,
  floored to the block size);
- TTFT (first content chunk) and end-to-end latency p50/p99 at the client, and TTFT p99 per
  backend (our router: each request attributed to its backend via ``GET /v1/sessions/{id}``'s
  ``last_backend``; peers: from the backends' ``vllm:time_to_first_token_seconds`` histograms);
- load over time: every ``--sample`` seconds the router's per-backend in-flight counts
  (``/admin/backends``) and the backends' own ``/load``; reported as max/mean of the per-backend
  time averages;
- placements by outcome (``session_router_placements_total``), the ``kv_aware`` policy's decisions by
  outcome and reason (``session_router_placement_decisions_total``; per request, the
  ``X-Session-Router-Decision`` header, turned on with ``[placement] decision_header``) and the
  sessions that spilled or were re-pinned.

The backends publish vLLM's KV events (``--kv-events-config``: a ZMQ PUB on an ``ipc://`` endpoint in
the run's temporary directory, which the backend binds, plus its replay socket); our router reads
them from each backend's ``GET /kv_event_sources`` (``[kv_events] enabled = "auto"``) into its KV
index, which the ``kv_aware`` policy (the default) weighs against the engines' load. The peers ignore
the events. ``--no-kv-events`` starts the backends without them.

    python -m bench.multiturn --quick                  # CI smoke: one variant, four policies, < 1 min
    python -m bench.multiturn                          # full: uniform, no-header, skewed; peers if installable
    python -m bench.multiturn --variants skewed --policies session,least_loaded --peers none
    python -m bench.multiturn --records --plots bench/plots   # + every request, and the PNGs (bench.plots)
    python -m bench.multiturn --variants skewed --policies kv_aware,session --peers none --skewed-seeds 4

One skewed cell per policy is a noisy measure of a tail: with the same code, the ``session`` policy's
worst-backend TTFT p99 ranged 0.54-3.0 s over runs and workload seeds on a quiet machine. So the full
run repeats the skewed variant's ``kv_aware`` and ``session`` cells at ``--skewed-seeds`` workload
seeds in all (``--seed``, ``--seed`` + 1, ...; variants ``skewed@seed<N>`` for the extra ones), and
judges its tail and preemption targets over all of them: the median of the per-seed ratios of the
worst-backend TTFT p99, and the preemptions summed.

Results go to stdout (a table per variant, the target checks) and as JSON to ``--out``
(default ``bench/out/multiturn-<time>.json``); ``--markdown`` also prints the tables in Markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from bench import peers as peer_mod
from bench.procs import REPO, Proc, free_ports, start_backend, start_router
from bench.workload import SessionPlan, Workload, WorkloadSpec, generate, system_message

SESSION_HEADER = "X-Session-ID"
MODEL = "session-sim"
#: our router's admin token here (sampling /admin/backends needs one on the data port)
ADMIN_TOKEN = "bench-admin-token"
POLICIES = ("kv_aware", "session", "round_robin", "least_loaded")
#: the policies the session-aware columns (spills, sessions moved) apply to
SESSION_POLICIES = ("kv_aware", "session")
DECISION_HEADER = "X-Session-Router-Decision"
VARIANTS = ("uniform", "noheader", "skewed")

# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


class Variant(msgspec.Struct, frozen=True):
    name: str
    spec: WorkloadSpec
    #: clients send X-Session-ID (else the router derives the session from the conversation)
    send_header: bool
    description: str
    #: policies and peers left out of this variant by default (those that ignore the session
    #: header add nothing new here)
    skip_policies: tuple[str, ...] = ()
    skip_peers: tuple[str, ...] = ()
    #: a repeat of another variant at another workload seed (its name: ``<variant>@seed<N>``)
    repeat_of: str = ""


#: the full run's backends: ``--speed 1`` (a small model on one GPU)
FULL_SPEED = "1"


class BenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    variants: tuple[Variant, ...]
    policies: tuple[str, ...] = POLICIES
    peers: tuple[str, ...] = ()
    peer_venv: str = peer_mod.DEFAULT_VENV
    num_backends: int = 4
    num_blocks: int = 768
    block_size: int = 16
    speed: str = FULL_SPEED
    load_factor: float = 1.25
    #: seconds between load samples
    sample_s: float = 0.1
    request_timeout_s: float = 300.0
    #: keep every request's record in the JSON results
    keep_records: bool = False
    #: --policies / --peers was given: run exactly those in every variant
    explicit_policies: bool = False
    explicit_peers: bool = False
    #: passed to our router as --config (e.g. a different load_factor); "" = defaults (plus the
    #: decision header, when the router has it)
    router_config: str = ""
    #: backends publish KV events (--kv-events-config, ipc:// endpoints in the run's directory)
    kv_events: bool = True


def quick_variants(seed: int) -> tuple[Variant, ...]:
    spec = WorkloadSpec(sessions=24, turns=5, arrival_rate=12.0, think_s=0.15, user_tokens=(20, 60),
                        answer_tokens=(30, 60), system_tokens=150, seed=seed)
    return (Variant("uniform", spec, True, "X-Session-ID sent; uniform sessions"),)


def full_variants(seed: int) -> dict[str, Variant]:
    uniform = WorkloadSpec(sessions=64, turns=8, arrival_rate=1.0, think_s=2.0, user_tokens=(40, 120),
                           answer_tokens=(100, 200), system_tokens=300, seed=seed)
    skewed = msgspec.structs.replace(uniform, heavy_share=0.1, heavy_turns_x=3.0, heavy_think_x=0.25)
    return {
        "uniform": Variant("uniform", uniform, True, "X-Session-ID sent; uniform sessions"),
        "noheader": Variant("noheader", uniform, False, "no header: the router derives the session id",
                            skip_policies=("least_loaded",), skip_peers=("sglang-router",)),
        "skewed": Variant("skewed", skewed, True,
                          "X-Session-ID sent; 10% heavy sessions (3x the turns, 1/4 the think time)"),
    }


#: the workload seeds the skewed targets are judged over in a full run (``--skewed-seeds``)
SKEWED_SEEDS = 4


def skewed_repeats(skewed: Variant, count: int) -> tuple[Variant, ...]:
    """``skewed`` at the ``count - 1`` workload seeds after its own, for ``kv_aware`` and ``session`` only."""
    out = []
    for seed in range(skewed.spec.seed + 1, skewed.spec.seed + count):
        out.append(Variant(f"{skewed.name}@seed{seed}", msgspec.structs.replace(skewed.spec, seed=seed), True,
                           f"{skewed.description}; workload seed {seed}",
                           skip_policies=tuple(p for p in POLICIES if p not in SESSION_POLICIES),
                           skip_peers=tuple(peer_mod.PEERS), repeat_of=skewed.name))
    return tuple(out)


def seeds_of(cells: Sequence[CellResult], variant: str) -> list[str]:
    """``variant`` and its repeats at other seeds (``<variant>@seed<N>``) that have cells, in run order."""
    names: list[str] = []
    for c in cells:
        if (c.variant == variant or c.variant.startswith(variant + "@")) and c.variant not in names:
            names.append(c.variant)
    return names


#: 2,048 tokens per backend: the quick workload (24 sessions of 5 turns, ~600 prompt tokens at the last turn)
#: fits a few sequences but not the working set
QUICK_NUM_BLOCKS = 128
#: the quick run's simulated GPU time (half the full run's): the same workload in about half the wall time
QUICK_SPEED = "0.5"

# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


class TurnRecord(msgspec.Struct):
    session: int
    turn: int
    heavy: bool
    ok: bool
    #: seconds after the cell's start when the request was sent
    sent_s: float
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    #: the session id the router resolved (header variant: ours; else derived), "" if unknown
    session_id: str = ""
    #: backend URL that served it ("" when not attributable) and the session's pin after it
    backend: str = ""
    pin: str = ""
    #: our router's X-Session-Router-Decision header ("" when it sent none)
    decision: str = ""
    error: str = ""


class Sample(msgspec.Struct, array_like=True):
    t: float
    #: router's in-flight count per backend (our router only), in backend order
    router: list[int] | None
    #: backends' own /load
    server: list[int]


class CellResult(msgspec.Struct, kw_only=True):
    variant: str
    target: str
    kind: str  # "ours" | "peer"
    command: str = ""
    skipped: str = ""
    duration_s: float = 0.0
    requests: int = 0
    errors: int = 0
    #: planned turns never sent (their conversation ended at an error)
    unsent: int = 0
    first_error: str = ""
    prompt_tokens: int = 0
    hit_ratio: float = 0.0
    client_hit_ratio: float = 0.0
    oracle_ratio: float = 0.0
    of_oracle: float = 0.0
    ttft_p50: float = 0.0
    ttft_p99: float = 0.0
    e2e_p50: float = 0.0
    e2e_p99: float = 0.0
    #: backend URL -> TTFT p99, client-side (attributed requests) and server-side (histograms)
    ttft_p99_by_backend: dict[str, float] = {}
    server_ttft_p99_by_backend: dict[str, float] = {}
    worst_backend_ttft_p99: float = 0.0
    #: how worst_backend_ttft_p99 was measured: "client" or "server-histogram"
    worst_backend_source: str = ""
    #: max/mean of per-backend time-averaged load: router in-flight (ours) and backend /load
    load_imbalance: float = 0.0
    server_load_imbalance: float = 0.0
    mean_in_flight: float = 0.0
    peak_in_flight: int = 0
    preemptions: int = 0
    placements: dict[str, int] = {}
    #: session_router_placement_decisions_total deltas, "outcome/reason" -> count (kv_aware)
    decisions: dict[str, int] = {}
    sessions_spilled: int = 0
    sessions_repinned: int = 0
    sessions: int = 0
    #: every request (only with --records)
    records: list[TurnRecord] | None = None
    #: load over time: every --sample seconds, per backend (always kept; bench.plots draws it)
    samples: list[Sample] = []
    #: backend URLs in the order of each sample's lists
    backends: list[str] = []
    #: the machine's 1-minute load average when the cell started and when it ended (a shared machine)
    loadavg: tuple[float, float] = (0.0, 0.0)


class TargetCheck(msgspec.Struct):
    name: str
    ok: bool
    detail: str


class BenchResult(msgspec.Struct, kw_only=True):
    started: str
    machine: dict[str, Any]
    command: str
    config: BenchConfig
    cells: list[CellResult]
    checks: list[TargetCheck]
    peer_notes: list[str]


# ---------------------------------------------------------------------------------------------
# Small statistics and Prometheus helpers
# ---------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out


def metric_sum(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def histogram_quantile(q: float, before: Samples, after: Samples, name: str) -> float:
    """Prometheus' ``histogram_quantile`` over the bucket deltas of ``name`` (linear in a bucket)."""
    buckets: dict[float, float] = defaultdict(float)
    for (n, lab), v in after.items():
        if n == name + "_bucket":
            le = dict(lab)["le"]
            buckets[float("inf") if le == "+Inf" else float(le)] += v - before.get((n, lab), 0.0)
    if not buckets:
        return 0.0
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return 0.0
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return bounds[-1]


def counter_deltas(before: Samples, after: Samples, name: str, *keys: str) -> dict[str, int]:
    """A counter's increase over the cell by the labels ``keys`` (joined with "/"), summed over the
    other labels; only the keys that grew."""
    out: dict[str, int] = defaultdict(int)
    for (n, labels), value in after.items():
        if n == name:
            lab = dict(labels)
            out["/".join(lab.get(k, "") for k in keys)] += int(value - before.get((n, labels), 0.0))
    return {k: v for k, v in sorted(out.items()) if v}


def imbalance(rows: Sequence[Sequence[int]]) -> tuple[float, float, int]:
    """(max/mean of the per-backend time averages, mean total, peak single-backend load)."""
    if not rows:
        return 0.0, 0.0, 0
    n = len(rows[0])
    means = [sum(r[i] for r in rows) / len(rows) for i in range(n)]
    mean = sum(means) / n
    peak = max(max(r) for r in rows)
    return (max(means) / mean if mean > 0 else 0.0), sum(means), peak


# ---------------------------------------------------------------------------------------------
# The client: replay a workload through a router
# ---------------------------------------------------------------------------------------------


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _PromptDetails | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict[str, Any] | None = None


class _SessionInfo(msgspec.Struct):
    pins: dict[str, str] = {}
    last_backend: str = ""


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_session_decoder = msgspec.json.Decoder(_SessionInfo)
_encoder = msgspec.json.Encoder()


class Driver:
    """Replays one workload through ``target_url`` and samples the load while it runs."""

    def __init__(self, workload: Workload, target_url: str, backend_urls: Sequence[str], *, send_header: bool,
                 router_api: bool, sample_s: float, request_timeout_s: float) -> None:
        self.workload = workload
        self.target = target_url
        self.backends = list(backend_urls)
        self.send_header = send_header
        #: our router: attribute requests (GET /v1/sessions/{id}) and sample /admin/backends
        self.router_api = router_api
        self.sample_s = sample_s
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.records: list[TurnRecord] = []
        self.samples: list[Sample] = []
        self._t0 = 0.0

    def target_for(self, record: TurnRecord) -> str:
        """The router URL a turn (and its attribution) goes to: the one target here; ``bench.replicas``
        spreads the turns over router replicas."""
        return self.target

    async def run(self) -> float:
        """Run every session to its end; returns the wall time in seconds."""
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=connector, timeout=self.timeout) as http:
            stop = asyncio.Event()
            self._t0 = time.perf_counter()
            sampler = asyncio.create_task(self._sample(http, stop))
            try:
                await asyncio.gather(*(self._session(http, plan) for plan in self.workload.sessions))
            finally:
                stop.set()
                await sampler
        return time.perf_counter() - self._t0

    async def _session(self, http: aiohttp.ClientSession, plan: SessionPlan) -> None:
        delay = self._t0 + plan.start_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        messages: list[dict[str, str]] = [system_message(self.workload)]
        session_id = plan.session_id if self.send_header else ""
        for index, turn in enumerate(plan.turns):
            messages.append({"role": "user", "content": turn.user})
            body = _encoder.encode({"model": MODEL, "messages": messages, "max_tokens": turn.max_tokens,
                                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
            record = TurnRecord(plan.index, index, plan.heavy, False, time.perf_counter() - self._t0)
            text = await self._turn(http, body, session_id, record)
            self.records.append(record)
            if not record.ok:
                return  # the conversation ends at an error (counted); its prompts are unknowable
            session_id = record.session_id or session_id
            messages.append({"role": "assistant", "content": text})
            if self.router_api and session_id:
                await self._attribute(http, session_id, record)
            if turn.think_s > 0:
                await asyncio.sleep(turn.think_s)

    async def _turn(self, http: aiohttp.ClientSession, body: bytes, session_id: str, record: TurnRecord) -> str:
        headers = {"Content-Type": "application/json"}
        if self.send_header and session_id:
            headers[SESSION_HEADER] = session_id
        parts: list[str] = []
        started = time.perf_counter()
        try:
            async with http.post(self.target_for(record) + "/v1/chat/completions", data=body, headers=headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200].decode(errors='replace')}")
                record.session_id = resp.headers.get(SESSION_HEADER, "")
                record.decision = resp.headers.get(DECISION_HEADER, "")
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = _chunk_decoder.decode(line[6:])
                    if chunk.error is not None:
                        raise RuntimeError(f"stream error: {chunk.error}")
                    for choice in chunk.choices:
                        if choice.delta is not None and choice.delta.content:
                            if not parts:
                                record.ttft_s = time.perf_counter() - started
                            parts.append(choice.delta.content)
                    if chunk.usage is not None:
                        record.prompt_tokens = chunk.usage.prompt_tokens
                        record.completion_tokens = chunk.usage.completion_tokens
                        details = chunk.usage.prompt_tokens_details
                        record.cached_tokens = details.cached_tokens if details is not None else 0
            record.e2e_s = time.perf_counter() - started
            if not parts or not record.prompt_tokens:
                raise RuntimeError("the stream had no content or no usage chunk")
            record.ok = True
        except (TimeoutError, aiohttp.ClientError, RuntimeError, msgspec.DecodeError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"[:300]
        return "".join(parts)

    async def _attribute(self, http: aiohttp.ClientSession, session_id: str, record: TurnRecord) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, msgspec.DecodeError):
            async with http.get(f"{self.target_for(record)}/v1/sessions/{session_id}") as resp:
                if resp.status == 200:
                    info = _session_decoder.decode(await resp.read())
                    record.backend = info.last_backend
                    record.pin = info.pins.get("default", "")

    async def _sample(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        index = {url: i for i, url in enumerate(self.backends)}

        async def server_load(url: str) -> int:
            async with http.get(url + "/load") as resp:
                return int((await resp.json())["server_load"])

        async def router_load() -> list[int] | None:
            if not self.router_api:
                return None
            async with http.get(self.target + "/admin/backends",
                                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
                data = (await resp.json())["data"]
            loads = [0] * len(self.backends)
            for row in data:
                if row["url"] in index:
                    loads[index[row["url"]]] = int(row["in_flight"])
            return loads

        while not stop.is_set():
            t = time.perf_counter() - self._t0
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                router, *server = await asyncio.gather(router_load(), *(server_load(u) for u in self.backends))
                self.samples.append(Sample(round(t, 3), router, list(server)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.sample_s)


# ---------------------------------------------------------------------------------------------
# One cell: fresh backends, one router, one workload
# ---------------------------------------------------------------------------------------------


def oracle_cached(records: Sequence[TurnRecord], system_prefix: int, block_size: int) -> int:
    """Cached tokens if every turn found its whole previous prompt + answer (first turns: the
    shared system prefix) in the cache; counted as the backend counts, in full blocks."""
    by_session: dict[int, list[TurnRecord]] = defaultdict(list)
    for r in records:
        if r.ok:
            by_session[r.session].append(r)
    total = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        previous: TurnRecord | None = None
        for r in turns:
            if previous is None or previous.turn != r.turn - 1:
                reusable = system_prefix
            else:
                reusable = previous.prompt_tokens + previous.completion_tokens - 1
            total += min(reusable, r.prompt_tokens - 1) // block_size * block_size
            previous = r
    return total


def shared_prefix_tokens(backend_url: str, workload: Workload) -> int:
    """Tokens two first turns share (the system prompt part of the chat template)."""

    def ids(text: str) -> list[int]:
        body = _encoder.encode({"model": MODEL, "messages": [system_message(workload), {"role": "user", "content": text}]})
        req = urllib.request.Request(backend_url + "/tokenize", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return list(msgspec.json.decode(resp.read())["tokens"])

    a, b = ids("alpha"), ids("omega")
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def scrape(url: str) -> Samples:
    """The exposition at ``url``/metrics, parsed (``parse_metrics``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode())


#: the backends' context length in tokens (the workload's conversations stay well under it)
BACKEND_CONTEXT_TOKENS = 8192


def kv_events_config(directory: str, port: int) -> str:
    """vLLM's ``--kv-events-config`` for the backend on ``port``: a ZMQ PUB and its replay socket on
    ``ipc://`` paths in ``directory`` (an ipc endpoint: the backend binds, subscribers connect)."""
    base = os.path.join(directory, f"kv-{port}")
    return _encoder.encode({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{base}.sock",
                            "replay_endpoint": f"ipc://{base}-replay.sock", "topic": "kv-events"}).decode()


def backends_have_kv_events() -> bool:
    """Whether ``python -m backends`` takes ``--kv-events-config``."""
    out = subprocess.run([sys.executable, "-m", "backends", "--help"], check=False, capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    return "--kv-events-config" in out.stdout


def router_has_decision_header() -> bool:
    """Whether the router's ``[placement]`` takes ``decision_header``."""
    from router.config.schema import PlacementConfig

    return "decision_header" in PlacementConfig.__struct_fields__


def backend_args(config: BenchConfig, log_dir: str, port: int) -> tuple[str, ...]:
    # the context as before the backends served a model folder (its own default is the shipped model's 2,048)
    extra: tuple[str, ...] = ("--num-blocks", str(config.num_blocks), "--block-size", str(config.block_size),
                              "--log-level", "WARNING", "--max-model-len", str(BACKEND_CONTEXT_TOKENS))
    if config.kv_events:
        extra += ("--kv-events-config", kv_events_config(log_dir, port))
    return extra


def start_backends(config: BenchConfig, log_dir: str) -> list[Proc]:
    with concurrent.futures.ThreadPoolExecutor(config.num_backends) as pool:
        futures = [pool.submit(start_backend, log_dir, *backend_args(config, log_dir, port), port=port,
                               speed=config.speed)
                   for port in free_ports(config.num_backends)]
        procs: list[Proc] = []
        errors: list[str] = []
        for f in futures:
            try:
                procs.append(f.result())
            except AssertionError as exc:
                errors.append(str(exc))
    if errors:
        for p in procs:
            p.stop()
        raise RuntimeError("a backend did not start: " + errors[0])
    return procs


def run_cell(config: BenchConfig, variant: Variant, workload: Workload, target: str, log_dir: str,
             peer: peer_mod.PeerInstall | None = None) -> CellResult:
    kind = "peer" if peer is not None else "ours"
    label = peer_mod.PEERS[peer.name].label if peer is not None else target
    backends = start_backends(config, log_dir)
    urls = [b.url for b in backends]
    router: Proc | None = None
    try:
        if peer is None:
            policy, _, factor = target.partition(":")
            args = ["--policy", policy, "--stamp", "derive", "--log-level", "warning", "--admin-token", ADMIN_TOKEN]
            if factor:
                args += ["--load-factor", factor]
            if config.router_config:
                args += ["--config", config.router_config]
            for u in urls:
                args += ["--backend", u]
            router = start_router(log_dir, *args)
            command = "python -m router " + " ".join(router.args[router.args.index("--host"):])
        else:
            try:
                router = peer_mod.start_peer(peer, urls, log_dir)
            except AssertionError as exc:
                reason = str(exc).splitlines()[0]
                print(f"  skipped {label}: {reason}", flush=True)
                return CellResult(variant=variant.name, target=label, kind=kind, skipped=reason)
            command = " ".join([os.path.basename(router.args[0]), *router.args[1:]])
        prefix = shared_prefix_tokens(urls[0], workload)
        before = [scrape(u) for u in urls]
        router_before = scrape(router.url) if peer is None else {}
        driver = Driver(workload, router.url, urls, send_header=variant.send_header, router_api=peer is None,
                        sample_s=config.sample_s, request_timeout_s=config.request_timeout_s)
        duration = asyncio.run(driver.run())
        after = [scrape(u) for u in urls]
        router_after = scrape(router.url) if peer is None else {}
    finally:
        if router is not None:
            router.stop()
        for b in backends:
            b.stop()
    return summarize(config, variant, label, kind, command, driver, duration, urls, prefix,
                     before, after, router_before, router_after)


def summarize(config: BenchConfig, variant: Variant, label: str, kind: str, command: str, driver: Driver,
              duration: float, urls: Sequence[str], prefix: int, before: Sequence[Samples],
              after: Sequence[Samples], router_before: Samples, router_after: Samples) -> CellResult:
    records = driver.records
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    hits = sum(metric_sum(a, "vllm:prefix_cache_hits_total") - metric_sum(b, "vllm:prefix_cache_hits_total")
               for a, b in zip(after, before))
    queries = sum(metric_sum(a, "vllm:prefix_cache_queries_total") - metric_sum(b, "vllm:prefix_cache_queries_total")
                  for a, b in zip(after, before))
    preempt = sum(metric_sum(a, "vllm:num_preemptions_total") - metric_sum(b, "vllm:num_preemptions_total")
                  for a, b in zip(after, before))
    prompt = sum(r.prompt_tokens for r in ok)
    oracle = oracle_cached(records, prefix, config.block_size)
    result = CellResult(variant=variant.name, target=label, kind=kind, command=command, duration_s=round(duration, 2))
    result.requests = len(ok)
    result.errors = len(failed)
    result.unsent = driver.workload.num_requests - len(records)
    result.first_error = failed[0].error if failed else ""
    result.prompt_tokens = prompt
    result.hit_ratio = hits / queries if queries else 0.0
    result.client_hit_ratio = sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0
    result.oracle_ratio = oracle / prompt if prompt else 0.0
    result.of_oracle = result.hit_ratio / result.oracle_ratio if result.oracle_ratio else 0.0
    ttft = [r.ttft_s for r in ok]
    e2e = [r.e2e_s for r in ok]
    result.ttft_p50, result.ttft_p99 = percentile(ttft, 50), percentile(ttft, 99)
    result.e2e_p50, result.e2e_p99 = percentile(e2e, 50), percentile(e2e, 99)
    by_backend: dict[str, list[float]] = defaultdict(list)
    for r in ok:
        if r.backend:
            by_backend[r.backend].append(r.ttft_s)
    result.ttft_p99_by_backend = {u: round(percentile(v, 99), 4) for u, v in sorted(by_backend.items())}
    result.server_ttft_p99_by_backend = {
        u: round(histogram_quantile(0.99, b, a, "vllm:time_to_first_token_seconds"), 4)
        for u, b, a in zip(urls, before, after)
    }
    attributed = sum(len(v) for v in by_backend.values())
    if result.ttft_p99_by_backend and attributed == len(ok):
        result.worst_backend_ttft_p99 = max(result.ttft_p99_by_backend.values())
        result.worst_backend_source = "client"
    else:
        result.worst_backend_ttft_p99 = max(result.server_ttft_p99_by_backend.values(), default=0.0)
        result.worst_backend_source = "server-histogram"
    router_rows = [s.router for s in driver.samples if s.router is not None]
    server_rows = [s.server for s in driver.samples]
    result.server_load_imbalance, server_mean, server_peak = imbalance(server_rows)
    if router_rows:
        result.load_imbalance, result.mean_in_flight, result.peak_in_flight = imbalance(router_rows)
    else:
        result.load_imbalance, result.mean_in_flight, result.peak_in_flight = (
            result.server_load_imbalance, server_mean, server_peak)
    result.preemptions = int(preempt)
    if router_after:
        result.placements = counter_deltas(router_before, router_after, "session_router_placements_total", "outcome")
        result.decisions = counter_deltas(router_before, router_after, "session_router_placement_decisions_total",
                                          "outcome", "reason")
    result.samples = list(driver.samples)
    result.backends = list(urls)
    spilled: set[int] = set()
    repinned: set[int] = set()
    last_pin: dict[int, str] = {}
    for r in sorted(ok, key=lambda r: (r.session, r.turn)):
        before = last_pin.get(r.session)  # the pin after the previous turn = the pin this turn met
        # served off its pin: a spill (the router moves the pin with a load spill) or a re-pin
        if r.backend and ((before and r.backend != before) or (r.pin and r.backend != r.pin)):
            spilled.add(r.session)
        if r.pin:
            if before and before != r.pin:
                repinned.add(r.session)
            last_pin[r.session] = r.pin
    result.sessions_spilled, result.sessions_repinned = len(spilled), len(repinned)
    result.sessions = len({r.session for r in records})
    if config.keep_records:
        result.records = sorted(records, key=lambda r: (r.session, r.turn))
    return result


# ---------------------------------------------------------------------------------------------
# Targets and report
# ---------------------------------------------------------------------------------------------


def _cell(cells: Sequence[CellResult], variant: str, target: str) -> CellResult | None:
    for c in cells:
        if c.variant == variant and c.target == target and not c.skipped:
            return c
    return None


def check_targets(cells: Sequence[CellResult], load_factor: float) -> list[TargetCheck]:
    checks: list[TargetCheck] = []
    for variant in VARIANTS:
        session = _cell(cells, variant, "session")
        rr = _cell(cells, variant, "round_robin")
        if session is None:
            continue
        tag = f"[{variant}]"
        if session.errors:
            checks.append(TargetCheck(f"{tag} no failed requests", False,
                                      f"{session.errors} failed; first: {session.first_error}"))
        if variant == "uniform":  # the session policy's own targets; noheader has its own below
            checks.append(TargetCheck(
                f"{tag} session hit ratio >= 90% of the oracle", session.of_oracle >= 0.9,
                f"{session.hit_ratio:.3f} / oracle {session.oracle_ratio:.3f} = {session.of_oracle:.1%}"))
            if rr is not None:
                checks.append(TargetCheck(
                    f"{tag} session hit ratio > round_robin's", session.hit_ratio > rr.hit_ratio,
                    f"{session.hit_ratio:.3f} vs {rr.hit_ratio:.3f}"))
                speedup = rr.ttft_p50 / session.ttft_p50 if session.ttft_p50 else 0.0
                checks.append(TargetCheck(
                    f"{tag} TTFT p50 >= 2x lower than round_robin's", speedup >= 2.0,
                    f"{session.ttft_p50 * 1e3:.0f} ms vs {rr.ttft_p50 * 1e3:.0f} ms ({speedup:.1f}x)"))
            checks.append(TargetCheck(
                f"{tag} backend load max/mean <= load factor {load_factor:g}", session.load_imbalance <= load_factor,
                f"{session.load_imbalance:.2f} (per-backend average in-flight; mean total {session.mean_in_flight:.1f})"))
        if variant == "skewed":
            ours = [c for p in POLICIES if (c := _cell(cells, variant, p)) is not None]
            best = min(ours, key=lambda c: c.worst_backend_ttft_p99)  # session is one of them
            limit = 1.5 * best.worst_backend_ttft_p99
            checks.append(TargetCheck(
                f"{tag} session: no backend's TTFT p99 > 1.5x the best policy's",
                session.worst_backend_ttft_p99 <= limit,
                f"worst backend {session.worst_backend_ttft_p99 * 1e3:.0f} ms vs best policy "
                f"({best.target}) {best.worst_backend_ttft_p99 * 1e3:.0f} ms x 1.5 = {limit * 1e3:.0f} ms"))
            checks.append(TargetCheck(
                f"{tag} backend load max/mean <= load factor {load_factor:g}", session.load_imbalance <= load_factor,
                f"{session.load_imbalance:.2f}"))
    header = _cell(cells, "uniform", "session")
    derived = _cell(cells, "noheader", "session")
    if header is not None and derived is not None and header.hit_ratio:
        share = derived.hit_ratio / header.hit_ratio
        checks.append(TargetCheck("[noheader] derived sessions >= 80% of the header variant's hit ratio",
                                  share >= 0.8, f"{derived.hit_ratio:.3f} vs {header.hit_ratio:.3f} ({share:.1%})"))
    return checks + check_kv_aware_targets(cells)


#: the peer the uniform targets of issue 14 compare with (its row label)
CONSISTENT_HASH = peer_mod.PEERS["vllm-router"].label


def check_kv_aware_targets(cells: Sequence[CellResult]) -> list[TargetCheck]:
    """Issue 14's targets for the ``kv_aware`` policy (each needs its cells in the same run)."""
    checks: list[TargetCheck] = []
    for variant in VARIANTS:
        kv = _cell(cells, variant, "kv_aware")
        if kv is not None and kv.errors:
            checks.append(TargetCheck(f"[{variant}] kv_aware: no failed requests", False,
                                      f"{kv.errors} failed; first: {kv.first_error}"))
    kv, peer = _cell(cells, "uniform", "kv_aware"), _cell(cells, "uniform", CONSISTENT_HASH)
    if kv is not None and peer is not None:
        checks.append(TargetCheck(
            "[uniform] kv_aware hit ratio >= vllm-router consistent_hash's", kv.hit_ratio >= peer.hit_ratio,
            f"{kv.hit_ratio:.3f} vs {peer.hit_ratio:.3f} ({kv.hit_ratio - peer.hit_ratio:+.3f})"))
        checks.append(TargetCheck(
            "[uniform] kv_aware TTFT p99 <= vllm-router consistent_hash's", kv.ttft_p99 <= peer.ttft_p99,
            f"{_ms(kv.ttft_p99)} vs {_ms(peer.ttft_p99)}"))
    kv, session = _cell(cells, "skewed", "kv_aware"), _cell(cells, "skewed", "session")
    if kv is not None:
        checks.append(TargetCheck(
            "[skewed] kv_aware hit ratio >= 90% of the oracle", kv.of_oracle >= 0.9,
            f"{kv.hit_ratio:.3f} / oracle {kv.oracle_ratio:.3f} = {kv.of_oracle:.1%}"))
    if kv is not None and session is not None:
        limit = 0.8 * session.worst_backend_ttft_p99
        checks.append(TargetCheck(
            "[skewed] kv_aware worst-backend TTFT p99 <= 0.8x session's", kv.worst_backend_ttft_p99 <= limit,
            f"{_ms(kv.worst_backend_ttft_p99)} vs session {_ms(session.worst_backend_ttft_p99)} x 0.8 = "
            f"{_ms(limit)} ({kv.worst_backend_ttft_p99 / session.worst_backend_ttft_p99:.2f}x)"
            if session.worst_backend_ttft_p99 else "session's worst backend measured 0"))
        # "fewer than today": with none for the session policy in this run, none is as few as can be
        fewer = kv.preemptions < session.preemptions or kv.preemptions == session.preemptions == 0
        checks.append(TargetCheck(
            "[skewed] kv_aware preemptions < session's", fewer,
            f"{kv.preemptions} vs {session.preemptions}" + (" (both 0)" if kv.preemptions == session.preemptions == 0
                                                            else "")))
    checks += check_skewed_over_seeds(cells)
    header, derived = _cell(cells, "uniform", "kv_aware"), _cell(cells, "noheader", "kv_aware")
    if header is not None and derived is not None and header.hit_ratio:
        share = derived.hit_ratio / header.hit_ratio
        checks.append(TargetCheck("[noheader] kv_aware derived sessions >= 95% of the header variant's hit ratio",
                                  share >= 0.95, f"{derived.hit_ratio:.3f} vs {header.hit_ratio:.3f} ({share:.1%})"))
    return checks


def check_skewed_over_seeds(cells: Sequence[CellResult]) -> list[TargetCheck]:
    """The skewed tail and preemption targets over every seed the run has both cells of (module
    docstring), when it has more than one: the median of the per-seed ratios kv_aware / session of the
    worst-backend TTFT p99 <= 0.8, and fewer preemptions in all."""
    pairs = [(name, kv, session) for name in seeds_of(cells, "skewed")
             if (kv := _cell(cells, name, "kv_aware")) is not None
             and (session := _cell(cells, name, "session")) is not None and session.worst_backend_ttft_p99 > 0]
    if len(pairs) < 2:
        return []
    ratios = sorted(kv.worst_backend_ttft_p99 / session.worst_backend_ttft_p99 for _, kv, session in pairs)
    median = percentile(ratios, 50)
    each = ", ".join(f"{name.partition('@')[2] or 'seed'}: {_ms(kv.worst_backend_ttft_p99)} / "
                     f"{_ms(session.worst_backend_ttft_p99)} = {kv.worst_backend_ttft_p99 / session.worst_backend_ttft_p99:.2f}x"
                     for name, kv, session in pairs)
    ours = sum(kv.preemptions for _, kv, _ in pairs)
    theirs = sum(session.preemptions for _, _, session in pairs)
    return [
        TargetCheck(f"[skewed, {len(pairs)} seeds] kv_aware worst-backend TTFT p99 <= 0.8x session's (median ratio)",
                    median <= 0.8, f"median {median:.2f}x ({each})"),
        TargetCheck(f"[skewed, {len(pairs)} seeds] kv_aware preemptions < session's (summed)",
                    ours < theirs or ours == theirs == 0, f"{ours} vs {theirs}"),
    ]


_COLUMNS = ("target", "hit ratio", "of oracle", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99",
            "worst-backend TTFT p99", "load max/mean", "peak in-flight", "spill / re-pin (requests)",
            "sessions spilled", "preempt", "errors")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def table_rows(cells: Sequence[CellResult], variant: str) -> list[list[str]]:
    rows: list[list[str]] = []
    for c in cells:
        if c.variant != variant:
            continue
        if c.skipped:
            rows.append([c.target, f"skipped: {c.skipped[:80]}"] + [""] * (len(_COLUMNS) - 2))
            continue
        worst = _ms(c.worst_backend_ttft_p99) + (" (srv)" if c.worst_backend_source == "server-histogram" else "")
        if c.kind == "ours":
            spill = c.placements.get("spill", 0)
            repin = c.placements.get("repin_unhealthy", 0) + c.placements.get("repin_removed", 0)
            session_like = c.target.partition(":")[0] in SESSION_POLICIES
            placements = f"{spill} / {repin}" if session_like else "n/a"
            spilled = str(c.sessions_spilled) if session_like else "n/a"
        else:
            placements, spilled = "n/a", "n/a"
        rows.append([c.target, f"{c.hit_ratio:.3f}", f"{c.of_oracle:.0%}", _ms(c.ttft_p50), _ms(c.ttft_p99),
                     _ms(c.e2e_p50), _ms(c.e2e_p99), worst, f"{c.load_imbalance:.2f}", str(c.peak_in_flight),
                     placements, spilled, str(c.preemptions), str(c.errors)])
    return rows


def render_text(cells: Sequence[CellResult], variant: str) -> str:
    rows = [list(_COLUMNS)] + table_rows(cells, variant)
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def render_markdown(cells: Sequence[CellResult], variant: str) -> str:
    rows = table_rows(cells, variant)
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions: dict[str, str] = {}
    from importlib import metadata

    for pkg in ("session-router", "aiohttp", "msgspec", "uvloop", "httptools", "prometheus-client"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[pkg] = metadata.version(pkg)
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "loadavg": list(os.getloadavg()), "versions": versions}


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def run(config: BenchConfig, log_dir: str, peer_notes: list[str]) -> list[CellResult]:
    installs: list[peer_mod.PeerInstall] = []
    if config.peers:
        print(f"peers: preparing {', '.join(config.peers)} in {config.peer_venv} ...", flush=True)
        for inst in peer_mod.prepare(config.peers, config.peer_venv):
            if inst.executable:
                installs.append(inst)
                peer_notes.append(f"{inst.name} {inst.version}: installed in {config.peer_venv}")
            else:
                peer_notes.append(f"{inst.name}: skipped ({inst.reason})")
            print("  " + peer_notes[-1], flush=True)
    cells: list[CellResult] = []
    for variant in config.variants:
        workload = generate(variant.spec)
        print(f"\n== variant {variant.name}: {variant.description}; {len(workload.sessions)} sessions, "
              f"{workload.num_requests} requests, last arrival at {workload.last_arrival_s:.0f}s", flush=True)
        # a repeat at another seed runs only its own policies, whatever was asked for
        skip = () if config.explicit_policies and not variant.repeat_of else variant.skip_policies
        targets: list[tuple[str, peer_mod.PeerInstall | None]] = [
            (p, None) for p in config.policies if p.partition(":")[0] not in skip]
        targets += [(inst.name, inst) for inst in installs
                    if (config.explicit_peers and not variant.repeat_of) or inst.name not in variant.skip_peers]
        for target, peer in targets:
            started, load_before = time.monotonic(), os.getloadavg()[0]
            print(f"  {target}: running (load average {load_before:.2f}) ...", flush=True)
            cell = run_cell(config, variant, workload, target, log_dir, peer)
            cell.loadavg = (round(load_before, 2), round(os.getloadavg()[0], 2))
            cells.append(cell)
            if not cell.skipped:
                print(f"    hit ratio {cell.hit_ratio:.3f} ({cell.of_oracle:.0%} of oracle {cell.oracle_ratio:.3f}), "
                      f"TTFT p50 {_ms(cell.ttft_p50)} p99 {_ms(cell.ttft_p99)}, load max/mean "
                      f"{cell.load_imbalance:.2f}, {cell.requests} ok / {cell.errors} failed "
                      f"in {time.monotonic() - started:.0f}s", flush=True)
        print("\n" + render_text(cells, variant.name), flush=True)
    return cells


def parse_args(argv: Sequence[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m bench.multiturn", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="CI smoke: uniform variant only, small, no peers, backends at --speed 0.5 (< 1 min)")
    p.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)} (full mode)")
    p.add_argument("--policies", default=None,
                   help="comma-separated policies of our router; session:C runs the session policy with "
                        "--load-factor C as an extra row")
    p.add_argument("--peers", default=None,
                   help="comma-separated peers (vllm-router,sglang-router) or 'none'; default: both in full mode")
    p.add_argument("--peer-venv", default=peer_mod.DEFAULT_VENV, help="venv the peers are installed into")
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per backend (default 768; quick 128)")
    p.add_argument("--load-factor", type=float, default=1.25, help="the router's default; for the target check only")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--skewed-seeds", type=int, default=None, metavar="N",
                   help=f"run the skewed variant's kv_aware and session cells at N workload seeds and judge its "
                        f"tail over all (full mode; default {SKEWED_SEEDS} when skewed runs, 1 = its own seed only)")
    p.add_argument("--sample", type=float, default=0.1, metavar="SECONDS", help="load sampling interval")
    p.add_argument("--out", default=None, help="JSON results path (default bench/out/multiturn-<time>.json)")
    p.add_argument("--markdown", action="store_true", help="also print the tables in Markdown")
    p.add_argument("--records", action="store_true", help="keep every request's record in the JSON results")
    p.add_argument("--router-config", default="", metavar="FILE",
                   help="TOML config for our router (flags still set policy, stamp and backends); default: the "
                        "router's defaults with [placement] decision_header = true")
    p.add_argument("--no-kv-events", action="store_true",
                   help="start the backends without --kv-events-config (our router then has no KV index)")
    p.add_argument("--plots", default=None, metavar="DIR",
                   help="also draw the PNGs (bench.plots: TTFT distributions, load over time) into DIR")
    args = p.parse_args(argv)
    policies = tuple(x for x in (args.policies or ",".join(POLICIES)).split(",") if x)
    for policy in policies:
        name, _, factor = policy.partition(":")
        if name not in POLICIES:
            p.error(f"--policies: unknown policy {name!r} (known: {', '.join(POLICIES)})")
        if factor:
            try:
                if name != "session" or float(factor) < 1:
                    raise ValueError
            except ValueError:
                p.error(f"--policies: {policy!r}: only session takes a load factor, as session:C with C >= 1")
    if args.quick:
        variants = quick_variants(args.seed)
        num_blocks = args.num_blocks or QUICK_NUM_BLOCKS
        speed = QUICK_SPEED
        peers: tuple[str, ...] = ()
    else:
        table = full_variants(args.seed)
        names = args.variants.split(",") if args.variants else list(VARIANTS)
        for name in names:
            if name not in table:
                p.error(f"--variants: unknown variant {name!r} (known: {', '.join(VARIANTS)})")
        variants = tuple(table[n] for n in names)
        repeats = SKEWED_SEEDS if args.skewed_seeds is None else args.skewed_seeds
        if repeats < 1:
            p.error("--skewed-seeds must be >= 1")
        if "skewed" in names and repeats > 1:
            variants += skewed_repeats(table["skewed"], repeats)
        num_blocks = args.num_blocks or 768
        speed = FULL_SPEED
        peers = tuple(peer_mod.PEERS)
    if args.peers is not None:
        peers = () if args.peers == "none" else tuple(x for x in args.peers.split(",") if x)
        for name in peers:
            if name not in peer_mod.PEERS:
                p.error(f"--peers: unknown peer {name!r} (known: {', '.join(peer_mod.PEERS)}, or none)")
    if args.backends < 1 or num_blocks < 1 or args.sample <= 0:
        p.error("--backends and --num-blocks must be >= 1 and --sample > 0")
    config = BenchConfig(variants=variants, policies=policies, peers=peers, peer_venv=args.peer_venv,
                         num_backends=args.backends, num_blocks=num_blocks, speed=speed,
                         load_factor=args.load_factor,
                         sample_s=args.sample, keep_records=args.records, explicit_policies=bool(args.policies),
                         explicit_peers=args.peers is not None, kv_events=not args.no_kv_events,
                         router_config=os.path.abspath(args.router_config) if args.router_config else "")
    return config, args


#: our router's config when --router-config is not given: its defaults, and the decision header on
ROUTER_CONFIG = "[placement]\ndecision_header = true\n"


def write_router_config(directory: str) -> str:
    path = os.path.join(directory, "router.toml")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(ROUTER_CONFIG)
    return path


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_cell's finally: its processes are stopped


def main(argv: Sequence[str] | None = None) -> int:
    config, args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    log_dir = tempfile.mkdtemp(prefix="bench-multiturn-")
    if config.kv_events and not backends_have_kv_events():
        print("multiturn: the backends have no --kv-events-config option; run with --no-kv-events", file=sys.stderr)
        return 2
    if not config.router_config and router_has_decision_header():
        config = msgspec.structs.replace(config, router_config=write_router_config(log_dir))
    machine = machine_info()
    print(f"multiturn benchmark: {config.num_backends} backends x {config.num_blocks} blocks of "
          f"{config.block_size} tokens, speed {config.speed}; policies {', '.join(config.policies)}; "
          f"load average {machine['loadavg'][0]:.2f}; logs in {log_dir}", flush=True)
    peer_notes: list[str] = []
    t0 = time.monotonic()
    cells = run(config, log_dir, peer_notes)
    checks = check_targets(cells, config.load_factor)
    print("\ntargets:")
    for c in checks:
        print(f"  {'PASS' if c.ok else 'MISS'}  {c.name}: {c.detail}")
    if args.markdown:
        for variant in config.variants:
            print(f"\n### {variant.name}: {variant.description}\n\n" + render_markdown(cells, variant.name))
    machine["loadavg_after"] = list(os.getloadavg())
    command = "python -m bench.multiturn " + " ".join(sys.argv[1:] if argv is None else argv)
    result = BenchResult(started=started, machine=machine, command=command.strip(), config=config,
                         cells=cells, checks=checks, peer_notes=peer_notes)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                   f"multiturn-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "wb") as fh:
        fh.write(msgspec.json.format(msgspec.json.encode(result)))
    print(f"\n{len(cells)} cells in {time.monotonic() - t0:.0f}s; results in {out}", flush=True)
    if args.plots:
        from bench import plots  # matplotlib: the bench extra, only when asked for

        for path in plots.draw_multiturn(result, args.plots):
            print(f"plot: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Router replicas that agree (issue 15 §5): 3 router processes against 1, with and without Redis.

Every cell starts fresh processes: 4 ``session-backend`` processes (``--speed 1``, KV events on, a KV
capacity that holds only part of the working set, as ``bench.multiturn``), 1 or 3 router processes in front of
all of them (``--policy kv_aware``, the default, with the decision header), and, for the Redis cells, a real
``/usr/bin/redis-server`` on 127.0.0.1 that every replica uses (``--shared-state redis://…``). The same seeded
multi-turn chat workload (``bench.workload``) is replayed through it by ``bench.multiturn``'s client, but each
request goes to the next replica in turn (round robin PER REQUEST, the worst case for affinity: a session's
consecutive turns meet three different routers). Meanwhile Responses API chains (``POST /v1/responses`` with
``store`` on, each follow-up naming the previous answer's ``previous_response_id``, no session header) run
through the same rotation.

What a cell measures:

- hit ratio: the backends' Δ``vllm:prefix_cache_hits_total / queries_total`` (``bench.multiturn.summarize``),
  and the oracle;
- where each request went: the replica that served it answers ``GET /v1/sessions/{id}`` (``last_backend``)
  right after the turn. A follow-up turn is placed "as a single router would" when it went where the session
  was (the previous turn's backend) or was moved by a spill or re-pin decision (``X-Session-Router-Decision``),
  both what one router holding the session's pin does; it went "elsewhere" when a ``new`` or ``sticky``
  decision put it on another backend (its replica had no entry for the session, or a stale pin). The
  request-by-request match with the 1-replica cell is shown too, but it measures timing more than agreement:
  the full run's second 1-replica cell shows how little two runs of the same single router match (kv_aware
  places new sessions on the engines' load, which differs by milliseconds);
- follow-ups that reach the storing backend: after each answer every backend is asked ``GET
  /v1/responses/{id}`` (exactly one holds it); a follow-up reached the storing backend when its own answer was
  stored on the backend that held the previous one (a follow-up sent elsewhere gets the backend's 404);
- kill: mid-run one replica is taken out of the clients' rotation (what a Service does when the pod goes) and
  SIGKILLed by PID; failures are counted per replica (clients retry nothing): only requests in flight on the
  killed replica may fail;
- churn: the routers discover the backends through the fake Kubernetes API (``bench.fake_kube``, real HTTP on
  127.0.0.1; ``--discovery kubernetes``); every ``--churn-period`` seconds one pod turns NotReady and half a
  period later Ready again; no request may fail, and each replica's ``GET /admin/backends`` must show each
  change within 2 s of the API write (polled every 20 ms).

    python -m bench.replicas --quick          # CI smoke (< 90 s, small)
    python -m bench.replicas --write-results  # the full run; its section "replicas" of bench/RESULTS.md

Redis cells run when ``/usr/bin/redis-server`` exists and the router has ``router.shared`` (``--redis auto``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import aiohttp
import msgspec

from bench import multiturn as mt
from bench.fake_kube import FakeKubeAPI, pod
from bench.procs import LOOPBACK, Proc, free_port, free_ports, start_backend, start_router, wait_until
from bench.router_overhead import machine_facts, publish, write_section
from bench.workload import Workload, WorkloadSpec, generate

SECTION = "replicas"
REDIS_SERVER = "/usr/bin/redis-server"
#: issue 15 §5's targets
HIT_RATIO_SHARE = 0.98
SAME_BACKEND_SHARE = 0.99
CONVERGE_S = 2.0
CHURN_POLL_S = 0.02
#: the shared state's counters a cell reports (name after session_router_shared_state_, label keys)
SHARED_COUNTERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reads", ("kind", "result")), ("writes", ("kind",)), ("pushes", ()), ("read_timeouts", ()),
    ("dropped_writes", ()), ("errors", ("op",)))
NUM_BACKENDS = 4

# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


class ChainRecord(msgspec.Struct):
    chain: int
    turn: int
    replica: int
    ok: bool
    status: int = 0
    response_id: str = ""
    previous_id: str = ""
    #: the backends holding this answer (GET /v1/responses/{id} on each) and the previous one
    stored_on: list[str] = []
    previous_on: list[str] = []
    error: str = ""


class Flip(msgspec.Struct):
    pod: str
    #: "out" (NotReady -> draining or gone) or "in" (Ready -> healthy, not draining)
    kind: str
    #: seconds from the API write until each replica showed it (replica order)
    seconds: list[float]


class CellReport(msgspec.Struct, kw_only=True):
    name: str
    replicas: int
    redis: bool
    discovery: str = "static"
    duration_s: float = 0.0
    loadavg: tuple[float, float] = (0.0, 0.0)
    requests: int = 0
    errors: int = 0
    first_error: str = ""
    hit_ratio: float = 0.0
    oracle_ratio: float = 0.0
    ttft_p50: float = 0.0
    ttft_p99: float = 0.0
    #: requests served (ok) and failed, by replica index
    served_by_replica: list[int] = []
    failed_by_replica: list[int] = []
    #: the decision header's outcome (sticky, new, spill, ...) -> requests
    outcomes: dict[str, int] = {}
    #: requests whose backend is known (attributed), and of them on the session's first backend
    attributed: int = 0
    on_first_backend: int = 0
    #: follow-up turns (turn >= 1, it and the previous turn attributed): on the previous turn's backend; moved
    #: by a deliberate decision (spill, re-pin: made from the session's pin, as a single router makes them);
    #: elsewhere without one (the replica did not know where the session was: disagreement)
    followup_turns: int = 0
    followup_same: int = 0
    followup_moved: int = 0
    followup_disagree: int = 0
    #: against the 1-replica cell of the same mode: (session, turn) pairs attributed in both, and same backend
    compared: int = 0
    same_backend: int = 0
    compared_with: str = ""
    #: Responses chains: follow-ups answered, reaching the storing backend, 404 (elsewhere), other failures
    followups: int = 0
    followups_reached: int = 0
    followups_not_found: int = 0
    followups_failed: int = 0
    chain_first_failed: int = 0
    stored_not_once: int = 0
    #: kill: the replica killed, when (s after start), requests in flight on it then
    killed_replica: int = -1
    killed_at_s: float = 0.0
    in_flight_on_killed: int = 0
    #: churn: every flip's convergence per replica
    flips: list[Flip] = []
    #: off-first-choice placements by reason (session_router_off_first_choice_total, summed over replicas)
    off_first_choice: dict[str, int] = {}
    placements: dict[str, int] = {}
    #: session_router_shared_state_* counter deltas summed over the replicas alive at the end ("reads/pin/miss")
    shared: dict[str, int] = {}
    records: list[mt.TurnRecord] = []
    turn_replicas: list[int] = []
    chains: list[ChainRecord] = []


# ---------------------------------------------------------------------------------------------
# Clients: the multi-turn driver spread over replicas, and Responses chains
# ---------------------------------------------------------------------------------------------


class Rotation:
    """Round robin per request over the replicas still in the clients' rotation."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self.alive = list(range(len(urls)))
        self._next = 0
        #: requests sent and not yet answered, per replica
        self.in_flight = [0] * len(urls)

    def pick(self) -> int:
        index = self.alive[self._next % len(self.alive)]
        self._next += 1
        return index

    def take_out(self, index: int) -> None:
        self.alive.remove(index)


class SpreadDriver(mt.Driver):
    """``bench.multiturn``'s client, each turn sent to the next replica (its attribution asks the same one)."""

    def __init__(self, workload: Workload, rotation: Rotation, backend_urls: Sequence[str], *, sample_s: float,
                 request_timeout_s: float) -> None:
        super().__init__(workload, rotation.urls[0], backend_urls, send_header=True, router_api=True,
                         sample_s=sample_s, request_timeout_s=request_timeout_s)
        self.rotation = rotation
        #: (session, turn) -> replica index
        self.sent_to: dict[tuple[int, int], int] = {}

    def target_for(self, record: mt.TurnRecord) -> str:
        key = (record.session, record.turn)
        index = self.sent_to.get(key)
        if index is None:
            index = self.sent_to[key] = self.rotation.pick()
        return self.rotation.urls[index]


class Chains:
    """Responses API conversations through the rotation: each follow-up names the previous answer."""

    def __init__(self, rotation: Rotation, backend_urls: Sequence[str], *, chains: int, turns: int, span_s: float,
                 think_s: float, answer_tokens: int, timeout_s: float) -> None:
        self.rotation = rotation
        self.backends = list(backend_urls)
        self.chains, self.turns, self.span_s, self.think_s = chains, turns, span_s, think_s
        self.answer_tokens = answer_tokens
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.records: list[ChainRecord] = []

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=self.timeout) as http:
            await asyncio.gather(*(self._chain(http, c) for c in range(self.chains)))

    async def _chain(self, http: aiohttp.ClientSession, chain: int) -> None:
        await asyncio.sleep(self.span_s * chain / max(1, self.chains))
        previous, previous_on = "", []
        for turn in range(self.turns):
            index = self.rotation.pick()
            body: dict[str, Any] = {"model": mt.MODEL, "input": f"Chain {chain} turn {turn}: say something.",
                                    "max_output_tokens": self.answer_tokens, "ignore_eos": True, "store": True}
            if previous:
                body["previous_response_id"] = previous
            record = ChainRecord(chain, turn, index, False, previous_id=previous, previous_on=previous_on)
            self.rotation.in_flight[index] += 1
            try:
                async with http.post(self.rotation.urls[index] + "/v1/responses", json=body) as resp:
                    record.status = resp.status
                    data = await resp.read()
                    if resp.status == 200:
                        record.response_id = str(msgspec.json.decode(data)["id"])
                        record.ok = True
                    else:
                        record.error = data[:200].decode(errors="replace")
            except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError, KeyError) as exc:
                record.error = f"{type(exc).__name__}: {exc}"[:200]
            finally:
                self.rotation.in_flight[index] -= 1
            if record.ok:
                record.stored_on = await self._holders(http, record.response_id)
                previous, previous_on = record.response_id, record.stored_on
            self.records.append(record)
            await asyncio.sleep(self.think_s)

    async def _holders(self, http: aiohttp.ClientSession, response_id: str) -> list[str]:
        async def holds(url: str) -> bool:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(f"{url}/v1/responses/{response_id}") as resp:
                    return resp.status == 200
            return False

        found = await asyncio.gather(*(holds(u) for u in self.backends))
        return [u for u, yes in zip(self.backends, found, strict=True) if yes]


# ---------------------------------------------------------------------------------------------
# Processes: Redis, routers, pods
# ---------------------------------------------------------------------------------------------


def start_redis(log_dir: str) -> Proc:
    """A real redis-server on 127.0.0.1:<free port>, no persistence; ready when it accepts connections."""
    port = free_port()
    args = [REDIS_SERVER, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no"]
    log_path = os.path.join(log_dir, f"redis-{port}.log")
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    proc = Proc(args, port, popen, log_path)

    def accepting() -> bool:
        if not proc.alive():
            raise AssertionError(f"redis-server exited:\n{proc.log()}")
        with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), timeout=0.5):
            return True
        return False

    wait_until(accepting, timeout=10, what="redis-server")
    return proc


def redis_ready() -> str:
    """"" when the Redis cells can run, else why not."""
    if not os.path.exists(REDIS_SERVER):
        return f"{REDIS_SERVER} is not installed"
    if importlib.util.find_spec("router.shared") is None:
        return "the router has no shared state yet (router.shared)"
    return ""


def router_args(router_config: str, backend_urls: Sequence[str], redis_url: str, kubeconfig: str) -> list[str]:
    args = ["--stamp", "derive", "--log-level", "warning", "--admin-token", mt.ADMIN_TOKEN, "--config", router_config]
    if kubeconfig:
        args += ["--discovery", "kubernetes", "--kubernetes-selector", "app=vllm", "--kubernetes-port-name", "http",
                 "--kubernetes-namespace", "inference", "--kubeconfig", kubeconfig]
    else:
        for url in backend_urls:
            args += ["--backend", url]
    if redis_url:
        args += ["--shared-state", redis_url]
    return args


async def admin_backends(http: aiohttp.ClientSession, router_url: str) -> dict[str, dict[str, Any]]:
    async with http.get(router_url + "/admin/backends", headers={"Authorization": f"Bearer {mt.ADMIN_TOKEN}"}) as resp:
        return {b["url"]: b for b in (await resp.json())["data"]}


def _taking_traffic(row: dict[str, Any] | None) -> bool:
    return row is not None and bool(row.get("healthy")) and not row.get("draining")


async def converge(http: aiohttp.ClientSession, routers: Sequence[str], url: str, ready: bool, started: float,
                   timeout_s: float = 30.0) -> list[float]:
    """Seconds from ``started`` until each router's backend list shows ``url`` taking traffic (``ready``) or
    out of rotation (draining or gone)."""

    async def one(router: str) -> float:
        deadline = started + timeout_s
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                row = (await admin_backends(http, router)).get(url)
                if _taking_traffic(row) == ready:
                    return time.monotonic() - started
            if time.monotonic() > deadline:
                return float("inf")
            await asyncio.sleep(CHURN_POLL_S)

    return list(await asyncio.gather(*(one(r) for r in routers)))


# ---------------------------------------------------------------------------------------------
# One cell
# ---------------------------------------------------------------------------------------------


class CellPlan(msgspec.Struct, frozen=True, kw_only=True):
    #: short name for --cells
    key: str
    name: str
    replicas: int
    redis: bool
    chains: bool = True
    #: SIGKILL the last replica this many seconds into the run (0 = never)
    kill_at_s: float = 0.0
    #: churn the pods (kubernetes discovery) with this period (0 = static backends)
    churn_period_s: float = 0.0


class RunConfig(msgspec.Struct, frozen=True, kw_only=True):
    spec: WorkloadSpec
    num_blocks: int
    chains: int
    chain_turns: int
    chain_think_s: float
    sample_s: float = 0.25
    timeout_s: float = 120.0


def _sum_samples(samples: Sequence[mt.Samples]) -> mt.Samples:
    total: mt.Samples = defaultdict(float)
    for s in samples:
        for key, value in s.items():
            total[key] += value
    return dict(total)


async def _scrape(http: aiohttp.ClientSession, url: str) -> mt.Samples:
    async with http.get(url + "/metrics") as resp:
        return mt.parse_metrics(await resp.text())


async def _scrape_all(urls: Sequence[str]) -> list[mt.Samples]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
        return list(await asyncio.gather(*(_scrape(http, u) for u in urls)))


async def _churn(fake: FakeKubeAPI, backends: Sequence[Proc], routers: Sequence[str], period_s: float,
                 stop: asyncio.Event, flips: list[Flip]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        turn = 0
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s / 2)
                return
            backend = backends[turn % len(backends)]
            name = f"vllm-{turn % len(backends)}"
            turn += 1
            for ready in (False, True):
                started = time.monotonic()
                await fake.put(pod(name, LOOPBACK, port=backend.port, ready=ready))
                seconds = await converge(http, routers, backend.url, ready, started)
                flips.append(Flip(name, "in" if ready else "out", [round(s, 4) for s in seconds]))
                if not ready:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), max(0.0, period_s / 2 - (time.monotonic() - started)))
                    # the pod comes back even when the run ends now: the next cell starts clean anyway


async def _run_cell(plan: CellPlan, run: RunConfig, workload: Workload, log_dir: str, router_config: str,
                    bench: mt.BenchConfig, ports: Sequence[int]) -> CellReport:
    """One cell; the backends listen on ``ports`` in every cell of a run (their URLs are what rendezvous
    hashing ranks, so cells compare request by request only with the same URLs)."""
    report = CellReport(name=plan.name, replicas=plan.replicas, redis=plan.redis,
                        discovery="kubernetes" if plan.churn_period_s else "static")
    procs: list[Proc] = []
    fake: FakeKubeAPI | None = None
    try:
        backends = list(await asyncio.gather(*(asyncio.to_thread(start_backend, log_dir, *mt.backend_args(
            bench, log_dir, port), port=port, speed=bench.speed) for port in ports)))
        procs += backends
        urls = [b.url for b in backends]
        redis_url = ""
        if plan.redis:
            redis = await asyncio.to_thread(start_redis, log_dir)
            procs.append(redis)
            redis_url = f"redis://{LOOPBACK}:{redis.port}/0"
        kubeconfig = ""
        if plan.churn_period_s:
            fake = FakeKubeAPI()
            await fake.start()
            for i, b in enumerate(backends):
                await fake.put(pod(f"vllm-{i}", LOOPBACK, port=b.port))
            kubeconfig = fake.kubeconfig(log_dir)
        args = router_args(router_config, urls, redis_url, kubeconfig)
        routers = list(await asyncio.gather(*(asyncio.to_thread(start_router, log_dir, *args)
                                              for _ in range(plan.replicas))))
        procs += routers
        router_urls = [r.url for r in routers]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            for r in router_urls:  # every replica sees every backend healthy before the clock starts
                await _until_all_healthy(http, r, urls)
        prefix = await asyncio.to_thread(mt.shared_prefix_tokens, urls[0], workload)
        before = await _scrape_all(urls)
        router_before = await _scrape_all(router_urls)
        rotation = Rotation(router_urls)
        driver = SpreadDriver(workload, rotation, urls, sample_s=run.sample_s, request_timeout_s=run.timeout_s)
        tasks = [driver.run()]
        chains = Chains(rotation, urls, chains=run.chains, turns=run.chain_turns,
                        span_s=max(1.0, workload.last_arrival_s), think_s=run.chain_think_s, answer_tokens=16,
                        timeout_s=run.timeout_s)
        if plan.chains:
            tasks.append(chains.run())
        stop = asyncio.Event()
        background: list[asyncio.Task[None]] = []
        if fake is not None:
            background.append(asyncio.create_task(_churn(fake, backends, router_urls, plan.churn_period_s, stop,
                                                         report.flips)))
        if plan.kill_at_s:
            background.append(asyncio.create_task(_kill(plan.kill_at_s, routers[-1], rotation, driver, report)))
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
        stop.set()
        for task in background:
            await task
        live_routers = [r.url for r in routers if r.alive()]
        after = await _scrape_all(urls)
        router_after = await _scrape_all(live_routers)
        router_before = [s for r, s in zip(routers, router_before, strict=True) if r.alive()]
    finally:
        for proc in reversed(procs):
            proc.stop()
        if fake is not None:
            await fake.stop()
    report.loadavg = (round(load_before, 2), round(os.getloadavg()[0], 2))
    rb, ra = _sum_samples(router_before), _sum_samples(router_after)
    variant = mt.Variant(plan.name, workload.spec, True, plan.name)
    cell = mt.summarize(bench, variant, plan.name, "ours", "", driver, duration, urls, prefix, before, after, rb, ra)
    report.duration_s = round(duration, 2)
    report.requests, report.errors, report.first_error = cell.requests, cell.errors, cell.first_error
    report.hit_ratio, report.oracle_ratio = round(cell.hit_ratio, 4), round(cell.oracle_ratio, 4)
    report.ttft_p50, report.ttft_p99 = round(cell.ttft_p50, 4), round(cell.ttft_p99, 4)
    report.placements = cell.placements
    report.off_first_choice = mt.counter_deltas(rb, ra, "session_router_off_first_choice_total", "reason")
    for metric, keys in SHARED_COUNTERS:
        for key, value in mt.counter_deltas(rb, ra, f"session_router_shared_state_{metric}_total", *keys).items():
            report.shared[f"{metric}/{key}" if keys else metric] = value
    records = sorted(driver.records, key=lambda r: (r.session, r.turn))
    report.records = records
    report.turn_replicas = [driver.sent_to[(r.session, r.turn)] for r in records]
    served, failed = [0] * plan.replicas, [0] * plan.replicas
    for r, replica in zip(records, report.turn_replicas, strict=True):
        (served if r.ok else failed)[replica] += 1
    for c in chains.records:
        (served if c.ok else failed)[c.replica] += 1
    report.served_by_replica, report.failed_by_replica = served, failed
    report.outcomes = dict(Counter(r.decision.split(";", 1)[0] for r in records if r.ok and r.decision))
    first: dict[int, str] = {}
    for r in records:
        if r.ok and r.backend:
            first.setdefault(r.session, r.backend)
            report.attributed += 1
            report.on_first_backend += r.backend == first[r.session]
    agreement(report)
    report.chains = sorted(chains.records, key=lambda c: (c.chain, c.turn))
    tally_chains(report)
    return report


def tally_chains(cell: CellReport) -> None:
    """The Responses chains' counts: a follow-up reached the storing backend when its own answer is stored
    on the one backend that held the previous answer; a 404 is a backend that did not hold it."""
    cell.followups = cell.followups_reached = cell.followups_not_found = cell.followups_failed = 0
    cell.chain_first_failed = cell.stored_not_once = 0
    for c in cell.chains:
        if c.ok and len(c.stored_on) != 1:
            cell.stored_not_once += 1
        if c.turn == 0:
            cell.chain_first_failed += not c.ok
            continue
        cell.followups += 1
        if c.ok:
            cell.followups_reached += len(c.stored_on) == 1 and c.stored_on == c.previous_on
        elif c.status == 404:
            cell.followups_not_found += 1
        else:
            cell.followups_failed += 1


async def _until_all_healthy(http: aiohttp.ClientSession, router: str, urls: Sequence[str]) -> None:
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            seen = await admin_backends(http, router)
            if all(_taking_traffic(seen.get(u)) for u in urls):
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"router {router} did not see every backend healthy within 30 s")
        await asyncio.sleep(0.05)


async def _kill(at_s: float, router: Proc, rotation: Rotation, driver: SpreadDriver, report: CellReport) -> None:
    await asyncio.sleep(at_s)
    index = rotation.urls.index(router.url)
    rotation.take_out(index)  # as a Service drops the pod's endpoint: no new request goes there
    report.killed_replica = index
    report.killed_at_s = round(at_s, 2)
    # requests sent to it and not answered yet (chat turns: records appear when answered; chains: counted live)
    answered = {(r.session, r.turn) for r in driver.records}
    report.in_flight_on_killed = rotation.in_flight[index] + sum(
        1 for key, replica in driver.sent_to.items() if replica == index and key not in answered)
    await asyncio.to_thread(router.kill)


# ---------------------------------------------------------------------------------------------
# Comparisons, checks, report
# ---------------------------------------------------------------------------------------------


#: decision outcomes that move a session on purpose (the replica knew its pin)
MOVES = ("spill", "repin_unhealthy", "repin_removed")


def agreement(cell: CellReport) -> None:
    """Per follow-up turn: was it placed where the session was (the previous turn's backend), moved by a
    decision made from the session's pin, or elsewhere because its replica did not know the session (no
    entry, or a stale pin)? What a single router would choose for a turn is the session's pin unless it
    decides a move; a replica that agrees does the same."""
    previous: dict[int, tuple[int, str]] = {}
    cell.followup_turns = cell.followup_same = cell.followup_moved = cell.followup_disagree = 0
    for r in sorted(cell.records, key=lambda r: (r.session, r.turn)):
        if not (r.ok and r.backend):
            continue
        before = previous.get(r.session)
        previous[r.session] = (r.turn, r.backend)
        if before is None or before[0] != r.turn - 1:
            continue
        cell.followup_turns += 1
        if r.backend == before[1]:
            cell.followup_same += 1
        elif r.decision.split(";", 1)[0] in MOVES:
            cell.followup_moved += 1
        else:
            cell.followup_disagree += 1


def compare(cell: CellReport, single: CellReport) -> None:
    """Fill ``cell``'s same-backend counts against the 1-replica cell ``single`` ((session, turn) pairs
    attributed in both)."""
    theirs = {(r.session, r.turn): r.backend for r in single.records if r.ok and r.backend}
    cell.compared = cell.same_backend = 0
    for r in cell.records:
        other = theirs.get((r.session, r.turn))
        if r.ok and r.backend and other:
            cell.compared += 1
            cell.same_backend += r.backend == other
    cell.compared_with = single.name


def _share(num: int, den: int) -> float:
    return num / den if den else 0.0


def checks(cells: Sequence[CellReport]) -> list[mt.TargetCheck]:
    out: list[mt.TargetCheck] = []
    by_name = {c.name: c for c in cells}
    for redis, tag in ((False, "without Redis"), (True, "with Redis")):
        three = by_name.get(f"3 replicas{', Redis' if redis else ''}")
        if three is None:
            continue
        # the reference: the 1-replica cells of the run that ran the same workload (one router alone, with or
        # without Redis, is the same router; on a shared machine two runs of it differ by more than the
        # replicas do); not the repeat cell, which runs no Responses chains: 60 fewer requests, less KV load
        singles = [c for c in cells if c.replicas == 1 and c.hit_ratio and bool(c.chains) == bool(three.chains)]
        if not singles:
            continue
        single = statistics.fmean(c.hit_ratio for c in singles)
        spread = (f"; 1-replica cells {', '.join(f'{c.name} {c.hit_ratio:.3f}' for c in singles)}"
                  if len(singles) > 1 else "")
        share = _share(three.hit_ratio, single)
        out.append(mt.TargetCheck(f"hit ratio, 3 replicas >= {HIT_RATIO_SHARE:.0%} of 1 replica's ({tag})",
                                  share >= HIT_RATIO_SHARE,
                                  f"{three.hit_ratio:.3f} vs {single:.3f} = {share:.1%}{spread}"))
        agree = three.followup_same + three.followup_moved
        same = _share(agree, three.followup_turns)
        out.append(mt.TargetCheck(
            f"follow-up turns placed as a single router would ({tag})"
            + (f" >= {SAME_BACKEND_SHARE:.0%}" if redis else ": figure"),
            same >= SAME_BACKEND_SHARE if redis else True,
            f"{agree}/{three.followup_turns} = {same:.2%} ({three.followup_same} where the session was, "
            f"{three.followup_moved} moved by a spill or re-pin, {three.followup_disagree} elsewhere by a replica "
            f"that did not know the session; request by request against the 1-replica run: {three.same_backend}/"
            f"{three.compared} = {_share(three.same_backend, three.compared):.1%})"))
        reached = _share(three.followups_reached, three.followups)
        out.append(mt.TargetCheck(
            f"previous_response_id follow-ups reach the storing backend ({tag})" + (": 100%" if redis else ": figure"),
            three.followups > 0 and three.followups_reached == three.followups if redis else True,
            f"{three.followups_reached}/{three.followups} = {reached:.1%} ({three.followups_not_found} answered 404 "
            f"by another backend, {three.followups_failed} other failures)"))
    for c in cells:
        if c.killed_replica >= 0:
            elsewhere = sum(n for i, n in enumerate(c.failed_by_replica) if i != c.killed_replica)
            on_killed = c.failed_by_replica[c.killed_replica]
            out.append(mt.TargetCheck(
                f"[{c.name}] no request fails except those in flight on the killed replica",
                elsewhere == 0 and on_killed <= c.in_flight_on_killed,
                f"failed by replica {c.failed_by_replica} (killed: {c.killed_replica}, {c.in_flight_on_killed} in "
                f"flight on it at the kill); served {c.served_by_replica}"))
        else:  # a follow-up sent to another backend (404) is counted by the follow-up check above
            other = c.errors + c.chain_first_failed + c.followups_failed
            out.append(mt.TargetCheck(f"[{c.name}] no request fails" + (" (404 follow-ups aside)" if c.followups else ""),
                                      other == 0, f"{c.errors} chat requests failed"
                                      + (f" (first: {c.first_error})" if c.first_error else "")
                                      + f"; failed by replica {c.failed_by_replica}"))
        if c.flips:
            worst = max(max(f.seconds) for f in c.flips)
            out.append(mt.TargetCheck(f"[{c.name}] discovery converges within {CONVERGE_S:g} s on every replica",
                                      worst <= CONVERGE_S, f"{len(c.flips)} changes, worst {worst * 1e3:.0f} ms"))
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def _flip_stats(flips: Sequence[Flip], kind: str) -> str:
    values = sorted(s * 1e3 for f in flips if f.kind == kind for s in f.seconds)
    if not values:
        return "–"
    return f"{statistics.median(values):.0f} / {values[-1]:.0f} ms ({len(values)})"


def render(cells: Sequence[CellReport], found: Sequence[mt.TargetCheck], facts: dict[str, str], run: RunConfig,
           notes: Sequence[str]) -> str:
    spec = run.spec
    lines = [
        f"### {run.num_blocks} KV blocks per backend — {facts['date']}",
        "",
        f"`{facts['command']}` (`bench/replicas.py`). Per cell fresh processes: 4 `session-backend` (`--speed 1`, "
        f"{run.num_blocks} KV blocks of 16 tokens, KV events on), 1 or 3 routers (`kv_aware`, decision header), and "
        "for the Redis cells one `redis-server` on 127.0.0.1 shared by the replicas (`--shared-state`). Workload "
        f"(`bench.workload`, seed {spec.seed}): {spec.sessions} sessions of {spec.turns} turns arriving at "
        f"{spec.arrival_rate:g}/s, think {spec.think_s:g} s, system prompt {spec.system_tokens} tokens, user "
        f"{spec.user_tokens[0]}–{spec.user_tokens[1]}, answers {spec.answer_tokens[0]}–{spec.answer_tokens[1]} tokens, "
        f"`X-Session-ID` sent; plus {run.chains} Responses chains of {run.chain_turns} turns (`store` on, "
        "`previous_response_id`, no session header). Every request goes to the next replica (round robin per "
        "request). Machine: "
        f"{facts['nproc']} cores ({facts['cpu']}), shared with other helpers; load average at start {facts['loadavg']}.",
        "",
        "| cell | requests | failed, by replica (404 follow-ups included) | hit ratio | oracle | TTFT p50 / p99 "
        "| follow-up turns as a single router (same / moved / elsewhere) | same backend as the 1-replica run "
        "| previous_response_id reaching the storing backend | decisions | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        same = (f"{c.same_backend}/{c.compared} = {_share(c.same_backend, c.compared):.1%}" if c.compared else "–")
        agree = (f"{_share(c.followup_same + c.followup_moved, c.followup_turns):.2%} ({c.followup_same} / "
                 f"{c.followup_moved} / {c.followup_disagree})" if c.followup_turns else "–")
        reach = (f"{c.followups_reached}/{c.followups} = {_share(c.followups_reached, c.followups):.0%}"
                 if c.followups else "–")
        decisions = ", ".join(f"{k} {v}" for k, v in sorted(c.outcomes.items()))
        lines.append(
            f"| {c.name} | {c.requests + c.errors} chat + {len(c.chains)} responses | {sum(c.failed_by_replica)} "
            f"{c.failed_by_replica} | {c.hit_ratio:.3f} | {c.oracle_ratio:.3f} | {_ms(c.ttft_p50)} / {_ms(c.ttft_p99)} "
            f"| {agree} | {same} | {reach} | {decisions} "
            f"| {c.loadavg[0]:.1f}→{c.loadavg[1]:.1f} |")
    churn = [c for c in cells if c.flips]
    if churn:
        lines += ["", "Discovery under churn (seconds from the fake API's write to each replica's `GET "
                  "/admin/backends` showing it; median / max over replicas × flips, polled every "
                  f"{CHURN_POLL_S * 1e3:.0f} ms):", "",
                  "| cell | NotReady → out of rotation | Ready → taking traffic |", "|---|---|---|"]
        lines += [f"| {c.name} | {_flip_stats(c.flips, 'out')} | {_flip_stats(c.flips, 'in')} |" for c in churn]
    kills = [c for c in cells if c.killed_replica >= 0]
    for c in kills:
        lines += ["", f"Kill ({c.name}): replica {c.killed_replica} taken out of the rotation and SIGKILLed "
                  f"{c.killed_at_s:g} s into the run with {c.in_flight_on_killed} requests in flight on it; failed "
                  f"by replica {c.failed_by_replica}, served {c.served_by_replica}."]
    offs = [c for c in cells if c.off_first_choice]
    if offs:
        lines += ["", "Off first choice (`session_router_off_first_choice_total`, summed over replicas): "
                  + "; ".join(f"{c.name}: " + ", ".join(f"{k} {v}" for k, v in c.off_first_choice.items())
                              for c in offs) + "."]
    shared = [c for c in cells if c.shared]
    if shared:
        lines += ["", "Shared state (`session_router_shared_state_*_total`, summed over the replicas alive at the "
                  "end): " + "; ".join(f"{c.name}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.shared.items()))
                                       for c in shared) + "."]
    lines += ["", "Targets (issue 15 §5):", ""]
    lines += [f"- {'met' if c.ok else '**NOT met**'}: {c.name}: {c.detail}" for c in found]
    if notes:
        lines += ["", *[f"Note: {n}" for n in notes]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def quick_config(seed: int) -> RunConfig:
    spec = WorkloadSpec(sessions=10, turns=4, arrival_rate=4.0, think_s=0.3, user_tokens=(20, 40),
                        answer_tokens=(16, 32), system_tokens=120, seed=seed)
    return RunConfig(spec=spec, num_blocks=mt.QUICK_NUM_BLOCKS, chains=4, chain_turns=3, chain_think_s=0.2)


def full_config(seed: int) -> RunConfig:
    """``bench.multiturn``'s uniform sizes (768 blocks per backend), 48 sessions of 8 turns at 1.5/s."""
    spec = WorkloadSpec(sessions=48, turns=8, arrival_rate=1.5, think_s=2.0, user_tokens=(40, 120),
                        answer_tokens=(100, 200), system_tokens=300, seed=seed)
    return RunConfig(spec=spec, num_blocks=768, chains=12, chain_turns=5, chain_think_s=1.0)


def plans(quick: bool, redis: bool, churn_period_s: float, duration_hint_s: float) -> list[CellPlan]:
    """The cells of a run. Quick: the 3-replica cells compare with one 1-replica cell (without Redis: one
    router alone shares nothing); full: a 1-replica cell per mode and a repeat that measures the noise."""
    out = [CellPlan(key="1", name="1 replica", replicas=1, redis=False),
           CellPlan(key="3", name="3 replicas", replicas=3, redis=False)]
    if not quick:
        out.append(CellPlan(key="1-repeat", name="1 replica (repeat)", replicas=1, redis=False, chains=False))
    if redis:
        if not quick:
            out.append(CellPlan(key="1-redis", name="1 replica, Redis", replicas=1, redis=True))
        out.append(CellPlan(key="3-redis", name="3 replicas, Redis", replicas=3, redis=True))
    tag = ", Redis" if redis else ""
    out.append(CellPlan(key="kill", name=f"3 replicas{tag}, one killed", replicas=3, redis=redis, chains=False,
                        kill_at_s=round(duration_hint_s / 2, 1)))
    out.append(CellPlan(key="churn", name=f"3 replicas{tag}, pod churn", replicas=3, redis=redis, chains=False,
                        churn_period_s=churn_period_s))
    return out


HEADING = "## Router replicas (issue 15)"


class SavedRun(msgspec.Struct):
    facts: dict[str, str]
    run: RunConfig
    cells: list[CellReport]
    notes: list[str] = []


def report_runs(paths: Sequence[str], results: str) -> int:
    """Render saved runs (checks recomputed), one subsection each; into ``results``' section if given."""
    parts, ok = [HEADING], True
    for path in paths:
        with open(path, "rb") as fh:
            saved = msgspec.json.decode(fh.read(), type=SavedRun)
        found = checks(saved.cells)
        ok = ok and all(c.ok for c in found)
        parts.append(render(saved.cells, found, saved.facts, saved.run, saved.notes))
    text = "\n\n".join(parts)
    if results:
        write_section(results, text, SECTION)
    print(text)
    return 0 if ok else 1


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cell's finally: its processes are stopped


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    p = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI smoke: small workload, short churn period (< 90 s)")
    p.add_argument("--redis", choices=("auto", "on", "off"), default="auto",
                   help="the Redis cells: auto = when redis-server and router.shared exist")
    p.add_argument("--churn-period", type=float, default=None, metavar="SECONDS",
                   help="a pod NotReady -> Ready every SECONDS (default 20; quick 3)")
    p.add_argument("--cells", default="", help="comma-separated cells to run: 1, 3, 1-repeat (full), 1-redis (full), "
                                                "3-redis, kill, churn (default all)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per backend (default 768, quick 128; a capacity that holds the whole working set "
                        "leaves placement as the only cause of misses)")
    p.add_argument("--out", default=None, help="JSON results (default bench/out/replicas-<time>.json)")
    p.add_argument("--write-results", action="store_true", help="write the section 'replicas' of bench/RESULTS.md")
    p.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))
    p.add_argument("--report", nargs="+", metavar="JSON", default=None,
                   help="run nothing: render the results of earlier runs (their --out files), one subsection each")
    args = p.parse_args(argv)
    if args.report:
        return report_runs(args.report, args.results if args.write_results else "")
    run = quick_config(args.seed) if args.quick else full_config(args.seed)
    if args.num_blocks:
        run = msgspec.structs.replace(run, num_blocks=args.num_blocks)
    notes: list[str] = []
    why_not = redis_ready()
    if args.redis == "on" and why_not:
        p.error(f"--redis on: {why_not}")
    redis = args.redis != "off" and not why_not
    if args.redis == "auto" and why_not:
        notes.append(f"Redis cells skipped: {why_not}.")
    workload = generate(run.spec)
    churn = args.churn_period or (3.0 if args.quick else 20.0)
    hint = workload.last_arrival_s + run.spec.turns * run.spec.think_s
    cell_plans = plans(args.quick, redis, churn, hint)
    if args.cells:
        wanted = set(args.cells.split(","))
        unknown = wanted - {c.key for c in cell_plans}
        if unknown:
            p.error(f"--cells: unknown {', '.join(sorted(unknown))} (known: {', '.join(c.key for c in cell_plans)})")
        cell_plans = [c for c in cell_plans if c.key in wanted]
    bench = mt.BenchConfig(variants=(), num_backends=NUM_BACKENDS, num_blocks=run.num_blocks, keep_records=True)
    facts = machine_facts(None, sys.argv[1:] if argv is None else list(argv), module="bench.replicas")
    print(f"replicas benchmark: {len(cell_plans)} cells, {len(workload.sessions)} sessions, "
          f"{workload.num_requests} chat requests per cell; load average {facts['loadavg']}", flush=True)
    cells: list[CellReport] = []
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as log_dir:
        router_config = mt.write_router_config(log_dir)
        ports = free_ports(NUM_BACKENDS)
        for number, plan in enumerate(cell_plans):
            cell_dir = os.path.join(log_dir, f"cell-{number}")
            os.makedirs(cell_dir)
            t0 = time.monotonic()
            print(f"  {plan.name}: running (load average {os.getloadavg()[0]:.2f}) ...", flush=True)
            cell = asyncio.run(_run_cell(plan, run, workload, cell_dir, router_config, bench, ports))
            cells.append(cell)
            print(f"    hit ratio {cell.hit_ratio:.3f}, {cell.requests} ok / {sum(cell.failed_by_replica)} failed "
                  f"{cell.failed_by_replica}, follow-ups {cell.followups_reached}/{cell.followups}, "
                  f"{time.monotonic() - t0:.0f}s", flush=True)
    singles = {c.redis: c for c in cells if c.name in ("1 replica", "1 replica, Redis")}
    for c in cells:
        single = singles.get(c.redis) or singles.get(False)
        if single is not None and c is not single:
            compare(c, single)
    found = checks(cells)
    text = HEADING + "\n\n" + render(cells, found, facts, run, notes)
    record = {"facts": facts, "run": run, "cells": cells, "checks": found, "notes": notes}
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                   f"replicas-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "wb") as fh:
        fh.write(msgspec.json.format(msgspec.json.encode(record)))
    if args.write_results:
        publish(text, args.results, SECTION, os.path.join(os.path.dirname(out), "replicas.jsonl"),
                {"facts": facts, "checks": found})
    else:
        print(text)
    print(f"results in {out}", flush=True)
    return 0 if all(c.ok for c in found) else 1


if __name__ == "__main__":
    sys.exit(main())

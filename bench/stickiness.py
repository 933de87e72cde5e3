"""Do sessions stay on one backend when nothing is saturated, and leave one that becomes slow? (issue 14)

The router-overhead setup (``bench.router_overhead``): two ``session-backend`` processes at ``--speed
0`` (instant) on 127.0.0.1, our router in front, and the load generator (``bench.loadgen``, its own
process, closed loop, keep-alive) sending short completions with ``X-Session-ID`` on every request
from a pool of 64 sessions. The backends publish vLLM's KV events (``--kv-events-config`` on ``ipc://``
endpoints, as in ``bench.multiturn``), so the router's KV index is live. Per placement policy
(``kv_aware``, the default, and ``session``, the old one): fresh backends and router, then a cell per
mode (non-stream ``max_tokens`` 8, stream ``max_tokens`` 16) and concurrency (16, 128), each with its
own 64 session ids.

Where each request went is read exactly from the backends: each keeps a per-session request count
(``GET /v1/sessions``, keyed on the ``X-Session-ID`` the router forwards), read before and after the
cell. Per session, its **majority backend's share** = requests on the backend that served most of
them / all its requests in the cell (warm-up included). Also per cell: the router's placements by
outcome (``session_router_placements_total``: ``spill`` = sent off its pin for load) and the
``kv_aware`` decisions by outcome and reason (``session_router_placement_decisions_total``); the
router's CPU per request (utime + stime of its process from ``/proc``, over the measured window, per
completed request, as ``bench.router_overhead`` measures it); latency and TTFT at the client.

The **slow-backend cell** (per policy, fresh processes): stream requests at ``--slow-concurrency``
in consecutive windows of ``--window`` seconds, with one of the two backends really slow, in one of
two ways (``--slowdown``):

- ``speed`` (the default): the second backend runs at ``--speed`` ``--slow-speed`` (5: a decode step
  of ~50 ms, against none on the other) from the start, so its engine is slow and its own metrics
  say so; new sessions are spread over both as usual, and the windows show them leave it. The TTFT
  p99 it is compared with ("before") is the all-fast stream cell's at the same concurrency.
- ``sigstop``: after ``--before`` windows this process stops and continues the second backend with
  ``SIGSTOP``/``SIGCONT`` (by its PID), stopped ``--stop-ms`` out of every ``--period-ms``
  milliseconds (requests wait in its socket, unseen by its engine's metrics); it is continued for
  good at the end (also on failure).

Per window: TTFT p50/p99, the share of the window's requests the slow backend served and the
sessions it served.

    python -m bench.stickiness                     # full: ~4 min; writes its section of bench/RESULTS.md
    python -m bench.stickiness --quick             # CI smoke (small, short; writes no RESULTS section)
    python -m bench.stickiness --policies kv_aware --no-slow --concurrency 16

Output: the tables (printed; with ``--out`` written between ``<!-- stickiness:begin -->`` /
``<!-- stickiness:end -->`` of that file, by default ``bench/RESULTS.md`` unless ``--quick``), the
JSON result (``--json``, default ``bench/out/stickiness-<time>.json``; ``python -m bench.plots`` draws
``stickiness-slow.png`` from it, or ``--plots DIR`` here).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence

import msgspec

from bench.loadgen import LoadResult, LoadSpec
from bench.multiturn import (
    backends_have_kv_events,
    counter_deltas,
    kv_events_config,
    parse_metrics,
    router_has_decision_header,
    write_router_config,
)
from bench.procs import Proc, free_ports, start_backend, start_router
from bench.router_overhead import MODES, LoadGen, machine_facts, process_tree, write_section

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(BENCH_DIR, "RESULTS.md")
SECTION = "stickiness"
POLICIES = ("kv_aware", "session")
#: issue 14: each session's majority backend serves at least this share of its requests
MAJORITY_TARGET = 0.95
#: issue 14: the router's CPU per request within this factor of the session policy's
CPU_TARGET = 1.10
#: the slow cell: the TTFT p99 "recovered" when the last windows' p99 is within this factor of the
#: windows before the slowdown, and the sessions "left" when the slowed backend served at most this share
RECOVERY_FACTOR = 2.0
LEFT_SHARE = 0.10
#: windows at the end of the slow cell that count as "after"
AFTER_WINDOWS = 3


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


class StickCell(msgspec.Struct, kw_only=True):
    policy: str
    mode: str
    concurrency: int
    sessions: int = 0
    requests: int = 0
    errors: int = 0
    first_error: str = ""
    rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    proxy_cpu_us: float = 0.0
    #: requests per backend URL over the cell (backends' session tables; warm-up included)
    backend_requests: dict[str, int] = {}
    #: per session: the share of its requests its majority backend served
    majority_min: float = 0.0
    majority_mean: float = 0.0
    #: sessions whose majority backend served >= MAJORITY_TARGET of their requests
    sessions_at_target: int = 0
    #: sessions served by more than one backend, and the requests off their majority backend
    sessions_moved: int = 0
    off_majority_requests: int = 0
    placements: dict[str, int] = {}
    decisions: dict[str, int] = {}


class Window(msgspec.Struct, kw_only=True):
    start_s: float
    end_s: float
    slowed: bool
    requests: int = 0
    errors: int = 0
    rps: float = 0.0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    #: requests the slowed backend served in the window (backends' session tables) and their share
    slow_requests: int = 0
    slow_share: float = 0.0
    #: sessions with at least one request served by the slowed backend in the window
    sessions_on_slow: int = 0


class SlowCell(msgspec.Struct, kw_only=True):
    policy: str
    concurrency: int
    slowdown: str
    slowed_at_s: float
    #: where before_p99_ms comes from: the windows before the slowdown, or the all-fast cell
    before_source: str = ""
    windows: list[Window] = []
    placements: dict[str, int] = {}
    decisions: dict[str, int] = {}
    #: median TTFT p99 of the windows before the slowdown, and of the last AFTER_WINDOWS windows
    before_p99_ms: float = 0.0
    after_p99_ms: float = 0.0
    #: the worst window's TTFT p99 after the slowdown
    peak_p99_ms: float = 0.0
    before_slow_share: float = 0.0
    after_slow_share: float = 0.0


class Check(msgspec.Struct):
    name: str
    ok: bool
    detail: str


class StickinessResult(msgspec.Struct, kw_only=True):
    benchmark: str = "stickiness"
    started: str
    facts: dict[str, str]
    settings: dict[str, object]
    cells: list[StickCell] = []
    slow: list[SlowCell] = []
    checks: list[Check] = []


# ---------------------------------------------------------------------------------------------
# Reading the backends and the router
# ---------------------------------------------------------------------------------------------


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return bytes(resp.read())


def session_counts(backend_url: str) -> dict[str, int]:
    """Session id -> requests the backend finished for it (its accounting table, all of it)."""
    data = json.loads(_get(backend_url + "/v1/sessions?limit=100000"))["data"]
    return {row["session_id"]: int(row["requests"]) for row in data}


def count_deltas(before: dict[str, int], after: dict[str, int], prefix: str) -> dict[str, int]:
    """Requests per session of ``prefix`` between two reads of one backend's table."""
    return {sid: n - before.get(sid, 0) for sid, n in after.items() if sid.startswith(prefix) and n > before.get(sid, 0)}


def majority(per_backend: Sequence[dict[str, int]]) -> tuple[list[float], int, int]:
    """Per session, its majority backend's share of its requests; sessions on more than one
    backend; requests off their session's majority backend."""
    sessions = {sid for table in per_backend for sid in table}
    shares: list[float] = []
    moved = off = 0
    for sid in sorted(sessions):
        counts = [table.get(sid, 0) for table in per_backend]
        total = sum(counts)
        shares.append(max(counts) / total)
        moved += sum(1 for n in counts if n) > 1
        off += total - max(counts)
    return shares, moved, off


def router_counters(router_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return parse_metrics(_get(router_url + "/metrics").decode())


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


class Stack:
    """Two backends (KV events on ipc://) and our router with one policy; stopped by PID."""

    def __init__(self, policy: str, tmp: str, kv_events: bool, router_config: str, slow_speed: str = "0") -> None:
        self.procs: list[Proc] = []
        try:
            for index, port in enumerate(free_ports(2)):
                extra = ("--log-level", "WARNING")
                if kv_events:
                    extra += ("--kv-events-config", kv_events_config(tmp, port))
                self.procs.append(start_backend(tmp, *extra, port=port, speed=slow_speed if index else "0"))
            self.backends = list(self.procs)
            args = ["--policy", policy, "--log-level", "warning"]
            if router_config:
                args += ["--config", router_config]
            for b in self.backends:
                args += ["--backend", b.url]
            self.router = start_router(tmp, *args)
            self.procs.append(self.router)
        except BaseException:
            self.stop()
            raise

    def check_alive(self) -> None:
        dead = [p.args[:3] for p in self.procs if not p.alive()]
        if dead:
            raise RuntimeError(f"a process died during the benchmark: {dead}")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


class Throttle:
    """Slows a process from outside: SIGSTOP for ``stop_ms`` out of every ``period_ms``, in a thread,
    until ``stop()`` (which always leaves it continued)."""

    def __init__(self, pid: int, stop_ms: float, period_ms: float) -> None:
        self.pid = pid
        self.stop_s, self.run_s = stop_ms / 1e3, max(0.0, (period_ms - stop_ms) / 1e3)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="throttle", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the thread still stops and continues the process."""
        return self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                self._done.wait(self.run_s)
        except ProcessLookupError:
            return

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(5)
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------------------------
# Cells
# ---------------------------------------------------------------------------------------------


def run_cell(stack: Stack, loadgen: LoadGen, policy: str, mode: str, concurrency: int,
             args: argparse.Namespace) -> StickCell:
    stream, max_tokens = MODES[mode]
    prefix = f"stick-{policy}-{mode}-{concurrency}-"
    urls = [b.url for b in stack.backends]
    tables_before = [session_counts(u) for u in urls]
    router_before = router_counters(stack.router.url)
    spec = LoadSpec(urls=[stack.router.url], stream=stream, max_tokens=max_tokens, concurrency=concurrency,
                    seconds=args.seconds, warmup_s=args.warmup, sessions=args.sessions,
                    session_prefix=prefix.rstrip("-"), cpu_groups={"proxy": process_tree(stack.router.pid)})
    result = loadgen.run(spec)
    stack.check_alive()
    tables = [count_deltas(b, session_counts(u), prefix) for b, u in zip(tables_before, urls, strict=True)]
    router_after = router_counters(stack.router.url)
    shares, moved, off = majority(tables)
    cell = StickCell(policy=policy, mode=mode, concurrency=concurrency)
    _take_load(cell, result)
    cell.proxy_cpu_us = round(result.cpu_us_per_req.get("proxy", 0.0), 1)
    cell.sessions = len(shares)
    cell.backend_requests = {u: sum(t.values()) for u, t in zip(urls, tables, strict=True)}
    cell.majority_min = round(min(shares, default=0.0), 4)
    cell.majority_mean = round(statistics.fmean(shares), 4) if shares else 0.0
    cell.sessions_at_target = sum(s >= MAJORITY_TARGET for s in shares)
    cell.sessions_moved, cell.off_majority_requests = moved, off
    cell.placements = counter_deltas(router_before, router_after, "session_router_placements_total", "outcome")
    cell.decisions = counter_deltas(router_before, router_after, "session_router_placement_decisions_total",
                                    "outcome", "reason")
    return cell


def _take_load(cell: StickCell | Window, result: LoadResult) -> None:
    cell.requests, cell.errors, cell.rps = result.requests, result.errors, round(result.rps, 1)
    cell.ttft_p50_ms, cell.ttft_p99_ms = round(result.ttft_p50_ms, 2), round(result.ttft_p99_ms, 2)
    if isinstance(cell, StickCell):
        cell.first_error = result.first_error
        cell.p50_ms, cell.p99_ms = round(result.p50_ms, 2), round(result.p99_ms, 2)


def slowdown_text(args: argparse.Namespace) -> str:
    if args.slowdown == "speed":
        return f"the second backend at --speed {args.slow_speed:g} from the start (the other at 0)"
    return f"SIGSTOP {args.stop_ms:g} ms of every {args.period_ms:g} ms"


def run_slow_cell(stack: Stack, loadgen: LoadGen, policy: str, args: argparse.Namespace,
                  reference: StickCell | None) -> SlowCell:
    slow = stack.backends[1]
    prefix = f"slow-{policy}-"
    cell = SlowCell(policy=policy, concurrency=args.slow_concurrency, slowdown=slowdown_text(args), slowed_at_s=0.0)
    router_before = router_counters(stack.router.url)
    throttle = Throttle(slow.pid, args.stop_ms, args.period_ms)
    before = args.before if args.slowdown == "sigstop" else 0
    t0 = time.monotonic()
    try:
        for index in range(before + args.after):
            if index == before and args.slowdown == "sigstop":
                cell.slowed_at_s = round(time.monotonic() - t0, 3)
                throttle.start()
            tables_before = [session_counts(b.url) for b in stack.backends]
            start = time.monotonic() - t0
            spec = LoadSpec(urls=[stack.router.url], stream=True, max_tokens=MODES["stream"][1],
                            concurrency=args.slow_concurrency, seconds=args.window, warmup_s=0.0,
                            sessions=args.sessions, session_prefix=prefix.rstrip("-"))
            result = loadgen.run(spec)
            end = time.monotonic() - t0
            # every request of the window's run (its drain included), per backend
            tables = [count_deltas(b, session_counts(p.url), prefix)
                      for b, p in zip(tables_before, stack.backends, strict=True)]
            on_slow = tables[1]
            window = Window(start_s=round(start, 3), end_s=round(end, 3), slowed=index >= before)
            _take_load(window, result)
            window.slow_requests = sum(on_slow.values())
            served = sum(sum(t.values()) for t in tables)
            window.slow_share = round(window.slow_requests / served, 4) if served else 0.0
            window.sessions_on_slow = len(on_slow)
            cell.windows.append(window)
            stack.check_alive()
    finally:
        throttle.stop()
    router_after = router_counters(stack.router.url)
    cell.placements = counter_deltas(router_before, router_after, "session_router_placements_total", "outcome")
    cell.decisions = counter_deltas(router_before, router_after, "session_router_placement_decisions_total",
                                    "outcome", "reason")
    summarize_slow(cell, reference)
    return cell


def summarize_slow(cell: SlowCell, reference: StickCell | None = None) -> None:
    """Before (the windows before the slowdown; else the all-fast ``reference`` cell's TTFT p99 and
    the first window's share) against the last AFTER_WINDOWS windows."""
    before = [w for w in cell.windows if not w.slowed]
    after = [w for w in cell.windows if w.slowed]
    tail = after[-AFTER_WINDOWS:]
    if before:
        cell.before_p99_ms = round(statistics.median(w.ttft_p99_ms for w in before), 2)
        cell.before_slow_share = round(statistics.fmean(w.slow_share for w in before), 4)
        cell.before_source = "median of the windows before the slowdown"
    elif after:
        cell.before_slow_share = after[0].slow_share
        if reference is not None:
            cell.before_p99_ms = reference.ttft_p99_ms
            cell.before_source = (f"the all-fast {reference.mode} cell at c={reference.concurrency}; share: the "
                                  "first window's")
    if tail:
        cell.after_p99_ms = round(statistics.median(w.ttft_p99_ms for w in tail), 2)
        cell.after_slow_share = round(statistics.fmean(w.slow_share for w in tail), 4)
    cell.peak_p99_ms = max((w.ttft_p99_ms for w in after), default=0.0)


# ---------------------------------------------------------------------------------------------
# Targets and report
# ---------------------------------------------------------------------------------------------


def check_targets(cells: Sequence[StickCell], slow: Sequence[SlowCell]) -> list[Check]:
    checks: list[Check] = []
    for c in cells:
        tag = f"[{c.policy} {c.mode} c={c.concurrency}]"
        if c.errors:
            checks.append(Check(f"{tag} no failed requests", False, f"{c.errors} failed; first: {c.first_error}"))
        if c.policy == "kv_aware":
            checks.append(Check(
                f"{tag} each session's majority backend serves >= {MAJORITY_TARGET:.0%} of its requests",
                c.majority_min >= MAJORITY_TARGET,
                f"worst session {c.majority_min:.1%}, mean {c.majority_mean:.1%}; {c.sessions_at_target}/{c.sessions} "
                f"sessions at >= {MAJORITY_TARGET:.0%}"))
        if c.policy != "session":
            base = next((b for b in cells if b.policy == "session" and b.mode == c.mode
                         and b.concurrency == c.concurrency), None)
            if base is not None and base.proxy_cpu_us > 0:
                ratio = c.proxy_cpu_us / base.proxy_cpu_us
                checks.append(Check(f"{tag} router CPU/request within {CPU_TARGET - 1:.0%} of session's",
                                    ratio <= CPU_TARGET,
                                    f"{c.proxy_cpu_us:.0f} vs {base.proxy_cpu_us:.0f} us ({ratio - 1:+.1%})"))
    for s in slow:
        if s.policy != "kv_aware":
            continue
        tag = f"[slow backend, {s.policy}]"
        checks.append(Check(f"{tag} sessions leave it (its share of requests <= {LEFT_SHARE:.0%} at the end)",
                            s.after_slow_share <= LEFT_SHARE,
                            f"{s.before_slow_share:.0%} before -> {s.after_slow_share:.0%} in the last "
                            f"{AFTER_WINDOWS} windows"))
        checks.append(Check(f"{tag} TTFT p99 recovers (last {AFTER_WINDOWS} windows <= {RECOVERY_FACTOR:g}x before)",
                            0 < s.after_p99_ms <= RECOVERY_FACTOR * s.before_p99_ms,
                            f"{s.before_p99_ms:.1f} ms before, peak {s.peak_p99_ms:.1f} ms, {s.after_p99_ms:.1f} ms "
                            "at the end"))
    return checks


def _fmt_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "—"


def render(result: StickinessResult, args: argparse.Namespace) -> str:
    f = result.facts
    lines = [
        f"## Session stickiness and a slow backend (issue 14) — {f['date']}",
        "",
        f"- Machine: {f['nproc']} CPUs ({f['cpu']}), {f['kernel']}; load average at start {f['loadavg']}, at the "
        f"end {result.settings['loadavg_end']} (shared machine).",
        f"- Command: `{f['command']}`",
        "- Setup (the router-overhead setup): 2 × `python -m backends --speed 0 --model session-sim` on 127.0.0.1"
        + (" with `--kv-events-config` (ZMQ PUB on `ipc://`, the router subscribes via `/kv_event_sources`)"
           if args.kv_events else " (no KV events)")
        + f"; `python -m router --policy P --backend A --backend B` (fresh processes per policy; "
        f"{'`[placement] decision_header = true`, ' if result.settings.get('decision_header') else ''}defaults "
        f"otherwise). The load generator (`bench/loadgen.py`, its own process) sends `X-Session-ID` on every "
        f"request from a pool of {args.sessions} sessions (new ids per cell), closed loop at concurrency c; "
        f"non-stream `POST /v1/completions` `max_tokens` 8, stream `max_tokens` 16; {args.warmup:g} s warm-up + "
        f"{args.seconds:g} s measured per cell.",
        "- Where each request went: the backends' per-session request counts (`GET /v1/sessions`, before and "
        "after the cell; warm-up included). **Majority share** = a session's requests on the backend that served "
        "most of them / all its requests. **Moved** = sessions served by both backends; **off-majority** = their "
        "requests off the majority backend. Spill = `session_router_placements_total{outcome=\"spill\"}`. Router "
        "CPU = utime+stime of the router process per completed request over the measured window.",
        "",
        "| policy | mode | c | req/s | p50 ms | p99 ms | TTFT p99 ms | router CPU µs/req | majority share worst / "
        "mean | sessions ≥ 95% | moved | off-majority req | requests per backend | placements | decisions |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---|---|",
    ]
    for c in result.cells:
        ttft = f"{c.ttft_p99_ms:.2f}" if MODES[c.mode][0] else "—"
        lines.append(
            f"| {c.policy} | {c.mode} | {c.concurrency} | {c.rps:.0f} | {c.p50_ms:.2f} | {c.p99_ms:.2f} | {ttft} | "
            f"{c.proxy_cpu_us:.0f} | {c.majority_min:.1%} / {c.majority_mean:.1%} | {c.sessions_at_target}/{c.sessions} "
            f"| {c.sessions_moved} | {c.off_majority_requests} | "
            f"{' / '.join(str(n) for n in c.backend_requests.values())} | {_fmt_counts(c.placements)} | "
            f"{_fmt_counts(c.decisions)} |")
    if result.slow:
        s0 = result.slow[0]
        lines += [
            "",
            f"### A backend made slow (stream, c={s0.concurrency}, {args.sessions} sessions)",
            "",
            f"Windows of {args.window:g} s, back to back (a new load-generator run each; the gaps are its drain). "
            + (f"After {args.before} windows the second backend is slowed from outside: {s0.slowdown} (its PID "
               "stopped and continued by the benchmark), until the end. " if args.slowdown == "sigstop" else
               f"The slow backend: {s0.slowdown}; fresh processes and new sessions, placed by the policy as they "
               "come. ")
            + "Per window: TTFT at the client, and the share of the window's requests the slow backend served "
            f"(backends' session tables). \"Before\": {s0.before_source}.",
            "",
            "| policy | TTFT p99 before | peak with the slow backend | TTFT p99 last "
            f"{AFTER_WINDOWS} windows | slowed backend's share before → last {AFTER_WINDOWS} | placements | "
            "decisions |",
            "|---|---:|---:|---:|---|---|---|",
        ]
        for s in result.slow:
            lines.append(f"| {s.policy} | {s.before_p99_ms:.1f} ms | {s.peak_p99_ms:.1f} ms | {s.after_p99_ms:.1f} ms | "
                         f"{s.before_slow_share:.0%} → {s.after_slow_share:.0%} | {_fmt_counts(s.placements)} | "
                         f"{_fmt_counts(s.decisions)} |")
        lines += ["", "Per window (TTFT p99 ms / slowed backend's share of requests / sessions it served):", "",
                  "| window end (s) | " + " | ".join(s.policy for s in result.slow) + " |",
                  "|---:|" + "---|" * len(result.slow)]
        for i in range(max(len(s.windows) for s in result.slow)):
            row = []
            for s in result.slow:
                w = s.windows[i] if i < len(s.windows) else None
                row.append("" if w is None else
                           f"{'**slow** ' if w.slowed else ''}{w.ttft_p99_ms:.1f} / {w.slow_share:.0%} / "
                           f"{w.sessions_on_slow}")
            end = result.slow[0].windows[i].end_s if i < len(result.slow[0].windows) else 0.0
            lines.append(f"| {end:.1f} | " + " | ".join(row) + " |")
    lines += ["", "| check | |", "|---|---|"]
    lines += [f"| {c.name}: {c.detail} | {'✅' if c.ok else '❌'} |" for c in result.checks]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.stickiness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI smoke: short cells, c=4, a short slow cell")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies of our router")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="default 16 128; quick 4")
    p.add_argument("--sessions", type=int, default=64, help="X-Session-ID pool per cell (default 64)")
    p.add_argument("--seconds", type=float, default=None, help="measured seconds per cell (default 5; quick 0.5)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per cell (default 0.5; quick 0.2)")
    p.add_argument("--no-slow", dest="slow", action="store_false", help="skip the slow-backend cell")
    p.add_argument("--slow-concurrency", type=int, default=None, help="the slow cell's concurrency (default 16)")
    p.add_argument("--window", type=float, default=None, help="slow cell: seconds per window (default 1; quick 0.4)")
    p.add_argument("--before", type=int, default=None, help="slow cell: windows before the slowdown (default 4)")
    p.add_argument("--after", type=int, default=None, help="slow cell: windows after it (default 16; quick 5)")
    p.add_argument("--slowdown", choices=("speed", "sigstop"), default="speed",
                   help="slow cell: a backend at --slow-speed from the start (default), or one stopped and "
                        "continued by signals after --before windows")
    p.add_argument("--slow-speed", type=float, default=5.0, help="slow cell, speed: the slow backend's --speed")
    p.add_argument("--stop-ms", type=float, default=80.0, help="slow cell: stopped ms per period (default 80)")
    p.add_argument("--period-ms", type=float, default=100.0, help="slow cell: period in ms (default 100)")
    p.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="start the backends without --kv-events-config")
    p.add_argument("--out", default=None,
                   help="markdown file whose stickiness section is written (default bench/RESULTS.md; quick: none)")
    p.add_argument("--json", default=None, help="JSON result path (default bench/out/stickiness-<time>.json)")
    p.add_argument("--plots", default=None, metavar="DIR", help="also draw stickiness-slow.png into DIR")
    args = p.parse_args(argv)
    args.policies = [x for x in args.policies.split(",") if x]
    args.modes = [x for x in args.modes.split(",") if x]
    for mode in args.modes:
        if mode not in MODES:
            p.error(f"--modes: unknown mode {mode!r} (known: {', '.join(MODES)})")
    args.concurrency = args.concurrency or ([4] if args.quick else [16, 128])
    args.seconds = args.seconds or (0.5 if args.quick else 5.0)
    args.warmup = args.warmup if args.warmup is not None else (0.2 if args.quick else 0.5)
    args.slow_concurrency = args.slow_concurrency or (4 if args.quick else 16)
    args.window = args.window or (0.4 if args.quick else 1.0)
    args.before = args.before if args.before is not None else (2 if args.quick else 4)
    args.after = args.after if args.after is not None else (5 if args.quick else 16)
    if args.out is None and not args.quick:
        args.out = DEFAULT_OUT
    if (not args.policies or args.sessions < 1 or args.seconds <= 0 or args.window <= 0 or args.before < 1
            or args.after < 1 or min(args.concurrency) < 1 or not 0 < args.stop_ms < args.period_ms):
        p.error("need policies, positive sizes, --before/--after >= 1 and 0 < --stop-ms < --period-ms")
    return args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: processes stopped, throttle lifted


def main(argv: Sequence[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.kv_events and not backends_have_kv_events():
        print("stickiness: the backends have no --kv-events-config option; run with --no-kv-events", file=sys.stderr)
        return 2
    facts = machine_facts(None, raw_argv, module="bench.stickiness")
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    cells: list[StickCell] = []
    slow: list[SlowCell] = []
    decision_header = router_has_decision_header()
    with tempfile.TemporaryDirectory(prefix="bench-stickiness-") as tmp:
        router_config = write_router_config(tmp) if decision_header else ""
        loadgen = LoadGen()
        try:
            for policy in args.policies:
                stack = Stack(policy, tmp, args.kv_events, router_config)
                try:
                    for mode in args.modes:
                        for c in args.concurrency:
                            cell = run_cell(stack, loadgen, policy, mode, c, args)
                            cells.append(cell)
                            print(f"{policy:<9} {mode:<10} c={c:<4} {cell.rps:7.0f} req/s  majority worst "
                                  f"{cell.majority_min:6.1%} mean {cell.majority_mean:6.1%}  moved {cell.sessions_moved:3d}"
                                  f"  router {cell.proxy_cpu_us:5.0f} us/req  errors {cell.errors}  "
                                  f"placements {_fmt_counts(cell.placements)}", file=sys.stderr, flush=True)
                finally:
                    stack.stop()
            for policy in args.policies if args.slow else ():
                stack = Stack(policy, tmp, args.kv_events, router_config,
                              slow_speed=f"{args.slow_speed:g}" if args.slowdown == "speed" else "0")
                reference = next((c for c in cells if c.policy == policy and c.mode == "stream"
                                  and c.concurrency == args.slow_concurrency), None)
                try:
                    cell_slow = run_slow_cell(stack, loadgen, policy, args, reference)
                finally:
                    stack.stop()
                slow.append(cell_slow)
                print(f"{policy:<9} slow backend: TTFT p99 {cell_slow.before_p99_ms:.1f} ms before, peak "
                      f"{cell_slow.peak_p99_ms:.1f}, {cell_slow.after_p99_ms:.1f} at the end; its share "
                      f"{cell_slow.before_slow_share:.0%} -> {cell_slow.after_slow_share:.0%}", file=sys.stderr,
                      flush=True)
        finally:
            loadgen.stop()
    settings: dict[str, object] = {k: v for k, v in vars(args).items() if k not in ("out", "json", "plots")}
    settings["decision_header"] = decision_header
    settings["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    result = StickinessResult(started=started, facts=facts, settings=settings, cells=cells, slow=slow)
    result.checks = check_targets(cells, slow)
    report = render(result, args)
    print(report)
    if args.out:
        write_section(args.out, report, SECTION)
    path = args.json or os.path.join(BENCH_DIR, "out", f"stickiness-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(msgspec.json.format(msgspec.json.encode(result)))
    print(f"results in {path}", file=sys.stderr)
    if args.plots:
        from bench import plots  # matplotlib: the bench extra, only when asked for

        for png in plots.draw_stickiness(result, args.plots):
            print(f"plot: {png}", file=sys.stderr)
    failed = sum(c.errors for c in cells) + sum(w.errors for s in slow for w in s.windows)
    return 1 if failed or any(c.requests == 0 for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())

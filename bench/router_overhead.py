"""What the router adds on top of talking to a backend directly, next to nginx (issue 3, section 5).

    python -m bench.router_overhead [--quick] [--rounds 3] [--seconds 3] [--out bench/RESULTS.md]
    python -m bench.router_overhead --access-log text json     # the access log's cost per request

One run starts two session-backends at ``--speed 0`` (instant; ``--backend-speed S`` makes them step
like an engine on a GPU) on 127.0.0.1 and, in front of the
same two, the router (session policy), the router with ``--workers N`` when its CLI offers it,
and nginx as a plain round-robin reverse proxy when it is installed. A separate load-generator
process (``bench.loadgen``) then drives every target in turn, closed loop, with small
completions (non-stream, ``max_tokens`` 8; stream, ``max_tokens`` 16) at each concurrency,
sending ``X-Session-ID`` from a pool of 100 sessions. "direct" spreads its connections over
both backends (the same serving capacity, no proxy hop).

Rounds are interleaved (every cell of round 1, then of round 2, ...; the target order rotates)
because the machine is shared and noisy. Each figure is the best over the rounds (highest
req/s, lowest latency, lowest CPU) and ``[lo-hi]`` is its range. The proxy's CPU per request
comes from ``/proc/PID/stat`` (utime + stime of the proxy's process tree: the router, its
workers, nginx's master and workers) read at both ends of the measured window: far steadier
than wall-clock figures on a shared 2-core machine.

``--access-log FMT...`` adds a router with ``--access-log FMT`` per format (rows ``router(log=FMT)``,
writing to a file in the run's temporary directory), side by side with the plain router (access
log off), and a check row with each format's CPU per request over the plain router's.

``--baseline REV`` adds the router of another revision of this repository (``git archive`` of REV into the run's
temporary directory, run from there with the session policy, no other option) as row ``router@REV``, and check
rows with every other router row's CPU per request over it: "today's" router, when an issue was filed, side by
side with the router as it is now, in the same run and on the same backends.

``--rate R`` runs every cell open loop at R requests/s instead (the same rate for every target: CPU per
request of an asyncio server falls as its rate rises, so closed loop a target that serves fewer req/s looks
dearer per request for the same work). ``--kv-events``: the backends publish vLLM's KV events and the
``--policies`` rows' routers subscribe (the session-policy rows run ``--kv-events off``), so the KV index's
upkeep is in their CPU.

Each cell also records how the backends shared its requests (their ``vllm:request_success_total`` read
before and after): the report gives the busiest backend's share per target and cell, so a target that
piles the sessions on one backend (which then becomes the bottleneck) shows.

Output: a markdown report, printed and written into ``--out`` between the markers
``<!-- SECTION:begin -->`` / ``<!-- SECTION:end -->`` (the rest of the file is kept; ``--section``,
default ``router_overhead``, or ``router_overhead_access_log`` with ``--access-log``), and one JSON
line per run appended to ``bench/out/router_overhead.jsonl``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from bench.loadgen import LoadResult, LoadSpec
from bench.multiturn import kv_events_config, metric_sum, scrape
from bench.nginx import Nginx, find_nginx, nginx_version, start_nginx
from bench.procs import REPO, Proc, free_port, start_backend, start_router

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(BENCH_DIR, "RESULTS.md")
JSONL = os.path.join(BENCH_DIR, "out", "router_overhead.jsonl")
SECTION = "router_overhead"
BEGIN = f"<!-- {SECTION}:begin -->"
END = f"<!-- {SECTION}:end -->"
ACCESS_LOG_SECTION = "router_overhead_access_log"
ACCESS_LOG_PREFIX = "router(log="
POLICY_SECTION = "router_overhead_policy"
POLICY_PREFIX = "router(policy="
#: the row of the router of another revision (``--baseline``): ``router@<commit>``
BASELINE_PREFIX = "router@"
#: a policy row's router that does not subscribe to the backends' KV events (``--unsubscribed``)
UNSUBSCRIBED = ", unsubscribed"

#: mode -> (stream, max_tokens)
MODES: dict[str, tuple[bool, int]] = {"non-stream": (False, 8), "stream": (True, 16)}
#: targets of issue 3 section 5
CPU_TARGET_US = {"non-stream": 200.0, "stream": 300.0}
THROUGHPUT_TARGET = 0.60
TTFT_SLACK_MS = 1.0
TTFT_CONCURRENCY = 16


@dataclass
class Target:
    """Something the load generator drives: its URLs and the PIDs whose CPU is "the proxy"."""

    name: str
    urls: list[str]
    proxy_pids: Callable[[], list[int]] = field(default=list)
    is_proxy: bool = True


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (read from /proc now)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def router_supports_front() -> bool:
    out = subprocess.run([sys.executable, "-m", "router", "--help"], check=False, capture_output=True, text=True,
                         cwd=REPO)
    return "--front" in out.stdout


def router_supports_workers() -> bool:
    out = subprocess.run([sys.executable, "-m", "router", "--help"], check=False, capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    return "--workers" in out.stdout


# ---------------------------------------------------------------------- the load generator process
class LoadGen:
    """``python -m bench.loadgen --serve`` as a child: one spec line in, one result line out."""

    def __init__(self) -> None:
        self.popen = subprocess.Popen([sys.executable, "-m", "bench.loadgen", "--serve"], cwd=REPO,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(LoadResult)

    def run(self, spec: LoadSpec) -> LoadResult:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write(self._encoder.encode(spec) + b"\n")
        self.popen.stdin.flush()
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"the load generator exited with {self.popen.wait()}")
        return self._decoder.decode(line)

    def stop(self) -> None:
        if self.popen.stdin is not None:
            self.popen.stdin.close()
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


# ---------------------------------------------------------------------- aggregation
class Cell(msgspec.Struct):
    mode: str
    concurrency: int
    target: str
    rounds: list[LoadResult] = []
    #: per round, the busiest backend's share of the requests the backends served in the cell (0.5: even)
    shares: list[float] = []

    def best(self, get: Callable[[LoadResult], float], highest: bool = False) -> float:
        values = [get(r) for r in self.rounds]
        return max(values) if highest else min(values)

    def spread(self, get: Callable[[LoadResult], float]) -> tuple[float, float]:
        values = [get(r) for r in self.rounds]
        return min(values), max(values)


def served(backend_urls: Sequence[str]) -> list[float]:
    """Requests each backend has answered so far (its ``vllm:request_success_total``, summed over labels)."""
    return [metric_sum(scrape(url), "vllm:request_success_total") for url in backend_urls]


def busiest_share(before: Sequence[float], after: Sequence[float]) -> float:
    """The largest backend's share of the requests served between two ``served`` readings (0 when none)."""
    done = [b - a for a, b in zip(before, after)]
    total = sum(done)
    return max(done) / total if total > 0 else 0.0


def _proxy_cpu(r: LoadResult) -> float:
    return r.cpu_us_per_req.get("proxy", 0.0)


def _backend_cpu(r: LoadResult) -> float:
    return r.cpu_us_per_req.get("backends", 0.0)


def _fmt_range(cell: Cell, get: Callable[[LoadResult], float], best: float, digits: int = 0) -> str:
    lo, hi = cell.spread(get)
    if len(cell.rounds) < 2:
        return f"{best:.{digits}f}"
    return f"{best:.{digits}f} [{lo:.{digits}f}–{hi:.{digits}f}]"


def _signed(value: float) -> str:
    return f"{value:+.2f}"


def _speed_note(speed: float) -> str:
    if speed <= 0:
        return ""
    return (f"The backends step like an engine on a GPU (`--speed {speed:g}`: decode steps of {10 * speed:g} ms, every "
            "request in flight batched into each step, and the KV events of a step published as one batch), so "
            "the KV-event messages follow the step rate rather than the request rate. ")


def render(cells: dict[tuple[str, int, str], Cell], targets: Sequence[Target], facts: dict[str, str],
           args: argparse.Namespace) -> str:
    names = [t.name for t in targets]
    concurrencies = sorted({c for (_, c, _) in cells})
    workers_note = next((f"**{n}**: the same with `--workers {n.split('×')[1]}`. " for n in names
                         if n.startswith("router×")), "")
    if "router(aiohttp)" in names:
        workers_note += "**router(aiohttp)**: the same with `--front aiohttp` (aiohttp serves every route). "
    logged = [n for n in names if n.startswith(ACCESS_LOG_PREFIX)]
    if logged:
        workers_note += (f"**{', '.join(logged)}**: the same with `--access-log FMT --access-log-file FILE` (one line "
                         "per request appended to a file; **router** has the access log off, the default). ")
    policies = [n for n in names if n.startswith(POLICY_PREFIX)]
    if policies:
        if args.kv_events:
            events = ("the backends publish KV events (`--kv-events-config`, ipc://); the policy rows' routers "
                      "subscribe to them, **router** runs `--kv-events off`: the index's upkeep is in their CPU")
            if any(UNSUBSCRIBED in n for n in policies):
                events += ("; the rows marked *unsubscribed* run the same policy with `--kv-events off`, so the gap "
                           "between the two rows is the subscription's cost")
        else:
            events = "the backends publish no KV events here, so `kv_aware` has no index"
        workers_note += (f"**{', '.join(policies)}**: the same with `--policy POLICY` (**router** runs `--policy "
                         f"session`; {events}). ")
    for name in names:
        if name.startswith(BASELINE_PREFIX):
            workers_note += (f"**{name}**: the router of commit `{name[len(BASELINE_PREFIX):]}` of this repository "
                             "(`--baseline`: run from a `git archive` of it, `--policy session`, no other option), "
                             "side by side with today's in the same run. ")
    nginx_note = ("**nginx**: plain reverse proxy, 1 worker, round-robin, keep-alive upstream, `proxy_buffering off`, "
                  "no access log. " if "nginx" in names else "**nginx**: not run. ")
    machine = (f"- Machine: {facts['nproc']} CPUs ({facts['cpu']}), {facts['kernel']}; load average at start "
               f"{facts['loadavg']} (shared machine).")
    versions = (f"- Versions: Python {facts['python']}, aiohttp {facts['aiohttp']}, uvloop {facts['uvloop']}, "
                f"httptools {facts['httptools']}, msgspec {facts['msgspec']}; {facts['nginx']}.")
    setup = (f"- Setup: 2 × `python -m backends --speed {args.backend_speed:g} --model session-sim` on 127.0.0.1. "
             f"{_speed_note(args.backend_speed)}**direct**: client "
             "connections split over both backends. **router**: `python -m router --backend A --backend B` "
             f"(session policy); clients send `X-Session-ID` from a pool of {args.sessions} sessions (every target "
             f"gets the same requests). {workers_note}{nginx_note}non-stream: `POST /v1/completions` `max_tokens` 8; "
             "stream: the same with `stream: true`, `max_tokens` 16 (16 token events + `[DONE]`).")
    loop = (f"open loop at {args.rate:g} requests/s (one started every 1/rate s over at most c connections; "
            "requests that found every connection busy are counted late)" if args.rate else "closed loop")
    method = (f"- Method: {loop} at concurrency c, keep-alive; per cell {args.warmup:g} s warm-up, then "
              f"{args.seconds:g} s measured; {args.rounds} round(s) interleaved (target order rotates). Each figure "
              "is the best over the rounds (highest req/s, lowest latency and CPU); `[lo–hi]` is the range over "
              "rounds. Proxy CPU = utime+stime of the proxy's process tree from /proc/PID/stat over the window, "
              "per completed request; backends CPU likewise for both backends together. TTFT = time to the first "
              "`data:` chunk. The load generator (`bench/loadgen.py`, raw asyncio + httptools, its own process) "
              "shares the 2 cores.")
    goals = ("- **Targets**: proxy CPU per request ≤ 200 µs non-stream, ≤ 300 µs stream (issue 3 quotes "
             "nginx at ~60–70 / ~150 µs); throughput ≥ 60% of nginx's; added stream TTFT at c=16 ≤ nginx's + 1 ms.")
    header = ("| mode | c | target | req/s | p50 ms | p99 ms | +p50 vs direct ms | TTFT p50 ms | +TTFT vs direct ms "
              "| proxy CPU µs/req | backends CPU µs/req | errors |")
    lines = [
        (f"## Access log cost (issue 11 §18) — {facts['date']}" if logged else
         f"## Router CPU per request by placement policy (issue 14) — {facts['date']}" if policies else
         f"## Router overhead (issue 3 §5) — {facts['date']}"),
        "",
        machine,
        versions,
        f"- Command: `{facts['command']}`",
        setup,
        method,
        goals,
        "",
        header,
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        for c in concurrencies:
            direct = cells.get((mode, c, "direct"))
            d_p50 = direct.best(lambda r: r.p50_ms) if direct else 0.0
            d_ttft = direct.best(lambda r: r.ttft_p50_ms) if direct else 0.0
            for target in targets:
                cell = cells.get((mode, c, target.name))
                if cell is None or not cell.rounds:
                    continue
                rps = cell.best(lambda r: r.rps, highest=True)
                p50 = cell.best(lambda r: r.p50_ms)
                p99 = cell.best(lambda r: r.p99_ms)
                stream = MODES[mode][0]
                ttft = cell.best(lambda r: r.ttft_p50_ms) if stream else 0.0
                cpu = cell.best(_proxy_cpu)
                errors = sum(r.errors for r in cell.rounds)
                lines.append(
                    f"| {mode} | {c} | {target.name} | {_fmt_range(cell, lambda r: r.rps, rps)} | {p50:.2f} | "
                    f"{p99:.2f} | {'—' if not target.is_proxy else _signed(p50 - d_p50)} | "
                    f"{f'{ttft:.2f}' if stream else '—'} | "
                    f"{_signed(ttft - d_ttft) if stream and target.is_proxy else '—'} | "
                    f"{_fmt_range(cell, _proxy_cpu, cpu) if target.is_proxy else '—'} | "
                    f"{cell.best(_backend_cpu):.0f} | {errors} |"
                )
    if args.rate:
        late = {name: sum(r.late for (_, _, n), cell in cells.items() if n == name for r in cell.rounds) for name in names}
        lines += ["", "Late requests (open loop: due while every connection was busy), all cells and rounds: "
                  + ", ".join(f"{name} {count}" for name, count in late.items()) + "."]
    lines += ["", *checks(cells, targets, concurrencies), "", *balance(cells, targets, concurrencies), ""]
    return "\n".join(lines)


def balance(cells: dict[tuple[str, int, str], Cell], targets: Sequence[Target], concurrencies: Sequence[int]) -> list[str]:
    """The busiest backend's share of each cell's requests, median over rounds: how evenly each target
    spreads the 100 sessions (a proxy that piles them on one backend makes it the bottleneck)."""
    plan = [(mode, c) for mode in MODES for c in concurrencies]
    rows = []
    for target in targets:
        row = []
        for mode, c in plan:
            cell = cells.get((mode, c, target.name))
            row.append(f"{statistics.median(cell.shares):.2f}" if cell is not None and cell.shares else "—")
        if any(v != "—" for v in row):
            rows.append(f"| {target.name} | " + " | ".join(row) + " |")
    if not rows:
        return []
    return ["The busiest backend's share of the requests in each cell (median over rounds; 0.50 is an even split "
            "over the two backends):", "",
            "| target | " + " | ".join(f"{mode} c={c}" for mode, c in plan) + " |",
            "|---|" + "---:|" * len(plan), *rows]


def checks(cells: dict[tuple[str, int, str], Cell], targets: Sequence[Target], concurrencies: Sequence[int]) -> list[str]:
    routers = [t.name for t in targets if t.name.startswith("router")]
    have_nginx = any(t.name == "nginx" for t in targets)
    out = ["| check (best of rounds) | " + " | ".join(routers) + " |", "|---|" + "---|" * len(routers)]

    def verdict(ok: bool) -> str:
        return "✅" if ok else "❌"

    for mode in MODES:
        for c in concurrencies:
            row = [f"CPU/req {mode} c={c} ≤ {CPU_TARGET_US[mode]:.0f} µs"]
            for name in routers:
                cell = cells.get((mode, c, name))
                if cell is None or not cell.rounds:
                    row.append("—")
                    continue
                cpu = cell.best(_proxy_cpu)
                row.append(f"{cpu:.0f} µs {verdict(cpu <= CPU_TARGET_US[mode])}")
            out.append("| " + " | ".join(row) + " |")
    logged = [name for name in routers if name.startswith(ACCESS_LOG_PREFIX)]
    out += _over_router(cells, routers, [name for name in routers if name.startswith(POLICY_PREFIX)], concurrencies,
                        "CPU/req {mode} c={c} over router (session policy)")
    for baseline in (name for name in routers if name.startswith(BASELINE_PREFIX)):
        out += _over_router(cells, routers, [name for name in routers if not name.startswith(BASELINE_PREFIX)],
                            concurrencies, "CPU/req {mode} c={c} over " + baseline + " (session policy)", baseline)
    for mode in MODES:
        for c in concurrencies if logged else ():
            row = [f"access log cost, CPU/req {mode} c={c} (over router)"]
            plain = cells.get((mode, c, "router"))
            for name in routers:
                cell = cells.get((mode, c, name))
                if name not in logged or cell is None or plain is None or not cell.rounds or not plain.rounds:
                    row.append("—")
                    continue
                row.append(f"{cell.best(_proxy_cpu) - plain.best(_proxy_cpu):+.0f} µs")
            out.append("| " + " | ".join(row) + " |")
    if have_nginx:
        for mode in MODES:
            for c in concurrencies:
                row = [f"req/s {mode} c={c} ≥ {THROUGHPUT_TARGET:.0%} of nginx"]
                ngx = cells.get((mode, c, "nginx"))
                for name in routers:
                    cell = cells.get((mode, c, name))
                    if cell is None or ngx is None or not cell.rounds or not ngx.rounds:
                        row.append("—")
                        continue
                    ratio = cell.best(lambda r: r.rps, highest=True) / max(1e-9, ngx.best(lambda r: r.rps, highest=True))
                    row.append(f"{ratio * 100:.1f}% {verdict(ratio >= THROUGHPUT_TARGET)}")
                out.append("| " + " | ".join(row) + " |")
        c = TTFT_CONCURRENCY if TTFT_CONCURRENCY in concurrencies else min(concurrencies)
        row = [f"stream TTFT p50 c={c} ≤ nginx + {TTFT_SLACK_MS:g} ms"]
        ngx = cells.get(("stream", c, "nginx"))
        for name in routers:
            cell = cells.get(("stream", c, name))
            if cell is None or ngx is None or not cell.rounds or not ngx.rounds:
                row.append("—")
                continue
            gap = cell.best(lambda r: r.ttft_p50_ms) - ngx.best(lambda r: r.ttft_p50_ms)
            row.append(f"{gap:+.2f} ms vs nginx {verdict(gap <= TTFT_SLACK_MS)}")
        out.append("| " + " | ".join(row) + " |")
    else:
        out.append("| nginx comparisons | " + " | ".join("skipped: nginx not installed" for _ in routers) + " |")
    return out


def _over_router(cells: dict[tuple[str, int, str], Cell], routers: Sequence[str], names: Sequence[str],
                 concurrencies: Sequence[int], label: str, reference: str = "router") -> list[str]:
    """Check rows (a column per router row): each of ``names``' best CPU per request over the ``reference``
    row's, in µs and %; with several rounds, also the median over rounds of the two rows' ratio within a
    round (the rounds interleave the rows, so each pair ran under the same load of the machine)."""
    out = []
    for mode in MODES:
        for c in concurrencies if names else ():
            row = [label.format(mode=mode, c=c)]
            plain = cells.get((mode, c, reference))
            for name in routers:
                cell = cells.get((mode, c, name))
                if name not in names or cell is None or plain is None or not cell.rounds or not plain.rounds:
                    row.append("—")
                    continue
                extra = cell.best(_proxy_cpu) - plain.best(_proxy_cpu)
                text = f"{extra / max(1e-9, plain.best(_proxy_cpu)):+.1%}"
                ratios = [_proxy_cpu(mine) / max(1e-9, _proxy_cpu(ref)) - 1
                          for mine, ref in zip(cell.rounds, plain.rounds)]
                if len(ratios) > 1:
                    text += f"; median of rounds {statistics.median(ratios):+.1%}"
                row.append(f"{extra:+.0f} µs ({text})")
            out.append("| " + " | ".join(row) + " |")
    return out


# ---------------------------------------------------------------------- RESULTS.md
def write_section(path: str, section: str, name: str = SECTION) -> None:
    """Replace the marked section ``name`` of ``path`` (or add it), keeping the rest of the file."""
    begin, end_marker = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{section.rstrip()}\n{end_marker}\n"
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        text = "# Benchmark results\n\n"
    start, end = text.find(begin), text.find(end_marker)
    if start != -1 and end > start:
        rest = text[end + len(end_marker):].lstrip("\n")
        text = text[:start] + block + ("\n" + rest if rest else "")
        if not text.endswith("\n"):
            text += "\n"
    else:
        text = text.rstrip("\n") + "\n\n" + block
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def publish(report: str, out: str, section: str, jsonl: str, record: dict[str, object]) -> None:
    """Print a run's report, write it into its marked section of ``out`` and append its raw
    ``record`` as one JSON line to ``jsonl``."""
    print(report)
    write_section(out, report, section)
    os.makedirs(os.path.dirname(os.path.abspath(jsonl)), exist_ok=True)
    with open(jsonl, "a", encoding="utf-8") as fh:
        fh.write(msgspec.json.encode(record).decode() + "\n")


class _Round(Protocol):
    errors: int
    requests: int


class _Rounds(Protocol):
    @property
    def rounds(self) -> Sequence[_Round]: ...


def failures(cells: Mapping[str, _Rounds]) -> tuple[int, list[str]]:
    """The failed requests of a run (any benchmark's cells), and the cells that completed no request."""
    errors = sum(r.errors for cell in cells.values() for r in cell.rounds)
    return errors, [key for key, cell in cells.items() if not any(r.requests for r in cell.rounds)]


def exit_status(cells: Mapping[str, _Rounds]) -> int:
    """A benchmark's exit status: 1 (said on stderr) when a request failed or a cell completed none."""
    errors, empty = failures(cells)
    if errors or empty:
        print(f"benchmark had {errors} failed requests; cells without a completed request: {empty}", file=sys.stderr)
        return 1
    return 0


def machine_facts(nginx_binary: str | None, argv: Sequence[str], module: str = "bench.router_overhead") -> dict[str, str]:
    """The machine, its load and the versions a run depends on, and the command (``python -m module argv``)."""
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    nproc = subprocess.run(["nproc"], check=False, capture_output=True, text=True).stdout.strip() or str(os.cpu_count())
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": nproc,
        "cpu": cpu,
        "kernel": f"{platform.system()} {platform.release()}",
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "aiohttp": version("aiohttp"),
        "uvloop": version("uvloop"),
        "httptools": version("httptools"),
        "msgspec": version("msgspec"),
        "nginx": nginx_version(nginx_binary) if nginx_binary else "nginx not installed",
        "command": f"python -m {module}" + "".join(f" {shlex.quote(a)}" for a in argv),
    }


# ---------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.router_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 round, 0.4 s cells, concurrency 4 (unless given explicitly)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; quick 1)")
    p.add_argument("--seconds", type=float, default=None, help="measured seconds per cell (default 3; quick 0.4)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per cell (default 0.5; quick 0.2)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="default 16 128; quick 4")
    p.add_argument("--sessions", type=int, default=100, help="X-Session-ID pool size (default 100)")
    p.add_argument("--workers", type=int, default=2,
                   help="also run the router with --workers N when its CLI supports it (0 or 1: skip; default 2)")
    p.add_argument("--no-nginx", action="store_true", help="skip the nginx row")
    p.add_argument("--aiohttp-front", action="store_true",
                   help="also run the router with --front aiohttp (row router(aiohttp)), to compare the fronts")
    p.add_argument("--access-log", nargs="+", choices=("text", "json"), default=[], metavar="FMT",
                   help="also run the router with --access-log FMT (text and/or json; rows router(log=FMT)) to "
                        "measure the access log's cost per request against the plain router (access log off)")
    p.add_argument("--policies", nargs="+", default=[], metavar="POLICY",
                   help="also run the router with --policy POLICY (rows router(policy=POLICY)) to compare its CPU "
                        "per request with the plain router's (session policy)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="open loop at this many requests per second for every target and cell (default 0: closed "
                        "loop). CPU per request of an asyncio server falls as its rate rises; closed loop, a target "
                        "that serves fewer req/s (e.g. a policy that keeps sessions where a hash put them, unevenly) "
                        "then shows a higher CPU per request for the same work. At one rate the comparison is like for like")
    p.add_argument("--kv-events", action="store_true",
                   help="the backends publish vLLM's KV events (--kv-events-config on ipc://) and the --policies "
                        "routers subscribe to them (their default [kv_events] enabled = auto; the session-policy "
                        "routers run --kv-events off, as before the index): the index's upkeep in their CPU")
    p.add_argument("--backend-speed", type=float, default=0.0, metavar="S",
                   help="the backends' --speed (default 0: instant, a step per request). S > 0 makes them step like an "
                        "engine on a GPU (decode steps of 10*S ms batching every request in flight), so with "
                        "--kv-events the event messages follow the step rate, as vLLM's do, not the request rate")
    p.add_argument("--unsubscribed", action="store_true",
                   help="with --kv-events: also run each --policies router with --kv-events off (rows "
                        "router(policy=POLICY, unsubscribed)), on the same event-publishing backends: the policy's "
                        "own cost apart from reading the events")
    p.add_argument("--baseline", default=None, metavar="REV",
                   help="also run the router of revision REV of this repository (a git archive of it, session policy) "
                        "as row router@REV, with check rows of every other router row's CPU per request over it")
    p.add_argument("--section", default=None,
                   help=f"marked section of --out to write (default {SECTION}; {ACCESS_LOG_SECTION} with --access-log)")
    p.add_argument("--out", default=DEFAULT_OUT, help="markdown file to write the report into (default bench/RESULTS.md)")
    p.add_argument("--jsonl", default=JSONL, help="raw results, one JSON line per run appended")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.seconds = args.seconds or (0.4 if args.quick else 3.0)
    args.warmup = args.warmup if args.warmup is not None else (0.2 if args.quick else 0.5)
    args.concurrency = args.concurrency or ([4] if args.quick else [16, 128])
    args.section = args.section or (ACCESS_LOG_SECTION if args.access_log else
                                    POLICY_SECTION if args.policies else SECTION)
    if args.rate < 0:
        p.error("--rate must be >= 0 (0: closed loop)")
    if args.backend_speed < 0:
        p.error("--backend-speed must be >= 0 (0: instant)")
    if args.unsubscribed and not (args.kv_events and args.policies):
        p.error("--unsubscribed needs --kv-events and --policies (it adds a row per policy without the subscription)")
    if args.rounds < 1 or args.seconds <= 0 or args.warmup < 0 or min(args.concurrency) < 1 or args.sessions < 1:
        p.error("--rounds, --seconds, --concurrency and --sessions must be positive")
    return args


def baseline_tree(rev: str, dest: str) -> str:
    """Extract revision ``rev`` of this repository (``git archive``) into ``dest``; its short commit id."""
    found = subprocess.run(["git", "-C", REPO, "rev-parse", "--verify", "--short", f"{rev}^{{commit}}"],
                           check=False, capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"--baseline {rev}: not a commit of this repository ({found.stderr.strip()}); "
                         "give a commit id, tag or branch that `git log` shows")
    commit = found.stdout.strip()
    archive = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", commit], check=True, capture_output=True)
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return commit


def bench_backend(tmp: str, kv_events: bool, speed: float = 0.0) -> Proc:
    """One backend at ``speed`` (0: instant); with ``kv_events`` it publishes vLLM's KV events on ipc://
    sockets in ``tmp``."""
    if not kv_events:
        return start_backend(tmp, speed=f"{speed:g}")
    port = free_port()
    return start_backend(tmp, "--kv-events-config", kv_events_config(tmp, port), port=port, speed=f"{speed:g}")


def main(argv: Sequence[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    nginx_binary = None if args.no_nginx else find_nginx()
    facts = machine_facts(nginx_binary, raw_argv)
    started: list[Proc | Nginx] = []
    loadgen: LoadGen | None = None
    cells: dict[tuple[str, int, str], Cell] = {}
    with tempfile.TemporaryDirectory(prefix="bench-router-overhead-") as tmp:
        try:
            backends = [bench_backend(tmp, args.kv_events, args.backend_speed) for _ in range(2)]
            started += backends
            backend_urls = [b.url for b in backends]
            backend_pids = [b.pid for b in backends]
            route_args = [a for url in backend_urls for a in ("--backend", url)]
            # with --kv-events, the session-policy rows stay the router before the KV index (no subscription);
            # the --policies rows subscribe (their default): what the index's upkeep adds is in their CPU
            session_args = [*route_args, "--kv-events", "off"] if args.kv_events else route_args
            targets = [Target("direct", backend_urls, is_proxy=False)]
            router = start_router(tmp, *session_args, "--policy", "session")
            started.append(router)
            targets.append(Target("router", [router.url], lambda p=router.pid: process_tree(p)))
            if args.workers > 1 and router_supports_workers():
                multi = start_router(tmp, *session_args, "--policy", "session", "--workers", str(args.workers))
                started.append(multi)
                targets.append(Target(f"router×{args.workers}", [multi.url], lambda p=multi.pid: process_tree(p)))
            elif args.workers > 1:
                print("router has no --workers option: skipping that row", file=sys.stderr)
            if args.aiohttp_front and router_supports_front():
                aio = start_router(tmp, *session_args, "--policy", "session", "--front", "aiohttp")
                started.append(aio)
                targets.append(Target("router(aiohttp)", [aio.url], lambda p=aio.pid: process_tree(p)))
            elif args.aiohttp_front:
                print("router has no --front option: skipping the router(aiohttp) row", file=sys.stderr)
            policy_rows = [(policy, "", ()) for policy in args.policies]
            if args.unsubscribed:
                policy_rows += [(policy, UNSUBSCRIBED, ("--kv-events", "off")) for policy in args.policies]
            for policy, suffix, extra in policy_rows:
                other = start_router(tmp, *route_args, "--policy", policy, *extra)
                started.append(other)
                targets.append(Target(f"{POLICY_PREFIX}{policy}{suffix})", [other.url],
                                      lambda p=other.pid: process_tree(p)))
            if args.baseline is not None:
                tree = os.path.join(tmp, "baseline")
                commit = baseline_tree(args.baseline, tree)
                facts["baseline"] = commit
                old = start_router(tmp, *route_args, "--policy", "session", tree=tree)
                started.append(old)
                targets.append(Target(f"{BASELINE_PREFIX}{commit}", [old.url], lambda p=old.pid: process_tree(p)))
            for fmt in args.access_log:
                logged = start_router(tmp, *session_args, "--policy", "session", "--access-log", fmt,
                                      "--access-log-file", os.path.join(tmp, f"access-{fmt}.log"))
                started.append(logged)
                targets.append(Target(f"{ACCESS_LOG_PREFIX}{fmt})", [logged.url], lambda p=logged.pid: process_tree(p)))
            if nginx_binary is not None:
                try:
                    ngx = start_nginx(os.path.join(tmp, "nginx"), backend_urls, binary=nginx_binary)
                except AssertionError as exc:
                    print(f"nginx did not start, skipping that row: {exc}", file=sys.stderr)
                    facts["nginx"] += " (did not start)"
                else:
                    started.append(ngx)
                    targets.append(Target("nginx", [ngx.url], lambda p=ngx.pid: process_tree(p)))
            elif not args.no_nginx:
                print("nginx is not installed: skipping that row", file=sys.stderr)

            loadgen = LoadGen()
            plan = [(mode, c) for mode in MODES for c in args.concurrency]
            total = args.rounds * len(plan) * len(targets)
            done = 0
            for rnd in range(args.rounds):
                for index, (mode, c) in enumerate(plan):
                    shift = (rnd + index) % len(targets)
                    for target in targets[shift:] + targets[:shift]:
                        stream, max_tokens = MODES[mode]
                        groups = {"backends": backend_pids}
                        if target.is_proxy:
                            groups["proxy"] = target.proxy_pids()
                        spec = LoadSpec(urls=target.urls, stream=stream, max_tokens=max_tokens, concurrency=c,
                                        seconds=args.seconds, warmup_s=args.warmup, sessions=args.sessions,
                                        cpu_groups=groups, rate=args.rate)
                        before = served(backend_urls)
                        result = loadgen.run(spec)
                        share = busiest_share(before, served(backend_urls))
                        cell = cells.setdefault((mode, c, target.name), Cell(mode, c, target.name))
                        cell.rounds.append(result)
                        cell.shares.append(share)
                        done += 1
                        print(f"[{done}/{total}] round {rnd + 1} {mode:<10} c={c:<4} {target.name:<10} "
                              f"{result.rps:8.0f} req/s  p50 {result.p50_ms:7.2f} ms  "
                              f"proxy {_proxy_cpu(result):6.0f} us/req  busiest {share:.2f}  errors {result.errors}"
                              + (f" ({result.first_error})" if result.first_error else ""),
                              file=sys.stderr, flush=True)
            dead = [p for p in started if not p.alive()]
            if dead:
                raise RuntimeError(f"a process died during the benchmark: {dead}")
        finally:
            if loadgen is not None:
                loadgen.stop()
            for proc in reversed(started):
                proc.stop()

    publish(render(cells, targets, facts, args), args.out, args.section, args.jsonl,
            {"facts": facts, "cells": list(cells.values())})
    return exit_status(cells)


if __name__ == "__main__":
    sys.exit(main())

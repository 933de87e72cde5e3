"""1,000 concurrent streaming clients through one router to 4 backends, twice, on loopback.

    python -m bench.load1000                   # the recorded run
    python -m bench.load1000 --clients 200     # smaller

Starts ``--backends`` session-backend processes (``--speed``, so that streams overlap) and one
router, then runs two rounds of ``--clients`` concurrent streaming chat completions (each with
its own connection and session id; ``--max-tokens`` tokens each). Every client reads its first
event, waits until all clients have theirs (so all streams are open at once), then reads to the
end. Round 1 warms up (it fills the router's keep-alive pools); round 2 is measured against the
state after round 1: the router's open file descriptors and RSS before and after, the most
requests it had in flight at once, errors, and client-side latency. ``tests/test_load_1000.py``
runs this with assertions; the numbers go into ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import tempfile
import time
from typing import Any

import aiohttp

from bench.procs import Proc, start_backend, start_router, wait_until


def raise_fd_limit(need: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards ``need`` (children inherit it); return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        soft = min(need, hard) if hard != resource.RLIM_INFINITY else need
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def proc_usage(pid: int) -> tuple[int, int]:
    """(open file descriptors, RSS in kB) of ``pid``."""
    rss = 0
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return len(os.listdir(f"/proc/{pid}/fd")), rss


async def _in_flight(http: aiohttp.ClientSession, router: Proc) -> int:
    async with http.get(router.url + "/admin/backends") as resp:
        return sum(b["in_flight"] for b in (await resp.json())["data"])


async def one_round(router: Proc, clients: int, max_tokens: int, round_no: int) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=120)
    all_started = asyncio.Event()
    started = 0
    errors: list[str] = []
    latencies: list[float] = []
    peak = 0

    async def client(http: aiohttp.ClientSession, i: int) -> None:
        nonlocal started
        body = {"model": "session-sim", "messages": [{"role": "user", "content": f"round {round_no} client {i}"}],
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        t0 = time.monotonic()
        first = False
        try:
            async with http.post(router.url + "/v1/chat/completions", json=body,
                                 headers={"X-Session-ID": f"load-{round_no}-{i}"}) as resp:
                if resp.status != 200:
                    errors.append(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
                    return
                await resp.content.readuntil(b"\n\n")
                first = True
                started += 1
                if started == clients:
                    all_started.set()
                await all_started.wait()
                rest = await resp.content.read()
            events = [e for e in rest.split(b"\n\n") if e.strip()]
            if not events or events[-1] != b"data: [DONE]" or any(b'"error"' in e for e in events):
                errors.append(f"bad stream end: {rest[-200:]!r}")
                return
            latencies.append(time.monotonic() - t0)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            if not first:
                started += 1  # a failed client must not hold the others at the barrier
                if started == clients:
                    all_started.set()

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http, \
            aiohttp.ClientSession(timeout=timeout) as probe:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(client(http, i)) for i in range(clients)]
        while not all(t.done() for t in tasks):
            peak = max(peak, await _in_flight(probe, router))
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
        after = await _in_flight(probe, router)
    latencies.sort()

    def pct(q: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 3) if latencies else 0.0

    return {"clients": clients, "ok": len(latencies), "errors": len(errors), "error_samples": errors[:5],
            "peak_in_flight": peak, "in_flight_after": after, "wall_s": round(wall, 2),
            "latency_p50_s": pct(0.5), "latency_p99_s": pct(0.99)}


async def run(log_dir: str, *, clients: int = 1000, backends: int = 4, max_tokens: int = 24,
              speed: str = "1") -> dict[str, Any]:
    """Start the topology, run two rounds, stop everything; return the figures."""
    raise_fd_limit(4 * clients + 1024)
    procs: list[Proc] = []
    try:
        procs += [start_backend(log_dir, "--max-num-seqs", str(clients), speed=speed) for _ in range(backends)]
        router = start_router(log_dir, *[a for b in procs for a in ("--backend", b.url)])
        procs.append(router)
        fds_start, rss_start = proc_usage(router.pid)
        warm = await one_round(router, clients, max_tokens, 1)
        fds_before, rss_before = proc_usage(router.pid)
        measured = await one_round(router, clients, max_tokens, 2)
        # client sockets close as the responses end; give the router a bounded moment to see them
        wait_until(lambda: proc_usage(router.pid)[0] <= fds_before, timeout=10, interval=0.05,
                   what="router file descriptors back to the level after round 1")
        fds_after, rss_after = proc_usage(router.pid)
        code = router.stop()
    finally:
        for proc in procs:
            if proc.alive():
                proc.kill()
    return {"round1": warm, "round2": measured, "router_fds": {"start": fds_start, "after_round1": fds_before,
            "after_round2": fds_after}, "router_rss_kb": {"start": rss_start, "after_round1": rss_before,
            "after_round2": rss_after}, "router_exit_code": code, "backends": backends, "max_tokens": max_tokens,
            "speed": speed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load1000", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--speed", default="1")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="load1000-") as log_dir:
        result = asyncio.run(run(log_dir, clients=args.clients, backends=args.backends, max_tokens=args.max_tokens,
                                 speed=args.speed))
    print(json.dumps(result, indent=1))
    bad = result["round1"]["errors"] + result["round2"]["errors"]
    return 1 if bad or result["router_exit_code"] != 0 else 0


if __name__ == "__main__":
    sys.exit(main())

"""1,000 concurrent streaming clients through one router to 4 backends, in rounds, on loopback.

    python -m bench.load1000                   # the recorded run
    python -m bench.load1000 --clients 200     # smaller

Starts ``--backends`` session-backend processes (``--speed``, so that streams overlap) and one
router, then runs ``--rounds`` rounds of ``--clients`` concurrent streaming chat completions, each
on its own connection, ``--max-tokens`` tokens each; client i is session ``load-i`` in every
round, so the session table stops growing after round 1. Every client reads its first event,
waits until all clients have theirs (so all streams are open at once), then reads to the end.
Round 1 warms up (it fills the router's keep-alive pools: ``IDLE_KEPT`` idle connections per backend);
later rounds are measured against the state after round 1: the router's open file descriptors
and RSS, the most requests it had in flight at once, errors, client-side latency.
``tests/system/test_load_1000.py`` runs this with assertions; the numbers go into ``bench/RESULTS.md``.
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

#: the router's admin token here (the admin API and the session listing need one on the data port)
ADMIN_TOKEN = "bench-admin-token"
#: the router's ``[upstream] max_idle_per_host`` here: below the ~250 streams each backend gets, so that every
#: round ends with the same full idle pools (4 x this) and a leaked descriptor shows as growth
IDLE_KEPT = 64


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
    async with http.get(router.url + "/admin/backends", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
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
                                 headers={"X-Session-ID": f"load-{i}"}) as resp:
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
        except (TimeoutError, aiohttp.ClientError) as exc:
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
              speed: str = "1", rounds: int = 2) -> dict[str, Any]:
    """Start the topology, run ``rounds`` rounds (the first warms up), stop everything; return the figures.

    ``router_fds`` / ``router_rss_kb`` hold the router's figures at start and after each round;
    after every round but the first its descriptors must be back where round 1 left them.
    """
    raise_fd_limit(4 * clients + 1024)
    procs: list[Proc] = []
    results: list[dict[str, Any]] = []
    try:
        procs += [start_backend(log_dir, "--max-num-seqs", str(clients), speed=speed) for _ in range(backends)]
        config = os.path.join(log_dir, "router.toml")
        with open(config, "w") as fh:
            fh.write(f"[upstream]\nmax_idle_per_host = {IDLE_KEPT}\n")
        router = start_router(log_dir, "--config", config, "--admin-token", ADMIN_TOKEN,
                              *[a for b in procs for a in ("--backend", b.url)])
        procs.append(router)
        fds, rss = proc_usage(router.pid)
        fds_seen, rss_seen = [fds], [rss]
        for round_no in range(1, rounds + 1):
            results.append(await one_round(router, clients, max_tokens, round_no))
            if round_no > 1:
                # client sockets close as the responses end; give the router a bounded moment to see them
                # (a few descriptors of slack: health checks and the admin probe come and go)
                target = fds_seen[1] + 3
                wait_until(lambda limit=target: proc_usage(router.pid)[0] <= limit, timeout=10, interval=0.05,
                           what="router file descriptors back to the level after round 1")
            fds, rss = proc_usage(router.pid)
            fds_seen.append(fds)
            rss_seen.append(rss)
        code = router.stop()
    finally:
        for proc in procs:
            if proc.alive():
                proc.kill()
    return {"rounds": results, "router_fds": fds_seen, "router_rss_kb": rss_seen, "router_exit_code": code,
            "clients": clients, "backends": backends, "max_tokens": max_tokens, "speed": speed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load1000", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--speed", default="1")
    p.add_argument("--rounds", type=int, default=3, help="rounds of --clients streams (the first warms up)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="load1000-") as log_dir:
        result = asyncio.run(run(log_dir, clients=args.clients, backends=args.backends, max_tokens=args.max_tokens,
                                 speed=args.speed, rounds=args.rounds))
    print(json.dumps(result, indent=1))
    bad = sum(r["errors"] for r in result["rounds"])
    return 1 if bad or result["router_exit_code"] != 0 else 0


if __name__ == "__main__":
    sys.exit(main())

"""Throughput of one session-backend at ``--speed 0`` on small non-streaming completions.

    python -m bench.backend_throughput [--seconds 5] [--concurrency 32] [--max-tokens 8]

Starts one backend process on 127.0.0.1 (a free port), warms it up, then drives it with an aiohttp
client for ``--seconds`` (and at most ``--max-requests``). Prints requests/s, latency p50/p99 and
the backend's own CPU time per request (from /proc/PID/stat, steadier than wall-clock on a shared
machine: 1e6 / cpu_us is what one core can serve). Appends one JSON line to
``bench/out/backend_throughput.jsonl``. The client runs in this process and competes for the
same cores, so requests/s is a floor; the CPU figure is the backend's alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any

import aiohttp

from bench.procs import start_backend

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


async def drive(url: str, seconds: float, concurrency: int, max_requests: int, max_tokens: int) -> dict[str, Any]:
    latencies: list[float] = []
    errors = 0
    sent = 0
    deadline = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:

        async def worker(wid: int) -> None:
            nonlocal errors, sent
            i = 0
            while time.monotonic() < deadline and sent < max_requests:
                sent += 1
                i += 1
                body = {"prompt": f"worker {wid} request {i}: say something", "max_tokens": max_tokens}
                t0 = time.perf_counter()
                try:
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        await resp.read()
                        if resp.status != 200:
                            errors += 1
                            continue
                except aiohttp.ClientError:
                    errors += 1
                    continue
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - t0
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000 if latencies else float("nan")

    return {"ok": len(latencies), "errors": errors, "elapsed_s": elapsed,
            "rps": len(latencies) / elapsed if elapsed else 0.0, "p50_ms": pct(0.50), "p99_ms": pct(0.99)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.backend_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-requests", type=int, default=500_000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--warmup-seconds", type=float, default=1.0)
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.concurrency < 1 or args.max_tokens < 1:
        p.error("--seconds, --concurrency and --max-tokens must be positive")

    with tempfile.TemporaryDirectory(prefix="bench-backend-") as logs:
        backend = start_backend(logs, "--model", "bench-model", speed="0")
        try:
            asyncio.run(drive(backend.url, args.warmup_seconds, args.concurrency, 10**9, args.max_tokens))
            cpu0 = cpu_seconds(backend.pid)
            result = asyncio.run(drive(backend.url, args.seconds, args.concurrency, args.max_requests,
                                       args.max_tokens))
            cpu1 = cpu_seconds(backend.pid)
        finally:
            code = backend.stop()
    cpu_us = (cpu1 - cpu0) * 1e6 / result["ok"] if result["ok"] else float("nan")
    record = {
        "bench": "backend_throughput",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        **{k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()},
        "backend_cpu_us_per_request": round(cpu_us, 1),
        "backend_rps_per_core": round(1e6 / cpu_us) if cpu_us == cpu_us and cpu_us > 0 else None,
        "backend_exit_code": code,
        "python": sys.version.split()[0],
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
    }
    print(f"{result['ok']} requests in {result['elapsed_s']:.2f}s: {result['rps']:.0f} req/s "
          f"(concurrency {args.concurrency}, max_tokens {args.max_tokens}), errors {result['errors']}, "
          f"p50 {result['p50_ms']:.2f} ms, p99 {result['p99_ms']:.2f} ms; backend CPU {cpu_us:.0f} us/request "
          f"(~{record['backend_rps_per_core']} req/s per core)")
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "backend_throughput.jsonl"), "a") as fh:
        fh.write(json.dumps(record) + "\n")
    return 0 if result["errors"] == 0 and result["ok"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Soak: steady multi-turn traffic through one router while backends are killed and restarted.

    python -m bench.soak                      # 10 minutes (the recorded run)
    python -m bench.soak --minutes 1          # a short look
    python -m bench.soak --json out.json      # also write the summary as JSON

Everything runs on 127.0.0.1 and stops by itself: ``--backends`` session-backend processes
(``--speed``), one router in front of them with small session bounds (``--max-sessions``,
``--top-k``) so that eviction and the per-session series bound are exercised, and
``--clients`` concurrent clients, each running conversations of ``--turns`` turns (every
turn's prompt extends the previous one; a new session id per conversation; a share of the
turns stream). Every ``--kill-every`` seconds one backend is SIGKILLed (never the last one
alive) and restarted on the same port ``--down`` seconds later.

Outcome of every request:

- ``ok``: 200 and a complete answer (a stream ends with ``data: [DONE]`` and no error event);
- ``cut``: a stream that had started and ended with an SSE error event then ``data: [DONE]``:
  the expected fate of a stream whose backend was killed under it;
- ``failed``: anything else (an error status, a stream without ``[DONE]``, a timeout, a
  refused connection). The target is zero.

Every ``--sample-every`` seconds it records the router's RSS and open file descriptors
(``/proc/PID``), the session table size (``GET /v1/sessions``), the number of sessions with
per-session series and of session-labelled series (``GET /metrics``). At the end it checks the
bounds (session table <= max_sessions, sessions with series <= top_k, no failure) and exits 1
when one is broken.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import msgspec

from bench.procs import Proc, free_port, start_backend, start_router

#: the router's admin token here (the admin API and the session listing need one on the data port)
ADMIN_TOKEN = "bench-admin-token"

SESSION_LABEL = re.compile(rb'session="([^"]*)"')
SYSTEM = "You are a patient assistant in a long soak test. Answer briefly and keep the thread going."
TOPICS = ("rivers", "bread", "lighthouses", "chess", "bees", "glaciers", "compilers", "jazz")
_decode = msgspec.json.Decoder()


@dataclass
class Sample:
    t: float
    rss_kb: int
    fds: int
    sessions: int
    session_series: int
    sessions_with_series: int
    served: int


@dataclass
class Tally:
    ok: int = 0
    cut: int = 0
    failed: int = 0
    streams: int = 0
    conversations: int = 0
    kills: int = 0
    restarts: int = 0
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failed += 1
        if len(self.failures) < 20:
            self.failures.append(what[:300])


def _proc_status(pid: int) -> tuple[int, int]:
    """RSS in kB and the number of open file descriptors of ``pid``."""
    rss = 0
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
                break
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


async def _turn(http: aiohttp.ClientSession, url: str, body: dict[str, Any], session: str, stream: bool,
                tally: Tally) -> str | None:
    """One request; returns the answer text when it counts as ok."""
    headers = {"X-Session-ID": session}
    try:
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                tally.fail(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
                return None
            if not stream:
                data = _decode.decode(await resp.read())
                return str(data["choices"][0]["message"]["content"] or "")
            raw = await resp.read()
    except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError, KeyError, IndexError, TypeError) as exc:
        tally.fail(f"{type(exc).__name__}: {exc}")
        return None
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    if not events or events[-1] != b"data: [DONE]":
        tally.fail(f"stream without [DONE]: ...{raw[-200:]!r}")
        return None
    parts: list[str] = []
    for event in events[:-1]:
        if not event.startswith(b"data: "):
            continue
        payload = _decode.decode(event[6:])
        if isinstance(payload, dict) and "error" in payload:
            tally.cut += 1  # started, then the backend went away: an error event and [DONE]
            return None
        for choice in payload.get("choices") or ():
            parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


async def client(index: int, http: aiohttp.ClientSession, url: str, args: argparse.Namespace, tally: Tally,
                 stop: asyncio.Event) -> None:
    rng = random.Random(args.seed * 7919 + index)
    conversation = 0
    while not stop.is_set():
        session = f"soak-{index}-{conversation}"
        topic = TOPICS[(index + conversation) % len(TOPICS)]
        messages = [{"role": "system", "content": SYSTEM}]
        turn = 0
        while turn < args.turns and not stop.is_set():
            messages.append({"role": "user", "content": f"{session}: tell me more about {topic} ({turn})."})
            stream = rng.random() < args.stream_share
            body: dict[str, Any] = {"model": "session-sim", "messages": messages,
                                    "max_tokens": rng.randint(8, args.max_tokens), "stream": stream}
            if stream:
                tally.streams += 1
            answer = await _turn(http, url, body, session, stream, tally)
            if answer is None:
                messages.pop()  # ask again
            else:
                tally.ok += 1
                messages.append({"role": "assistant", "content": answer})
                turn += 1
            await asyncio.sleep(args.think * rng.uniform(0.5, 1.5))
        conversation += 1
        tally.conversations += 1


async def chaos(backends: list[Proc], args: argparse.Namespace, log_dir: str, tally: Tally, stop: asyncio.Event,
                events: list[str], started: float) -> None:
    rng = random.Random(args.seed)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), args.kill_every)
            return
        except TimeoutError:
            pass
        alive = [i for i, b in enumerate(backends) if b.alive()]
        if len(alive) < 2:
            continue
        index = rng.choice(alive)
        victim = backends[index]
        await asyncio.to_thread(victim.kill)
        tally.kills += 1
        events.append(f"{time.monotonic() - started:7.1f}s kill backend {index} (pid {victim.pid})")
        try:
            await asyncio.wait_for(stop.wait(), args.down)
            return
        except TimeoutError:
            pass
        backends[index] = await asyncio.to_thread(start_backend, log_dir, port=victim.port, speed=str(args.speed))
        tally.restarts += 1
        events.append(f"{time.monotonic() - started:7.1f}s restart backend {index} (pid {backends[index].pid})")


async def sampler(router: Proc, http: aiohttp.ClientSession, args: argparse.Namespace, tally: Tally,
                  stop: asyncio.Event, samples: list[Sample], started: float) -> None:
    while True:
        rss, fds = _proc_status(router.pid)
        async with http.get(router.url + "/v1/sessions?limit=1", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
            sessions = int((await resp.json())["total"])
        async with http.get(router.url + "/metrics") as resp:
            text = await resp.read()
        labelled = [line for line in text.splitlines() if not line.startswith(b"#") and b'session="' in line]
        with_series = {m.group(1) for line in labelled for m in [SESSION_LABEL.search(line)] if m}
        samples.append(Sample(round(time.monotonic() - started, 1), rss, fds, sessions, len(labelled),
                              len(with_series), tally.ok + tally.cut + tally.failed))
        try:
            await asyncio.wait_for(stop.wait(), args.sample_every)
            return
        except TimeoutError:
            pass


def start_topology(args: argparse.Namespace, log_dir: str) -> tuple[list[Proc], Proc]:
    """The backends, and the router in front of them with small session bounds."""
    backends = [start_backend(log_dir, speed=str(args.speed)) for _ in range(args.backends)]
    config = os.path.join(log_dir, "router.toml")
    with open(config, "w") as fh:
        fh.write(f"[sessions]\nmax_sessions = {args.max_sessions}\nmetrics_top_k = {args.top_k}\n"
                 f'[admin]\ntoken = "{ADMIN_TOKEN}"\n'  # for the session count (GET /v1/sessions)
                 "[health]\ninterval_s = 0.5\ntimeout_s = 0.5\n"
                 "[upstream]\nretries = 2\nfirst_byte_timeout_s = 10\ntotal_timeout_s = 60\n")
        fh.writelines(f'[[backends]]\nurl = "{b.url}"\n' for b in backends)
    return backends, start_router(log_dir, "--config", config, port=free_port())


async def soak(args: argparse.Namespace, log_dir: str) -> dict[str, Any]:
    backends, router = await asyncio.to_thread(start_topology, args, log_dir)
    tally = Tally()
    samples: list[Sample] = []
    events: list[str] = []
    stop = asyncio.Event()
    started = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=120)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            tasks = [asyncio.create_task(client(i, http, router.url, args, tally, stop)) for i in range(args.clients)]
            side = [asyncio.create_task(chaos(backends, args, log_dir, tally, stop, events, started)),
                    asyncio.create_task(sampler(router, http, args, tally, stop, samples, started))]
            deadline = started + args.minutes * 60
            while time.monotonic() < deadline:
                await asyncio.sleep(min(30.0, max(0.0, deadline - time.monotonic())))
                last = samples[-1] if samples else None
                if last is not None:
                    print(f"soak {last.t:6.0f}s: ok {tally.ok} cut {tally.cut} failed {tally.failed} kills "
                          f"{tally.kills}; router rss {last.rss_kb // 1024} MiB fds {last.fds} sessions "
                          f"{last.sessions} with series {last.sessions_with_series}", flush=True)
            stop.set()
            await asyncio.gather(*tasks, *side)
            # the final sample after the traffic stopped and every backend is back
            for i, b in enumerate(backends):
                if not b.alive():
                    backends[i] = start_backend(log_dir, port=b.port, speed=str(args.speed))
            await sampler(router, http, args, tally, stop, samples, started)
        code = router.stop()
    finally:
        for proc in [router, *backends]:
            if proc.alive():
                proc.kill()
    baseline = next((s for s in samples if s.t >= 60), samples[0])
    summary: dict[str, Any] = {
        "minutes": args.minutes,
        "backends": args.backends,
        "clients": args.clients,
        "served": tally.ok + tally.cut + tally.failed,
        "ok": tally.ok,
        "cut_streams": tally.cut,
        "failed": tally.failed,
        "streams": tally.streams,
        "conversations": tally.conversations,
        "kills": tally.kills,
        "restarts": tally.restarts,
        "router_exit_code": code,
        "rss_kb": {"first": samples[0].rss_kb, "after_1min": baseline.rss_kb,
                   "max": max(s.rss_kb for s in samples), "last": samples[-1].rss_kb},
        "fds": {"first": samples[0].fds, "max": max(s.fds for s in samples), "last": samples[-1].fds},
        "sessions_max": max(s.sessions for s in samples),
        "max_sessions": args.max_sessions,
        "sessions_with_series_max": max(s.sessions_with_series for s in samples),
        "session_series_max": max(s.session_series for s in samples),
        "top_k": args.top_k,
        "failures": tally.failures,
        "events": events,
        "samples": [asdict(s) for s in samples],
    }
    return summary


def check(summary: dict[str, Any]) -> list[str]:
    broken = []
    if summary["failed"]:
        broken.append(f"{summary['failed']} failed requests (target 0)")
    if summary["sessions_max"] > summary["max_sessions"]:
        broken.append(f"session table reached {summary['sessions_max']} > max_sessions {summary['max_sessions']}")
    if summary["sessions_with_series_max"] > summary["top_k"]:
        broken.append(f"{summary['sessions_with_series_max']} sessions had series > top_k {summary['top_k']}")
    if summary["router_exit_code"] != 0:
        broken.append(f"the router exited with {summary['router_exit_code']} on SIGTERM")
    return broken


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--backends", type=int, default=3)
    p.add_argument("--clients", type=int, default=24, help="concurrent conversations")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation (a new session each)")
    p.add_argument("--think", type=float, default=0.2, help="mean seconds between turns")
    p.add_argument("--stream-share", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--speed", type=float, default=1.0, help="backends' latency-model speed")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between backend kills")
    p.add_argument("--down", type=float, default=5.0, help="seconds a killed backend stays down")
    p.add_argument("--max-sessions", type=int, default=500, help="router session table bound")
    p.add_argument("--top-k", type=int, default=20, help="router per-session series bound")
    p.add_argument("--sample-every", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--json", metavar="FILE", help="write the summary here as JSON")
    args = p.parse_args(argv)
    if args.backends < 2:
        p.error("--backends must be at least 2 (one is always kept alive)")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM cleans up like Ctrl-C
    with tempfile.TemporaryDirectory(prefix="soak-") as log_dir:
        summary = asyncio.run(soak(args, log_dir))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)
    short = {k: v for k, v in summary.items() if k not in ("samples", "events")}
    print(json.dumps(short, indent=1))
    broken = check(summary)
    for line in broken:
        print(f"soak: BOUND BROKEN: {line}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())

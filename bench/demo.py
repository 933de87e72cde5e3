"""`make demo`: three backends and the router on loopback, multi-turn chat traffic through it,
and a live per-session summary (backend, turns, cached-token ratio). Ctrl-C stops everything.

    python -m bench.demo                 # runs until Ctrl-C
    python -m bench.demo --rounds 4      # a bounded run (CI smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from typing import Any

import aiohttp

from bench.procs import LOOPBACK, Proc, free_port, start_backend, start_router

TOPICS = ["the tides", "sourdough", "rust lifetimes", "jazz harmony", "orbital mechanics", "tea", "chess openings",
          "volcanoes", "typography", "compilers"]
SYSTEM = "You are a concise assistant. Answer in a few sentences and keep the conversation going."


def port_or_free(preferred: int) -> int:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, preferred))
            return preferred
        except OSError:
            return free_port()


class Conversation:
    def __init__(self, index: int, rng: random.Random, send_header: bool) -> None:
        self.name = f"demo-{index}"
        self.topic = TOPICS[index % len(TOPICS)]
        self.messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        self.send_header = send_header
        self.session_id: str | None = f"demo-session-{index}" if send_header else None
        self.rng = rng

    def next_body(self) -> dict[str, Any]:
        turn = sum(1 for m in self.messages if m["role"] == "user")
        self.messages.append({"role": "user", "content": f"Tell me more about {self.topic} (turn {turn + 1})."})
        return {"model": "session-sim", "messages": list(self.messages), "max_tokens": self.rng.randint(16, 48)}


async def run_turn(http: aiohttp.ClientSession, router_url: str, conv: Conversation) -> None:
    headers = {"X-Session-ID": conv.session_id} if conv.send_header and conv.session_id else {}
    async with http.post(router_url + "/v1/chat/completions", json=conv.next_body(), headers=headers) as resp:
        data = await resp.json()
        if resp.status != 200:
            conv.messages.pop()
            return
        conv.session_id = resp.headers.get("X-Session-ID", conv.session_id)
        conv.messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})


async def summary(http: aiohttp.ClientSession, router_url: str, clear: bool) -> str:
    async with http.get(router_url + "/v1/sessions?limit=20") as resp:
        sessions = (await resp.json())["data"]
    lines = [f"{'session':<40} {'backend':<24} {'turns':>5} {'prompt':>7} {'cached':>7} {'ratio':>6}"]
    for s in sorted(sessions, key=lambda s: s["session_id"]):
        prompt, cached = s.get("prompt_tokens", 0), s.get("cached_tokens", 0)
        ratio = cached / prompt if prompt else 0.0
        backend = ",".join(s.get("pins", {}).values())
        lines.append(f"{s['session_id']:<40} {backend:<24} {s['requests']:>5} {prompt:>7} {cached:>7} {ratio:>6.2f}")
    prefix = "\x1b[2J\x1b[H" if clear else ""
    return prefix + "\n".join(lines)


async def traffic(router_url: str, sessions: int, rounds: int | None, seed: int, urls: dict[str, str]) -> None:
    rng = random.Random(seed)
    convs = [Conversation(i, rng, send_header=i % 2 == 0) for i in range(sessions)]
    clear = sys.stdout.isatty()
    async with aiohttp.ClientSession() as http:
        done = 0
        while rounds is None or done < rounds:
            await asyncio.gather(*(run_turn(http, router_url, c) for c in convs))
            done += 1
            print(await summary(http, router_url, clear))
            print("\nwhere to look: " + "  ".join(f"{k}={v}" for k, v in urls.items()))
            print(f"round {done}; even-numbered sessions send X-Session-ID, odd ones are derived by the router."
                  " Ctrl-C stops every process.", flush=True)
            if rounds is None:
                await asyncio.sleep(rng.uniform(0.5, 1.5))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=None, help="stop after this many turns per session")
    parser.add_argument("--speed", default="1", help="backend latency model (1 = small model on a GPU, 0 = instant)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)

    log_dir = tempfile.mkdtemp(prefix="session-router-demo-")
    procs: list[Proc] = []
    stop = {"now": False}

    def on_signal(signum: int, frame: Any) -> None:
        stop["now"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        backend_ports = [port_or_free(8100 + i) for i in range(args.backends)]
        for port in backend_ports:
            procs.append(start_backend(log_dir, port=port, speed=args.speed))
        router_args: list[str] = []
        for p in procs:
            router_args += ["--backend", p.url]
        router = start_router(log_dir, *router_args, port=port_or_free(8000))
        procs.append(router)
        urls = {"router": router.url, "sessions": router.url + "/v1/sessions", "metrics": router.url + "/metrics",
                "logs": log_dir}
        print("started: " + ", ".join(p.url for p in procs), flush=True)
        asyncio.run(traffic(router.url, args.sessions, args.rounds, args.seed, urls))
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(Exception):
                proc.stop()
        print(f"stopped {len(procs)} processes (logs in {log_dir})", flush=True)


if __name__ == "__main__":
    sys.exit(main())

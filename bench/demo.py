"""`make demo`: three backends and the router on loopback, multi-turn chat traffic through it,
and a live per-session summary (backend, turns, cached-token ratio). Ctrl-C stops everything.

    python -m bench.demo                 # runs until Ctrl-C
    python -m bench.demo --rounds 4      # a bounded run (CI smoke test)
    python -m bench.demo --pd            # P/D: 1 prefill + 2 decode backends (make demo DEMO_ARGS=--pd)

With ``--pd`` the backends run ``--role prefill`` (port 8200 when free) and ``--role decode``
(8201, 8202; each with ``--kv-allow`` naming the prefill), the router gets ``--prefill``/``--decode``,
and the summary shows each session's decode instance plus the KV hand-off counters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import secrets
import signal
import sys
import tempfile
from typing import Any

import aiohttp

from bench.procs import LOOPBACK, Proc, free_port, start_backend, start_router
from bench.traffic import TOPICS, Conversation, Stats, TrafficConfig, run_turn

#: the demo router's admin token: the session listing (GET /v1/sessions) is an admin action
ADMIN_TOKEN = secrets.token_hex(16)

def port_or_free(preferred: int) -> int:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, preferred))
            return preferred
        except OSError:
            return free_port()


async def summary(http: aiohttp.ClientSession, router_url: str, clear: bool) -> str:
    async with http.get(router_url + "/v1/sessions?limit=20", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
        sessions = (await resp.json())["data"]
    lines = [f"{'session':<40} {'backend':<24} {'turns':>5} {'prompt':>7} {'cached':>7} {'ratio':>6}"]
    for s in sorted(sessions, key=lambda s: s["session_id"]):
        prompt, cached = s.get("prompt_tokens", 0), s.get("cached_tokens", 0)
        ratio = cached / prompt if prompt else 0.0
        pins = s.get("pins", {})
        # in P/D mode the decode pin is where the session's answers come from
        backend = pins["decode"] if "decode" in pins else ",".join(pins.values())
        lines.append(f"{s['session_id']:<40} {backend:<24} {s['requests']:>5} {prompt:>7} {cached:>7} {ratio:>6.2f}")
    prefix = "\x1b[2J\x1b[H" if clear else ""
    return prefix + "\n".join(lines)


async def scrape_sum(http: aiohttp.ClientSession, url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of every sample of each named series on ``url``/metrics (0 when unreachable)."""
    totals = dict.fromkeys(names, 0.0)
    try:
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
    except aiohttp.ClientError:
        return totals
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


async def pd_summary(http: aiohttp.ClientSession, router_url: str, pd: dict[str, list[str]]) -> str:
    """One line per P/D backend: pulls served / held blocks (prefill), pulls and pulled tokens (decode)."""
    lines = []
    for url in pd["prefill"]:
        m = await scrape_sum(http, url, ("session_backend_kv_pulls_served_total", "session_backend_kv_held_requests",
                                         "vllm:prefix_cache_hits_total"))
        lines.append(f"prefill {url}: pulls served {m['session_backend_kv_pulls_served_total']:.0f}, held now "
                     f"{m['session_backend_kv_held_requests']:.0f}, prefix-cache hit tokens "
                     f"{m['vllm:prefix_cache_hits_total']:.0f}")
    for url in pd["decode"]:
        m = await scrape_sum(http, url, ("session_backend_kv_pulls_total", "session_backend_kv_pulled_tokens_total",
                                         "session_backend_kv_pull_failures_total"))
        lines.append(f"decode  {url}: pulls {m['session_backend_kv_pulls_total']:.0f}, pulled tokens "
                     f"{m['session_backend_kv_pulled_tokens_total']:.0f}, failed pulls "
                     f"{m['session_backend_kv_pull_failures_total']:.0f}")
    fb = await scrape_sum(http, router_url, ("session_router_pd_fallback_total",))
    lines.append(f"router: decode-only fallbacks {fb['session_router_pd_fallback_total']:.0f}")
    return "\n".join(lines)


async def traffic(router_url: str, sessions: int, rounds: int | None, seed: int, urls: dict[str, str],
                  pd: dict[str, list[str]] | None = None) -> None:
    """Rounds of one turn per conversation (the traffic generator's conversations), then a summary."""
    rng = random.Random(seed)
    config = TrafficConfig(router=router_url, sessions=sessions, seed=seed, stream_share=0.3)
    # even-numbered conversations send X-Session-ID; the router derives the others' ids
    convs = [Conversation(i, TOPICS[i % len(TOPICS)], f"demo-session-{i}" if i % 2 == 0 else None, config.model)
             for i in range(sessions)]
    stats = Stats()
    clear = sys.stdout.isatty()
    async with aiohttp.ClientSession() as http:
        done = 0
        while rounds is None or done < rounds:
            await asyncio.gather(*(run_turn(http, config, c, rng, stats) for c in convs))
            done += 1
            print(await summary(http, router_url, clear))
            if pd is not None:
                print(await pd_summary(http, router_url, pd))
            print("\nwhere to look: " + "  ".join(f"{k}={v}" for k, v in urls.items()))
            print(f"round {done}; {stats.line()}")
            print("even-numbered sessions send X-Session-ID, odd ones are derived by the router."
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
    parser.add_argument("--any-ports", action="store_true",
                        help="ephemeral loopback ports instead of the demo's 8000/8100+/8200+ (tests use this)")
    parser.add_argument("--pd", action="store_true",
                        help="prefill/decode topology: 1 prefill + 2 decode backends (ignores --backends)")
    args = parser.parse_args(argv)

    log_dir = tempfile.mkdtemp(prefix="session-router-demo-")
    procs: list[Proc] = []
    stop = {"now": False}

    def on_signal(signum: int, frame: Any) -> None:
        stop["now"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    port_for = (lambda preferred: free_port()) if args.any_ports else port_or_free
    try:
        router_args: list[str] = []
        pd: dict[str, list[str]] | None = None
        if args.pd:
            prefill = start_backend(log_dir, "--role", "prefill", port=port_for(8200), speed=args.speed)
            procs.append(prefill)
            allow = f"{LOOPBACK}:{prefill.port}"
            decodes = [start_backend(log_dir, "--role", "decode", "--kv-allow", allow, port=port_for(8201 + i),
                                     speed=args.speed) for i in range(2)]
            procs += decodes
            pd = {"prefill": [prefill.url], "decode": [d.url for d in decodes]}
            router_args += ["--prefill", prefill.url]
            for d in decodes:
                router_args += ["--decode", d.url]
        else:
            backend_ports = [port_for(8100 + i) for i in range(args.backends)]
            for port in backend_ports:
                procs.append(start_backend(log_dir, port=port, speed=args.speed))
            for p in procs:
                router_args += ["--backend", p.url]
        router = start_router(log_dir, *router_args, "--admin-token", ADMIN_TOKEN, port=port_for(8000))
        procs.append(router)
        urls = {"router": router.url, "sessions": router.url + "/v1/sessions", "admin_token": ADMIN_TOKEN,
                "metrics": router.url + "/metrics", "logs": log_dir}
        if pd is not None:
            urls["prefill"] = pd["prefill"][0] + "/metrics"
        print("started: " + ", ".join(p.url for p in procs), flush=True)
        asyncio.run(traffic(router.url, args.sessions, args.rounds, args.seed, urls, pd))
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

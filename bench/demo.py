"""`make demo`: three backends and the router on loopback, multi-turn chat traffic through it,
and a live view: request and error counts, the cached-token ratio of the last seconds, and one
row per running conversation (session, backend, turns, tokens). Ctrl-C stops everything.

    python -m bench.demo                 # runs until Ctrl-C
    python -m bench.demo --rounds 4      # a bounded run (CI smoke test)
    python -m bench.demo --pd            # P/D: 1 prefill + 2 decode backends (make demo PD=1)
    python -m bench.demo --tokens        # tokens mode: a render server, tokens-only engines (make demo TOKENS=1)

Conversations end and new ones (new sessions) start: after ``--turns`` turns, or before a turn
could take the context past ``--max-context-tokens`` (default: half the backends' context
length), or when the router refuses a turn with a 4xx. Failed requests are shown in a banner at
the top of the view (count, rate, the last status and message), never folded into the ratio.

With ``--pd`` the backends run ``--role prefill`` (port 8200 when free) and ``--role decode``
(8201, 8202; each with ``--kv-allow`` naming the prefill), the router gets ``--prefill``/``--decode``,
and the view adds each P/D backend's KV hand-off counters.

With ``--tokens`` the demo runs vLLM's disaggregated layout with the shipped model
(``models/tiny-llama``): a render server (``session-backend --role render``, port 8300 when free),
``--backends`` engines that take only token ids (``session-backend --tokens-only``, 8301+), and the
router in tokens mode (``--upstream-api tokens --model-dir ... --render URL``): it renders each
chat request on the render server, places it by session, sends the token ids to an engine's
``/inference/v1/generate`` with ``X-Session-ID``, and derenders the ids that come back. Before the
traffic starts it shows one exchange: a chat answer, a stream (its deltas as they arrive), and the
session id as the engine that served it recorded it (``GET /v1/sessions/{id}`` on the engine).

The router runs with ``--access-log text`` when its ``--help`` lists that flag; the log is in the
directory printed under "where to look".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from bench.procs import LOOPBACK, REPO, Proc, free_port, start_backend, start_process, start_router
from bench.traffic import (TOPICS, Conversation, Stats, TrafficConfig, conversation_over, min_context_budget,
                           run_turn)

#: the backends' context length when --max-model-len is not given (passed to them explicitly)
BACKEND_CONTEXT_TOKENS = 8192
#: tokens mode's model (shipped in the repository) and its context length (its config.json)
TOKENS_MODEL_DIR = os.path.join(REPO, "models", "tiny-llama")
TOKENS_MODEL = "tiny-llama"
TOKENS_CONTEXT_TOKENS = 2048
#: the session of the exchange shown before the traffic in tokens mode
SHOWCASE_SESSION = "demo-tokens-hello"
#: the exchange's answer length (not 16: vLLM's SamplingParams default, which a render server leaves
#: out of the GenerateRequest, and an engine then reads as "the rest of the context")
SHOWCASE_TOKENS = 12
#: seconds of recent requests the view's rates and ratio are computed over
WINDOW_S = 30.0
RED, YELLOW, BOLD, RESET = "\x1b[1;37;41m", "\x1b[1;33m", "\x1b[1m", "\x1b[0m"


def port_or_free(preferred: int) -> int:
    """``preferred`` when nothing listens on it, else a free port. A port held only by TIME_WAIT
    connections of an earlier run counts as free (SO_REUSEADDR, as the servers themselves bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, preferred))
            return preferred
        except OSError:
            return free_port()


def router_lists_flag(flag: str, command: Sequence[str] | None = None) -> bool:
    """Whether the router's ``--help`` (or ``command``'s output) lists ``flag``."""
    cmd = list(command) if command is not None else [sys.executable, "-m", "router", "--help"]
    try:
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", out.stdout) is not None


# ------------------------------------------------------------------------------ the traffic


@dataclass(eq=False)
class Lane:
    """One of the demo's concurrent clients: one conversation at a time, a new one when it ends."""

    index: int
    #: even lanes send X-Session-ID (demo-<lane>-<n>); the router derives the others' ids
    with_header: bool
    conv: Conversation
    #: conversations this lane started
    started: int = 1


class DemoTraffic:
    """Rounds of one turn per lane; a lane whose conversation is over starts a new one first."""

    def __init__(self, config: TrafficConfig, seed: int) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.stats = Stats()
        #: conversation numbers name the first message, so derived session ids never repeat
        self._next_number = self.rng.randrange(1_000_000)
        self.lanes = [Lane(i, i % 2 == 0, self._conversation(i, 0, i % 2 == 0)) for i in range(config.sessions)]

    def _conversation(self, lane: int, nth: int, with_header: bool) -> Conversation:
        number = self._next_number
        self._next_number += 1
        session_id = f"demo-{lane}-{nth}" if with_header else None
        return Conversation(number, TOPICS[number % len(TOPICS)], session_id, self.config.model)

    def rotate(self) -> None:
        """Replace every conversation that is over (turns, token budget or refused) by a new one."""
        for lane in self.lanes:
            if conversation_over(lane.conv, self.config):
                self.stats.conversations += 1
                lane.conv = self._conversation(lane.index, lane.started, lane.with_header)
                lane.started += 1

    async def round(self, http: aiohttp.ClientSession) -> None:
        self.rotate()
        await asyncio.gather(*(run_turn(http, self.config, lane.conv, self.rng, self.stats) for lane in self.lanes))


# ------------------------------------------------------------------------------ the view


@dataclass
class Row:
    lane: int
    session: str
    backend: str
    turns: int
    context: int
    prompt: int
    cached: int
    errors: int


def error_banner(stats: Stats, now: float, window_s: float = WINDOW_S, color: bool = False) -> list[str]:
    """Lines nobody misses when requests failed: in the window (red), or earlier (a yellow note)."""
    if not stats.failed:
        return []
    window = stats.window(window_s, now)
    status = f"HTTP {stats.last_error_status}" if stats.last_error_status else "no answer"
    by_status = ", ".join(f"{'HTTP ' + str(k) if k else 'no answer'}: {v}" for k, v in sorted(stats.errors_by_status.items()))
    ago = max(0.0, now - stats.last_error_at)
    last = stats.last_error
    if stats.last_error_status and last.startswith(f"HTTP {stats.last_error_status}: "):
        last = last[len(f"HTTP {stats.last_error_status}: "):]
    if window.failed:
        lines = [
            "!" * 100,
            f"!! ERRORS: {window.failed} of {window.requests} requests FAILED in the last {window_s:.0f} s "
            f"({window.error_rate:.0%}); {stats.failed} failed since the start ({by_status})",
            f"!! last error {ago:.0f} s ago: {status}: {last}",
            "!" * 100,
        ]
        return [f"{RED}{line}{RESET}" for line in lines] if color else lines
    line = (f"note: {stats.failed} requests failed earlier ({by_status}), none in the last {window_s:.0f} s; "
            f"last error {ago:.0f} s ago: {status}: {last}")
    return [f"{YELLOW}{line}{RESET}" if color else line]


def ratio_line(stats: Stats, now: float, window_s: float = WINDOW_S) -> str:
    """The cached-token ratio of the requests answered in the window, said together with how many
    requests that is and how many failed (failed requests have no usage: they are not in it)."""
    window = stats.window(window_s, now)
    head = f"last {window_s:.0f} s: {window.requests} requests, {window.failed} failed ({window.error_rate:.0%})"
    ratio = window.cached_ratio
    if ratio is None:
        return head + "; cached-token ratio n/a (no request answered)"
    text = f"{head}; cached-token ratio {ratio:.2f} over the {window.answered} answered"
    return text + (f" (the {window.failed} failed are not in it)" if window.failed else "")


def render(stats: Stats, rows: Sequence[Row], *, now: float, round_no: int, config: TrafficConfig,
           urls: dict[str, str], pd_lines: Sequence[str] = (), color: bool = False, clear: bool = False) -> str:
    lines = error_banner(stats, now, color=color)
    total = stats.ok + stats.failed
    rate = stats.failed / total if total else 0.0
    title = f"round {round_no}: {stats.ok} ok, {stats.failed} failed ({rate:.1%}) since the start"
    lines.append(f"{BOLD}{title}{RESET}" if color else title)
    lines.append(ratio_line(stats, now))
    lines.append(f"conversations: {stats.conversations} finished, {len(rows)} running (each ends after "
                 f"{config.turns} turns, before its context passes {config.max_context_tokens} tokens, "
                 f"or on a 4xx); longest context answered: {stats.max_context_tokens} tokens")
    lines.append("")
    lines.append(f"{'session':<40} {'backend':<24} {'turns':>5} {'context':>7} {'prompt':>7} {'cached':>7} "
                 f"{'ratio':>6} {'errors':>6}")
    for r in rows:
        ratio = f"{r.cached / r.prompt:.2f}" if r.prompt else "-"
        lines.append(f"{r.session:<40} {r.backend:<24} {r.turns:>5} {r.context:>7} {r.prompt:>7} {r.cached:>7} "
                     f"{ratio:>6} {r.errors:>6}")
    if pd_lines:
        lines += ["", *pd_lines]
    lines.append("")
    lines.append("where to look: " + "  ".join(f"{k}={v}" for k, v in urls.items()))
    lines.append(f"round {round_no}; {stats.line()}")
    lines.append("even-numbered lanes send X-Session-ID, odd ones are derived by the router. Ctrl-C stops every process.")
    return ("\x1b[2J\x1b[H" if clear else "") + "\n".join(lines)


async def lane_rows(http: aiohttp.ClientSession, router_url: str, lanes: Sequence[Lane],
                    engine_counts: bool = False) -> list[Row]:
    """One row per lane's running conversation; the backend from ``GET /v1/sessions/{id}``. With
    ``engine_counts`` (tokens mode, whose chat answers carry no cached-token count, as vLLM's) the
    prompt and cached tokens are the engine's own per-session counts (``GET /v1/sessions/{id}`` on it)."""

    async def backend_of(session_id: str | None) -> str:
        if session_id is None:
            return "-"
        try:
            async with http.get(f"{router_url}/v1/sessions/{session_id}") as resp:
                if resp.status != 200:
                    return "-"
                pins = (await resp.json()).get("pins") or {}
        except (aiohttp.ClientError, ValueError):
            return "?"
        # in P/D mode the decode pin is where the session's answers come from
        return str(pins["decode"]) if "decode" in pins else ",".join(pins.values()) or "-"

    async def engine_tokens(backend: str, session_id: str | None) -> tuple[int, int] | None:
        if not engine_counts or session_id is None or not backend.startswith("http"):
            return None
        try:
            async with http.get(f"{backend}/v1/sessions/{session_id}") as resp:
                if resp.status != 200:
                    return None
                seen = await resp.json()
        except (aiohttp.ClientError, ValueError):
            return None
        return int(seen.get("prompt_tokens") or 0), int(seen.get("cached_tokens") or 0)

    backends = await asyncio.gather(*(backend_of(lane.conv.session_id) for lane in lanes))
    counts = await asyncio.gather(*(engine_tokens(b, lane.conv.session_id) for lane, b in zip(lanes, backends)))
    return [Row(lane.index, lane.conv.session_id or "(not yet answered)", backend, lane.conv.turns,
                lane.conv.context_tokens, *(count or (lane.conv.prompt_tokens, lane.conv.cached_tokens)),
                lane.conv.errors)
            for lane, backend, count in zip(lanes, backends, counts, strict=True)]


async def tokens_summary(http: aiohttp.ClientSession, tokens: dict[str, list[str]]) -> list[str]:
    """The engines' prefix cache over the run (tokens mode: the answers' usage has no cached count)."""
    hits = queries = 0.0
    for url in tokens["engines"]:
        m = await scrape_sum(http, url, ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"))
        hits += m["vllm:prefix_cache_hits_total"]
        queries += m["vllm:prefix_cache_queries_total"]
    ratio = f"{hits / queries:.2f}" if queries else "n/a"
    return [f"engines' prefix cache since the start: {hits:.0f} of {queries:.0f} prompt tokens hit ({ratio}); "
            "in tokens mode the answers' usage has no cached-token count (as vLLM's), so the rows show the "
            "engines' own per-session counts"]


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


async def pd_summary(http: aiohttp.ClientSession, router_url: str, pd: dict[str, list[str]]) -> list[str]:
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
    return lines


async def traffic(config: TrafficConfig, rounds: int | None, seed: int, urls: dict[str, str],
                  pd: dict[str, list[str]] | None = None, tokens: dict[str, list[str]] | None = None) -> Stats:
    """Rounds of one turn per lane, each followed by the live view; returns the counts."""
    demo = DemoTraffic(config, seed)
    tty = sys.stdout.isatty()
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        done = 0
        while rounds is None or done < rounds:
            await demo.round(http)
            done += 1
            rows = await lane_rows(http, config.router, demo.lanes, engine_counts=tokens is not None)
            pd_lines = await pd_summary(http, config.router, pd) if pd is not None else []
            if tokens is not None:
                pd_lines = await tokens_summary(http, tokens)
            print(render(demo.stats, rows, now=time.monotonic(), round_no=done, config=config, urls=urls,
                         pd_lines=pd_lines, color=tty, clear=tty), flush=True)
            if rounds is None:
                await asyncio.sleep(demo.rng.uniform(0.5, 1.5))
    return demo.stats


# ------------------------------------------------------------------------------ tokens mode


async def showcase(router_url: str, engine_urls: Sequence[str], model: str) -> list[str]:
    """One visible exchange through the tokens-mode router: a chat answer, a stream's deltas, and the
    session id as the engine that served both recorded it. Returns the lines it printed."""
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    headers = {"X-Session-ID": SHOWCASE_SESSION}
    messages: list[dict[str, str]] = [{"role": "user", "content": "Hello! Who are you?"}]
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        # min_tokens (vLLM's extension): the simulated engine may draw EOS first, and an empty answer shows nothing
        body = {"model": model, "messages": messages, "max_tokens": SHOWCASE_TOKENS, "min_tokens": 4}
        async with http.post(f"{router_url}/v1/chat/completions", json=body, headers=headers) as resp:
            answer = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"the router answered the first chat turn with HTTP {resp.status}: {answer}")
        choice, usage = answer["choices"][0], answer["usage"]
        content = choice["message"]["content"] or ""
        say(f"chat   {SHOWCASE_SESSION}: {content!r} (finish_reason {choice['finish_reason']}, "
            f"{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens)")
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "Tell me more."}]
        body = {"model": model, "messages": messages, "max_tokens": SHOWCASE_TOKENS, "min_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}}
        deltas: list[str] = []
        finish = None
        async with http.post(f"{router_url}/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"the router answered the streamed turn with HTTP {resp.status}: "
                                   f"{(await resp.read())[:300]!r}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = msgspec.json.decode(line[len("data: "):])
                for choice in event.get("choices") or []:
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        deltas.append(delta)
                    finish = choice.get("finish_reason") or finish
        say(f"stream {SHOWCASE_SESSION}: {len(deltas)} deltas " + " ".join(repr(d) for d in deltas)
            + f" (finish_reason {finish})")
        for url in engine_urls:
            async with http.get(f"{url}/v1/sessions/{SHOWCASE_SESSION}") as resp:
                if resp.status != 200:
                    continue
                seen = await resp.json()
            say(f"engine {url}: session {SHOWCASE_SESSION} arrived with both turns: {seen.get('requests')} "
                f"requests, {seen.get('prompt_tokens')} prompt tokens, {seen.get('cached_tokens')} of them cached")
    return lines


def start_tokens_stack(log_dir: str, engines: int, speed: str, port_for: Any,
                       max_model_len: int | None) -> tuple[list[Proc], list[str], dict[str, list[str]]]:
    """The render server, ``engines`` tokens-only engines and the router's arguments for them."""
    model_args = ["--model-dir", TOKENS_MODEL_DIR] + (["--max-model-len", str(max_model_len)] if max_model_len else [])
    procs: list[Proc] = []
    port = port_for(8300)
    procs.append(start_process("backends", ["--host", LOOPBACK, "--port", str(port), "--role", "render", *model_args],
                               port, log_dir, timeout=60))
    for i in range(engines):
        port = port_for(8301 + i)
        procs.append(start_process("backends", ["--host", LOOPBACK, "--port", str(port), "--tokens-only",
                                                "--speed", speed, *model_args], port, log_dir, timeout=60))
    router_args = ["--upstream-api", "tokens", *model_args, "--render", procs[0].url]
    for engine in procs[1:]:
        router_args += ["--backend", engine.url]
    return procs, router_args, {"render": [procs[0].url], "engines": [p.url for p in procs[1:]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=6, help="concurrent conversations (lanes)")
    parser.add_argument("--turns", type=int, default=10, help="turns per conversation before a new one starts")
    parser.add_argument("--max-context-tokens", type=int, default=None, metavar="TOKENS",
                        help="end a conversation before its context could pass this many tokens "
                             "(default: half the backends' context length)")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                        help=f"the backends' context length (default: theirs, {BACKEND_CONTEXT_TOKENS})")
    parser.add_argument("--rounds", type=int, default=None, help="stop after this many rounds (one turn per lane each)")
    parser.add_argument("--speed", default="1", help="backend latency model (1 = small model on a GPU, 0 = instant)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--any-ports", action="store_true",
                        help="ephemeral loopback ports instead of the demo's 8000/8100+/8200+ (tests use this)")
    parser.add_argument("--pd", action="store_true",
                        help="prefill/decode topology: 1 prefill + 2 decode backends (ignores --backends)")
    parser.add_argument("--tokens", action="store_true",
                        help="tokens mode: a render server, --backends tokens-only engines and the router rendering "
                             f"and derendering (model {TOKENS_MODEL}, context {TOKENS_CONTEXT_TOKENS} tokens)")
    args = parser.parse_args(argv)
    if args.tokens and args.pd:
        parser.error("--tokens and --pd are separate demos: pick one")
    context = args.max_model_len or (TOKENS_CONTEXT_TOKENS if args.tokens else BACKEND_CONTEXT_TOKENS)
    budget = args.max_context_tokens or context // 2
    if budget > context:
        parser.error(f"--max-context-tokens ({budget}) must not exceed the backends' context length ({context})")
    config = TrafficConfig(router="", sessions=args.sessions, turns=args.turns, seed=args.seed, stream_share=0.3,
                           max_context_tokens=budget, **({"model": TOKENS_MODEL} if args.tokens else {}))
    if budget < min_context_budget(config.max_tokens[1]):
        parser.error(f"--max-context-tokens must be at least {min_context_budget(config.max_tokens[1])} "
                     "(room for the system prompt, one message and its answer)")

    log_dir = tempfile.mkdtemp(prefix="session-router-demo-")
    procs: list[Proc] = []

    def stopping(signum: int, frame: Any) -> None:
        """A signal while the demo stops its processes: nothing to do, each stop is bounded (SIGTERM,
        then SIGKILL after 10 s). A Python handler, not SIG_IGN: a signal already pending when the
        handler changes would otherwise be reported as "ignored due to race condition"."""

    def on_signal(signum: int, frame: Any) -> None:
        # the first SIGTERM or SIGINT stops the demo; the ones after it (``timeout`` or make forwarding one,
        # a second Ctrl-C) must not cut that stop short
        for other in (signal.SIGTERM, signal.SIGINT):
            signal.signal(other, stopping)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    port_for = (lambda preferred: free_port()) if args.any_ports else port_or_free
    # the context is always given: session-backend's own default is its model folder's (2,048 tokens for the
    # shipped tiny-llama), and the conversations' budget is half of the context named here
    backend_args = ["--max-model-len", str(context)]
    try:
        router_args: list[str] = []
        pd: dict[str, list[str]] | None = None
        tokens: dict[str, list[str]] | None = None
        if args.tokens:
            started, router_args, tokens = start_tokens_stack(log_dir, args.backends, args.speed, port_for,
                                                              args.max_model_len)
            procs += started
        elif args.pd:
            prefill = start_backend(log_dir, "--role", "prefill", *backend_args, port=port_for(8200), speed=args.speed)
            procs.append(prefill)
            allow = f"{LOOPBACK}:{prefill.port}"
            decodes = [start_backend(log_dir, "--role", "decode", "--kv-allow", allow, *backend_args,
                                     port=port_for(8201 + i), speed=args.speed) for i in range(2)]
            procs += decodes
            pd = {"prefill": [prefill.url], "decode": [d.url for d in decodes]}
            router_args += ["--prefill", prefill.url]
            for d in decodes:
                router_args += ["--decode", d.url]
        else:
            for preferred in range(8100, 8100 + args.backends):
                procs.append(start_backend(log_dir, *backend_args, port=port_for(preferred), speed=args.speed))
            for p in procs:
                router_args += ["--backend", p.url]
        access_log = router_lists_flag("--access-log")
        if access_log:
            router_args += ["--access-log", "text"]
        router = start_router(log_dir, *router_args, port=port_for(8000))
        procs.append(router)
        urls = {"router": router.url, "metrics": router.url + "/metrics",
                ("access log" if access_log else "router log"): router.log_path}
        if pd is not None:
            urls["prefill"] = pd["prefill"][0] + "/metrics"
        if tokens is not None:
            urls["render server"] = tokens["render"][0]
        print("started: " + ", ".join(p.url for p in procs) + f" (logs in {log_dir})", flush=True)
        if not access_log:
            print("note: this router has no --access-log flag; its log has no per-request lines", flush=True)
        if tokens is not None:
            print(f"tokens mode: render server {tokens['render'][0]}, engines taking token ids "
                  f"{', '.join(tokens['engines'])}; the router renders, places by session, generates and derenders",
                  flush=True)
            asyncio.run(showcase(router.url, tokens["engines"], TOKENS_MODEL))
        config = msgspec.structs.replace(config, router=router.url)
        asyncio.run(traffic(config, args.rounds, args.seed, urls, pd, tokens))
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):  # stopping, whatever ended the demo (see on_signal)
            signal.signal(signum, stopping)
        for proc in reversed(procs):
            with contextlib.suppress(Exception):
                proc.stop()
        print(f"stopped {len(procs)} processes (logs in {log_dir})", flush=True)


if __name__ == "__main__":
    sys.exit(main())

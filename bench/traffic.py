"""Gentle multi-turn chat traffic through the router, forever (the demo stack's ``traffic`` service).

Each of ``--sessions`` workers holds one conversation at a time: a shared system prompt, then
turns whose prompt is the whole conversation so far plus a new user message (so every turn's
prompt extends the previous one and a sticky backend serves it from its prefix cache). A
conversation ends after ``--turns`` turns, or earlier when its next turn could take the context
past ``--max-context-tokens`` (a budget well under a backend's context length, 8,192 tokens by
default), or at once when the router answers one of its turns with a client error (a 4xx other
than 408/429: sending it again cannot help); the worker then starts a new conversation (a new
session). Between turns it
thinks for about ``--think`` seconds. Some workers send ``X-Session-ID`` (``--header-share``),
the others leave the id to the router (it derives one from the conversation). A share of the
turns stream (``--stream-share``) with ``stream_options.include_usage``.

    python -m bench.traffic --router http://127.0.0.1:8000                  # forever
    python -m bench.traffic --router http://router:8000 --think 2          # compose service
    python -m bench.traffic --router URL --conversations 1 --turns 4       # bounded: 1 per worker

It never gives up on the router: a refused connection or an error answer is counted, the
worker backs off (up to 10 s) and tries again, so the service may start before the router.
SIGTERM / SIGINT stop it; it prints a one-line summary every ``--report`` seconds and at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import aiohttp
import msgspec

SESSION_HEADER = "X-Session-ID"
TOPICS = ("the tides", "sourdough", "rust lifetimes", "jazz harmony", "orbital mechanics", "tea",
          "chess openings", "volcanoes", "typography", "compilers", "glaciers", "bees")
SYSTEM = ("You are a concise assistant for a long-running demo. Answer in a few sentences, stay on "
          "the topic and keep the conversation going.")
MAX_BACKOFF_S = 10.0
#: room kept for the next user message and its chat-template tokens when checking the token budget (with the
#: backends' shipped tiny-llama tokenizer the longest next message here is 49 tokens, its template 14 more)
NEXT_MESSAGE_TOKENS = 96
#: a bound on a conversation's tokens before its first user message: the system prompt and its template. A
#: byte-level BPE (the backends' tokenizer) never makes more tokens than the text has UTF-8 bytes
OPENING_TOKENS = len(SYSTEM.encode()) + 32
#: client errors that a retry may fix (the others end the conversation)
RETRYABLE_4XX = frozenset({408, 409, 429})
#: outcomes kept for the recent-window figures (``Stats.window``)
RECENT_OUTCOMES = 10_000


class TrafficConfig(msgspec.Struct, kw_only=True, frozen=True):
    router: str
    model: str = "session-sim"
    #: concurrent conversations (one worker each)
    sessions: int = 6
    #: turns per conversation before the worker starts a new one
    turns: int = 12
    #: conversations per worker (None = forever)
    conversations: int | None = None
    #: mean think time between turns, seconds (each pause is uniform in [0.5, 1.5] x this)
    think_s: float = 2.0
    #: share of workers that send X-Session-ID (the rest rely on the router's derivation)
    header_share: float = 0.5
    #: share of turns that stream (with include_usage)
    stream_share: float = 0.3
    max_tokens: tuple[int, int] = (16, 48)
    #: a conversation ends before its next prompt + answer could pass this many tokens
    max_context_tokens: int = 4096
    #: session ids sent in the header are ``<prefix>-<worker>-<conversation>``
    session_prefix: str = ""
    seed: int = 7
    #: seconds between summary lines (0 = only at exit)
    report_s: float = 30.0
    request_timeout_s: float = 120.0


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Outcome(NamedTuple):
    """One request's result, for the recent-window figures."""

    at: float  # time.monotonic()
    ok: bool
    prompt_tokens: int
    cached_tokens: int


class Window(NamedTuple):
    """The requests of the last ``seconds``."""

    seconds: float
    requests: int
    failed: int
    #: over the answered requests only (a failed request has no usage)
    prompt_tokens: int
    cached_tokens: int

    @property
    def answered(self) -> int:
        return self.requests - self.failed

    @property
    def error_rate(self) -> float:
        return self.failed / self.requests if self.requests else 0.0

    @property
    def cached_ratio(self) -> float | None:
        """Cached share of the answered requests' prompt tokens; None when nothing was answered."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


class Stats(msgspec.Struct):
    ok: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    #: conversations finished (by turns, token budget or a client error)
    conversations: int = 0
    #: session id -> turns answered (only for sessions whose id the router echoed)
    session_turns: dict[str, int] = {}
    last_error: str = ""
    #: HTTP status of the last failed request (0: no answer, e.g. refused or cut)
    last_error_status: int = 0
    #: time.monotonic() of the last failure (0.0: none yet)
    last_error_at: float = 0.0
    #: failed requests by HTTP status (0: no answer)
    errors_by_status: dict[int, int] = {}
    #: the largest prompt + completion tokens of one answered request
    max_context_tokens: int = 0
    recent: deque[Outcome] = msgspec.field(default_factory=lambda: deque(maxlen=RECENT_OUTCOMES))

    def record_ok(self, usage: Usage | None, now: float | None = None) -> None:
        self.ok += 1
        prompt = cached = 0
        if usage is not None:
            prompt, cached = usage.prompt_tokens, usage.cached_tokens
            self.prompt_tokens += prompt
            self.completion_tokens += usage.completion_tokens
            self.cached_tokens += cached
            self.max_context_tokens = max(self.max_context_tokens, prompt + usage.completion_tokens)
        self.recent.append(Outcome(time.monotonic() if now is None else now, True, prompt, cached))

    def record_failure(self, status: int, message: str, now: float | None = None) -> None:
        at = time.monotonic() if now is None else now
        self.failed += 1
        self.last_error = message[:300]
        self.last_error_status = status
        self.last_error_at = at
        self.errors_by_status[status] = self.errors_by_status.get(status, 0) + 1
        self.recent.append(Outcome(at, False, 0, 0))

    def window(self, seconds: float, now: float | None = None) -> Window:
        """Counts over the requests that finished in the last ``seconds``."""
        since = (time.monotonic() if now is None else now) - seconds
        requests = failed = prompt = cached = 0
        for outcome in reversed(self.recent):
            if outcome.at < since:
                break
            requests += 1
            if outcome.ok:
                prompt += outcome.prompt_tokens
                cached += outcome.cached_tokens
            else:
                failed += 1
        return Window(seconds, requests, failed, prompt, cached)

    def line(self) -> str:
        total = self.ok + self.failed
        rate = self.failed / total if total else 0.0
        ratio = f"{self.cached_tokens / self.prompt_tokens:.2f}" if self.prompt_tokens else "n/a"
        text = (f"traffic: {self.ok} ok, {self.failed} failed ({rate:.0%}), {self.conversations} conversations "
                f"finished, {len(self.session_turns)} sessions, cached-token ratio {ratio} (answered requests)")
        return text + (f" (last error: {self.last_error})" if self.failed and self.last_error else "")


class Conversation:
    """One multi-turn chat; every turn's prompt extends the previous one."""

    def __init__(self, number: int, topic: str, session_id: str | None, model: str) -> None:
        self.number = number
        self.topic = topic
        #: sent as X-Session-ID when set; else learnt from the router's answer
        self.session_id = session_id
        self.send_header = session_id is not None
        self.model = model
        self.messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        self.turns = 0
        #: prompt + completion tokens of the last answered turn: the context the next turn extends
        self.context_tokens = 0
        #: this conversation's usage (answered turns) and failed requests
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.errors = 0
        #: set when the router refused a turn in a way a retry cannot fix (a 4xx): the conversation ends
        self.abandoned = False

    def next_body(self, *, stream: bool, max_tokens: int) -> dict[str, Any]:
        if self.turns == 0:  # unique first message: derived session ids must not collide
            text = f"Conversation {self.number}: tell me about {self.topic}."
        else:
            text = f"Interesting. Tell me more about {self.topic} (question {self.turns + 1})."
        self.messages.append({"role": "user", "content": text})
        body: dict[str, Any] = {"model": self.model, "messages": list(self.messages), "max_tokens": max_tokens}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def answered(self, text: str, usage: Usage | None = None) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.turns += 1
        if usage is not None:
            self.context_tokens = usage.prompt_tokens + usage.completion_tokens
            self.prompt_tokens += usage.prompt_tokens
            self.cached_tokens += usage.cached_tokens
        else:  # no usage in the answer: a bound (a byte-level BPE makes at most one token per byte, plus the template's)
            self.context_tokens = sum(len(m["content"].encode()) + 16 for m in self.messages)

    def failed(self, status: int = 0) -> None:
        self.messages.pop()  # ask the same question again next time
        self.errors += 1
        if 400 <= status < 500 and status not in RETRYABLE_4XX:
            self.abandoned = True

    def over(self, turns: int, max_context_tokens: int, max_answer_tokens: int) -> bool:
        """True when this conversation should end: ``turns`` answered, a turn refused for good, or
        a next turn (new message + an answer of up to ``max_answer_tokens``) that could pass
        ``max_context_tokens``."""
        if self.turns >= turns or self.abandoned:
            return True
        context = max(self.context_tokens, OPENING_TOKENS)
        return context + NEXT_MESSAGE_TOKENS + max_answer_tokens > max_context_tokens


def min_context_budget(max_answer_tokens: int) -> int:
    """The smallest ``max_context_tokens`` that lets a conversation's first turn be sent."""
    return OPENING_TOKENS + NEXT_MESSAGE_TOKENS + max_answer_tokens


def conversation_over(conv: Conversation, config: TrafficConfig) -> bool:
    return conv.over(config.turns, config.max_context_tokens, config.max_tokens[1])


_decode = msgspec.json.Decoder()


def _usage(obj: Any) -> Usage | None:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or {}
    return Usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                 int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0)


async def _read_stream(resp: aiohttp.ClientResponse) -> tuple[str, Usage | None]:
    """Collect an SSE chat stream's content deltas and its usage chunk."""
    parts: list[str] = []
    usage: Usage | None = None
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = _decode.decode(line[6:])
            if isinstance(event, dict) and "error" in event:
                raise RuntimeError(f"stream ended with an error: {event['error']}")
            usage = _usage(event) or usage
            for choice in event.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    parts.append(content)
    return "".join(parts), usage


async def run_turn(http: aiohttp.ClientSession, config: TrafficConfig, conv: Conversation,
                   rng: random.Random, stats: Stats) -> bool:
    """Send the conversation's next turn; True when it was answered."""
    stream = rng.random() < config.stream_share
    body = conv.next_body(stream=stream, max_tokens=rng.randint(*config.max_tokens))
    headers = {SESSION_HEADER: conv.session_id} if conv.send_header and conv.session_id else {}
    status = 0
    try:
        async with http.post(config.router + "/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                status = resp.status
                raise RuntimeError(f"HTTP {resp.status}: {_error_message(await resp.read())}")
            if stream:
                text, usage = await _read_stream(resp)
            else:
                data = _decode.decode(await resp.read())
                text = data["choices"][0]["message"]["content"] or ""
                usage = _usage(data)
            conv.session_id = resp.headers.get(SESSION_HEADER, conv.session_id)
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, msgspec.DecodeError,
            KeyError, IndexError, TypeError) as exc:
        conv.failed(status)
        message = str(exc) if status else f"{type(exc).__name__}: {exc}"
        stats.record_failure(status, message)
        return False
    conv.answered(text, usage)
    stats.record_ok(usage)
    if conv.session_id is not None:
        stats.session_turns[conv.session_id] = stats.session_turns.get(conv.session_id, 0) + 1
    return True


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    try:
        error = _decode.decode(body).get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
    except (msgspec.DecodeError, AttributeError):
        pass
    return body[:200].decode(errors="replace")


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    if seconds <= 0:
        return
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def worker(index: int, http: aiohttp.ClientSession, config: TrafficConfig, stats: Stats,
                 stop: asyncio.Event, counter: list[int]) -> None:
    rng = random.Random(config.seed * 1_000_003 + index)
    with_header = index < round(config.sessions * config.header_share)
    done = 0
    backoff = 0.5
    while not stop.is_set() and (config.conversations is None or done < config.conversations):
        number = counter[0]
        counter[0] += 1
        session_id = f"{config.session_prefix or 'traffic'}-{index}-{done}" if with_header else None
        conv = Conversation(number, TOPICS[number % len(TOPICS)], session_id, config.model)
        while not conversation_over(conv, config) and not stop.is_set():
            if await run_turn(http, config, conv, rng, stats):
                backoff = 0.5
                if not conversation_over(conv, config):
                    await _pause(stop, config.think_s * rng.uniform(0.5, 1.5))
            else:  # a retry (or, for an abandoned conversation, the next one) waits
                await _pause(stop, backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)
        done += 1
        stats.conversations += 1


async def run(config: TrafficConfig, stop: asyncio.Event | None = None, stats: Stats | None = None) -> Stats:
    """Run the workers until each finished its conversations (bounded) or ``stop`` is set.

    ``stats`` (default: a new one) is updated as turns finish, so a caller can watch it.
    """
    stop = stop or asyncio.Event()
    stats = stats if stats is not None else Stats()
    counter = [random.Random(config.seed).randrange(1_000_000) if not config.session_prefix else 0]
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=max(1, config.sessions))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        workers = [asyncio.create_task(worker(i, http, config, stats, stop, counter)) for i in range(config.sessions)]
        reporter = asyncio.create_task(_report(config, stats, stop)) if config.report_s > 0 else None
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            if reporter is not None:
                reporter.cancel()
            pending = workers + ([reporter] if reporter is not None else [])
            await asyncio.gather(*pending, return_exceptions=True)
    return stats


async def _report(config: TrafficConfig, stats: Stats, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await _pause(stop, config.report_s)
        print(stats.line(), flush=True)


def parse_args(argv: Sequence[str] | None = None) -> TrafficConfig:
    d = TrafficConfig(router="")
    p = argparse.ArgumentParser(prog="python -m bench.traffic", description=__doc__.split("\n\n")[0])
    p.add_argument("--router", required=True, metavar="URL", help="router base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=d.model)
    p.add_argument("--sessions", type=int, default=d.sessions, help="concurrent conversations")
    p.add_argument("--turns", type=int, default=d.turns, help="turns per conversation")
    p.add_argument("--conversations", type=int, default=None,
                   help="conversations per worker, then stop (default: forever)")
    p.add_argument("--max-context-tokens", type=int, default=d.max_context_tokens, metavar="TOKENS",
                   help="end a conversation before its context could pass this (keep it under the backends' "
                        "context length)")
    p.add_argument("--think", type=float, default=d.think_s, metavar="SECONDS", help="mean pause between turns")
    p.add_argument("--header-share", type=float, default=d.header_share,
                   help="share of conversations that send X-Session-ID")
    p.add_argument("--stream-share", type=float, default=d.stream_share, help="share of turns that stream")
    p.add_argument("--session-prefix", default=d.session_prefix, help="prefix of the X-Session-ID values sent")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--report", type=float, default=d.report_s, metavar="SECONDS",
                   help="seconds between summary lines (0 = only at exit)")
    args = p.parse_args(argv)
    if not args.router.startswith("http://"):
        p.error("--router must be an http:// URL")
    for name in ("sessions", "turns"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.max_context_tokens < min_context_budget(d.max_tokens[1]):
        p.error(f"--max-context-tokens must be at least {min_context_budget(d.max_tokens[1])} "
                "(room for the system prompt, one message and its answer)")
    if args.conversations is not None and args.conversations < 1:
        p.error("--conversations must be at least 1")
    if args.think < 0 or args.report < 0:
        p.error("--think and --report must be >= 0")
    for name in ("header_share", "stream_share"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be between 0 and 1")
    return TrafficConfig(router=args.router.rstrip("/"), model=args.model, sessions=args.sessions,
                         turns=args.turns, conversations=args.conversations, think_s=args.think,
                         max_context_tokens=args.max_context_tokens,
                         header_share=args.header_share, stream_share=args.stream_share,
                         session_prefix=args.session_prefix, seed=args.seed, report_s=args.report)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)

    async def _main() -> Stats:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"traffic: {config.sessions} conversations of {config.turns} turns against {config.router} "
              f"(pid {os.getpid()}); SIGTERM/Ctrl-C stops", flush=True)
        return await run(config, stop)

    started = time.monotonic()
    stats = asyncio.run(_main())
    print(stats.line() + f" in {time.monotonic() - started:.1f}s", flush=True)
    return 0 if stats.ok or not stats.failed else 1


if __name__ == "__main__":
    sys.exit(main())

"""A lean HTTP load generator: keep-alive connections driven by callbacks, parsed with httptools.

Each of ``concurrency`` connections sends one small completion request, waits for the whole
response and sends the next at once (closed loop). With ``rate`` > 0 the run is open loop instead:
requests start at fixed intervals of 1/``rate`` s (absolute times, so the mean rate holds), each on
an idle connection of the ``concurrency`` kept open; a request whose time comes while all of them
are busy waits for the next one to free up and counts as ``late`` (a rate the target cannot
sustain shows as late requests and an achieved ``rps`` below ``rate``). Requests carry ``X-Session-ID`` from a pool
of ``sessions`` ids, cycled. Connections are spread round-robin over the given base URLs (two
backends for the "direct" baseline, one proxy otherwise). No coroutine per request, no JSON
decoding: the client shares the machine with the proxies it measures, so it stays cheap.

A run has a warm-up, then a measured window of ``seconds``: latencies and time to first token
count for requests that complete inside the window, and the CPU time (utime + stime from
``/proc/PID/stat``) of each group of ``cpu_groups`` PIDs is read at both ends of the window, so
``cpu_us_per_req[group]`` is that group's CPU spent per request completed in the window. After
the window no new request starts; in-flight ones finish (bounded by ``drain_s``).

    python -m bench.loadgen --url http://127.0.0.1:8000 --concurrency 16 --seconds 3 [--stream] [--pid N]
    python -m bench.loadgen --serve     # JSON LoadSpec per stdin line -> JSON LoadResult per stdout line

A response counts as an error when its status is not 200, when a stream does not end with
``data: [DONE]``, or when the connection breaks with the request in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from functools import partial
from urllib.parse import urlsplit

import httptools
import msgspec

SESSION_HEADER = "X-Session-ID"
_TICKS = os.sysconf("SC_CLK_TCK")
_DONE_TAIL = b"data: [DONE]\n\n"


class LoadSpec(msgspec.Struct, kw_only=True, frozen=True):
    """One measured run."""

    urls: list[str]
    path: str = "/v1/completions"
    model: str = "session-sim"
    stream: bool = False
    max_tokens: int = 8
    concurrency: int = 16
    seconds: float = 3.0
    warmup_s: float = 0.5
    #: how long in-flight requests may take to finish after the window
    drain_s: float = 10.0
    sessions: int = 100
    session_prefix: str = "bench"
    #: request bodies (JSON text) to send instead of the default small completion, session i sending
    #: ``bodies[i % len(bodies)]`` (e.g. chat requests for ``path`` ``/v1/chat/completions``)
    bodies: list[str] = []
    #: group name -> PIDs whose summed CPU time is measured over the window
    cpu_groups: dict[str, list[int]] = {}
    #: requests per second started at fixed intervals (open loop); 0 = closed loop
    rate: float = 0.0


class LoadResult(msgspec.Struct, kw_only=True):
    requests: int
    errors: int
    window_s: float
    rps: float
    p50_ms: float
    p99_ms: float
    #: time to the first ``data:`` chunk (streams only; 0 otherwise)
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    #: group name -> CPU microseconds per completed request over the window
    cpu_us_per_req: dict[str, float] = {}
    #: this load generator's own CPU per request
    client_cpu_us_per_req: float = 0.0
    first_error: str = ""
    #: open loop: requests due in the window that found every connection busy and had to wait
    late: int = 0


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` so far, in seconds (0 when the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


def group_cpu(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in groups.items()}


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (0 for none)."""
    if not sorted_values:
        return 0.0
    rank = math.ceil(q * len(sorted_values) - 1e-9)  # the smallest value with at least q of them at or below
    return sorted_values[min(len(sorted_values), max(1, rank)) - 1]


def build_requests(spec: LoadSpec, host: str) -> list[bytes]:
    """The request bytes, one per session id (the body differs only in the prompt, or is taken from
    ``spec.bodies``)."""
    out = []
    for i in range(spec.sessions):
        if spec.bodies:
            body = spec.bodies[i % len(spec.bodies)].encode()
        else:
            body = msgspec.json.encode({
                "model": spec.model,
                "prompt": f"bench session {i}: say something short",
                "max_tokens": spec.max_tokens,
                "stream": spec.stream,
            })
        head = (
            f"POST {spec.path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"{SESSION_HEADER}: {spec.session_prefix}-{i}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        out.append(head + body)
    return out


class _Run:
    """Shared state of one run: the window, the samples, the stop flag."""

    __slots__ = ("backlog", "drained", "errors", "first_error", "idle", "in_flight", "late", "latencies",
                 "open_loop", "recording", "stopping", "stream", "ttfts")

    def __init__(self, stream: bool, open_loop: bool = False) -> None:
        self.stream = stream
        self.open_loop = open_loop
        #: open loop: connections waiting for a request's time, and requests due with none idle
        self.idle: list[_Conn] = []
        self.backlog = 0
        self.late = 0
        self.recording = False
        self.stopping = False
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.errors = 0
        self.first_error = ""
        self.in_flight = 0
        self.drained: asyncio.Future[None] | None = None

    def error(self, what: str) -> None:
        """Count a failed request (at any time: warm-up and drain errors count too)."""
        self.errors += 1
        if not self.first_error:
            self.first_error = what

    def due(self) -> None:
        """Open loop: a request's time has come; send it on an idle connection, or queue it."""
        if self.stopping:
            return
        if self.idle:
            self.idle.pop().send()
            return
        self.backlog += 1
        if self.recording:
            self.late += 1

    def ready(self, conn: _Conn) -> None:
        """Open loop: ``conn`` is free; it takes a queued request or waits for the next one due."""
        if self.backlog:
            self.backlog -= 1
            conn.send()
        else:
            self.idle.append(conn)

    def finished(self) -> None:
        self.in_flight -= 1
        if self.stopping and self.in_flight == 0 and self.drained is not None and not self.drained.done():
            self.drained.set_result(None)


class _Conn(asyncio.Protocol):
    """One keep-alive client connection: send, parse, record, send the next (all in callbacks)."""

    def __init__(self, run: _Run, requests: list[bytes], offset: int, closed: asyncio.Future[None]) -> None:
        self.run = run
        self.requests = requests
        self.index = offset
        self.closed = closed
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.started = 0.0
        self.first = 0.0
        self.tail = b""

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.run.open_loop:
            self.run.ready(self)
        else:
            self.send()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"bad response: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.run.idle:
            self.run.idle.remove(self)
        if self.busy:
            self.busy = False
            self.run.error(f"connection lost mid-request: {exc or 'closed by peer'}")
            self.run.finished()
        if not self.closed.done():
            self.closed.set_result(None)

    # -- httptools callbacks
    def on_body(self, body: bytes) -> None:
        if self.first == 0.0 and (not self.run.stream or b"data:" in body):
            self.first = time.perf_counter()
        if self.run.stream:
            self.tail = (self.tail + body)[-len(_DONE_TAIL):]

    def on_message_complete(self) -> None:
        now = time.perf_counter()
        run = self.run
        status = self.parser.get_status_code()
        self.busy = False
        if status != 200:
            run.error(f"status {status}")
        elif run.stream and self.tail != _DONE_TAIL:
            run.error("stream did not end with data: [DONE]")
        elif run.recording:
            run.latencies.append(now - self.started)
            if run.stream:
                run.ttfts.append(self.first - self.started)
        run.finished()
        if run.stopping or not self.parser.should_keep_alive():
            assert self.transport is not None
            self.transport.close()
        elif run.open_loop:
            run.ready(self)
        else:
            self.send()

    # -- internals
    def send(self) -> None:
        run = self.run
        if run.stopping:
            assert self.transport is not None
            self.transport.close()
            return
        requests = self.requests
        self.index += 1
        self.busy = True
        run.in_flight += 1
        self.first = 0.0
        self.tail = b""
        self.started = time.perf_counter()
        assert self.transport is not None
        self.transport.write(requests[self.index % len(requests)])

    def _fail(self, what: str) -> None:
        if self.busy:
            self.busy = False
            self.run.error(what)
            self.run.finished()
        if self.transport is not None:
            self.transport.abort()


async def _slot(run: _Run, host: str, port: int, requests: list[bytes], offset: int,
                conns: list[_Conn]) -> None:
    """Keep one connection open (reconnecting when the server closes it) until the run stops."""
    loop = asyncio.get_running_loop()
    while not run.stopping:
        closed: asyncio.Future[None] = loop.create_future()
        try:
            _, conn = await loop.create_connection(partial(_Conn, run, requests, offset, closed), host, port)
        except OSError as exc:
            run.error(f"connect to {host}:{port} failed: {exc}")
            await asyncio.sleep(0.05)
            continue
        conns.append(conn)
        await closed
        offset = conn.index


async def _pace(run: _Run, rate: float) -> None:
    """Open loop: one request due every 1/``rate`` s, at absolute times (a late wake-up catches up)."""
    loop = asyncio.get_running_loop()
    interval = 1.0 / rate
    due = loop.time()
    while not run.stopping:
        due += interval
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        run.due()


async def run_load(spec: LoadSpec) -> LoadResult:
    """Run ``spec`` on the running loop and return what was measured."""
    if spec.rate < 0:
        raise ValueError(f"rate must be >= 0 (0 = closed loop), got {spec.rate}")
    loop = asyncio.get_running_loop()
    run = _Run(spec.stream, open_loop=spec.rate > 0)
    targets = []
    for url in spec.urls:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        targets.append((host, port, build_requests(spec, f"{host}:{port}")))
    conns: list[_Conn] = []
    # spread the session ids: connection i starts at session i * sessions / concurrency
    step = max(1, spec.sessions // max(1, spec.concurrency))
    tasks = [
        asyncio.create_task(_slot(run, *targets[i % len(targets)][:2], targets[i % len(targets)][2], i * step, conns))
        for i in range(spec.concurrency)
    ]
    if run.open_loop:
        tasks.append(asyncio.create_task(_pace(run, spec.rate)))
    try:
        await asyncio.sleep(spec.warmup_s)
        cpu0, client0, t0 = group_cpu(spec.cpu_groups), time.process_time(), time.perf_counter()
        run.recording = True
        await asyncio.sleep(spec.seconds)
        cpu1, client1, t1 = group_cpu(spec.cpu_groups), time.process_time(), time.perf_counter()
        run.recording = False
        done = len(run.latencies)
        run.stopping = True
        run.drained = loop.create_future()
        if run.in_flight > 0:
            try:
                await asyncio.wait_for(asyncio.shield(run.drained), spec.drain_s)
            except TimeoutError:  # the abort below counts each unfinished request as an error
                run.first_error = run.first_error or f"{run.in_flight} requests unfinished {spec.drain_s}s after the window"
        for conn in conns:
            if conn.transport is not None:
                conn.transport.abort()
        try:
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5.0)
        except TimeoutError:
            pass  # a connect still pending: cancelled below
    finally:
        for task in tasks:
            task.cancel()
    window = t1 - t0
    latencies = sorted(run.latencies[:done])
    ttfts = sorted(run.ttfts[:done])
    per_req = (lambda seconds: seconds / done * 1e6) if done else (lambda seconds: 0.0)
    return LoadResult(
        requests=done,
        errors=run.errors,
        window_s=window,
        rps=done / window if window > 0 else 0.0,
        p50_ms=percentile(latencies, 0.50) * 1e3,
        p99_ms=percentile(latencies, 0.99) * 1e3,
        ttft_p50_ms=percentile(ttfts, 0.50) * 1e3,
        ttft_p99_ms=percentile(ttfts, 0.99) * 1e3,
        cpu_us_per_req={name: per_req(cpu1[name] - cpu0[name]) for name in cpu0},
        client_cpu_us_per_req=per_req(client1 - client0),
        first_error=run.first_error,
        late=run.late,
    )


def _run_blocking(spec: LoadSpec) -> LoadResult:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a test extra
        return asyncio.run(run_load(spec))
    return uvloop.run(run_load(spec))


def serve() -> None:
    """One JSON ``LoadSpec`` per input line -> one JSON ``LoadResult`` per output line."""
    encoder = msgspec.json.Encoder()
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        spec = msgspec.json.decode(line, type=LoadSpec)
        sys.stdout.buffer.write(encoder.encode(_run_blocking(spec)) + b"\n")
        sys.stdout.buffer.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help="read JSON specs from stdin, one per line")
    parser.add_argument("--url", action="append", default=[], help="base URL (repeatable; connections spread over them)")
    parser.add_argument("--path", default="/v1/completions")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 8, or 16 with --stream")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="connections (closed loop: requests in flight; open loop: the most in flight)")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="open loop: requests per second at fixed intervals (default 0: closed loop)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--pid", type=int, action="append", default=[], help="measure this process's CPU (repeatable)")
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return 0
    if not args.url:
        parser.error("--url is required (or --serve)")
    spec = LoadSpec(
        urls=args.url, path=args.path, stream=args.stream,
        max_tokens=args.max_tokens or (16 if args.stream else 8), concurrency=args.concurrency,
        seconds=args.seconds, warmup_s=args.warmup, sessions=args.sessions, rate=args.rate,
        cpu_groups={"pids": args.pid} if args.pid else {},
    )
    result = _run_blocking(spec)
    print(msgspec.json.encode(result).decode())
    return 1 if result.errors else 0


if __name__ == "__main__":
    sys.exit(main())

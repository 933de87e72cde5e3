"""Micro-benchmark: CPU per request of the upstream client, our raw pool vs aiohttp's ClientSession.

Both clients talk to the same minimal keep-alive server (uvloop + httptools) running in a child
process on 127.0.0.1, so only the client's own CPU is measured (``time.process_time`` of this
process around the run, divided by the number of requests). The pool's figure includes
``build_request_head`` for every request, as the proxy pays it.

    .venv/bin/python bench/upstream_micro.py                 # defaults: 20000 requests, c=16, best of 3
    .venv/bin/python bench/upstream_micro.py --requests 5000 --concurrency 128 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

JSON_BODY = (
    b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
    b'"text":" hello world, this is a short completion","logprobs":null,"finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":12,"total_tokens":20,"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":0}}}'
)
JSON_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Request-Id: r-1\r\n"
    b"Content-Length: " + str(len(JSON_BODY)).encode() + b"\r\n\r\n" + JSON_BODY
)
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
SSE_EVENTS = 16
REQUEST_BODY = b'{"model":"m","prompt":"hello","max_tokens":8,"session_id":"s-1"}'
CLIENT_HEADERS = [("Content-Type", "application/json"), ("X-Session-ID", "s-1"), ("X-Request-Id", "r-1")]


# ---------------------------------------------------------------------- the server (child process)
def serve(port: int) -> None:
    import httptools
    import uvloop

    def sse_event(i: int) -> bytes:
        data = b'data: {"choices":[{"index":0,"text":" tok%d"}]}\n\n' % i
        return b"%x\r\n%s\r\n" % (len(data), data)

    events = [sse_event(i) for i in range(SSE_EVENTS)] + [b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"]

    class Server(asyncio.Protocol):
        def __init__(self) -> None:
            self.parser = httptools.HttpRequestParser(self)
            self.url = b""

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport  # type: ignore[assignment]
            loop = asyncio.get_running_loop()
            self.loop = loop

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()

        def on_url(self, url: bytes) -> None:
            self.url = url

        def on_message_complete(self) -> None:
            if self.url.startswith(b"/sse"):
                self.transport.write(SSE_HEAD)
                self.loop.call_soon(self.stream, 0)
            else:
                self.transport.write(JSON_RESPONSE)

        def stream(self, i: int) -> None:  # one event per loop iteration, like a token stream
            if self.transport.is_closing():
                return
            self.transport.write(events[i])
            if i + 1 < len(events):
                self.loop.call_soon(self.stream, i + 1)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Server, "127.0.0.1", port, backlog=1024)
        print("ready", flush=True)
        await server.serve_forever()

    uvloop.run(main())


# ---------------------------------------------------------------------- the clients
async def run_pool(port: int, path: str, n: int, concurrency: int, stream: bool) -> None:
    from router.upstream import UpstreamPool, UpstreamTimeouts, build_request_head

    pool = UpstreamPool(UpstreamTimeouts())
    host_header = f"127.0.0.1:{port}"
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            head = build_request_head("POST", path, host_header, CLIENT_HEADERS, len(REQUEST_BODY))
            resp = await pool.request("127.0.0.1", port, head, REQUEST_BODY)
            if stream:
                async for _ in resp:
                    pass
            else:
                await resp.read()
            assert resp.status == 200

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await pool.close()


async def run_aiohttp(port: int, path: str, n: int, concurrency: int, stream: bool) -> None:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency, ttl_dns_cache=None)
    url = f"http://127.0.0.1:{port}{path}"
    headers = dict(CLIENT_HEADERS)
    remaining = n
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                     skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding")) as session:

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                async with session.post(url, data=REQUEST_BODY, headers=headers) as resp:
                    if stream:
                        async for _ in resp.content.iter_any():
                            pass
                    else:
                        await resp.read()
                    assert resp.status == 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def measure(client: str, port: int, stream: bool, n: int, concurrency: int) -> tuple[float, float]:
    import uvloop

    fn = run_pool if client == "pool" else run_aiohttp
    path = "/sse" if stream else "/v1/completions"

    async def once() -> tuple[float, float]:
        await fn(port, path, min(200, n), concurrency, stream)  # warm-up (connections, imports)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await fn(port, path, n, concurrency, stream)
        return time.process_time() - cpu0, time.perf_counter() - wall0

    cpu, wall = uvloop.run(once())
    return cpu / n * 1e6, n / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        print(f"{args.requests} requests per round, concurrency {args.concurrency}, best of {args.rounds} rounds; "
              f"client CPU per request (this process), requests/s")
        print(f"{'client':<10} {'mode':<11} {'CPU us/req':>10} {'req/s':>9}   (all rounds, us/req)")
        for stream in (False, True):
            for client in ("pool", "aiohttp"):
                results = [measure(client, port, stream, args.requests, args.concurrency) for _ in range(args.rounds)]
                best = min(results)
                print(f"{client:<10} {'stream' + str(SSE_EVENTS) if stream else 'non-stream':<11} "
                      f"{best[0]:>10.1f} {best[1]:>9.0f}   ({', '.join(f'{r[0]:.1f}' for r in results)})", flush=True)
    finally:
        os.kill(server.pid, signal.SIGTERM)
        server.wait(timeout=5)


if __name__ == "__main__":
    main()

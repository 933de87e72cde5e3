"""In-process fake upstreams for router tests: real HTTP servers on loopback whose behaviour a
test controls (record what arrived, stream on cue, break mid-stream, stall)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Seen:
    path: str
    headers: dict[str, list[str]]
    body: bytes


@dataclass
class EchoBackend:
    """Answers like a vLLM backend, records every request, and can be scripted per test."""

    name: str
    seen: list[Seen] = field(default_factory=list)
    #: status for inference routes (e.g. 503 to force a retry)
    status: int = 200
    #: stream: release each chunk after the test sets the event (chunk i waits on gates[i] if present)
    gates: dict[int, asyncio.Event] = field(default_factory=dict)
    #: stream: drop the connection after this many chunks
    break_after: int | None = None
    #: never answer (stall) inference requests
    stall: bool = False
    stalled: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    healthy: bool = True
    response_counter: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/load", self.load)
        app.router.add_get("/v1/models", self.models)
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/inference/v1/generate",
                     "/tokenize", "/detokenize", "/v1/embeddings"):
            app.router.add_post(path, self.infer)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def load(self, request: web.Request) -> web.Response:
        return web.json_response({"server_load": 0})

    async def models(self, request: web.Request) -> web.Response:
        # "m": the model the router tests send (the router routes by model: one nobody lists is a 404)
        return web.json_response({"object": "list", "data": [{"id": f"model-{self.name}", "object": "model"},
                                                              {"id": "shared", "object": "model"},
                                                              {"id": "m", "object": "model"}]})

    async def infer(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers: dict[str, list[str]] = {}
        for k, v in request.headers.items():
            headers.setdefault(k.lower(), []).append(v)
        self.seen.append(Seen(request.path, headers, body))
        if self.stall:
            self.stalled.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if self.status != 200:
            return web.json_response({"error": {"message": "scripted", "type": "X", "param": None,
                                                "code": self.status}}, status=self.status)
        try:
            payload: Any = json.loads(body)
        except ValueError:
            payload = {}
        self.response_counter += 1
        usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                 "prompt_tokens_details": {"cached_tokens": 4}}
        if isinstance(payload, dict) and payload.get("stream"):
            return await self._stream(request, payload, usage)
        result: dict[str, Any] = {"id": f"x-{self.name}-{self.response_counter}", "backend": self.name, "usage": usage}
        if request.path == "/v1/responses":
            result["id"] = f"resp_{self.name}_{self.response_counter}"
        return web.json_response(result)

    async def _stream(self, request: web.Request, payload: dict[str, Any], usage: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if request.path == "/v1/responses":
                rid = f"resp_{self.name}_{self.response_counter}"
                await resp.write(b'event: response.created\ndata: {"type":"response.created","response":{"id":"'
                                 + rid.encode() + b'"}}\n\n')
            for i in range(3):
                gate = self.gates.get(i)
                if gate is not None:
                    await gate.wait()
                if self.break_after is not None and i >= self.break_after:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                await resp.write(f'data: {{"backend":"{self.name}","i":{i}}}\n\n'.encode())
            if (payload.get("stream_options") or {}).get("include_usage"):
                await resp.write(b'data: {"choices":[],"usage":' + json.dumps(usage).encode() + b"}\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        await resp.write_eof()
        return resp

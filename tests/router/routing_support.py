"""In-process harness for the model-routing and catch-all tests: fake backends that serve chosen
models and vLLM's other routes, and the client side of a router before them (the router itself is
the ``serve`` fixture of ``tests/router/conftest.py``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from router.state import RouterState

FRONTS = ("raw", "aiohttp")


@dataclass
class Hit:
    method: str
    path: str
    #: lower-case names
    headers: dict[str, str]
    body: bytes


@dataclass
class ModelBackend:
    """A vLLM-like backend serving ``models`` (None: no ``/v1/models`` route, a 404) and some of
    vLLM's other routes; every request but ``/health`` and ``/v1/models`` is recorded in ``hits``."""

    name: str
    models: list[str] | None
    hits: list[Hit] = field(default_factory=list)
    #: path -> status answered instead (e.g. 503 to force a failover)
    fail: dict[str, int] = field(default_factory=dict)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self.health)
        if self.models is not None:
            app.router.add_get("/v1/models", self.list_models)
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/score",
                     "/inference/v1/generate"):
            app.router.add_post(path, self.json_route)
        app.router.add_post("/v1/audio/transcriptions", self.transcribe)
        app.router.add_post("/v1/messages", self.stream)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/responses/{response_id}", self.stored_response)
        app.router.add_route("*", "/internal/{tail:.*}", self.json_route)  # must never be reached
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def list_models(self, request: web.Request) -> web.Response:
        if "/v1/models" in self.fail:
            return web.Response(status=self.fail["/v1/models"])
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "owned_by": self.name} for m in self.models or ()]})

    async def _hit(self, request: web.Request) -> tuple[bytes, web.Response | None]:
        body = await request.read()
        self.hits.append(Hit(request.method, request.path_qs, {k.lower(): v for k, v in request.headers.items()}, body))
        status = self.fail.get(request.path)
        if status is not None:
            return body, web.json_response({"error": {"message": "scripted", "type": "X", "param": None,
                                                      "code": status}}, status=status)
        return body, None

    async def json_route(self, request: web.Request) -> web.Response:
        body, failed = await self._hit(request)
        if failed is not None:
            return failed
        payload = json.loads(body) if body[:1] == b"{" else {}
        model = payload.get("model")
        if model is not None and model not in (self.models or [model]):
            return web.json_response({"error": {"message": f"The model `{model}` does not exist.",
                                                "type": "NotFoundError", "param": "model", "code": 404}}, status=404)
        answer: dict[str, Any] = {"backend": self.name, "model": model, "path": request.path,
                                  "usage": {"prompt_tokens": 5, "total_tokens": 5}}
        kv = payload.get("kv_transfer_params")
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            answer["kv_transfer_params"] = {"remote_engine_id": self.name, "remote_block_ids": [1]}
        return web.json_response(answer)

    async def transcribe(self, request: web.Request) -> web.Response:
        body, failed = await self._hit(request)
        if failed is not None:
            return failed
        return web.json_response({"backend": self.name, "sha256": hashlib.sha256(body).hexdigest(),
                                  "content_type": request.headers.get("Content-Type", "")})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        await self._hit(request)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f'event: delta\ndata: {{"backend": "{self.name}", "i": {i}}}\n\n'.encode())
        await resp.write_eof()
        return resp

    async def version(self, request: web.Request) -> web.Response:
        await self._hit(request)
        return web.json_response({"version": "0.0-test", "backend": self.name})

    async def stored_response(self, request: web.Request) -> web.Response:
        await self._hit(request)
        return web.json_response({"id": request.match_info["response_id"], "backend": self.name})


@dataclass
class Routed:
    """A router on one front, its state, and a client session for it."""

    url: str
    state: RouterState
    http: aiohttp.ClientSession
    fakes: dict[str, ModelBackend]

    def hits(self, name: str, path: str | None = None) -> list[Hit]:
        return [h for h in self.fakes[name].hits if path is None or h.path.startswith(path)]

    def all_hits(self, path: str | None = None) -> list[Hit]:
        return [h for name in self.fakes for h in self.hits(name, path)]


Serve = Callable[..., Awaitable[Routed]]


async def ask(routed: Routed, method: str, path: str, *, json_body: Any = None, data: bytes | None = None,
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request to the router: status, headers (case-insensitive names, lower-cased) and body."""
    async with routed.http.request(method, routed.url + path, json=json_body, data=data, headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=30)) as resp:
        body = await resp.read()
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, body



async def raw_ask(routed: Routed, method: str, target: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """One request written as is (no client normalises the target), ``Connection: close``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(routed.url.rsplit(":", 1)[1]))
    try:
        writer.write(f"{method} {target} HTTP/1.1\r\nHost: router\r\nConnection: close\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode("latin-1") + body)
        data = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, payload

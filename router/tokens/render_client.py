"""Remote render: the client's body to a render server, a ``GenerateRequest`` back (tokens mode).

``RemoteRenderer`` is the renderer of a pool whose ``render`` setting lists render servers (vLLM's
``vllm launch render MODEL``, or ``session-backend --role render``). It POSTs the client's body, bytes
unchanged, to ``/v1/chat/completions/render`` or ``/v1/completions/render`` of one render server and
decodes the answer with ``rendering.generate_request``; ``/tokenize`` and ``/detokenize`` go the same way.

The render servers are a ``BackendPool`` named ``render`` (``build_render_pool``): the app factory puts
it beside the engine pools, so the one ``HealthChecker`` checks them (``GET /health``), and ``/metrics``
(``session_router_backend_healthy{pool="render"}``, ``..._backend_in_flight``), ``/health`` and the admin
API list them as they list backends. What it does per call, with the engines' settings:

- choice: the available render server with the fewest calls in flight, rotating among equals;
- a render server's 2xx: decoded, and refused with vLLM's 400 when a prompt's token id is past the
  model's vocabulary (a render server passes a client's ids through unchecked, and such an id crashes
  a tokens-only vLLM engine); its 4xx: the client's error, relayed with its status and body unchanged
  (``RenderRejected``; vLLM's shape) -- both count as a good answer for health;
- no answer (connect error, timeout, broken HTTP) or a 5xx: recorded as a failure on that server
  (a connect error downs it at once, as for backends), then the next render server not tried yet, up
  to ``[upstream] retries`` more, within ``total_timeout_s``;
- nothing left to try: the last 5xx answer relayed as it came when there was one, else a 503
  (``NoRenderServerError``) saying what to check.

Render is a pure function of the body, so retrying it on another server is always safe.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec

from contract.errors import (
    ClientError,
    NoHealthyBackendError,
    SessionRouterError,
    UpstreamConnectError,
    UpstreamError,
)
from rendering.generate_request import GenerateRequest, decode_generate_request, decode_generate_requests
from rendering.vocabulary import check_vocabulary
from router.exchange import REQUEST_ID_HEADER
from router.health import HealthChecker
from router.membership import Backend, BackendPool
from router.metrics import RenderMetrics
from router.upstream import UpstreamPool, UpstreamTimeouts, render_headers, request_head

T = TypeVar("T")

POOL_RENDER = "render"
CHAT_RENDER_PATH = "/v1/chat/completions/render"
COMPLETIONS_RENDER_PATH = "/v1/completions/render"
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"

_JSON_HEADER = render_headers([("Content-Type", "application/json")])


class _RelayedAnswer(SessionRouterError):
    """An error answered to the client with a render server's own status and body, as they came."""

    def __init__(self, status: int, body: bytes, server: str) -> None:
        super().__init__(f"render server {server} answered {status}")
        self.status = status
        self._body = body

    def body(self) -> bytes:
        return self._body


class RenderRejected(_RelayedAnswer, ClientError):
    """A render server refused the request (its 4xx): relayed as it came (vLLM's error shape: the render
    server is vLLM or ours)."""


class RenderServerError(_RelayedAnswer):
    """Every render server tried answered 5xx: the last answer, relayed as it came."""


class RenderAnswerError(UpstreamError):
    """502: a render server answered 2xx with something that is not a ``GenerateRequest``."""

    reason = "protocol"
    retryable = False


class NoRenderServerError(NoHealthyBackendError):
    """503: no render server could be asked, or none answered."""


def build_render_pool(urls: Sequence[str]) -> BackendPool:
    """The render servers as a pool named ``render`` (names default to the URLs, as for backends)."""
    return BackendPool(POOL_RENDER, [Backend(url) for url in urls])


class RemoteRenderer:
    """Render through the render servers of ``pool`` (see the module docstring)."""

    def __init__(self, pool: BackendPool, *, upstream: UpstreamPool, health: HealthChecker,
                 metrics: RenderMetrics, retries: int, retry_backoff_s: float, total_timeout_s: float,
                 max_token_id: int) -> None:
        """``max_token_id``: the model's largest token id; a render whose ids go past it is refused
        (``rendering.checks.check_vocabulary``) before any engine sees it."""
        self.pool = pool
        self.max_token_id = max_token_id
        self.upstream = upstream
        self.health = health
        self.metrics = metrics
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.total_timeout_s = total_timeout_s
        self._turn = itertools.count()

    # ------------------------------------------------------------------ the renderer protocol
    async def render_chat(self, body: bytes, *, request_id: str) -> GenerateRequest:
        """One ``GenerateRequest`` for a ``/v1/chat/completions`` body; its ``request_id`` is ours."""
        answer = await self.call(CHAT_RENDER_PATH, body, request_id)
        request: GenerateRequest = self._decode(decode_generate_request, answer, CHAT_RENDER_PATH)
        check_vocabulary(request.token_ids, self.max_token_id)
        return msgspec.structs.replace(request, request_id=request_id)

    async def render_completions(self, body: bytes, *, request_id: str) -> list[GenerateRequest]:
        """One ``GenerateRequest`` per prompt of a ``/v1/completions`` body; ids are ours, numbered
        ``{request_id}-{i}`` when there are several (as vLLM numbers them)."""
        answer = await self.call(COMPLETIONS_RENDER_PATH, body, request_id)
        requests: list[GenerateRequest] = self._decode(decode_generate_requests, answer, COMPLETIONS_RENDER_PATH)
        for request in requests:
            check_vocabulary(request.token_ids, self.max_token_id)
        if len(requests) == 1:
            return [msgspec.structs.replace(requests[0], request_id=request_id)]
        return [msgspec.structs.replace(request, request_id=f"{request_id}-{i}") for i, request in enumerate(requests)]

    async def tokenize(self, body: bytes, *, request_id: str) -> bytes:
        """The render server's ``/tokenize`` answer (vLLM's shape), bytes as they came."""
        return await self.call(TOKENIZE_PATH, body, request_id)

    async def detokenize(self, body: bytes, *, request_id: str) -> bytes:
        """The render server's ``/detokenize`` answer, bytes as they came."""
        return await self.call(DETOKENIZE_PATH, body, request_id)

    # ------------------------------------------------------------------ one call, with retries
    async def call(self, path: str, body: bytes, request_id: str) -> bytes:
        """POST ``body`` to ``path`` of a render server and return its 2xx body. Raises
        ``RenderRejected`` (its 4xx), ``RenderServerError`` (5xx from the last one tried) or
        ``NoRenderServerError`` (none available, or none answered)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.total_timeout_s
        headers = _JSON_HEADER + render_headers([(REQUEST_ID_HEADER, request_id)])
        tried: set[str] = set()
        failures: list[str] = []
        last_5xx: RenderServerError | None = None
        timeouts: UpstreamTimeouts | None = None
        while True:
            server = self._choose(tried)
            if server is None:
                break
            tried.add(server.url)
            head = request_head("POST", path, f"{server.host}:{server.port}", headers, len(body))
            sent = loop.time()
            server.admit()
            try:
                upstream = await self.upstream.request(server.host, server.port, head, body, timeouts=timeouts)
                try:
                    answer = await upstream.read()
                finally:
                    upstream.close()
            except UpstreamError as exc:
                self._failed(server, exc.reason, connect_error=isinstance(exc, UpstreamConnectError))
                failures.append(f"{server.name}: {exc.message}")
            else:
                status = upstream.status
                self.metrics.remote_done(server.name, status, loop.time() - sent)
                if status < 500:
                    self.health.record_success(server)
                    if status < 300:
                        return answer
                    raise RenderRejected(status, answer, server.name)
                self._failed(server, f"status_{status}", connect_error=False)
                failures.append(f"{server.name}: answered {status}")
                last_5xx = RenderServerError(status, answer, server.name)
            finally:
                server.release()
            if len(tried) > self.retries:
                break
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            await asyncio.sleep(min(self.retry_backoff_s * (0.5 + random.random()), remaining))
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            t = self.upstream.timeouts
            timeouts = UpstreamTimeouts(min(t.connect_s, remaining), min(t.first_byte_s, remaining), remaining)
        if last_5xx is not None:
            raise last_5xx
        raise self._unavailable(path, failures, loop.time() - started >= self.total_timeout_s)

    def _choose(self, tried: set[str]) -> Backend | None:
        """The available render server not tried yet with the fewest calls in flight; equals rotate."""
        members = self.pool.members
        if not members:
            return None
        start = next(self._turn) % len(members)
        best: Backend | None = None
        for server in itertools.chain(members[start:], members[:start]):
            if server.available and server.url not in tried and (best is None or server.in_flight < best.in_flight):
                best = server
        return best

    def _failed(self, server: Backend, reason: str, *, connect_error: bool) -> None:
        self.metrics.remote_failed(server.name, reason)
        self.health.record_failure(server, connect_error=connect_error)

    def _unavailable(self, path: str, failures: list[str], out_of_time: bool) -> NoRenderServerError:
        total = len(self.pool.members)
        if not failures:
            where = (f"none of the {total} render server(s) is healthy" if total
                     else "the render pool has no render servers")
        else:
            where = "no render server answered (" + "; ".join(failures) + ")"
            if out_of_time:
                where += f" within total_timeout_s ({self.total_timeout_s:g} s)"
        return NoRenderServerError(
            f"cannot render the request ({path}): {where}. Check that the render servers of the [tokens] "
            "render setting are running and reachable (the router's /health lists the render pool), "
            "or render in the router with render = \"local\"; then retry."
        )

    @staticmethod
    def _decode(decode: Callable[[bytes], T], answer: bytes, path: str) -> T:
        try:
            return decode(answer)
        except msgspec.DecodeError as exc:
            raise RenderAnswerError(
                f"a render server's {path} answer is not a GenerateRequest this router reads ({exc}); "
                "check that the render servers serve the same model and vLLM version as the engines"
            ) from None


__all__ = [
    "POOL_RENDER",
    "NoRenderServerError",
    "RemoteRenderer",
    "RenderAnswerError",
    "RenderRejected",
    "RenderServerError",
    "build_render_pool",
]

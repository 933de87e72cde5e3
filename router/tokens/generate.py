"""The engine leg of tokens mode: place the rendered request, POST it to ``/inference/v1/generate``,
and turn what comes back into the client's answer through a derenderer.

One ``EngineCall`` per client request. It places and sends exactly as text mode does
(``Proxy.place`` / ``Proxy.send``: session placement, retries before any byte reached the client,
timeouts, health and metrics; in P/D mode ``PDHandoff.prefill`` runs the prefill leg on the same
path first, and ``release`` frees its blocks when the decode leg fails), then reads the engine's
answer one of three ways (``Answer`` says which):

- client stream: the engine streams; every ``data:`` event goes through ``Derenderer.chunk`` and what
  it returns is written to the client; ``finish`` adds the usage event (when asked) and ``[DONE]``;
- client non-stream without stop strings: the engine answers whole; ``Derenderer.whole``;
- client non-stream with stop strings: the engine streams anyway, so that the router ends it at the
  stop string instead of after ``max_tokens`` (vLLM's engine stops there itself; a ``--tokens-only``
  one cannot); ``collect`` takes the events and ``collected`` answers them whole.

When the derenderer says stop strings ended every choice (``stopped``), or the client went away, the
engine request is aborted (``EngineAborts``) and the upstream connection closed. An engine error
status is relayed as the engine sent it (vLLM's shape); an error event mid-stream is relayed, then
``[DONE]``; an engine that breaks off mid-stream ends the client's stream with an error event and
``[DONE]``, as text mode does. The answer's usage is accounted to the session.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from msgspec import UNSET

from contract.errors import UpstreamError
from rendering.generate_response import (
    STREAM_DONE,
    GenerateResponse,
    GenerateStreamChunk,
    decode_generate_response,
    decode_stream_chunk,
)
from router.attempt import Attempt
from router.bodies import OpenFields
from router.exchange import REQUEST_ID_HEADER, ResponseWriter
from router.membership import Backend
from router.pd import Handoff
from router.proxy import DECISION_HEADER, JSON_CONTENT_TYPE, Proxy, decision_value, event_boundary
from router.routes import ROUTES, Route
from router.tokens.engine import GENERATE_PATH, EngineAborts, engine_headers, engine_request_id
from router.tokens.sse import SSEEvents
from router.upstream import UpstreamResponse
from router.usage import Usage

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
#: the P/D hand-off reads the legs' body as a generate request (``sampling_params.max_tokens = 1``)
GENERATE_ROUTE: Route = next(r for r in ROUTES if r.kind == "generate")

#: how the client is answered (see the module docstring)
STREAM = "stream"
WHOLE = "whole"
COLLECT = "collect"


class Derenderer(Protocol):
    """What the engine leg needs of ``rendering.derender`` (``router.tokens.answers`` adapts it)."""

    @property
    def stopped(self) -> bool:
        """Stop strings ended every choice: the engine's work is no longer wanted."""
        ...

    @property
    def failed(self) -> bool:
        """The engine sent an error event."""
        ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...

    def whole(self, response: GenerateResponse) -> bytes: ...

    def chunk(self, chunk: GenerateStreamChunk) -> bytes: ...

    def running(self, datas: list[bytes]) -> tuple[bytes, int]:
        """``chunk`` of the leading events of ``datas`` that are a stream's bulk, straight from their JSON:
        the bytes, and how many events (the rest: decode each and call ``chunk``)."""
        ...

    def finish(self) -> bytes: ...

    def collect(self, chunk: GenerateStreamChunk) -> None: ...

    def collected(self) -> bytes: ...


class EngineCall:
    """One client request's engine leg (see the module's docstring)."""

    __slots__ = ("proxy", "aborts", "writer", "route", "fields", "attempt", "derender", "answer", "stop_strings",
                 "headers", "cached_tokens")

    def __init__(self, proxy: Proxy, aborts: EngineAborts, writer: ResponseWriter, route: Route,
                 fields: OpenFields | None, attempt: Attempt, derender: Derenderer, answer: str, *,
                 stop_strings: bool) -> None:
        """``answer``: ``STREAM``, ``WHOLE`` or ``COLLECT``; ``stop_strings``: the request has some (only
        then can the derenderer end it early, so only then is that asked after each event)."""
        self.proxy = proxy
        self.aborts = aborts
        self.writer = writer
        self.route = route
        self.fields = fields
        self.attempt = attempt
        self.derender = derender
        self.answer = answer
        self.stop_strings = stop_strings
        self.headers = engine_headers(attempt.request_id, attempt.session_id)
        self.cached_tokens = 0

    def client_headers(self, content_type: str) -> list[tuple[str, str]]:
        attempt = self.attempt
        headers = [("Content-Type", content_type), (REQUEST_ID_HEADER, attempt.request_id)]
        if attempt.session_id is not None:
            headers.append((self.proxy.session_header, attempt.session_id))
        if self.proxy.decision_header and attempt.placement is not None:
            headers.append((DECISION_HEADER, decision_value(attempt.placement)))
        return headers

    async def run(self, payload: bytes) -> None:
        """Place, send ``payload`` (the encoded ``GenerateRequest``) and answer the client."""
        proxy = self.proxy
        attempt = self.attempt
        pool = attempt.pool or proxy.pool
        first = None
        handoff: Handoff | None = None
        if proxy.pd is not None:
            first = proxy.place(pool, attempt, self.fields, frozenset())  # decode first, then prefill
            handoff = await proxy.pd.prefill(GENERATE_ROUTE, payload, attempt, self.headers, GENERATE_PATH)
            payload = handoff.body
        completed = False
        try:
            try:
                upstream, backend = await proxy.send(pool, self.route, "POST", GENERATE_PATH, self.headers,
                                                     payload, self.fields, attempt, first)
            except asyncio.CancelledError:
                # the client left while the engine worked on it (a non-stream answer's head comes last)
                if attempt.backend is not None:
                    self.aborts.abort(attempt.backend, [engine_request_id(attempt.request_id)], self.headers)
                raise
            try:
                if upstream.status != 200:
                    await self._relay_error(upstream)
                elif self.answer == WHOLE:
                    await self._whole(upstream, backend)
                else:
                    await self._stream(upstream, backend)
            finally:
                upstream.close()
                backend.release()
            completed = 200 <= attempt.status < 300
        finally:
            if handoff is not None and not completed and proxy.pd is not None:
                proxy.pd.release(handoff)

    # ------------------------------------------------------------------ the ways to read
    async def _relay_error(self, upstream: UpstreamResponse) -> None:
        """The engine refused the request (e.g. 400 for a token id out of vocabulary): its answer as sent."""
        data = await upstream.read()
        self.attempt.status = upstream.status
        self.proxy.account_error(self.attempt)
        self.writer.respond(upstream.status, self.client_headers(upstream.content_type or JSON_CONTENT_TYPE), data)

    async def _whole(self, upstream: UpstreamResponse, backend: Backend) -> None:
        try:
            data = await upstream.read()
        except asyncio.CancelledError:  # the client left while the engine generates: end its work
            self.aborts.abort(backend, [engine_request_id(self.attempt.request_id)], self.headers)
            raise
        response = decode_generate_response(data)
        self._cached(response)
        body = self.derender.whole(response)
        self.attempt.status = 200
        self._account()
        self.writer.respond(200, self.client_headers(JSON_CONTENT_TYPE), body)

    async def _stream(self, upstream: UpstreamResponse, backend: Backend) -> None:
        """Read the engine's stream: written derendered (``STREAM``) or collected and answered whole
        (``COLLECT``). Aborts the engine request unless it ran to its end or broke off."""
        attempt = self.attempt
        derender = self.derender
        writer = self.writer
        stream = self.answer == STREAM
        stop_strings = self.stop_strings
        stopped = False
        events = SSEEvents()
        ended = False  # the engine sent [DONE] (or an error event): nothing to abort
        broke = False  # the engine's stream broke off: nothing to abort either
        tail = b"\n\n"
        last = b""  # what the last read added, held for the stream's end
        if stream:
            await writer.start(200, self.client_headers(SSE_CONTENT_TYPE))
        attempt.status = 200
        running = derender.running if stream else None
        try:
            async for raw in upstream:
                outs: list[bytes] = []  # what the events of this read add up to: one write
                datas = events.feed(raw)
                if running is not None and datas:  # the bulk of a stream: running steps, decoded lean
                    out, taken = running(datas)
                    if taken:
                        outs.append(out)
                        datas = datas[taken:]
                for data in datas:
                    if data == STREAM_DONE:
                        ended = True
                        break
                    chunk = decode_stream_chunk(data)
                    if chunk.usage is not None:
                        self._cached(chunk)
                    if stream:
                        out = derender.chunk(chunk)
                        if out:
                            outs.append(out)
                    else:
                        derender.collect(chunk)
                    if derender.failed:
                        ended = True
                        break
                    if stop_strings and derender.stopped:
                        stopped = True
                        break
                if outs:
                    tail = outs[0] if len(outs) == 1 else b"".join(outs)
                    if ended or stopped:
                        last = tail  # the stream's last events: sent with its end, in one write
                    else:
                        await writer.write(tail)
                if ended or stopped:
                    break
            else:
                broke = True  # the stream ended without [DONE]: the engine's request is over
        except UpstreamError as exc:
            broke = True
            await self._broke_off(exc, backend, stream, tail)
            return
        finally:
            if not ended and not broke:
                # stop strings ended every choice, or the client went away (cancelled)
                self.aborts.abort(backend, [engine_request_id(attempt.request_id)], self.headers)
        await self._end(stream, last)

    async def _broke_off(self, exc: UpstreamError, backend: Backend, stream: bool, tail: bytes) -> None:
        """The engine's stream broke off with ``exc``: raised again while nothing reached the client (the
        proxy answers it), else written as the client stream's last event (after ``tail``, the last write)."""
        self.proxy.record_failure(backend, exc.reason, connect_error=False)
        if not stream:
            raise exc
        self.attempt.status = exc.status
        self.proxy.account_error(self.attempt)
        await self.writer.end(event_boundary(tail) + b"data: " + exc.body() + b"\n\ndata: [DONE]\n\n")

    async def _end(self, stream: bool, last: bytes = b"") -> None:
        """The engine's stream is read: its usage accounted (an engine error event: counted as an error),
        then the collected answer, or the client stream's last events (``last``, what the last read added,
        goes first) and its end, in one write."""
        derender = self.derender
        if derender.failed:
            self.attempt.status = 502
            self.proxy.account_error(self.attempt)
        else:
            self._account()
        if not stream:
            body = derender.collected()  # an engine error event: UpstreamProtocolError, answered by the proxy
            self.writer.respond(200, self.client_headers(JSON_CONTENT_TYPE), body)
            return
        await self.writer.end(last + derender.finish())

    # ------------------------------------------------------------------ usage
    def _cached(self, answer: GenerateResponse | GenerateStreamChunk) -> None:
        usage = answer.usage
        if usage is not None:
            details = usage.prompt_tokens_details
            if details is not None and details is not UNSET:
                self.cached_tokens = details.cached_tokens

    def _account(self) -> None:
        """The answer's usage to the session, as the client's answer counts it."""
        derender = self.derender
        self.proxy.account(self.attempt, Usage(prompt_tokens=derender.prompt_tokens,
                                               completion_tokens=derender.completion_tokens,
                                               cached_tokens=self.cached_tokens))

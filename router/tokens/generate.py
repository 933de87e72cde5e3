"""The engine leg of tokens mode: place the rendered request, POST it to ``/inference/v1/generate``,
and turn what comes back into the client's answer through a derenderer.

One ``EngineCall`` per client request. It places and sends exactly as text mode does
(``Proxy.place`` / ``Proxy.send``: session placement, retries before any byte reached the client,
timeouts, health and metrics; in P/D mode ``PDHandoff.prefill`` runs the prefill leg on the same
route first), then reads the engine's answer one of three ways:

- client stream: the engine streams; every ``data:`` event goes through ``Derenderer.chunk`` and
  what it returns is written to the client; ``finish`` adds the usage chunk (when asked) and
  ``[DONE]``;
- client non-stream without stop strings: the engine answers whole; ``Derenderer.whole``;
- client non-stream with stop strings: the engine streams anyway (so that the router can end it at
  the stop string instead of after ``max_tokens``), the steps are gathered into one
  ``GenerateResponse`` and answered whole.

When every choice ended on a stop string (``Derenderer.stopped``), or the client went away, the engine
request is aborted (``EngineAborts``) and the upstream connection closed. An engine error status is
relayed as the engine sent it (vLLM's shape); an engine that breaks off mid-stream ends the client's
stream with an error event and ``[DONE]``, as text mode does. Usage is accounted to the session.
"""

from __future__ import annotations

from typing import Any, Protocol

from msgspec import UNSET

from contract.errors import UpstreamError
from rendering.generate_response import (
    STREAM_DONE,
    GenerateChoice,
    GenerateLogProbs,
    GenerateResponse,
    GenerateStreamChunk,
    GenerateUsage,
    PromptTokensDetails,
    decode_generate_response,
    decode_stream_chunk,
)
from router.attempt import Attempt
from router.bodies import OpenFields
from router.exchange import REQUEST_ID_HEADER, ResponseWriter
from router.membership import Backend
from router.pd import Handoff
from router.proxy import JSON_CONTENT_TYPE, Proxy, event_boundary
from router.routes import ROUTES, Route
from router.tokens.engine import GENERATE_PATH, EngineAborts, engine_headers, engine_request_id
from router.tokens.sse import SSEEvents
from router.upstream import UpstreamResponse
from router.usage import Usage

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
#: the P/D hand-off reads the leg's body as a generate request (sampling_params.max_tokens = 1)
GENERATE_ROUTE: Route = next(r for r in ROUTES if r.kind == "generate")


class Derenderer(Protocol):
    """What ``rendering.derender.ChatDerender`` / ``CompletionDerender`` offer the engine leg."""

    @property
    def stopped(self) -> bool:
        """A stop string ended every choice: the engine's work is no longer wanted."""
        ...

    def whole(self, response: GenerateResponse) -> bytes: ...

    def chunk(self, chunk: GenerateStreamChunk) -> bytes: ...

    def finish(self) -> bytes: ...

    @property
    def completion_tokens(self) -> int:
        """Output ids seen so far (all choices)."""
        ...


class EngineCall:
    """One client request's engine leg (see the module's docstring)."""

    __slots__ = ("proxy", "aborts", "writer", "route", "fields", "attempt", "derender", "watch",
                 "client_stream", "headers", "prompt_len", "prompt_tokens", "completion_tokens", "cached_tokens")

    def __init__(self, proxy: Proxy, aborts: EngineAborts, writer: ResponseWriter, route: Route,
                 fields: OpenFields | None, attempt: Attempt, derender: Derenderer, *, client_stream: bool,
                 prompt_len: int, watch: Derenderer | None = None) -> None:
        """``derender``: answers the client (stream or whole); ``watch``: for a client non-stream
        request whose engine leg streams (stop strings), a stream derenderer that tells when they
        ended every choice; ``prompt_len``: the prompt's token count (usage when the engine sends
        none)."""
        self.proxy = proxy
        self.aborts = aborts
        self.writer = writer
        self.route = route
        self.fields = fields
        self.attempt = attempt
        self.derender = derender
        self.watch = watch
        self.client_stream = client_stream
        self.headers = engine_headers(attempt.request_id, attempt.session_id)
        self.prompt_len = prompt_len
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0

    def client_headers(self, content_type: str) -> list[tuple[str, str]]:
        attempt = self.attempt
        headers = [("Content-Type", content_type), (REQUEST_ID_HEADER, attempt.request_id)]
        if attempt.session_id is not None:
            headers.append((self.proxy.session_header, attempt.session_id))
        return headers

    async def run(self, payload: bytes, *, engine_stream: bool) -> None:
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
            upstream, backend = await proxy.send(pool, self.route, "POST", GENERATE_PATH, self.headers, payload,
                                                 self.fields, attempt, first)
            try:
                if upstream.status != 200:
                    await self._relay_error(upstream)
                elif not engine_stream:
                    await self._whole(upstream)
                else:
                    await self._stream(upstream, backend)
            finally:
                upstream.close()
                backend.in_flight -= 1
            completed = 200 <= attempt.status < 300
        finally:
            if handoff is not None and not completed and proxy.pd is not None:
                proxy.pd.release(handoff)

    # ------------------------------------------------------------------ the three ways to read
    async def _relay_error(self, upstream: UpstreamResponse) -> None:
        """The engine refused the request (e.g. 400 for token ids out of range): its answer as sent."""
        data = await upstream.read()
        self.attempt.status = upstream.status
        self.proxy.account_error(self.attempt)
        content_type = upstream.content_type or JSON_CONTENT_TYPE
        self.writer.respond(upstream.status, self.client_headers(content_type), data)

    async def _whole(self, upstream: UpstreamResponse) -> None:
        response = decode_generate_response(await upstream.read())
        self._count(response.usage)
        body = self.derender.whole(response)
        self.attempt.status = 200
        self._account()
        self.writer.respond(200, self.client_headers(JSON_CONTENT_TYPE), body)

    async def _stream(self, upstream: UpstreamResponse, backend: Backend) -> None:
        """Read the engine's stream; write it derendered (client stream) or gather it and answer
        whole (client non-stream with stop strings). Aborts the engine request unless it ran to its
        end or broke off."""
        attempt = self.attempt
        derender = self.derender
        writer = self.writer
        # client non-stream: the steps are gathered; ``watch`` (a stream derenderer) only tells when
        # stop strings ended every choice
        gathered = None if self.client_stream else _Gathered()
        watch = self.watch if gathered is not None else derender
        assert watch is not None
        events = SSEEvents()
        ended = False  # the engine sent [DONE]: nothing to abort
        broke = False  # the engine broke off or sent an error: nothing to abort either
        tail = b"\n\n"
        if gathered is None:
            await writer.start(200, self.client_headers(SSE_CONTENT_TYPE))
        attempt.status = 200
        try:
            async for raw in upstream:
                for data in events.feed(raw):
                    if data == STREAM_DONE:
                        ended = True
                        break
                    chunk = decode_stream_chunk(data)
                    if chunk.error is not UNSET:
                        broke = True
                        await self._engine_error_event(data, tail, gathered)
                        return
                    self._count(chunk.usage)
                    out = watch.chunk(chunk)
                    if gathered is not None:
                        gathered.add(chunk)
                    elif out:
                        await writer.write(out)
                        tail = out
                    if watch.stopped:
                        break
                if ended or watch.stopped:
                    break
            else:
                broke = True  # the stream ended without [DONE]: the engine's request is over
        except UpstreamError as exc:
            broke = True
            self.proxy.record_failure(backend, exc.reason, connect_error=False)
            if gathered is not None:
                raise  # nothing reached the client: the proxy answers the error
            attempt.status = exc.status
            self.proxy.account_error(attempt)
            await writer.write(event_boundary(tail) + b"data: " + exc.body() + b"\n\ndata: [DONE]\n\n")
            await writer.end()
            return
        finally:
            if not ended and not broke:
                # every choice stopped on a stop string, or the client went away (cancelled)
                self.aborts.abort(backend, [engine_request_id(attempt.request_id)], self.headers)
        if gathered is not None:
            body = derender.whole(gathered.response(self.usage_struct()))
            self._account()
            writer.respond(200, self.client_headers(JSON_CONTENT_TYPE), body)
            return
        self._account()
        await writer.write(derender.finish())
        await writer.end()

    async def _engine_error_event(self, data: bytes, tail: bytes, gathered: _Gathered | None) -> None:
        """The engine sent ``data: {"error": ...}``: relayed as the stream's last event (then
        ``[DONE]``), or as the whole answer's error when nothing was sent yet."""
        attempt = self.attempt
        chunk_error = decode_stream_chunk(data).error
        status = getattr(chunk_error, "code", None) or 500
        attempt.status = status if isinstance(status, int) and 400 <= status < 600 else 500
        self.proxy.account_error(attempt)
        if gathered is not None:
            self.writer.respond(attempt.status, self.client_headers(JSON_CONTENT_TYPE), data)
            return
        await self.writer.write(event_boundary(tail) + b"data: " + data + b"\n\ndata: [DONE]\n\n")
        await self.writer.end()

    # ------------------------------------------------------------------ usage
    def _count(self, usage: GenerateUsage | None) -> None:
        if usage is None:
            return
        self.prompt_tokens = usage.prompt_tokens
        self.completion_tokens = usage.completion_tokens
        details = usage.prompt_tokens_details
        if details is not None and details is not UNSET:
            self.cached_tokens = details.cached_tokens

    def usage_struct(self) -> GenerateUsage | None:
        if not self.prompt_tokens and not self.completion_tokens:
            return None
        return GenerateUsage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                             total_tokens=self.prompt_tokens + self.completion_tokens,
                             prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens))

    def _account(self) -> None:
        """The answer's usage to the session: the engine's counts (its last usage), else the prompt's
        length and the ids the derenderer saw."""
        prompt = self.prompt_tokens or self.prompt_len
        completion = self.completion_tokens or self.derender.completion_tokens
        self.proxy.account(self.attempt, Usage(prompt_tokens=prompt, completion_tokens=completion,
                                               cached_tokens=self.cached_tokens))


class _Gathered:
    """A generate stream's steps gathered into the non-stream answer they add up to."""

    __slots__ = ("request_id", "choices", "kv_transfer_params")

    def __init__(self) -> None:
        self.request_id = ""
        self.choices: dict[int, GenerateChoice] = {}
        self.kv_transfer_params: dict[str, Any] | None = None

    def add(self, chunk: GenerateStreamChunk) -> None:
        if chunk.request_id is not UNSET:
            self.request_id = chunk.request_id
        if chunk.kv_transfer_params is not UNSET and chunk.kv_transfer_params is not None:
            self.kv_transfer_params = chunk.kv_transfer_params
        for step in chunk.choices:
            choice = self.choices.get(step.index)
            if choice is None:
                choice = self.choices[step.index] = GenerateChoice(index=step.index, finish_reason=None,
                                                                   token_ids=[])
            if step.token_ids:
                assert choice.token_ids is not None
                choice.token_ids.extend(step.token_ids)
            if step.finish_reason is not None:
                choice.finish_reason = step.finish_reason
                choice.stop_reason = None if step.stop_reason is UNSET else step.stop_reason
            if step.logprobs is not None and step.logprobs.content:
                if choice.logprobs is None or choice.logprobs.content is None:
                    choice.logprobs = GenerateLogProbs(content=[])
                assert choice.logprobs.content is not None
                choice.logprobs.content.extend(step.logprobs.content)

    def response(self, usage: GenerateUsage | None) -> GenerateResponse:
        choices = [self.choices[index] for index in sorted(self.choices)]
        return GenerateResponse(request_id=self.request_id, usage=usage, choices=choices,
                                kv_transfer_params=self.kv_transfer_params)

"""A ``/v1/completions`` request with several prompts: one engine request per prompt, one answer.

vLLM serves a list of prompts as one engine request each, numbered ``{request id}-{i}``, and answers
with their choices in prompt order (``index = prompt * n + choice``). ``FanOutCall`` does the same
over the engine leg of tokens mode (``router.tokens.generate.EngineCall``): every prompt's
``GenerateRequest`` is placed and sent like a single one (with ``X-Request-Id: <id>-<i>``, so the
engine's ids are ``generate-tokens-<id>-<i>``; the P/D hand-off per prompt in P/D mode), then

- whole answers: read and derendered together (``CompletionDerender.whole``);
- streams: each prompt's engine stream is read by its own task into a small bounded queue (so a slow
  client slows the engines' sockets down, as for one stream), and the events are derendered and
  written in arrival order with their prompt's index; a non-stream client with stop strings gets the
  collected whole answer.

An engine that refuses one prompt (an error status) answers the request with that error and the
other prompts' engine requests are aborted; a client that leaves, or stop strings that end every
choice of every prompt, abort the prompts' engine requests still running.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from contract.errors import UpstreamError
from rendering.generate_response import STREAM_DONE, decode_generate_response, decode_stream_chunk
from router.membership import Backend
from router.pd import Handoff
from router.proxy import JSON_CONTENT_TYPE
from router.tokens.answers import CompletionAnswer
from router.tokens.engine import GENERATE_PATH, engine_headers, engine_request_id
from router.tokens.generate import GENERATE_ROUTE, SSE_CONTENT_TYPE, STREAM, WHOLE, EngineCall
from router.tokens.sse import SSEEvents
from router.upstream import UpstreamResponse

#: events read ahead per prompt before its reader waits for the client
QUEUE_PER_PROMPT = 8


@dataclass(eq=False)
class _Leg:
    """One prompt's engine request."""

    index: int
    payload: bytes
    request_id: str
    headers: str
    upstream: UpstreamResponse | None = None
    backend: Backend | None = None
    #: the engine placement chose (the one still waiting for the answer's head, when cancelled)
    placed: Backend | None = None
    handoff: Handoff | None = None
    #: the engine's stream ended ([DONE], an error event, or broke off): nothing to abort
    over: bool = False
    reader: asyncio.Task[None] | None = field(default=None, repr=False)


class FanOutCall(EngineCall):
    """The engine leg of a completions request with several prompts (see the module docstring)."""

    __slots__ = ()

    async def run_all(self, payloads: list[bytes]) -> None:
        """Send one ``GenerateRequest`` per prompt (``payloads``, in prompt order); answer the client."""
        attempt = self.attempt
        legs = [_Leg(i, payload, f"{attempt.request_id}-{i}", engine_headers(f"{attempt.request_id}-{i}",
                                                                            attempt.session_id))
                for i, payload in enumerate(payloads)]
        answered = False
        try:
            opened = await asyncio.gather(*(self._open(leg) for leg in legs), return_exceptions=True)
            failure = next((r for r in opened if isinstance(r, BaseException)), None)
            if failure is not None:
                raise failure
            refused = next((leg for leg in legs if leg.upstream is not None and leg.upstream.status != 200), None)
            if refused is not None:
                assert refused.upstream is not None
                refused.over = True
                await self._relay_error(refused.upstream)
            elif self.answer == WHOLE:
                await self._whole_all(legs)
            else:
                await self._stream_all(legs)
            answered = 200 <= attempt.status < 300
        finally:
            self._close(legs, answered)

    async def _open(self, leg: _Leg) -> None:
        proxy = self.proxy
        attempt = self.attempt
        pool = attempt.pool or proxy.pool
        payload = leg.payload
        # placed here (not in send) so that the leg knows its engine before the answer's head arrives
        first = proxy.place(pool, attempt, self.fields, frozenset())
        leg.placed = first.backend
        if proxy.pd is not None:
            leg.handoff = await proxy.pd.prefill(GENERATE_ROUTE, payload, attempt, leg.headers, GENERATE_PATH)
            payload = leg.handoff.body
        leg.upstream, leg.backend = await proxy.send(pool, self.route, "POST", GENERATE_PATH, leg.headers, payload,
                                                     self.fields, attempt, first)

    def _close(self, legs: list[_Leg], answered: bool) -> None:
        """Stop the readers, abort what still runs, close the connections, release P/D holds."""
        proxy = self.proxy
        for leg in legs:
            if leg.reader is not None:
                leg.reader.cancel()
            if leg.upstream is not None and leg.backend is not None:
                if not leg.over:
                    self.aborts.abort(leg.backend, [engine_request_id(leg.request_id)], leg.headers)
                leg.upstream.close()
                leg.backend.release()
            elif leg.placed is not None and not answered:  # sent, no answer yet (cancelled, or another failed)
                self.aborts.abort(leg.placed, [engine_request_id(leg.request_id)], leg.headers)
            if leg.handoff is not None and not answered and proxy.pd is not None:
                proxy.pd.release(leg.handoff)

    async def _whole_all(self, legs: list[_Leg]) -> None:
        bodies = await asyncio.gather(*(leg.upstream.read() for leg in legs if leg.upstream is not None))
        for leg in legs:
            leg.over = True
        responses = [decode_generate_response(body) for body in bodies]
        for response in responses:
            self._cached(response)
        derender = self.derender
        assert isinstance(derender, CompletionAnswer)
        body = derender.derender.whole(responses)
        self.attempt.status = 200
        self._account()
        self.writer.respond(200, self.client_headers(JSON_CONTENT_TYPE), body)

    async def _stream_all(self, legs: list[_Leg]) -> None:
        attempt = self.attempt
        derender = self.derender
        assert isinstance(derender, CompletionAnswer)
        writer = self.writer
        stream = self.answer == STREAM
        queue: asyncio.Queue[tuple[_Leg, bytes | UpstreamError | None]] = asyncio.Queue(
            QUEUE_PER_PROMPT * len(legs))
        for leg in legs:
            leg.reader = asyncio.get_running_loop().create_task(self._read(leg, queue))
        if stream:
            await writer.start(200, self.client_headers(SSE_CONTENT_TYPE))
        attempt.status = 200
        running = len(legs)
        tail = b"\n\n"
        while running:
            leg, item = await queue.get()
            if item is None or isinstance(item, UpstreamError) or item == STREAM_DONE:
                leg.over = True
                running -= 1
                if isinstance(item, UpstreamError):
                    assert leg.backend is not None
                    await self._broke_off(item, leg.backend, stream, tail)
                    return
                continue
            chunk = decode_stream_chunk(item)
            self._cached(chunk)
            if stream:
                out = derender.chunk(chunk, leg.index)
                if out:
                    await writer.write(out)
                    tail = out
            else:
                derender.collect(chunk, leg.index)
            if derender.failed:
                leg.over = True
                break
            if self.stop_strings and derender.stopped:
                break
        await self._end(stream)

    @staticmethod
    async def _read(leg: _Leg, queue: asyncio.Queue[tuple[_Leg, bytes | UpstreamError | None]]) -> None:
        """One prompt's engine stream into ``queue``: each event's data, then ``None`` (or the error)."""
        assert leg.upstream is not None
        events = SSEEvents()
        try:
            async for raw in leg.upstream:
                for data in events.feed(raw):
                    await queue.put((leg, data))
                    if data == STREAM_DONE:
                        return
        except UpstreamError as exc:
            await queue.put((leg, exc))
            return
        await queue.put((leg, None))

"""Driving one engine request from a handler: to the end (non-stream) or frame by frame (SSE).

Both paths close the engine stream in ``finally``: a client that disconnects (the handler is
cancelled, a write fails, or the transport is gone when an output arrives) aborts the engine
request at once, and so does a request whose choices all ended on a stop string (the run's own
stop strings, or the derenderer's: ``stopped``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from typing import cast

import msgspec
from aiohttp import web

from backends.engine.errors import EngineError
from backends.engine.outputs import RequestOutput
from backends.engine.request import EngineCoreRequest
from backends.frontend import Frontend
from backends.generation_run import Choice, GenerationRun
from backends.http_errors import ClientDisconnected, http_error
from backends.sse import DONE, data_frame
from contract.errors import SessionRouterError, error_body

log = logging.getLogger(__name__)


def _start(fe: Frontend, ecr: EngineCoreRequest) -> AsyncGenerator[RequestOutput, None]:
    # AsyncEngine.generate is an async generator (it has aclose), though annotated AsyncIterator
    return cast(AsyncGenerator[RequestOutput, None], fe.engine.generate(ecr))


#: renders the frames of one engine step: (output, choices it moved) -> bytes to send (may be b"")
StepRenderer = Callable[[RequestOutput, list[Choice]], bytes]
#: renders what follows the last step (usage chunk, completion event, [DONE], ...)
TailRenderer = Callable[[], bytes]
#: whether stop strings applied outside the run ended every choice (the engine request is then aborted)
StopCheck = Callable[[], bool]
#: takes one engine step of a non-streaming answer: (output, choices it moved)
StepTaker = Callable[[RequestOutput, list[Choice]], None]


async def run_to_end(request: web.Request, fe: Frontend, ecr: EngineCoreRequest, run: GenerationRun,
                     take: StepTaker | None = None, stopped: StopCheck | None = None) -> None:
    """Consume the engine's outputs until the request finishes (non-streaming responses); ``take``
    sees every step (a derenderer collecting a whole answer), ``stopped`` may end it early."""
    gen = _start(fe, ecr)
    fe.in_flight += 1
    try:
        async for out in gen:
            moved = run.apply(out)
            if take is not None:
                take(out, moved)
            if (run.finished or (stopped is not None and stopped())) and not out.finished:
                fe.engine.abort(ecr.request_id, "stop")  # every choice ended on a stop string
                break
            if request.transport is None:
                raise ClientDisconnected
    finally:
        fe.in_flight -= 1
        await gen.aclose()
        _count_prompt(fe, run)


def _count_prompt(fe: Frontend, run: GenerationRun) -> None:
    """Prompt tokens by source (local compute, local cache, remote prefill) once per request."""
    kv = fe.kv
    if kv is not None:
        kv.count_prompt(run.prompt_tokens, run.cached_tokens, run.remote)


async def stream_run(
    resp: web.StreamResponse,
    fe: Frontend,
    ecr: EngineCoreRequest,
    run: GenerationRun,
    render_step: StepRenderer,
    render_tail: TailRenderer,
    done_marker: bool = True,
    stopped: StopCheck | None = None,
) -> None:
    """Write SSE frames as the engine produces them; end with the tail (and ``[DONE]``)."""
    gen = _start(fe, ecr)
    fe.in_flight += 1
    try:
        async for out in gen:
            frames = render_step(out, run.apply(out))
            if frames:
                await resp.write(frames)
            if (run.finished or (stopped is not None and stopped())) and not out.finished:
                fe.engine.abort(ecr.request_id, "stop")  # every choice ended on a stop string
                break
        tail = render_tail()
        if done_marker:
            tail += DONE
        await resp.write(tail)
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client went away; ``finally`` aborts the engine request
    except Exception as exc:
        # the headers are out: the error goes in the stream, in vLLM's shape (``data: {error}``)
        if isinstance(exc, EngineError):
            err = http_error(exc).body()
        elif isinstance(exc, SessionRouterError):
            err = exc.body()
        else:
            log.exception("stream of %s failed", ecr.request_id)
            err = error_body(500, "The server failed while streaming this response; see its log.")
        try:
            await resp.write(data_frame(err) + (DONE if done_marker else b""))
        except ConnectionResetError:
            pass
    finally:
        fe.in_flight -= 1
        await gen.aclose()
        _count_prompt(fe, run)


_json = msgspec.json.Encoder()


def json_response(obj: object, headers: dict[str, str], status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(obj), status=status, content_type="application/json", headers=headers)

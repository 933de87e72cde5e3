"""The engine side of tokens mode: what is POSTed to ``/inference/v1/generate`` and how an engine
request is ended early (``/inference/v1/abort_requests``).

``generate_payload`` turns the rendered ``GenerateRequest`` into the bytes for the engine: stop strings
removed (a ``--tokens-only`` vLLM rejects them; the router applies them while derendering), and the
stream flag and output kind as the router reads the answer (a client's non-stream request with stop
strings is streamed from the engine, so that the router can stop it early), with usage asked for
(the session's accounting needs the engine's cached-token count).

``EngineAborts`` tells an engine, in the background, to drop a request the router no longer reads
(every choice ended on a stop string, the client went away): ``POST /inference/v1/abort_requests
{"request_ids": [...]}`` with the engine's own request id, which vLLM's generate route makes
``generate-tokens-{X-Request-Id}``. Counted by result in ``session_router_engine_aborts_total``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

import msgspec

from contract.errors import UpstreamError
from contract.session import SESSION_HEADER
from router.exchange import REQUEST_ID_HEADER
from rendering.generate_request import (
    OUTPUT_DELTA,
    OUTPUT_FINAL_ONLY,
    GenerateRequest,
    StreamOptions,
    encode_generate_request,
)
from router.membership import Backend
from router.upstream import UpstreamPool, render_headers, request_head

log = logging.getLogger(__name__)

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
#: vLLM's generate route names its engine request ``generate-tokens-{X-Request-Id, else request_id}``
ENGINE_ID_PREFIX = "generate-tokens-"
#: an abort is small and off the request's path: it gets this long at most
ABORT_TIMEOUT_S = 10.0

_encoder = msgspec.json.Encoder()
_JSON_LINE = "Content-Type: application/json\r\n"
#: what no header value may hold (``router.upstream.render_headers`` refuses it too)
_UNSAFE = re.compile(r"[\r\n\x00]")
_STREAM_USAGE = StreamOptions(include_usage=True, continuous_usage_stats=False)


def engine_request_id(request_id: str) -> str:
    """The engine's id of a request sent with ``X-Request-Id: request_id``."""
    return ENGINE_ID_PREFIX + request_id


def engine_headers(request_id: str, session_id: str | None) -> str:
    """The header lines of a generate (or abort) call: JSON, the request id, the session (the only
    session channel vLLM reads on this path). Values with CR, LF or NUL are refused (a 400)."""
    if _UNSAFE.search(request_id) is not None or (session_id is not None and _UNSAFE.search(session_id) is not None):
        own = [(REQUEST_ID_HEADER, request_id)] + ([(SESSION_HEADER, session_id)] if session_id is not None else [])
        render_headers(own)  # raises the 400 naming the header
    if session_id is None:
        return f"{_JSON_LINE}{REQUEST_ID_HEADER}: {request_id}\r\n"
    return f"{_JSON_LINE}{REQUEST_ID_HEADER}: {request_id}\r\n{SESSION_HEADER}: {session_id}\r\n"


def generate_payload(request: GenerateRequest, *, stream: bool) -> bytes:
    """The JSON the engine gets: ``request`` without stop strings, streamed or not as the router reads
    it, with usage in the stream."""
    sampling = request.sampling_params
    changes: dict[str, Any] = {}
    if sampling.stop is not None:
        changes["stop"] = None
        changes["output_text_buffer_length"] = 0
    kind = OUTPUT_DELTA if stream else OUTPUT_FINAL_ONLY
    if sampling.output_kind != kind:
        changes["output_kind"] = kind
    options = _STREAM_USAGE if stream else None
    if changes:
        sampling = msgspec.structs.replace(sampling, **changes)
    if changes or request.stream is not stream or request.stream_options is not options:
        request = msgspec.structs.replace(request, sampling_params=sampling, stream=stream, stream_options=options)
    # max_tokens written even at 16: a generate route reads a missing one as the remaining context
    return encode_generate_request(request, explicit_max_tokens=True)


class EngineAborts:
    """Background aborts of engine requests (kept referenced until done)."""

    def __init__(self, upstream: UpstreamPool, *, on_result: Callable[[str], None] | None = None) -> None:
        """``on_result(result)`` is called with ``aborted`` / ``failed`` for each abort sent (the
        ``session_router_engine_aborts_total`` counter)."""
        self.upstream = upstream
        self.on_result = on_result
        self._tasks: set[asyncio.Task[None]] = set()

    def abort(self, backend: Backend, request_ids: list[str], headers: str) -> None:
        """Tell ``backend`` to drop ``request_ids`` (engine ids), in the background."""
        task = asyncio.get_running_loop().create_task(self._abort(backend, request_ids, headers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        """Until every abort under way is done (tests; shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _abort(self, backend: Backend, request_ids: list[str], headers: str) -> None:
        payload = _encoder.encode({"request_ids": request_ids})
        head = request_head("POST", ABORT_PATH, f"{backend.host}:{backend.port}", headers, len(payload))
        status = 0
        try:
            status = await self.upstream.control(backend.host, backend.port, head, payload, bound_s=ABORT_TIMEOUT_S)
        except UpstreamError as exc:
            log.warning("tokens mode: could not abort %s on %s (%s); the engine runs it to its end",
                        ", ".join(request_ids), backend.name, exc.reason)
        if status and status != 200:
            log.warning("tokens mode: aborting %s on %s answered %d", ", ".join(request_ids), backend.name, status)
        if self.on_result is not None:
            self.on_result("aborted" if status == 200 else "failed")

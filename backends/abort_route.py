"""``POST /inference/v1/abort_requests`` (and ``/abort_requests``): end engine requests by id.

What a coordinator sends when a stop string ended a choice it derendered, or its client went away:
``{"request_ids": ["generate-tokens-<X-Request-Id>", ...]}``. As in vLLM (``AsyncLLM.abort``), the ids
are the external ones the API server gave the engine (for the generate route
``generate-tokens-{X-Request-Id header, else body request_id}``; ``chatcmpl-...``/``cmpl-...`` for the
OpenAI routes); every engine request carrying one is aborted (its blocks freed, its consumer sees
``finish_reason: "abort"``), unknown ids are ignored, and the answer is 200 with an empty body.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from backends.frontend import ENGINE
from contract.errors import BadRequestError


class AbortRequests(msgspec.Struct):
    request_ids: list[str] | str | None = None


_decoder = msgspec.json.Decoder(AbortRequests)


async def abort_requests(request: web.Request) -> web.Response:
    raw = await request.read()
    try:
        body = _decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise BadRequestError(f"request_ids must be a list of request id strings: {exc}",
                              param="request_ids") from None
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"JSON decode error: {exc}") from None
    if body.request_ids is None:
        raise BadRequestError("Missing 'request_ids' in request body")
    ids = [body.request_ids] if isinstance(body.request_ids, str) else body.request_ids
    request.app[ENGINE].abort_external(ids)
    return web.Response(status=200)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/inference/v1/abort_requests", abort_requests)
    app.router.add_post("/abort_requests", abort_requests)

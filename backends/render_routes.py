"""vLLM's render-server routes, served through ``rendering/`` (the code the router renders with).

- ``POST /v1/chat/completions/render``: a chat body -> ONE ``GenerateRequest`` (JSON);
- ``POST /v1/completions/render``: a completions body -> a LIST of ``GenerateRequest`` (one per prompt);
- ``POST /v1/chat/completions/derender``: ``{generate_response, prompt_tokens?, prompt_token_ids?,
  chat_request?, model?, stream: false}`` -> the ``chat.completion`` object (id = the generate answer's
  ``request_id``); ``POST /v1/completions/derender``: ``{generate_responses: [...], prompt_tokens?,
  prompt_token_ids?, completion_request?, model?}`` -> the ``text_completion``. Streaming derender
  (vLLM's per-chunk ``stream_state``) is not served: a coordinator derenders streams locally;
- ``POST /tokenize``, ``/detokenize``: vLLM's answers (``Renderer.tokenize``/``detokenize``).

The request id of a render is ``chatcmpl-<X-Request-Id>`` / ``cmpl-<X-Request-Id>`` when the header is
given (vLLM's ``_base_request_id``), else a fresh one. ``create_render_app`` is ``--role render``: these
routes plus ``/v1/models``, ``/health``, ``/load``, ``/metrics``, ``/version``, and no engine (a generate
request is a 404, as on vLLM's render server). A full backend with ``--enable-scale-out`` adds the
render/derender routes to its own (``add_render_routes``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from backends.frontend import REQUEST_ID_HEADER, REQUEST_ID_KEY, REQUEST_IDS, package_version
from backends.http_errors import error_middleware
from backends.json_body import check_utf8, too_deep
from backends.protocol import ModelCard, ModelList
from contract.errors import BadRequestError, InvalidJSONError
from contract.ids import IdGenerator
from contract.kv_events import KV_EVENT_SOURCES_PATH
from rendering.derender import ChatDerender, CompletionDerender, DerenderOptions
from rendering.generate_request import encode_generate_request
from rendering.generate_response import GenerateResponse
from rendering.model import RenderModel
from rendering.render import Renderer
from rendering.requests import decode_chat_request, decode_completion_request

#: request bodies above this are a 413 (as the backends' own bound)
MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass(eq=False)
class RenderService:
    """One model's render and derender, shared by every route (built once at start-up)."""

    model: RenderModel
    renderer: Renderer
    registry: CollectorRegistry
    ids: IdGenerator = field(default_factory=IdGenerator)
    created: int = field(default_factory=lambda: int(time.time()))
    version: str = field(default_factory=package_version)
    #: render/derender requests being served now (``GET /load`` of a render server)
    in_flight: int = 0

    def __post_init__(self) -> None:
        self.requests = Counter("session_backend_render_requests", "Render-server requests answered, by route "
                                "and HTTP status.", ["route", "status"], registry=self.registry)


#: the render service of an app (a render server's, or a scale-out backend's)
RENDERING = web.AppKey("rendering", RenderService)


def render_service(model: RenderModel, registry: CollectorRegistry | None = None,
                   renderer: Renderer | None = None) -> RenderService:
    return RenderService(model=model, renderer=renderer if renderer is not None else Renderer(model),
                         registry=registry if registry is not None else CollectorRegistry())


def _json(data: bytes, request: web.Request) -> web.Response:
    headers = {REQUEST_ID_HEADER: request[REQUEST_ID_KEY]} if REQUEST_ID_KEY in request else None
    return web.Response(body=data, content_type="application/json", headers=headers)


class _Nothing(msgspec.Struct):
    """Reads no field: decoding with it only walks the JSON (its nesting and strings)."""


_walk = msgspec.json.Decoder(_Nothing)


async def _body(request: web.Request) -> bytes:
    """The body, refused (400) when it is empty, nests deeper than msgspec reads (about 1,000 levels) or
    is not UTF-8, even where the renderer would skip the offending field; every other fault is the
    renderer's to answer, in vLLM's words."""
    data = await request.read()
    if not data:
        raise InvalidJSONError("Request body is empty; send a JSON object.")
    try:
        _walk.decode(data)
    except msgspec.ValidationError:
        pass  # JSON but not an object: the renderer says so
    except msgspec.DecodeError:
        return data  # not JSON: the renderer says so
    except RecursionError:
        raise too_deep() from None
    check_utf8(data)
    return data


def _request_id(request: web.Request, prefix: str) -> str | None:
    header = request.headers.get(REQUEST_ID_HEADER)
    if header:
        request[REQUEST_ID_KEY] = header
        return f"{prefix}-{header}"
    return None


@web.middleware
async def _count(request: web.Request, handler: Any) -> web.StreamResponse:
    """Counts every render/derender/tokenize answer and keeps ``in_flight`` for ``/load``."""
    if request.method != "POST":
        return await handler(request)
    svc = request.app[RENDERING]
    svc.in_flight += 1
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as exc:
        status = exc.status
        raise
    except Exception as exc:
        status = getattr(exc, "status", 500)
        raise
    finally:
        svc.in_flight -= 1
        route = request.match_info.route.resource
        svc.requests.labels(route.canonical if route is not None else "unknown", str(status)).inc()


# ---- render ------------------------------------------------------------------------------------


async def render_chat(request: web.Request) -> web.Response:
    svc = request.app[RENDERING]
    rendered = svc.renderer.render_chat(await _body(request), request_id=_request_id(request, "chatcmpl"))
    return _json(encode_generate_request(rendered.request), request)


async def render_completions(request: web.Request) -> web.Response:
    svc = request.app[RENDERING]
    rendered = svc.renderer.render_completions(await _body(request), request_id=_request_id(request, "cmpl"))
    return _json(encode_generate_request(rendered), request)


# ---- derender ----------------------------------------------------------------------------------


class ChatDerenderBody(msgspec.Struct, kw_only=True):
    generate_response: GenerateResponse
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    #: the client's chat body (raw; decoded as rendering.requests.ChatRequest); empty when not sent
    chat_request: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    model: str | None = None
    stream: bool = False


class CompletionDerenderBody(msgspec.Struct, kw_only=True):
    generate_responses: list[GenerateResponse]
    prompt_tokens: int | list[int] | None = None
    prompt_token_ids: list[list[int]] | None = None
    completion_request: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    model: str | None = None
    stream: bool = False


_chat_derender_decoder = msgspec.json.Decoder(ChatDerenderBody)
_completion_derender_decoder = msgspec.json.Decoder(CompletionDerenderBody)


def _decode(decoder: msgspec.json.Decoder[Any], data: bytes) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise BadRequestError(f"1 validation error: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"The request body is not valid JSON: {exc}") from None


def _client_request(svc: RenderService, raw: msgspec.Raw, decode: Callable[[bytes], Any]) -> Any:
    """The client's request the derender follows (decoded, its model checked); vLLM's defaults
    (``DerenderOptions()``) when the body sent none."""
    if len(raw) == 0 or bytes(raw) == b"null":
        return DerenderOptions()
    request = decode(bytes(raw))
    svc.renderer.check_model(request.model)
    return request


def _no_stream(stream: bool) -> None:
    if stream:
        raise BadRequestError("Streaming derender (stream: true with a stream_state) is not served here; "
                              "derender a stream locally, chunk by chunk, or send the whole generate answer "
                              "with stream: false.", param="stream")


async def derender_chat(request: web.Request) -> web.Response:
    svc = request.app[RENDERING]
    body: ChatDerenderBody = _decode(_chat_derender_decoder, await _body(request))
    _no_stream(body.stream)
    svc.renderer.check_model(body.model)
    options = _client_request(svc, body.chat_request, decode_chat_request)
    response = body.generate_response
    derender = ChatDerender(svc.model, options, request_id=response.request_id, prompt_ids=body.prompt_token_ids,
                            prompt_tokens=body.prompt_tokens)
    return _json(derender.whole(response), request)


async def derender_completions(request: web.Request) -> web.Response:
    svc = request.app[RENDERING]
    body: CompletionDerenderBody = _decode(_completion_derender_decoder, await _body(request))
    _no_stream(body.stream)
    svc.renderer.check_model(body.model)
    if not body.generate_responses:
        raise BadRequestError("generate_responses must hold at least one generate answer.",
                              param="generate_responses")
    options = _client_request(svc, body.completion_request, decode_completion_request)
    counts = body.prompt_tokens
    derender = CompletionDerender(
        svc.model, options, request_id=body.generate_responses[0].request_id, prompt_ids=body.prompt_token_ids,
        prompt_tokens=[counts] if isinstance(counts, int) else counts,
    )
    return _json(derender.whole(body.generate_responses), request)


# ---- tokenize ----------------------------------------------------------------------------------


async def tokenize(request: web.Request) -> web.Response:
    return _json(request.app[RENDERING].renderer.tokenize(await _body(request)), request)


async def detokenize(request: web.Request) -> web.Response:
    return _json(request.app[RENDERING].renderer.detokenize(await _body(request)), request)


def add_render_routes(app: web.Application) -> None:
    """The render/derender routes (``--enable-scale-out``, ``--role render``)."""
    app.router.add_post("/v1/chat/completions/render", render_chat)
    app.router.add_post("/v1/completions/render", render_completions)
    app.router.add_post("/v1/chat/completions/derender", derender_chat)
    app.router.add_post("/v1/completions/derender", derender_completions)


def add_tokenizer_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)


# ---- --role render -----------------------------------------------------------------------------


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _load(request: web.Request) -> web.Response:
    return web.json_response({"server_load": request.app[RENDERING].in_flight})


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": request.app[RENDERING].version})


async def _models(request: web.Request) -> web.Response:
    svc = request.app[RENDERING]
    card = ModelCard(id=svc.model.name, created=svc.created, root=svc.model.name,
                     max_model_len=svc.model.max_model_len)
    return web.Response(body=msgspec.json.encode(ModelList(data=[card])), content_type="application/json")


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(request.app[RENDERING].registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _kv_event_sources(request: web.Request) -> web.Response:
    """vLLM's render-only server has no engine, so no KV-event publisher: ``{}``."""
    return web.Response(body=b"{}", content_type="application/json")


def create_render_app(model: RenderModel, *, registry: CollectorRegistry | None = None,
                      max_body_bytes: int = MAX_BODY_BYTES) -> web.Application:
    """A render server (``--role render``, vLLM's ``vllm launch render``): no engine."""
    svc = render_service(model, registry)
    app = web.Application(middlewares=[error_middleware, _count], client_max_size=max_body_bytes)
    app[RENDERING] = svc
    app[REQUEST_IDS] = svc.ids
    add_render_routes(app)
    add_tokenizer_routes(app)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/load", _load)
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get(KV_EVENT_SOURCES_PATH, _kv_event_sources)
    return app

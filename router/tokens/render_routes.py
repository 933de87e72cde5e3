"""The routes tokens mode answers beside chat and completions: ``/tokenize``, ``/detokenize`` and
``/v1/responses`` (non-streaming, nothing stored).

``/tokenize`` and ``/detokenize`` are the renderer's: the router's own (``rendering.render.Renderer``,
vLLM's answers) with ``render = "local"``, a render server's with remote render (its answer, or its
error, relayed as it came). No engine is asked.

``/v1/responses`` is answered as a chat turn, the way vLLM's own Responses route works without a tool or
reasoning parser: ``responses_turn`` turns the Responses input (a string, or message items, with
``instructions`` as a leading system message) into a ``/v1/chat/completions`` body; the data path renders,
places, generates and derenders it like any chat request; ``response_object`` turns the
``chat.completion`` answer into vLLM's ``response`` object (output message item with ``output_text``,
``usage`` with ``input_tokens``/``output_tokens``, ``status`` ``incomplete`` when ``max_output_tokens``
ended it). What needs a response store or a parser is a 400 that says what is supported: ``store: true``
(vLLM's own default is not to store, so an absent ``store`` is fine), ``previous_response_id``,
``background``, streaming, tools, structured output and logprobs.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from contract.errors import BadRequestError, InvalidJSONError
from rendering.model import RenderModel
from router.attempt import Attempt
from router.bodies import OpenFields
from router.exchange import REQUEST_ID_HEADER, Headers, RequestView, ResponseWriter
from router.proxy import RouteHandler
from router.routes import ROUTES, Route
from router.tokens.render_client import RemoteRenderer

if TYPE_CHECKING:
    from rendering.render import Renderer

_encoder = msgspec.json.Encoder()

#: what tokens mode's /v1/responses does, for the 400s
SUPPORTED = ("tokens mode answers /v1/responses without streaming and without storing: send \"stream\": "
             "false (or leave it out), \"store\": false (or leave it out), and the whole conversation as "
             "\"input\" message items")


class TokenizeHandler:
    """The proxy's ``RouteHandler`` for ``/tokenize`` or ``/detokenize`` in tokens mode: the answer of
    ``TokenizeRoutes`` with the proxy's own headers (``X-Request-Id``, the session when one resolved)."""

    __slots__ = ("answer", "session_header")

    def __init__(self, routes: "TokenizeRoutes", name: str, session_header: str) -> None:
        self.answer = routes.tokenize if name == "tokenize" else routes.detokenize
        self.session_header = session_header

    async def __call__(self, request: RequestView, writer: ResponseWriter, route: Route, body: bytes,
                       fields: OpenFields | None, attempt: Attempt) -> None:
        answer = await self.answer(body, request_id=attempt.request_id)
        attempt.status = 200
        headers = [("Content-Type", "application/json"), (REQUEST_ID_HEADER, attempt.request_id)]
        if attempt.session_id is not None:
            headers.append((self.session_header, attempt.session_id))
        writer.respond(200, headers, answer)


class TokenizeRoutes:
    """``/tokenize`` and ``/detokenize``: the local renderer's answers, or a render server's."""

    def __init__(self, renderer: Renderer | None, remote: RemoteRenderer | None = None) -> None:
        """``remote``: the render servers (they answer); else ``renderer``, the router's own."""
        if renderer is None and remote is None:
            raise ValueError("TokenizeRoutes needs the local renderer or the remote one")
        self.renderer = renderer
        self.remote = remote

    async def tokenize(self, body: bytes, *, request_id: str) -> bytes:
        """The 200 answer's body (vLLM's ``/tokenize`` shape); errors are raised (vLLM's status and body)."""
        if self.remote is not None:
            return await self.remote.tokenize(body, request_id=request_id)
        assert self.renderer is not None
        return self.renderer.tokenize(body)

    async def detokenize(self, body: bytes, *, request_id: str) -> bytes:
        """The 200 answer's body (vLLM's ``/detokenize`` shape); errors are raised."""
        if self.remote is not None:
            return await self.remote.detokenize(body, request_id=request_id)
        assert self.renderer is not None
        return self.renderer.detokenize(body)


# --------------------------------------------------------------------------------- /v1/responses


class ResponsesBody(msgspec.Struct):
    """The fields of a Responses request this route reads (vLLM's ``ResponsesRequest`` names)."""

    input: str | list[Any] | None = None
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    cache_salt: str | None = None
    priority: int | None = None
    stream: bool | None = None
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = "auto"
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str = "auto"
    truncation: str | None = "disabled"
    max_tool_calls: int | None = None
    user: str | None = None
    request_id: str | None = None
    session_id: Any = None
    vllm_xargs: dict[str, Any] | None = None


_body_decoder = msgspec.json.Decoder(ResponsesBody)

#: Responses fields passed to the chat render under the same name (vLLM's Responses sampling fields)
_SAME_NAME = ("model", "temperature", "top_p", "top_k", "seed", "repetition_penalty", "stop", "ignore_eos",
              "skip_special_tokens", "include_stop_str_in_output", "cache_salt", "priority", "session_id",
              "vllm_xargs")
#: content parts that carry text, by the Responses API's names (and chat's)
_TEXT_PARTS = frozenset(("input_text", "output_text", "text"))
_ROLES = frozenset(("user", "system", "developer", "assistant"))


@dataclass(frozen=True, slots=True)
class ResponsesTurn:
    """One ``/v1/responses`` request, read: the chat body to run and what the answer repeats."""

    request: ResponsesBody
    #: a non-streaming ``/v1/chat/completions`` body: render, place, generate and derender it as chat
    chat_body: bytes
    #: the Response's id: the body's ``request_id``, else ``resp_<32 hex>`` (vLLM's)
    response_id: str
    created_at: int


def responses_turn(body: bytes) -> ResponsesTurn:
    """Read a ``/v1/responses`` body; 400 for what tokens mode does not do (``SUPPORTED``)."""
    try:
        request = _body_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequestError(f"invalid /v1/responses body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidJSONError(f"the request body is not valid JSON: {exc}") from None
    _check_supported(request)
    chat: dict[str, Any] = {}
    for name in _SAME_NAME:
        value = getattr(request, name)
        if value is not None:
            chat[name] = value
    chat["messages"] = chat_messages(request.input, request.instructions)
    if request.max_output_tokens is not None:
        chat["max_tokens"] = request.max_output_tokens
    chat["stream"] = False
    return ResponsesTurn(request, _encoder.encode(chat), request.request_id or f"resp_{uuid.uuid4().hex}",
                         int(time.time()))


def _check_supported(request: ResponsesBody) -> None:
    if request.stream:
        raise BadRequestError(f"stream is not supported on /v1/responses in tokens mode; {SUPPORTED} (or use "
                              "/v1/chat/completions with \"stream\": true)", param="stream")
    if request.store:
        raise BadRequestError(f"store is not supported on /v1/responses in tokens mode (the router keeps no "
                              f"responses); {SUPPORTED}", param="store")
    if request.background:
        raise BadRequestError(f"background is not supported on /v1/responses in tokens mode; {SUPPORTED}",
                              param="background")
    if request.previous_response_id is not None:
        raise BadRequestError("previous_response_id is not supported on /v1/responses in tokens mode (nothing is "
                              f"stored to continue from); {SUPPORTED}", param="previous_response_id")
    if request.tools:
        raise BadRequestError("tools are not supported on /v1/responses in tokens mode (the router parses no tool "
                              "calls); use /v1/chat/completions", param="tools")
    if request.prompt is not None:
        raise BadRequestError("prompt template is not supported", param="prompt")
    text_format = (request.text or {}).get("format")
    if isinstance(text_format, dict) and text_format.get("type", "text") != "text":
        raise BadRequestError("text.format other than {\"type\": \"text\"} (structured output) is not supported on "
                              "/v1/responses in tokens mode; use /v1/chat/completions", param="text")
    if request.include and "message.output_text.logprobs" in request.include:
        raise BadRequestError("include: message.output_text.logprobs is not supported on /v1/responses in tokens "
                              "mode", param="include")


def chat_messages(value: str | list[Any] | None, instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input`` (as vLLM builds them): ``instructions`` first as a
    system message, a string input as one user message, message items in order (text content parts
    joined by newlines; an assistant item's first part, as vLLM takes it)."""
    if value is None:
        raise BadRequestError("Field required: input (a string, or a list of message items).", param="input")
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        return messages
    for i, item in enumerate(value):
        if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") not in _ROLES:
            kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
            raise BadRequestError(
                f"input[{i}]: only message items ({{\"role\": \"user\" | \"system\" | \"developer\" | \"assistant\", "
                f"\"content\": ...}}) are supported on /v1/responses in tokens mode, got {kind!r}", param="input")
        messages.append({"role": item["role"], "content": _text(item["role"], item.get("content"), i)})
    return messages


def _text(role: str, content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise BadRequestError(f"input[{i}].content must be a string or a list of content parts", param="input")
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequestError(f"input[{i}].content[{j}]: only text parts (input_text, output_text) are supported "
                                  f"in tokens mode, got {kind!r}", param="input")
        texts.append(part["text"])
    if role == "assistant":
        return texts[0] if texts else ""
    return "\n".join(texts)


class _Message(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    message: _Message
    finish_reason: str | None = None


class _Details(msgspec.Struct):
    cached_tokens: int = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _ChatCompletion(msgspec.Struct):
    choices: list[_Choice]
    model: str
    usage: _Usage | None = None


_chat_decoder = msgspec.json.Decoder(_ChatCompletion)


def response_object(turn: ResponsesTurn, model: RenderModel, chat_completion: bytes) -> bytes:
    """vLLM's ``response`` object (its keys, in its order) for ``turn`` from the ``chat.completion``
    the data path made of it. ``temperature``, ``top_p`` and ``max_output_tokens`` report the sampling
    parameters the request ran with, as vLLM's do: the request's, else the model's defaults
    (``generation_config.json``), else vLLM's (1.0); ``max_output_tokens`` is bounded by the context
    left after the prompt."""
    chat = _chat_decoder.decode(chat_completion)
    choice = chat.choices[0]
    text = choice.message.content or ""
    content = [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}] if text else []
    output = [{"id": f"msg_{uuid.uuid4().hex}", "content": content, "role": "assistant", "status": "completed",
               "type": "message"}]
    incomplete = choice.finish_reason == "length"
    usage = chat.usage or _Usage()
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
    request = turn.request
    defaults = model.default_sampling
    limits = [model.max_model_len - usage.prompt_tokens]
    for limit in (request.max_output_tokens, defaults.get("max_tokens")):
        if isinstance(limit, int):
            limits.append(limit)
    answer = {
        "id": turn.response_id,
        "created_at": turn.created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.instructions,
        "metadata": request.metadata,
        "model": chat.model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls,
        "temperature": _sampling(request.temperature, defaults.get("temperature")),
        "tool_choice": request.tool_choice,
        "tools": [],
        "top_p": _sampling(request.top_p, defaults.get("top_p")),
        "background": False,
        "max_output_tokens": min(limits),
        "max_tool_calls": request.max_tool_calls,
        "previous_response_id": None,
        "prompt": None,
        "reasoning": request.reasoning,
        "service_tier": request.service_tier,
        "status": "incomplete" if incomplete else "completed",
        "text": request.text,
        "top_logprobs": None,
        "truncation": request.truncation,
        "usage": {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "input_tokens_per_turn": [],
                                     "cached_tokens_per_turn": []},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        },
        "user": request.user,
        "input_messages": None,
        "output_messages": None,
    }
    return _encoder.encode(answer)


def _sampling(value: float | None, default: Any) -> float:
    if value is not None:
        return value
    return float(default) if isinstance(default, (int, float)) else 1.0


class _Capture:
    """A ``ResponseWriter`` that keeps a whole answer (the chat turn's) instead of sending it."""

    __slots__ = ("status", "headers", "body")

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.body = b""

    @property
    def started(self) -> bool:
        return False

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.status, self.headers, self.body = status, list(headers), body

    async def start(self, status: int, headers: Headers) -> None:
        raise AssertionError("a /v1/responses turn runs its chat request without streaming")

    async def write(self, chunk: bytes) -> None:
        raise AssertionError("a /v1/responses turn runs its chat request without streaming")

    async def end(self) -> None:
        raise AssertionError("a /v1/responses turn runs its chat request without streaming")


class ResponsesHandler:
    """The proxy's ``RouteHandler`` for ``/v1/responses`` in tokens mode: the turn runs as a non-streaming
    chat request through the chat route's handler (render, placement, generate, derender, accounting),
    and its ``chat.completion`` becomes the ``response`` object; an error answer is relayed as it is."""

    __slots__ = ("chat", "chat_route", "model")

    def __init__(self, chat: RouteHandler, model: RenderModel) -> None:
        self.chat = chat
        self.chat_route = next(r for r in ROUTES if r.name == "chat")
        self.model = model

    async def __call__(self, request: RequestView, writer: ResponseWriter, route: Route, body: bytes,
                       fields: OpenFields | None, attempt: Attempt) -> None:
        turn = responses_turn(body)
        capture = _Capture()
        await self.chat(request, capture, self.chat_route, turn.chat_body, fields, attempt)
        if capture.status != 200:
            writer.respond(capture.status, capture.headers, capture.body)
            return
        writer.respond(200, capture.headers, response_object(turn, self.model, capture.body))


def side_handlers(chat: RouteHandler, model: RenderModel, renderer: Renderer | None, remote: RemoteRenderer | None,
                  session_header: str) -> dict[str, RouteHandler]:
    """The handlers of this module by route name, for ``Proxy.tokens`` (beside the chat and
    completions handlers of ``router.tokens.flow``; ``chat`` is the chat route's). ``remote``: the
    render servers when they render (they answer /tokenize and /detokenize too), else ``renderer``."""
    tokenize = TokenizeRoutes(renderer, remote)
    return {
        "responses": ResponsesHandler(chat, model),
        "tokenize": TokenizeHandler(tokenize, "tokenize", session_header),
        "detokenize": TokenizeHandler(tokenize, "detokenize", session_header),
    }

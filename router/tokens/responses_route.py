"""``/v1/responses`` in tokens mode: a Responses request answered as a chat turn, stream or not,
nothing stored.

The way vLLM's own Responses route works without a tool or reasoning parser: ``responses_turn`` turns
the Responses input (a string, or message items, with ``instructions`` as a leading system message)
into a ``/v1/chat/completions`` body; ``ResponsesHandler`` runs it through the chat route's handler
(render, placement, generate, derender, stop strings, aborts, usage accounting: all the chat path's)
with a writer of its own in between:

- not streaming: ``_Capture`` keeps the ``chat.completion``; ``response_object`` makes vLLM's
  ``response`` object of it (output message item with ``output_text``, ``usage`` with
  ``input_tokens``/``output_tokens``, ``status: incomplete`` when ``max_output_tokens`` ended it);
- streaming: ``ResponsesStream`` turns the chat chunks into vLLM's event sequence
  (``response.created``, ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done``, ``response.completed``; each as
  ``event: <type>`` + ``data: {...}``, no ``[DONE]``); an error in the chat stream ends it with an
  ``error`` event.

An error answer of the chat path (render's 4xx, an engine's error) is relayed as it is. What needs a
response store or a parser is a 400 that says what is supported: ``store: true`` (vLLM's own default
is not to store, so an absent ``store`` is fine), ``previous_response_id``, ``background``, tools,
structured output and logprobs.

The request fields, the input's conversion, the ``response`` object and the event sequence are
``rendering.responses_objects``' (the backends' ``/v1/responses`` answers with the same code).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from contract.errors import BadRequestError
from rendering import responses_objects
from rendering.model import RenderModel
from rendering.responses_objects import (
    OutputMessage,
    ResponseObject,
    ResponsesEvents,
    ResponsesRequest,
    ResponseUsage,
    chat_body,
    chat_messages,
    decode_responses_request,
    encode,
    message_item,
    response_usage,
)
from router.attempt import Attempt
from router.bodies import OpenFields
from router.exchange import Headers, RequestView, ResponseWriter
from router.proxy import RouteHandler
from router.routes import ROUTES, Route

#: what tokens mode's /v1/responses does, for the 400s
SUPPORTED = ("tokens mode answers /v1/responses without storing anything: send \"store\": false (or leave it "
             "out) and the whole conversation as \"input\" message items")
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


@dataclass(frozen=True, slots=True)
class ResponsesTurn:
    """One ``/v1/responses`` request, read: the chat body to run and what the answer repeats."""

    request: ResponsesRequest
    #: a ``/v1/chat/completions`` body (streaming with usage when the request streams): render, place,
    #: generate and derender it as chat
    chat_body: bytes
    #: the Response's id: the body's ``request_id``, else ``resp_<32 hex>`` (vLLM's)
    response_id: str
    created_at: int

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)


def responses_turn(body: bytes) -> ResponsesTurn:
    """Read a ``/v1/responses`` body; 400 for what tokens mode does not do (``SUPPORTED``)."""
    request = decode_responses_request(body)
    _check_supported(request)
    chat = chat_body(request, chat_messages(request.input, request.instructions))
    chat["stream"] = bool(request.stream)
    if request.stream:
        chat["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    return ResponsesTurn(request, encode(chat), request.request_id or f"resp_{uuid.uuid4().hex}",
                         int(time.time()))


def _check_supported(request: ResponsesRequest) -> None:
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


# ------------------------------------------------------------------ the chat answer, as far as read


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


class _Delta(msgspec.Struct):
    content: str | None = None


class _ChunkChoice(msgspec.Struct):
    delta: _Delta
    finish_reason: str | None = None


class _ChatChunk(msgspec.Struct):
    """One ``chat.completion.chunk`` (or the error object a stream ends with)."""

    choices: list[_ChunkChoice] = []
    usage: _Usage | None = None
    error: dict[str, Any] | None = None


_chat_decoder = msgspec.json.Decoder(_ChatCompletion)
_chunk_decoder = msgspec.json.Decoder(_ChatChunk)


# ------------------------------------------------------------------ the response object


def _usage(usage: _Usage) -> ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
    return response_usage(usage.prompt_tokens, usage.completion_tokens, cached)


def _response(turn: ResponsesTurn, model: RenderModel, *, model_name: str, prompt_tokens: int, status: str,
              output: list[OutputMessage], usage: ResponseUsage | None) -> ResponseObject:
    return responses_objects.response_object(turn.request, model, response_id=turn.response_id,
                                             created_at=turn.created_at, model_name=model_name,
                                             prompt_tokens=prompt_tokens, status=status, output=output, usage=usage)


def response_object(turn: ResponsesTurn, model: RenderModel, chat_completion: bytes) -> bytes:
    """The ``response`` object for ``turn`` from the ``chat.completion`` the chat path made of it."""
    chat = _chat_decoder.decode(chat_completion)
    choice = chat.choices[0]
    usage = chat.usage or _Usage()
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    output = [message_item(f"msg_{uuid.uuid4().hex}", choice.message.content or "")]
    return encode(_response(turn, model, model_name=chat.model, prompt_tokens=usage.prompt_tokens,
                            status=status, output=output, usage=_usage(usage)))


# ------------------------------------------------------------------ writers between the chat path and the client


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
        raise AssertionError("a non-streaming /v1/responses turn runs its chat request without streaming")

    async def write(self, chunk: bytes) -> None:
        raise AssertionError("a non-streaming /v1/responses turn runs its chat request without streaming")

    async def end(self, last: bytes = b"") -> None:
        raise AssertionError("a non-streaming /v1/responses turn runs its chat request without streaming")


class ResponsesStream:
    """A ``ResponseWriter`` for the chat path that writes the client Responses events instead of chat
    chunks (module docstring). Whole answers (errors before the stream began) pass through."""

    def __init__(self, writer: ResponseWriter, turn: ResponsesTurn, model: RenderModel, attempt: Attempt) -> None:
        self.writer = writer
        self.turn = turn
        self.model = model
        self.attempt = attempt
        self.events = ResponsesEvents(f"msg_{uuid.uuid4().hex}")
        self.buffer = b""
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage: _Usage | None = None
        self.failed = False

    @property
    def item_id(self) -> str:
        return self.events.item_id

    @property
    def started(self) -> bool:
        return self.writer.started

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.writer.respond(status, headers, body)

    async def start(self, status: int, headers: Headers) -> None:
        await self.writer.start(status, [(k, SSE_CONTENT_TYPE if k.lower() == "content-type" else v)
                                         for k, v in headers])
        await self.writer.write(self.events.started(self._response("in_progress", [], None)))

    async def write(self, chunk: bytes) -> None:
        out = self._take(chunk)
        if out:
            await self.writer.write(out)

    async def end(self, last: bytes = b"") -> None:
        out = self._take(last) if last else b""
        if not self.failed:
            text = "".join(self.text)
            status = "incomplete" if self.finish_reason == "length" else "completed"
            final = self._response(status, [message_item(self.item_id, text)], _usage(self.usage or _Usage()))
            out += self.events.end(text, final)
        await self.writer.end(out)

    # -- helpers
    def _take(self, chunk: bytes) -> bytes:
        """The Responses events for the chat events ``chunk`` completes."""
        self.buffer += chunk
        out = b""
        while not self.failed:
            end = self.buffer.find(b"\n\n")
            if end < 0:
                break
            event, self.buffer = self.buffer[:end], self.buffer[end + 2:]
            out += self._chat_event(event)
        return out

    def _chat_event(self, event: bytes) -> bytes:
        """Responses events for one chat SSE event (its ``data:`` lines)."""
        data = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
        if not data or data == b"[DONE]":
            return b""
        chunk = _chunk_decoder.decode(data)
        if chunk.error is not None:
            self.failed = True
            error = chunk.error
            return self.events.error(error.get("code"), error.get("message"), error.get("param"))
        if chunk.usage is not None:
            self.usage = chunk.usage
        out = b""
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
            delta = choice.delta.content
            if delta:
                self.text.append(delta)
                out += self.events.delta(delta)
        return out

    def _response(self, status: str, output: list[OutputMessage], usage: ResponseUsage | None) -> ResponseObject:
        prompt_ids = self.attempt.prompt_ids
        return _response(self.turn, self.model, model_name=self.model.name,
                         prompt_tokens=len(prompt_ids) if prompt_ids is not None else 0,
                         status=status, output=output, usage=usage)


class ResponsesHandler:
    """The proxy's ``RouteHandler`` for ``/v1/responses`` in tokens mode (module docstring)."""

    __slots__ = ("chat", "chat_route", "model")

    def __init__(self, chat: RouteHandler, model: RenderModel) -> None:
        self.chat = chat
        self.chat_route = next(r for r in ROUTES if r.name == "chat")
        self.model = model

    async def __call__(self, request: RequestView, writer: ResponseWriter, route: Route, body: bytes,
                       fields: OpenFields | None, attempt: Attempt) -> None:
        turn = responses_turn(body)
        if turn.stream:
            await self.chat(request, ResponsesStream(writer, turn, self.model, attempt), self.chat_route,
                            turn.chat_body, fields, attempt)
            return
        capture = _Capture()
        await self.chat(request, capture, self.chat_route, turn.chat_body, fields, attempt)
        if capture.status != 200:
            writer.respond(capture.status, capture.headers, capture.body)
            return
        writer.respond(200, capture.headers, response_object(turn, self.model, capture.body))

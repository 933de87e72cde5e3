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
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from contract.errors import BadRequestError, InvalidJSONError
from rendering.model import RenderModel
from router.attempt import Attempt
from router.bodies import OpenFields
from router.exchange import Headers, RequestView, ResponseWriter
from router.proxy import RouteHandler
from router.routes import ROUTES, Route

_encoder = msgspec.json.Encoder()

#: what tokens mode's /v1/responses does, for the 400s
SUPPORTED = ("tokens mode answers /v1/responses without storing anything: send \"store\": false (or leave it "
             "out) and the whole conversation as \"input\" message items")
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


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
    chat["stream"] = bool(request.stream)
    if request.stream:
        chat["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    return ResponsesTurn(request, _encoder.encode(chat), request.request_id or f"resp_{uuid.uuid4().hex}",
                         int(time.time()))


def _check_supported(request: ResponsesBody) -> None:
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


def _sampling(value: float | None, default: Any) -> float:
    if value is not None:
        return value
    return float(default) if isinstance(default, (int, float)) else 1.0


def _usage(usage: _Usage) -> dict[str, Any]:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                                  "tool_output_tokens_per_turn": []},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """The output message item (vLLM's: no content part when the text is empty)."""
    content = [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}] if text else []
    return {"id": item_id, "content": content, "role": "assistant", "status": status, "type": "message"}


def response_fields(turn: ResponsesTurn, model: RenderModel, *, model_name: str, prompt_tokens: int,
                    status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's ``response`` object (its keys, in its order). ``temperature``, ``top_p`` and
    ``max_output_tokens`` report the sampling parameters the request ran with, as vLLM's do: the
    request's, else the model's defaults (``generation_config.json``), else vLLM's (1.0);
    ``max_output_tokens`` is bounded by the context left after the prompt."""
    request = turn.request
    defaults = model.default_sampling
    limits = [model.max_model_len - prompt_tokens]
    for limit in (request.max_output_tokens, defaults.get("max_tokens")):
        if isinstance(limit, int):
            limits.append(limit)
    return {
        "id": turn.response_id,
        "created_at": turn.created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "metadata": request.metadata,
        "model": model_name,
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
        "status": status,
        "text": request.text,
        "top_logprobs": None,
        "truncation": request.truncation,
        "usage": usage,
        "user": request.user,
        "input_messages": None,
        "output_messages": None,
    }


def response_object(turn: ResponsesTurn, model: RenderModel, chat_completion: bytes) -> bytes:
    """The ``response`` object for ``turn`` from the ``chat.completion`` the chat path made of it."""
    chat = _chat_decoder.decode(chat_completion)
    choice = chat.choices[0]
    usage = chat.usage or _Usage()
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    output = [message_item(f"msg_{uuid.uuid4().hex}", choice.message.content or "")]
    return _encoder.encode(response_fields(turn, model, model_name=chat.model, prompt_tokens=usage.prompt_tokens,
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

    async def end(self) -> None:
        raise AssertionError("a non-streaming /v1/responses turn runs its chat request without streaming")


class ResponsesStream:
    """A ``ResponseWriter`` for the chat path that writes the client Responses events instead of chat
    chunks (module docstring). Whole answers (errors before the stream began) pass through."""

    def __init__(self, writer: ResponseWriter, turn: ResponsesTurn, model: RenderModel, attempt: Attempt) -> None:
        self.writer = writer
        self.turn = turn
        self.model = model
        self.attempt = attempt
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.sequence = 0
        self.buffer = b""
        self.text: list[str] = []
        self.opened = False  # the message item and its content part were announced
        self.finish_reason: str | None = None
        self.usage: _Usage | None = None
        self.failed = False

    @property
    def started(self) -> bool:
        return self.writer.started

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.writer.respond(status, headers, body)

    async def start(self, status: int, headers: Headers) -> None:
        await self.writer.start(status, [(k, SSE_CONTENT_TYPE if k.lower() == "content-type" else v)
                                         for k, v in headers])
        started = self._response("in_progress", [], None)
        await self.writer.write(self._event("response.created", response=started)
                                + self._event("response.in_progress", response=started))

    async def write(self, chunk: bytes) -> None:
        self.buffer += chunk
        out = b""
        while not self.failed:
            end = self.buffer.find(b"\n\n")
            if end < 0:
                break
            event, self.buffer = self.buffer[:end], self.buffer[end + 2:]
            out += self._chat_event(event)
        if out:
            await self.writer.write(out)

    async def end(self) -> None:
        if not self.failed:
            text = "".join(self.text)
            out = b"" if self.opened else self._open()
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
            where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
            usage = self.usage or _Usage()
            status = "incomplete" if self.finish_reason == "length" else "completed"
            item = message_item(self.item_id, text)
            final = self._response(status, [item], _usage(usage))
            out += (self._event("response.output_text.done", text=text, logprobs=[], **where)
                    + self._event("response.content_part.done", part=part, **where)
                    + self._event("response.output_item.done", output_index=0, item=item)
                    + self._event("response.completed", response=final))
            await self.writer.write(out)
        await self.writer.end()

    # -- helpers
    def _chat_event(self, event: bytes) -> bytes:
        """Responses events for one chat SSE event (its ``data:`` lines)."""
        data = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
        if not data or data == b"[DONE]":
            return b""
        chunk = _chunk_decoder.decode(data)
        if chunk.error is not None:
            self.failed = True
            error = chunk.error
            return self._event("error", code=str(error.get("code")), message=error.get("message"),
                               param=error.get("param"))
        if chunk.usage is not None:
            self.usage = chunk.usage
        out = b""
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
            delta = choice.delta.content
            if delta:
                if not self.opened:
                    out += self._open()
                self.text.append(delta)
                out += self._event("response.output_text.delta", item_id=self.item_id, output_index=0,
                                   content_index=0, delta=delta, logprobs=[])
        return out

    def _open(self) -> bytes:
        self.opened = True
        return (self._event("response.output_item.added", output_index=0,
                            item={"id": self.item_id, "content": [], "role": "assistant", "status": "in_progress",
                                  "type": "message"})
                + self._event("response.content_part.added", item_id=self.item_id, output_index=0, content_index=0,
                              part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        prompt_ids = self.attempt.prompt_ids
        return response_fields(self.turn, self.model, model_name=self.model.name,
                               prompt_tokens=len(prompt_ids) if prompt_ids is not None else 0,
                               status=status, output=output, usage=usage)

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"


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

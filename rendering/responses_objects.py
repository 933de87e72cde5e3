"""OpenAI's Responses API (text only) as vLLM 0.32 answers it: the request fields read, the ``input`` as chat
messages, the ``response`` object and the stream's events. One implementation for every ``/v1/responses``:
the router's in tokens mode (``router.tokens.responses_route``) and the backends' (``backends.responses_api``).

- ``ResponsesRequest``: the body's fields (vLLM's ``ResponsesRequest`` names); unknown fields are ignored.
- ``chat_messages(input, instructions)``: the chat conversation vLLM builds of it (``instructions`` first as
  a system message, a string as one user message, message items in order: text parts joined by newlines,
  an assistant item's first part); ``chat_body(request, messages)``: the ``/v1/chat/completions`` body a
  turn is rendered from (the Responses sampling fields under their chat names, ``max_output_tokens`` as
  ``max_tokens``).
- ``ResponseObject`` (via ``response_object``): vLLM's ``ResponsesResponse``, every key in its order;
  ``temperature``, ``top_p`` and ``max_output_tokens`` report what the request ran with (the request's, else
  the model's ``generation_config.json`` defaults, else 1.0; the output budget bounded by the context left
  after the prompt); ``status: "incomplete"`` with ``incomplete_details`` when ``max_output_tokens`` ended it.
- ``ResponsesEvents``: the event sequence of a stream (``response.created``, ``response.in_progress``,
  ``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``...,
  ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``,
  ``response.completed``; ``error`` for a failure), each ``event: <type>`` + ``data: {...}`` with its
  ``sequence_number``; no ``[DONE]``, as in vLLM.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from contract.errors import BadRequestError, InvalidJSONError
from rendering.model import RenderModel

__all__ = ["OutputMessage", "OutputText", "ResponseObject", "ResponseUsage", "ResponsesEvents", "ResponsesRequest",
           "chat_body", "chat_messages", "decode_responses_request", "message_item", "response_object",
           "response_usage", "responses_request_decoder"]


class ResponsesRequest(Struct):
    """The fields of a ``/v1/responses`` body the routes read (vLLM's ``ResponsesRequest`` names)."""

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
    #: the session contract decides what a non-string value means (``contract.session``)
    session_id: Any = None
    vllm_xargs: dict[str, Any] | None = None


#: the body decoder (a server with its own body reader decodes with it)
responses_request_decoder = msgspec.json.Decoder(ResponsesRequest)


def decode_responses_request(body: bytes) -> ResponsesRequest:
    """The body as a ``ResponsesRequest``: 400 when it is not JSON or a field has the wrong type."""
    try:
        return responses_request_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequestError(f"invalid /v1/responses body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidJSONError(f"the request body is not valid JSON: {exc}") from None


# ---- input -> chat messages ----------------------------------------------------------------------

#: content parts that carry text, by the Responses API's names (and chat's)
_TEXT_PARTS = frozenset(("input_text", "output_text", "text"))
_ROLES = frozenset(("user", "system", "developer", "assistant"))


def chat_messages(value: str | list[Any] | None, instructions: str | None) -> list[dict[str, str]]:
    """The chat messages of a Responses ``input`` (module docstring); a 400 (param ``input``) for an absent
    or empty input and for items other than text messages."""
    if value is None:
        raise BadRequestError("Field required: input (a string, or a list of message items).", param="input")
    if not isinstance(value, str) and not value:
        raise BadRequestError("input must not be an empty list; send a string or message items.", param="input")
    messages: list[dict[str, str]] = []
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
                f"\"content\": ...}}) are supported on /v1/responses here, got {kind!r}", param="input")
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
                                  f"on /v1/responses here, got {kind!r}", param="input")
        texts.append(part["text"])
    if role == "assistant":
        return texts[0] if texts else ""
    return "\n".join(texts)


#: Responses fields passed to the chat render under the same name (vLLM's Responses sampling fields)
_SAME_NAME = ("model", "temperature", "top_p", "top_k", "seed", "repetition_penalty", "stop", "ignore_eos",
              "skip_special_tokens", "include_stop_str_in_output", "cache_salt", "priority", "session_id",
              "vllm_xargs")


def chat_body(request: ResponsesRequest, messages: list[dict[str, str]]) -> dict[str, Any]:
    """The chat request of a Responses turn (``messages`` from ``chat_messages``), as a JSON-ready dict;
    a 400 for a ``max_output_tokens`` below 1."""
    chat: dict[str, Any] = {}
    for name in _SAME_NAME:
        value = getattr(request, name)
        if value is not None:
            chat[name] = value
    chat["messages"] = messages
    if request.max_output_tokens is not None:
        if request.max_output_tokens < 1:
            raise BadRequestError(f"max_output_tokens must be at least 1, got {request.max_output_tokens}.",
                                  param="max_output_tokens")
        chat["max_tokens"] = request.max_output_tokens
    return chat


# ---- the response object ---------------------------------------------------------------------------


class InputTokensDetails(Struct, kw_only=True):
    cached_tokens: int = 0
    input_tokens_per_turn: list[int] = msgspec.field(default_factory=list)
    cached_tokens_per_turn: list[int] = msgspec.field(default_factory=list)


class OutputTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0
    tool_output_tokens: int = 0
    output_tokens_per_turn: list[int] = msgspec.field(default_factory=list)
    tool_output_tokens_per_turn: list[int] = msgspec.field(default_factory=list)


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


def response_usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> ResponseUsage:
    return ResponseUsage(input_tokens=input_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
                         output_tokens=output_tokens, output_tokens_details=OutputTokensDetails(),
                         total_tokens=input_tokens + output_tokens)


class OutputText(Struct, kw_only=True):
    annotations: list[Any] = msgspec.field(default_factory=list)
    text: str
    type: str = "output_text"
    logprobs: list[Any] | None = None


class OutputMessage(Struct, kw_only=True):
    id: str
    content: list[OutputText]
    role: str = "assistant"
    status: str = "completed"
    type: str = "message"


def message_item(item_id: str, text: str, status: str = "completed") -> OutputMessage:
    """The output message item (vLLM's: no content part when the text is empty)."""
    return OutputMessage(id=item_id, content=[OutputText(text=text)] if text else [], status=status)


class ResponseObject(Struct, kw_only=True):
    """vLLM 0.32's ``ResponsesResponse``: its keys, in its order."""

    id: str
    created_at: int
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    metadata: dict[str, Any] | None = None
    model: str
    object: str = "response"
    output: list[OutputMessage]
    parallel_tool_calls: bool | None = True
    temperature: float
    tool_choice: Any = "auto"
    tools: list[Any] = msgspec.field(default_factory=list)
    top_p: float
    background: bool = False
    max_output_tokens: int
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    service_tier: str = "auto"
    status: str
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: str | None = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    input_messages: Any = None
    output_messages: Any = None


def _sampling(value: float | None, default: Any) -> float:
    if value is not None:
        return value
    return float(default) if isinstance(default, (int, float)) else 1.0


def response_object(request: ResponsesRequest, model: RenderModel, *, response_id: str, created_at: int,
                    model_name: str, prompt_tokens: int, status: str, output: list[OutputMessage],
                    usage: ResponseUsage | None, previous_response_id: str | None = None) -> ResponseObject:
    """The ``response`` object of ``request`` (module docstring). ``status`` "incomplete" sets
    ``incomplete_details`` to ``max_output_tokens``."""
    defaults = model.default_sampling
    limits = [model.max_model_len - prompt_tokens]
    for limit in (request.max_output_tokens, defaults.get("max_tokens")):
        if isinstance(limit, int):
            limits.append(limit)
    return ResponseObject(
        id=response_id,
        created_at=created_at,
        incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
        instructions=request.instructions,
        metadata=request.metadata,
        model=model_name,
        output=output,
        parallel_tool_calls=request.parallel_tool_calls,
        temperature=_sampling(request.temperature, defaults.get("temperature")),
        tool_choice=request.tool_choice,
        top_p=_sampling(request.top_p, defaults.get("top_p")),
        max_output_tokens=min(limits),
        max_tool_calls=request.max_tool_calls,
        previous_response_id=previous_response_id,
        reasoning=request.reasoning,
        service_tier=request.service_tier,
        status=status,
        text=request.text,
        truncation=request.truncation,
        usage=usage,
        user=request.user,
    )


# ---- stream events -----------------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()
encode = _encoder.encode


class ResponsesEvents:
    """The events of one Responses stream, numbered in order (module docstring). One message item, one
    ``output_text`` part: ``opening`` announces them before the first delta (``end`` does if none came)."""

    __slots__ = ("item_id", "sequence", "opened")

    def __init__(self, item_id: str) -> None:
        self.item_id = item_id
        self.sequence = 0
        #: the message item and its content part were announced
        self.opened = False

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"

    def started(self, response: ResponseObject) -> bytes:
        """``response.created`` and ``response.in_progress`` (``response`` in progress, no output yet)."""
        return self.event("response.created", response=response) + self.event("response.in_progress", response=response)

    def opening(self) -> bytes:
        self.opened = True
        return (self.event("response.output_item.added", output_index=0,
                           item={"id": self.item_id, "content": [], "role": "assistant", "status": "in_progress",
                                 "type": "message"})
                + self.event("response.content_part.added", item_id=self.item_id, output_index=0, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))

    def delta(self, text: str) -> bytes:
        """One ``response.output_text.delta`` (after the opening events, the first time)."""
        head = b"" if self.opened else self.opening()
        return head + self.event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                                 delta=text, logprobs=[])

    def end(self, text: str, final: ResponseObject) -> bytes:
        """The closing events, ``response.completed`` (with ``final``) last."""
        out = b"" if self.opened else self.opening()
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
        return out + (self.event("response.output_text.done", text=text, logprobs=[], **where)
                      + self.event("response.content_part.done", part=part, **where)
                      + self.event("response.output_item.done", output_index=0, item=message_item(self.item_id, text))
                      + self.event("response.completed", response=final))

    def error(self, code: Any, message: Any, param: Any) -> bytes:
        """The ``error`` event a failed stream ends with."""
        return self.event("error", code=str(code), message=message, param=param)

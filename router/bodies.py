"""Partial decoding of request and response bodies: only what routing and accounting need.

The request body is parsed once by msgspec into ``RoutingFields``; fields the router never
reads are skipped by the parser, and the bodies that derivation may need (``messages``,
``input``) are kept as ``msgspec.Raw`` slices, decoded only when a session id must be derived.
The original bytes are what gets forwarded.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

import msgspec

from contract.errors import BadRequestError, InvalidJSONError


class OpenFields(msgspec.Struct):
    """What routing reads from any JSON object body: the session channels and the model."""

    session_id: Any = None
    vllm_xargs: Any = None
    model: Any = None


class RoutingFields(OpenFields):
    """What routing reads from the body of an inference route (the router's own contract)."""

    stream: bool | None = None
    previous_response_id: Any = None
    stream_options: Any = None
    # kept undecoded (a zero-copy slice; empty when absent) until derivation needs them
    messages: msgspec.Raw = msgspec.Raw()
    input: msgspec.Raw = msgspec.Raw()
    #: only its presence matters (a client's own P/D parameters are stripped)
    kv_transfer_params: msgspec.Raw = msgspec.Raw()


class _KVParamsOnly(msgspec.Struct):
    kv_transfer_params: msgspec.Raw = msgspec.Raw()


class _Message(msgspec.Struct):
    role: Any = None
    content: Any = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    prompt_tokens_details: Any = None
    input_tokens_details: Any = None


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None
    id: Any = None
    response: Any = None  # responses API stream events wrap the response object


_fields_decoder = msgspec.json.Decoder(RoutingFields)
_open_decoder = msgspec.json.Decoder(OpenFields)
_messages_decoder = msgspec.json.Decoder(list[_Message])
_any_decoder = msgspec.json.Decoder()
_usage_decoder = msgspec.json.Decoder(_WithUsage)
_canonical = msgspec.json.Encoder(order="sorted")
_kv_only_decoder = msgspec.json.Decoder(_KVParamsOnly)
_object_decoder = msgspec.json.Decoder(dict[str, Any])
_encoder = msgspec.json.Encoder()


def decode_routing_fields(body: bytes) -> RoutingFields:
    """Parse the fields routing needs; a body that is not a JSON object is a 400."""
    try:
        return _fields_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidJSONError(f"invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidJSONError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's nesting bound (about 1,000 levels), also for skipped fields
        raise InvalidJSONError("request body nests JSON arrays or objects too deeply; flatten it") from None


def decode_open_fields(body: bytes) -> OpenFields | None:
    """The routing fields of a body the router does not own (``/tokenize``, the routes it does not
    name): read only when the body is a JSON object; anything else (empty, multipart, not JSON)
    gives None and is the backend's to judge."""
    if body[:1] != b"{" and body[:64].lstrip()[:1] != b"{":
        return None
    try:
        return _open_decoder.decode(body)
    except (msgspec.MsgspecError, RecursionError):
        return None


def wants_stream_usage(fields: RoutingFields) -> bool:
    opts = fields.stream_options
    return isinstance(opts, dict) and opts.get("include_usage") is True


# ---------------------------------------------------------------------------- kv_transfer_params

def without_kv_transfer_params(body: bytes, fields: OpenFields | None) -> bytes | None:
    """``body`` re-encoded without its top-level ``kv_transfer_params``, or None when it has none
    (then the original bytes are forwarded).

    ``fields`` (the routing fields of an inference route) already tell whether the key is there;
    for any other route a body that cannot hold the key, even escaped, is passed over without
    parsing, and one that is not a JSON object is left to the backend to answer."""
    if isinstance(fields, RoutingFields):
        if not fields.kv_transfer_params:
            return None
    else:
        if b"kv_transfer_param" not in body and b"\\u" not in body:
            return None
        try:
            if not _kv_only_decoder.decode(body).kv_transfer_params:
                return None
        except (msgspec.MsgspecError, RecursionError):
            return None
    try:
        obj = _object_decoder.decode(body)
    except (msgspec.MsgspecError, RecursionError):
        # parsed when its fields were skipped, not when decoded whole (e.g. a number out of range)
        raise InvalidJSONError(
            "request body carries kv_transfer_params, which this router removes, and cannot be re-encoded "
            "without them (a number out of range or an invalid string); fix the body or leave the field out"
        ) from None
    value = obj.pop("kv_transfer_params", None)
    if value is not None and not isinstance(value, dict):  # as a backend would answer it (vLLM: a dict)
        raise BadRequestError(
            f"kv_transfer_params must be an object or null, got {type(value).__name__}; this router removes "
            "client kv_transfer_params anyway (trust_client_kv_params = false), so leave the field out",
            param="kv_transfer_params",
        )
    return _encoder.encode(obj)


# ---------------------------------------------------------------------------- derivation

def _digest(parts: Any) -> str:
    return hashlib.blake2b(_canonical.encode(parts), digest_size=16).hexdigest()


def derive_chat_session(messages: msgspec.Raw) -> str | None:
    """``conv-`` + 32 hex from the system messages and the first user message, or None."""
    if not messages:
        return None
    try:
        decoded = _messages_decoder.decode(messages)
    except msgspec.MsgspecError:
        return None
    anchor: list[Any] = []
    for message in decoded:
        if message.role in ("system", "developer"):
            anchor.append([message.role, message.content])
        elif message.role == "user":
            anchor.append(["user", message.content])
            return "conv-" + _digest(anchor)
    return None


def derive_responses_session(input_raw: msgspec.Raw) -> str | None:
    """``conv-`` + 32 hex from the first input item of a Responses request, or None."""
    if not input_raw:
        return None
    try:
        value = _any_decoder.decode(input_raw)
    except msgspec.MsgspecError:
        return None
    if isinstance(value, str):
        first: Any = value
    elif isinstance(value, list) and value:
        first = value[0]
    else:
        return None
    return "conv-" + _digest(["responses", first])


def mint_session() -> str:
    return "sess-" + os.urandom(16).hex()


# ---------------------------------------------------------------------------- responses

def usage_from_json(body: bytes) -> tuple[Usage | None, str | None]:
    """``usage`` and ``id`` of a JSON response body (chat, completion, generate, responses)."""
    try:
        parsed = _usage_decoder.decode(body)
    except msgspec.MsgspecError:
        return None, None
    response_id = parsed.id if isinstance(parsed.id, str) else None
    return _to_usage(parsed.usage), response_id


def _to_usage(raw: _Usage | None) -> Usage | None:
    if raw is None:
        return None
    details = raw.prompt_tokens_details or raw.input_tokens_details
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=raw.prompt_tokens or raw.input_tokens,
        completion_tokens=raw.completion_tokens or raw.output_tokens,
        cached_tokens=cached if isinstance(cached, int) else 0,
    )


_DATA_LINE = re.compile(rb"^data: (\{.*\})\s*$", re.MULTILINE)
_RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[^"]+)"')


def usage_from_sse_tail(tail: bytes) -> Usage | None:
    """The last ``usage`` object found in the tail of an SSE stream, if any."""
    for match in reversed(_DATA_LINE.findall(tail)):
        if b'"usage"' not in match:
            continue
        try:
            parsed = _usage_decoder.decode(match)
        except msgspec.MsgspecError:
            continue
        usage = parsed.usage
        if usage is None and isinstance(parsed.response, dict):
            usage = _usage_from_dict(parsed.response.get("usage"))
        if usage is not None:
            return _to_usage(usage)
    return None


def _usage_from_dict(value: Any) -> _Usage | None:
    if not isinstance(value, dict):
        return None
    try:
        return msgspec.convert(value, _Usage)
    except msgspec.ValidationError:
        return None


def response_id_from_sse(head: bytes) -> str | None:
    """The ``resp_…`` id announced at the start of a Responses API stream."""
    match = _RESPONSE_ID.search(head)
    return match.group(1).decode() if match else None

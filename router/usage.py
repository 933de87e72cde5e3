"""What the router reads from a backend's answer: its token usage and, for the Responses API, its id.

A JSON answer is parsed once for both (``usage_from_json``); a stream is searched only in its tail
for the last ``usage`` (``usage_from_sse_tail``) and in its first chunks for the ``resp_…`` id
(``response_id_from_sse``). Everything else in the answer is skipped by the parser and relayed as
received.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec


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


_usage_decoder = msgspec.json.Decoder(_WithUsage)


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

"""The session contract: one implementation, imported by the router and the backends.

Where a request's session id comes from (first match wins):

1. the body field ``session_id`` when it is a non-empty string
   (a value that is neither a string nor null is a 400);
2. the ``X-Session-ID`` header when non-empty (two headers with different values are a 400);
   a router may read it under another name (its ``session_header`` setting): callers pass the
   name they read the values from, and the rules are the same;
3. ``vllm_xargs["session_id"]`` when it is a non-empty string (anything else is ignored);
4. nothing: the request has no session.

``X-Correlation-ID``, ``X-Request-Id``, ``user`` and every other header or field are never
a session. A resolved id must be 1..256 characters of visible ASCII (0x21-0x7E) because it
travels in a header. The tokens-in route (``/inference/v1/generate``) has no body field:
there the header is the only channel.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from contract.errors import InvalidSessionIdError

SESSION_HEADER = "X-Session-ID"
SESSION_BODY_FIELD = "session_id"
MAX_SESSION_ID_LENGTH = 256

# str.translate deletes every allowed character; anything left over is forbidden.
_VISIBLE_ASCII = {c: None for c in range(0x21, 0x7F)}


def validate_session_id(value: str, source: str) -> str:
    """Return ``value`` if it may be used as a session id, else raise a 400 naming the rule."""
    if len(value) > MAX_SESSION_ID_LENGTH:
        raise InvalidSessionIdError(
            f"session id from {source} is {len(value)} characters long; "
            f"the limit is {MAX_SESSION_ID_LENGTH}",
            param=SESSION_BODY_FIELD,
        )
    if value.translate(_VISIBLE_ASCII):
        raise InvalidSessionIdError(
            f"session id from {source} contains characters outside visible ASCII (0x21-0x7E); "
            "spaces, control characters and non-ASCII are not allowed",
            param=SESSION_BODY_FIELD,
        )
    return value


def session_from_headers(header_values: Iterable[str], header_name: str = SESSION_HEADER) -> str | None:
    """The session named by the ``X-Session-ID`` header values (all of them, as received).

    Empty values count as absent; two different non-empty values are a 400. ``header_name``: the
    header the values were read from (named in the messages).
    """
    found: str | None = None
    for value in header_values:
        if not value:
            continue
        if found is None:
            found = value
        elif value != found:
            raise InvalidSessionIdError(
                f"conflicting {header_name} headers: send the header once",
                param=header_name,
            )
    if found is None:
        return None
    return validate_session_id(found, f"the {header_name} header")


def resolve_session_id(
    body_session_id: Any,
    header_values: Iterable[str],
    vllm_xargs: Mapping[str, Any] | None | Any = None,
    header_name: str = SESSION_HEADER,
) -> str | None:
    """Apply the precedence body > header > vllm_xargs; return the id or None.

    ``body_session_id`` is the decoded JSON value of the body field (None when absent).
    ``header_values`` are all values of the ``X-Session-ID`` header (or of ``header_name``, the
    header a router configured with another ``session_header`` reads instead).
    """
    if body_session_id is not None and not isinstance(body_session_id, str):
        raise InvalidSessionIdError(
            f"body field session_id must be a string or null, got {_json_type(body_session_id)}",
            param=SESSION_BODY_FIELD,
        )
    # Header conflicts are rejected even when the body wins: the request is ambiguous.
    from_header = session_from_headers(header_values, header_name)
    if body_session_id:
        return validate_session_id(body_session_id, "the body field session_id")
    if from_header is not None:
        return from_header
    if isinstance(vllm_xargs, Mapping):
        xarg = vllm_xargs.get(SESSION_BODY_FIELD)
        if isinstance(xarg, str) and xarg:
            return validate_session_id(xarg, 'vllm_xargs["session_id"]')
    return None


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__

"""Session ids the router makes itself (``[sessions] stamp``): derived from a conversation, or minted.

``derive``: ``conv-`` + 32 hex of a canonical digest of what stays the same on every turn of one
conversation: the system (and developer) messages and the first user message of a chat request,
or the first input item of a Responses request. Two turns of one conversation give the same id;
nothing is remembered. ``mint``: ``sess-`` + 32 random hex, when nothing can be derived.

The request fields come undecoded (``msgspec.Raw``, see ``router.bodies``) and are decoded here
only when an id must be derived.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import msgspec


class _Message(msgspec.Struct):
    role: Any = None
    content: Any = None


_messages_decoder = msgspec.json.Decoder(list[_Message])
_any_decoder = msgspec.json.Decoder()
_canonical = msgspec.json.Encoder(order="sorted")


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

"""Session ids the router makes itself (``[sessions] stamp``): derived from a conversation, or minted.

Only for requests that no vLLM channel and no agent header (``router.sessions.agents``) names a
session for.

``derive``: ``conv-`` + 32 hex of a canonical digest of who sent the request and of what stays the
same on every turn of one conversation: the system (and developer) messages and the first user
message of a chat request, or the first input item of a Responses request. Two turns of one
conversation from one sender give the same id; nothing is remembered. ``mint``: ``sess-`` + 32
random hex, when nothing can be derived.

The sender (``sender_key``): the ``Authorization`` header's value when the request has one, else
the client's address (its IP, without the port: one client's turns come over many connections).
Only a blake2b digest of it enters the id; the credential is never stored, logged or shown (the
id is a digest of the digest, and a bearer token is far too long to be guessed back from it). So
two users who open with the same words get two sessions, and one user's turns share one. Every
client behind one proxy or address without credentials is one sender (the benchmark's no-header
variant: every client on 127.0.0.1, no ``Authorization``): their ids still differ by
conversation, as before. Behind a load balancer the address is the balancer's; ``X-Forwarded-For``
is not read (any client could set it).

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


_AUTH_PERSON = b"sr-sender-auth"
_PEER_PERSON = b"sr-sender-peer"


def sender_key(authorization: str | None, peer: str | None) -> str:
    """Who sent a request, for the derived id: 32 hex of blake2b over the ``Authorization`` value
    (surrounding whitespace removed) when there is one, else over the client's address; "" when
    neither is known. The two never coincide (different blake2b personalisations)."""
    if authorization:
        return hashlib.blake2b(authorization.strip().encode("utf-8", "surrogateescape"), digest_size=16,
                               person=_AUTH_PERSON).hexdigest()
    if peer:
        return hashlib.blake2b(peer.encode("utf-8", "surrogateescape"), digest_size=16,
                               person=_PEER_PERSON).hexdigest()
    return ""


def derive_chat_session(messages: msgspec.Raw, sender: str = "") -> str | None:
    """``conv-`` + 32 hex from ``sender`` (``sender_key``), the system messages and the first user
    message, or None."""
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
            return "conv-" + _digest([sender, anchor])
    return None


def derive_responses_session(input_raw: msgspec.Raw, sender: str = "") -> str | None:
    """``conv-`` + 32 hex from ``sender`` (``sender_key``) and the first input item of a Responses
    request, or None."""
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
    return "conv-" + _digest(["responses", sender, first])


def mint_session() -> str:
    return "sess-" + os.urandom(16).hex()

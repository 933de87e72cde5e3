"""Request ids without a uuid4 per request: a random per-process prefix plus a counter.

Shared by the router and the backends; unique across processes (the prefix is 48 random bits)
and cheap on the hot path.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets


class IdGenerator:
    __slots__ = ("_prefix", "_counter")

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(6)
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):08x}"


def session_hash(session_id: str) -> str:
    """A short stable stand-in for a session id where the id itself must not appear (metrics labels):
    BLAKE2b with a 64-bit digest of the id's UTF-8 bytes, as 16 hex digits. The same everywhere and
    across restarts; an operator computes it with ``printf %s ID | b2sum -l 64`` or
    ``hashlib.blake2b(ID.encode(), digest_size=8).hexdigest()``."""
    return hashlib.blake2b(session_id.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()

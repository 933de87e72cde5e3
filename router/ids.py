"""Request ids without a uuid4 per request: a random per-process prefix plus a counter.

Shared by the router and the backends; unique across processes (the prefix is 48 random bits)
and cheap on the hot path.
"""

from __future__ import annotations

import itertools
import secrets


class IdGenerator:
    __slots__ = ("_prefix", "_counter")

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(6)
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):08x}"

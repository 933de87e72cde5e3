"""How many live sessions each backend holds pinned: what the ``kv_aware`` policy spreads new sessions by.

A rendezvous hash spreads sessions evenly only on average: 100 sessions over 2 backends land 60/40 or worse
about one draw in eighteen (the draw depends on the backends' URLs), and a policy that keeps every session where
it was first placed keeps that split for the sessions' whole lives. ``kv_aware`` with ``session_balance`` set skips a new
session's hash choice when that backend already holds more than its share of the pinned sessions
(``balance_bound``; consistent hashing with bounded loads, counted in sessions rather than requests).

The session table keeps each entry's pins in a ``CountedPins``: a dict (pool name -> backend URL) that keeps
one ``PinCounts`` current on every write. A pin set or moved (by a placement, or learnt from another router
process through the shared state) and an entry leaving the table (``release``) change the counts at once,
whoever writes. An entry released from the table no longer counts, even if a request still holding it
writes its pins afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

_NONE: Mapping[str, int] = {}


def balance_bound(factor: float, total: int, count: int) -> int:
    """The most pinned sessions a backend may hold for a new session to be placed there: ``factor`` times
    the mean over ``count`` backends once the new session is counted (``total + 1``), rounded up."""
    return math.ceil(factor * (total + 1) / count)


class PinCounts:
    """Pool name -> backend URL -> live sessions pinned there."""

    __slots__ = ("_pools",)

    def __init__(self) -> None:
        self._pools: dict[str, dict[str, int]] = {}

    def of(self, pool: str) -> Mapping[str, int]:
        """Backend URL -> sessions pinned there in ``pool`` (URLs with none are absent)."""
        return self._pools.get(pool, _NONE)

    def moved(self, pool: str, old: str | None, new: str | None) -> None:
        """One session's pin in ``pool`` went from ``old`` to ``new`` (None: no pin)."""
        counts = self._pools.get(pool)
        if counts is None:
            counts = self._pools[pool] = {}
        if old is not None:
            left = counts.get(old, 0) - 1
            if left > 0:
                counts[old] = left
            else:
                counts.pop(old, None)
        if new is not None:
            counts[new] = counts.get(new, 0) + 1


class CountedPins(dict[str, str]):
    """A session's pins (pool name -> backend URL) that keep a ``PinCounts`` current (module docstring).
    Every way of changing a dict goes through ``__setitem__`` or ``_drop``."""

    __slots__ = ("_counts",)

    def __init__(self, counts: PinCounts) -> None:
        super().__init__()
        self._counts: PinCounts | None = counts

    def __setitem__(self, pool: str, url: str) -> None:
        old = self.get(pool)
        if old == url:
            return
        dict.__setitem__(self, pool, url)
        if self._counts is not None:
            self._counts.moved(pool, old, url)

    def __delitem__(self, pool: str) -> None:
        old = self[pool]
        dict.__delitem__(self, pool)
        if self._counts is not None:
            self._counts.moved(pool, old, None)

    def pop(self, pool: str, *default: Any) -> Any:  # type: ignore[override]
        if pool not in self:
            return dict.pop(self, pool, *default)
        old = self[pool]
        del self[pool]
        return old

    def popitem(self) -> tuple[str, str]:
        pool, url = dict.popitem(self)
        if self._counts is not None:
            self._counts.moved(pool, url, None)
        return pool, url

    def setdefault(self, pool: str, url: str) -> str:  # type: ignore[override]
        if pool not in self:
            self[pool] = url
        return self[pool]

    def update(self, *others: Mapping[str, str] | Iterable[tuple[str, str]], **pins: str) -> None:  # type: ignore[override]
        for other in others:
            items = other.items() if isinstance(other, Mapping) else other
            for pool, url in items:
                self[pool] = url
        for pool, url in pins.items():
            self[pool] = url

    def __ior__(self, other: Mapping[str, str] | Iterable[tuple[str, str]]) -> CountedPins:  # type: ignore[override]
        self.update(other)
        return self

    def clear(self) -> None:
        while self:
            self.popitem()

    def release(self) -> None:
        """The entry left the session table: its pins stop counting, now and on any later write (they stay
        readable: a request in flight may still hold the entry)."""
        counts = self._counts
        if counts is None:
            return
        self._counts = None
        for pool, url in self.items():
            counts.moved(pool, url, None)

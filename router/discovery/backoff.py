"""Bounded exponential backoff with jitter, for retrying a discovery API or DNS server."""

from __future__ import annotations

import random


class Backoff:
    """Waits that double from ``initial_s`` up to ``max_s``, each drawn uniformly from the upper half
    of the current bound ("equal jitter": never shorter than half of it, so retries stay spaced out,
    and spread so that many routers restarted together do not retry in step). ``reset`` after a
    success starts over from ``initial_s``."""

    def __init__(self, initial_s: float, max_s: float, rng: random.Random | None = None) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError(f"backoff needs 0 < initial_s <= max_s, got {initial_s}, {max_s}")
        self.initial_s = initial_s
        self.max_s = max_s
        self._rng = rng or random.Random()
        self._bound = initial_s
        #: failures since the last reset
        self.failures = 0

    def next_delay(self) -> float:
        """The wait before the next attempt (and the bound doubles for the one after)."""
        bound = self._bound
        self._bound = min(self.max_s, bound * 2)
        self.failures += 1
        return bound / 2 + self._rng.uniform(0, bound / 2)

    def reset(self) -> None:
        self._bound = self.initial_s
        self.failures = 0

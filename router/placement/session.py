"""The ``session`` policy: rendezvous hashing with bounded loads, and pins (DESIGN.md §5).

Score of a backend for a session = the first 8 bytes (little-endian) of
``blake2b(url + b"\\0" + session_id, digest_size=8)``: stable across processes and machines, so
router replicas with the same backends rank them identically (Python's salted ``hash()`` is never
used). Only backends that are available and not excluded take part. Candidates are ranked by score,
highest first (ties, practically impossible, by URL).

Bounded loads: with ``total`` the summed load of the participating backends and ``n`` their number,
a backend may take a request when ``load + 1 <= ceil(c * (total + 1) / n)`` (c = load factor ≥ 1).
With integer loads and c ≥ 1 some backend always qualifies; otherwise the least loaded is taken.
New placements, re-pins and spill targets meet this bound.

A request of a pinned session may instead bring its pin up to the *sticky bound*
``max(bound, ceil((total + 1) / n) + h)`` (h = ``sticky_headroom``, default 2 requests). The pin
holds the session's cached prefix, and every spill recomputes it elsewhere. At low concurrency the
factor leaves less than one request of room over the mean (10 in flight over 4 backends: bound 4,
mean 2.75), so chance fluctuations alone spilled 12-18% of a multi-turn benchmark's requests; the
headroom keeps them home. Once ``(c - 1) * mean >= h`` the factor's bound is the larger one, so at
scale the load stays within the factor exactly as before. ``h = 0`` restores the plain bound.

Pins (``entry.pins[pool.name]``, a backend URL) decide the outcome:

- no pin: the first qualifying candidate, pinned -> NEW; a child agent session (``hint.parent_entry``,
  ``router.sessions.agents``) first goes to its parent's pin when that is available and within the
  sticky bound (the parent's prompt prefix, its system prompt and tools, is cached there) -> NEW
- pin available, not excluded, within the sticky bound -> STICKY
- pin over the sticky bound: the first other candidate within the bound, and the pin MOVES there
  -> SPILL. That backend now holds the session's freshest prefix (the spilled turn), so the next
  turn hits there; a kept pin would miss the spilled turn, and a busy pin would keep spilling its
  sessions one request at a time instead of shedding a few of them.
- pin present but unavailable (unhealthy by a health check, or by a failed connection, which the
  proxy reports before retrying; or draining): re-placed and re-pinned -> REPIN_UNHEALTHY
- pin available but in ``exclude`` (this request already failed there without the backend being
  marked down, e.g. a 503 or a timeout): this request elsewhere, pin kept -> SPILL
- pin no longer in the pool: re-placed and re-pinned -> REPIN_REMOVED
- no session id or no entry: the least-loaded backend -> NO_SESSION

The sticky path costs one pass over the pool (the load total) and no hashing; hashing happens only
for NEW, SPILL and re-pins, from per-backend hash states cached per ``pool.version``.

``pool`` may be a model's candidate set (``BackendPool.for_model``): placement then ranks and
bounds loads over those backends only; pins stay per pool name, so a session that names another
model whose candidates do not include its pin is re-pinned (REPIN_REMOVED).
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

from router.membership import Backend, BackendSet
from router.placement.base import Outcome, Placement, PlacementHint, SessionPins
from router.placement.least_loaded import NOTHING_EXCLUDED, LeastLoaded, no_available_backend

if TYPE_CHECKING:
    from hashlib import _Hash

#: requests of room over the mean that a pinned session keeps on its pin (see the module docstring)
DEFAULT_STICKY_HEADROOM = 2

# Absorbs float rounding in ``c * (total + 1) / n`` (e.g. 1.1 * 10 = 11.000000000000002), far
# below the smallest true fractional part (1/n for integer loads).
_BOUND_EPSILON = 1e-9


def load_bound(load_factor: float, total_load: float, available: int) -> int:
    """Most load a backend may carry after taking one more request: ``ceil(c * (total + 1) / n)``."""
    return math.ceil(load_factor * (total_load + 1) / available - _BOUND_EPSILON)


def sticky_bound(bound: int, total_load: float, available: int, headroom: int) -> int:
    """Most load a pin may carry after taking one more request of its session:
    ``max(bound, ceil((total + 1) / n) + headroom)``."""
    if headroom <= 0:
        return bound
    return max(bound, math.ceil((total_load + 1) / available - _BOUND_EPSILON) + headroom)


def session_score(url: str, session_id: str) -> int:
    """The rendezvous score of ``url`` for ``session_id`` (the definition; ``place`` uses a faster
    equivalent from cached hash states)."""
    digest = hashlib.blake2b(url.encode() + b"\0" + session_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Ring:
    """Per-membership work of one pool: each backend with its URL already absorbed by blake2b."""

    __slots__ = ("version", "states")

    def __init__(self, pool: BackendSet) -> None:
        self.version = pool.version
        self.states: list[tuple[Backend, _Hash]] = [
            (backend, hashlib.blake2b(backend.url.encode() + b"\0", digest_size=8))
            for backend in pool.members
        ]


class SessionPolicy:
    """``session``: sticky, load-bounded placement; see the module docstring."""

    name = "session"

    def __init__(self, *, load_factor: float = 1.25, reported_load_weight: float = 0.0,
                 sticky_headroom: int = DEFAULT_STICKY_HEADROOM) -> None:
        self.load_factor = load_factor
        self.sticky_headroom = sticky_headroom
        self._weight = reported_load_weight
        self._least = LeastLoaded(reported_load_weight)
        #: ``pool.key`` -> that set's ring (a pool's, or a model's candidate set's)
        self._rings: dict[str, Ring] = {}

    # -- the hot path -------------------------------------------------------------------------

    def place(
        self,
        pool: BackendSet,
        session_id: str | None,
        entry: SessionPins | None,
        exclude: frozenset[str] = NOTHING_EXCLUDED,
        hint: PlacementHint | None = None,
    ) -> Placement:
        if session_id is None or entry is None:
            return Placement(self._least.pick(pool, exclude), Outcome.NO_SESSION, "least")
        weight = self._weight
        total = 0.0
        count = 0
        for backend in pool.members:
            if backend.available and not (exclude and backend.url in exclude):
                total += backend.in_flight + weight * backend.reported_load if weight else backend.in_flight
                count += 1
        if count == 0:
            raise no_available_backend(pool)
        bound = load_bound(self.load_factor, total, count)

        pins = entry.pins
        pin = pins.get(pool.name)
        if pin is None:
            outcome = Outcome.NEW
            parent = hint.parent_entry if hint is not None else None
            if parent is not None:  # a child agent session's first request: where its parent is
                home = pool.get(parent.pins.get(pool.name, ""))
                if home is not None and home.available and not (exclude and home.url in exclude):
                    load = home.in_flight + weight * home.reported_load if weight else home.in_flight
                    if load + 1 <= sticky_bound(bound, total, count, self.sticky_headroom):
                        pins[pool.name] = home.url
                        return Placement(home, outcome, "parent")
        else:
            pinned = pool.get(pin)
            if pinned is None:
                outcome = Outcome.REPIN_REMOVED
            elif not pinned.available:
                outcome = Outcome.REPIN_UNHEALTHY
            elif exclude and pin in exclude:
                # Already tried for this request and failed without being marked down (a 503, a
                # timeout): this request goes elsewhere, the pin stays.
                return Placement(self._choose(pool, session_id, exclude, bound), Outcome.SPILL, "retry")
            else:
                load = pinned.in_flight + weight * pinned.reported_load if weight else pinned.in_flight
                if load + 1 <= sticky_bound(bound, total, count, self.sticky_headroom):
                    return Placement(pinned, Outcome.STICKY, "cached")
                # The pin is over the sticky bound (so over the bound too): the first candidate
                # within the bound is another backend, and the session moves there.
                target = self._choose(pool, session_id, exclude, bound)
                if target is pinned:  # fractional loads: nobody within the bound, the pin is least loaded
                    return Placement(target, Outcome.STICKY, "cached")
                pins[pool.name] = target.url
                return Placement(target, Outcome.SPILL, "load")
        target = self._choose(pool, session_id, exclude, bound)
        pins[pool.name] = target.url
        return Placement(target, outcome, "hash" if outcome is Outcome.NEW else "unavailable")

    # -- ranking ------------------------------------------------------------------------------

    def candidates(
        self, pool: BackendSet, session_id: str, exclude: frozenset[str] = NOTHING_EXCLUDED
    ) -> list[Backend]:
        """The available, non-excluded backends of ``pool`` in score order for ``session_id``."""
        return [backend for _, _, backend in self._ranked(pool, session_id, exclude)]

    def _ranked(
        self, pool: BackendSet, session_id: str, exclude: frozenset[str]
    ) -> list[tuple[int, str, Backend]]:
        ring = self._rings.get(pool.key)
        if ring is None or ring.version != pool.version:
            ring = self._rings[pool.key] = Ring(pool)
        key = session_id.encode()
        ranked: list[tuple[int, str, Backend]] = []
        for backend, state in ring.states:
            if not backend.available or (exclude and backend.url in exclude):
                continue
            h = state.copy()
            h.update(key)
            ranked.append((int.from_bytes(h.digest(), "little"), backend.url, backend))
        ranked.sort(key=_rank_key, reverse=True)
        return ranked

    def _choose(
        self,
        pool: BackendSet,
        session_id: str,
        exclude: frozenset[str],
        bound: int,
    ) -> Backend:
        """The first candidate in score order within ``bound``; when none is (only possible with
        fractional loads), the least loaded, the earliest in score order among equals."""
        ranked = self._ranked(pool, session_id, exclude)
        weight = self._weight
        least: Backend | None = None
        least_load = 0.0
        for _, _, backend in ranked:
            load = backend.in_flight + weight * backend.reported_load if weight else backend.in_flight
            if load + 1 <= bound:
                return backend
            if least is None or load < least_load:
                least, least_load = backend, load
        if least is None:  # unreachable: place() checked that a backend is available
            raise no_available_backend(pool)
        return least


def _rank_key(item: tuple[int, str, Backend]) -> tuple[int, str]:
    return item[0], item[1]

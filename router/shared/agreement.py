"""Where a placement left a session's pin, compared with its first choice: the agreement metric and the
pin writes of the shared state.

A session's *first choice* is the backend of the candidate set with the highest rendezvous score
(``router.placement.session.session_score``) among the available ones: what every replica picks for it
when nothing else matters. The proxy calls ``placed`` after a placement of a session with the pin it
had before, except when ``placed`` would do nothing: the request went to its unchanged pin, the session
is on its first choice (``off_first`` empty) and no shared state is kept. Only when the pin changed is
the first choice computed (hashing the candidates once) and the answer kept on the entry
(``SessionEntry.off_first``: the reason, "" when on it). A request that went elsewhere than its pin (a
retry, a Responses follow-up at the backend that stored its response) is compared with the first choice
then.

Reasons (``session_router_off_first_choice_total{reason}``): the placement's reason for new sessions
and spills (``load``, ``wait``, ``kv_pressure``, ``cached``, ``parent``, ``balance``: a new session
whose first choice held more than its share of the pinned sessions; a new session's rendezvous
choice pushed off its first choice by the load bound is ``load``), ``repin`` (the pin was unhealthy or
gone), ``retry`` (this request failed on its pin), ``response`` (a Responses follow-up at its stored
response's backend). A pin learnt from another process (``router.shared.store``) keeps that process's
reason when it is off their own first choice (their backends may differ).
"""

from __future__ import annotations

from typing import Protocol

from router.membership import Backend, BackendSet
from router.placement.base import Outcome, Placement
from router.placement.session import session_score
from router.sessions.table import SessionEntry


class PinWriter(Protocol):
    """Where pin changes go (``router.shared.store.SharedState``)."""

    def pin_moved(self, session_id: str, pool: str, url: str, reason: str, *, publish: bool = True,
                  new: bool = False) -> None: ...

#: the reason label's closed set (a peer's unknown reason is counted as "other")
OFF_FIRST_REASONS = frozenset(
    ("load", "balance", "wait", "kv_pressure", "evicted", "cached", "parent", "repin", "retry", "response",
     "unavailable", "other")
)
_REPINS = frozenset((Outcome.REPIN_UNHEALTHY, Outcome.REPIN_REMOVED))


def first_choice(pool: BackendSet, session_id: str) -> Backend | None:
    """The available backend of ``pool`` with the highest rendezvous score for ``session_id`` (ties by
    URL, as the ``session`` policy ranks), None when none is available."""
    best: Backend | None = None
    best_key = (-1, "")
    for backend in pool.members:
        if backend.available:
            key = (session_score(backend.url, session_id), backend.url)
            if key > best_key:
                best, best_key = backend, key
    return best


def off_first_reason(placement: Placement) -> str:
    """Why ``placement`` put a session where it did, as the metric's reason."""
    outcome = placement.outcome
    if outcome in _REPINS:
        return "repin"
    if outcome is Outcome.STICKY:
        return "response"  # sticky but not at its pin: at the backend holding its previous response
    reason = placement.reason
    if outcome is Outcome.NEW and reason in ("hash", ""):
        return "load"
    return reason if reason in OFF_FIRST_REASONS else "other"


class Agreement:
    """Counts placements off the first choice; tells the shared state (if any) of pin changes."""

    __slots__ = ("counts", "shared", "refresh_s")

    def __init__(self, shared: PinWriter | None = None, *, refresh_s: float = 1800.0) -> None:
        #: reason -> requests placed off their session's first choice (exported by ``SharedMetrics``)
        self.counts: dict[str, int] = {}
        self.shared = shared
        #: a pin in use is written to the shared state again after this long (its TTL / 2)
        self.refresh_s = refresh_s

    def placed(self, pool: BackendSet, session_id: str, entry: SessionEntry, before: str | None,
               placement: Placement, now: float) -> None:
        """After a placement of ``session_id`` in ``pool``: ``before`` = its pin there before the
        placement, ``now`` = the request's (loop) start time."""
        pin = entry.pins.get(pool.name)
        shared = self.shared
        if pin != before and pin is not None:  # pinned or moved by this placement
            first = first_choice(pool, session_id)
            why = off_first_reason(placement)
            off = "" if first is not None and first.url == pin else why
            entry.off_first = off
            if shared is not None:
                # every pin is written, a new one too: a replica that meets the session later reads it
                # rather than placing it by its own view of the load; the others judge "off first choice"
                # on their own backends, so they get the reason either way
                if before is None:  # a session's first pin: why only when off the first choice here
                    shared.pin_moved(session_id, pool.name, pin, off, new=True)
                else:
                    shared.pin_moved(session_id, pool.name, pin, why)
                entry.shared_until = now + self.refresh_s
        if pin is None:  # a session-blind policy (round_robin, least_loaded) pins nothing
            return
        if placement.backend.url == pin:
            if shared is not None and now > entry.shared_until:  # a pin in use stays alive in Redis
                shared.pin_moved(session_id, pool.name, pin, entry.off_first, publish=False)
                entry.shared_until = now + self.refresh_s
            off = entry.off_first
            if not off:
                return
        else:  # not at its pin: a retry elsewhere, or a Responses follow-up where its response is
            first = first_choice(pool, session_id)
            if first is not None and first is placement.backend:
                return
            off = off_first_reason(placement)
        counts = self.counts
        counts[off] = counts.get(off, 0) + 1

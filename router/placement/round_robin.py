"""The ``round_robin`` policy: available backends in turn, session-blind, for comparison."""

from __future__ import annotations

from router.membership import BackendSet
from router.placement.base import Outcome, Placement, PlacementHint, SessionPins
from router.placement.least_loaded import NOTHING_EXCLUDED, no_available_backend


class RoundRobinPolicy:
    """Each pool (and each model's candidate set) has its own cursor; unavailable and excluded
    backends are skipped. No pins."""

    name = "round_robin"

    def __init__(self) -> None:
        #: ``pool.key`` (a pool, or a model's candidate set) -> index in ``pool.members`` of the
        #: next backend to try
        self._cursor: dict[str, int] = {}

    def place(
        self,
        pool: BackendSet,
        session_id: str | None,
        entry: SessionPins | None,
        exclude: frozenset[str] = NOTHING_EXCLUDED,
        hint: PlacementHint | None = None,
    ) -> Placement:
        members = pool.members
        count = len(members)
        index = self._cursor.get(pool.key, 0)
        if index >= count:
            index = 0
        for _ in range(count):
            backend = members[index]
            index += 1
            if index == count:
                index = 0
            if backend.available and not (exclude and backend.url in exclude):
                self._cursor[pool.key] = index
                return Placement(backend, Outcome.NO_SESSION)
        raise no_available_backend(pool)

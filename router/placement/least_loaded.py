"""The ``least_loaded`` policy: the available backend with the smallest load, session-blind.

Load of a backend = ``in_flight + reported_load_weight * reported_load``. Ties go round-robin:
the scan starts just after the backend chosen last time in the same pool (or a model's candidate
set in it), and the first backend with the smallest load wins. The session policy uses
``LeastLoaded.pick`` for requests without a session, and the other policies use
``no_available_backend`` for their one error.
"""

from __future__ import annotations

from contract.errors import NoHealthyBackendError
from router.membership import Backend, BackendSet
from router.placement.base import Outcome, Placement, PlacementHint, SessionPins

NOTHING_EXCLUDED: frozenset[str] = frozenset()


def no_available_backend(pool: BackendSet) -> NoHealthyBackendError:
    """The 503 raised when a pool (or a model's candidate set) has no backend left for a request."""
    return NoHealthyBackendError(
        f"no available backend in {pool.describe()}: every backend is unhealthy, draining "
        f"or already failed for this request; check the backends' /health and the router's "
        f"/admin/backends"
    )


def backend_load(backend: Backend, reported_load_weight: float) -> float:
    """The load signal every policy compares (see the module docstring)."""
    if reported_load_weight:
        return backend.in_flight + reported_load_weight * backend.reported_load
    return backend.in_flight


class LeastLoaded:
    """Chooses the least-loaded available backend of a pool; one tie-breaking cursor per pool."""

    __slots__ = ("_weight", "_cursor")

    def __init__(self, reported_load_weight: float = 0.0) -> None:
        self._weight = reported_load_weight
        #: ``pool.key`` (a pool, or a model's candidate set) -> index in ``pool.members`` where the
        #: next scan starts
        self._cursor: dict[str, int] = {}

    def pick(self, pool: BackendSet, exclude: frozenset[str] = NOTHING_EXCLUDED) -> Backend:
        members = pool.members
        count = len(members)
        index = self._cursor.get(pool.key, 0)
        if index >= count:
            index = 0
        weight = self._weight
        best: Backend | None = None
        best_load = 0.0
        after_best = 0
        for _ in range(count):
            backend = members[index]
            index += 1
            if index == count:
                index = 0
            if not backend.available or (exclude and backend.url in exclude):
                continue
            load = backend.in_flight + weight * backend.reported_load if weight else backend.in_flight
            if best is None or load < best_load:
                best, best_load, after_best = backend, load, index
        if best is None:
            raise no_available_backend(pool)
        self._cursor[pool.key] = after_best
        return best


class LeastLoadedPolicy:
    """``least_loaded``: every request to the least-loaded available backend; no pins."""

    name = "least_loaded"

    def __init__(self, *, reported_load_weight: float = 0.0) -> None:
        self._picker = LeastLoaded(reported_load_weight)

    def place(
        self,
        pool: BackendSet,
        session_id: str | None,
        entry: SessionPins | None,
        exclude: frozenset[str] = NOTHING_EXCLUDED,
        hint: PlacementHint | None = None,
    ) -> Placement:
        return Placement(self._picker.pick(pool, exclude), Outcome.NO_SESSION, "least")

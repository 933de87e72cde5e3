"""What every placement policy shares: the closed set of outcomes and the ``Policy`` protocol."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from router.membership import Backend, BackendSet


class Outcome(enum.Enum):
    """Every way a placement decision can go; one metric label value each."""

    NEW = "new"  # session seen for the first time in this pool: pinned now
    STICKY = "sticky"  # went to its pin
    SPILL = "spill"  # pin over its load bound (the pin moves along) or failed for this request (pin kept)
    REPIN_UNHEALTHY = "repin_unhealthy"  # pin unhealthy (health check or failed connection): re-pinned
    REPIN_REMOVED = "repin_removed"  # pin no longer in the pool: re-pinned
    NO_SESSION = "no_session"  # request without a session (or a session-blind policy)


@dataclass(slots=True)
class Placement:
    backend: Backend
    outcome: Outcome


class SessionPins(Protocol):
    """The part of a session-table entry a policy reads and writes: pool name -> backend URL."""

    pins: dict[str, str]


class Policy(Protocol):
    name: str

    def place(
        self,
        pool: BackendSet,
        session_id: str | None,
        entry: SessionPins | None,
        exclude: frozenset[str] = frozenset(),
    ) -> Placement:
        """Choose a backend of ``pool`` (a whole pool, or the candidate set of the request's model)
        for one request.

        ``entry`` is the session's table entry (None without a session); the policy may set
        ``entry.pins[pool.name]``. ``exclude`` holds URLs already tried for this request (retries).
        Raises ``NoHealthyBackendError`` when no available backend is left.
        """
        ...

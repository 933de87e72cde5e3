"""What every placement policy shares: the closed set of outcomes, the request's hint, the decision and
the ``Policy`` protocol."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

import msgspec

from router.membership import Backend, BackendSet


class Outcome(enum.Enum):
    """Every way a placement decision can go; one metric label value each."""

    NEW = "new"  # session seen for the first time in this pool: pinned now
    STICKY = "sticky"  # went to its pin
    SPILL = "spill"  # pin over its load bound (the pin moves along) or failed for this request (pin kept)
    REPIN_UNHEALTHY = "repin_unhealthy"  # pin unhealthy (health check or failed connection): re-pinned
    REPIN_REMOVED = "repin_removed"  # pin no longer in the pool: re-pinned
    NO_SESSION = "no_session"  # request without a session (or a session-blind policy)


#: why a decision went as it did: the closed set of the ``reason`` label
REASONS = (
    "cached",  # where the session's (or prompt's) KV is: predicted fastest, or not clearly slower
    "hash",  # a new session's rendezvous-hash choice (within the load bound)
    "balance",  # a new session whose hash choice held more than its share of pinned sessions: the next one
    "parent",  # a child session's first request, where its parent's KV (or pin) is
    "wait",  # moved: the pin's (or hash choice's) predicted wait made another backend clearly faster
    "kv_pressure",  # moved: the pin's KV cache is nearly full (eviction / preemption risk)
    "evicted",  # moved: the pin's KV events show the session's prefix gone there; where predicted fastest
    "load",  # moved: the pin is over the load bound (the safety net)
    "retry",  # this request already failed on the pin: elsewhere, pin kept
    "unavailable",  # the pin is unhealthy, draining or gone: re-placed
    "least",  # no session: the least loaded of the backends predicted fastest
)


class Placement(msgspec.Struct, gc=False):
    """A policy's decision for one request (made per request: a Struct, built in C, and never tracked by the
    cyclic GC, since nothing it holds refers back to it)."""

    backend: Backend
    outcome: Outcome
    #: why (one of ``REASONS``; "" from policies that do not say)
    reason: str = ""
    #: tokens of the request's prompt predicted cached on ``backend``
    cached_tokens: int = 0
    #: predicted seconds the request waits there before its prefill (queue, KV pressure, in-flight work)
    wait_s: float = 0.0
    #: predicted time to first token there, seconds (0.0 from policies that do not predict)
    predicted_ttft_s: float = 0.0


class PlacementHint(msgspec.Struct, gc=False):
    """What the proxy knows about a request that a policy predicting its time to first token reads (made per
    request, like ``Placement``)."""

    #: prompt tokens: exact in tokens mode, else estimated from the body's length
    prompt_tokens_estimate: int = 0
    #: tokens mode: the rendered prompt's ids (None in text mode)
    prompt_ids: Sequence[int] | None = None
    #: the parent session of a child agent session (``SessionEntry.parent``), when known
    parent_session: str | None = None
    #: the parent's table entry (its pins), when it is still in the session table
    parent_entry: SessionPins | None = None
    #: tokens the session's last request left in its pin's cache (its prompt + answer; 0 when unknown)
    last_tokens: int = 0


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
        hint: PlacementHint | None = None,
    ) -> Placement:
        """Choose a backend of ``pool`` (a whole pool, or the candidate set of the request's model)
        for one request.

        ``entry`` is the session's table entry (None without a session); the policy may set
        ``entry.pins[pool.name]``. ``exclude`` holds URLs already tried for this request (retries).
        ``hint``: the request's prompt size, ids and parent session (policies that ignore it take None).
        Raises ``NoHealthyBackendError`` when no available backend is left.
        """
        ...

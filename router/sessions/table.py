"""The router's session table: one entry per live session, bounded in size and idle time.

An ``OrderedDict`` kept in least-recently-active-first order: ``touch`` moves an entry to the
end in O(1), capacity eviction pops the front, and ``sweep`` walks from the front and stops at the
first entry that has not expired (every later entry was active more recently). Idle time is
measured on a monotonic clock; ``created`` and ``last_active`` are wall-clock unix times for
display only.

Every entry that leaves the table goes through ``on_evict(entry, reason)`` with reason
``"ttl"`` (idle past ``ttl_s``), ``"capacity"`` (pushed out by a new session over
``max_sessions``) or ``"deleted"`` (``delete``), so metrics can follow the table exactly.

Each entry's pins are a ``router.placement.spread.CountedPins`` over the table's ``pin_counts``: how many
live sessions each backend holds pinned, current on every pin write and every eviction.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Literal

import msgspec

from contract.errors import BadRequestError, ConfigError
from contract.ids import session_hash
from router.placement.spread import CountedPins, PinCounts

EvictReason = Literal["ttl", "capacity", "deleted"]
EvictHook = Callable[["SessionEntry", EvictReason], None]


class SessionView(msgspec.Struct, kw_only=True):
    """The JSON of one session in ``GET /v1/sessions`` and ``GET /v1/sessions/{id}``."""

    session_id: str
    #: pool name (``default``, or ``prefill``/``decode``) -> backend URL
    pins: dict[str, str]
    requests: int
    #: unix times
    created: float
    last_active: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    errors: int
    #: the backend (name, which defaults to its URL) that served the last request; "" before the first
    last_backend: str
    #: ``contract.ids.session_hash`` of the id: its ``session`` label on /metrics (session_label = "hash")
    session_hash: str
    #: the parent session its first request named (``x-parent-session-id``), if any
    parent: str | None = None
    #: backend URL -> the session's tokens resident in that backend's KV cache, as the router's KV
    #: index knows them from the engines' KV events (``router.kv``; {} when it knows none or is off)
    kv: dict[str, int] = {}


@dataclass(slots=True, eq=False)
class SessionEntry:
    """One session's pins and counters. The proxy updates the counters; the table only ages it.

    ``requests`` is not counted by the table: the caller adds 1 per routed request (not per retry).
    """

    session_id: str
    #: wall-clock unix time of creation and of the last ``touch``
    created: float
    last_active: float
    #: monotonic time of the last ``touch`` (TTL and LRU order)
    last_seen: float
    #: pool name -> backend URL; read and written by the placement policy
    pins: dict[str, str] = field(default_factory=dict)
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    errors: int = 0
    last_backend: str = ""
    #: prompt + completion tokens of the last answer that reported usage: what it left in its
    #: backend's prefix cache (placement's estimate of the pin's cached tokens without KV events)
    last_tokens: int = 0
    #: the parent session (an agent's ``x-parent-session-id``, ``router.sessions.agents``), set by
    #: the proxy when the entry is created; placement sends its first request where the parent is
    parent: str | None = None
    #: why its pin (in the pool the proxy places) is not its first-choice (rendezvous) backend, "" when
    #: it is: set when the pin is set or moved (``router.shared.agreement``), read per request
    off_first: str = ""
    #: loop time after which its off-first pin is written to the shared state again (``router.shared``)
    shared_until: float = 0.0

    def record_usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        """Add one response's usage."""
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.cached_tokens += cached_tokens
        if prompt_tokens:
            self.last_tokens = prompt_tokens + completion_tokens

    @property
    def cached_ratio(self) -> float:
        """Share of prompt tokens served from a prefix cache (0.0 before any usage)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def duration(self) -> float:
        """Seconds between creation and the last activity (wall clock)."""
        return max(0.0, self.last_active - self.created)

    def to_json(self, kv: Mapping[str, int] | None = None) -> SessionView:
        """The session's JSON view; ``kv``: its resident tokens per backend (``KVIndex.session_tokens``)."""
        return SessionView(
            session_id=self.session_id,
            pins=dict(self.pins),
            requests=self.requests,
            created=self.created,
            last_active=self.last_active,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            errors=self.errors,
            last_backend=self.last_backend,
            session_hash=session_hash(self.session_id),
            parent=self.parent,
            kv=dict(kv) if kv else {},
        )


class SessionTable:
    """Bounded LRU of ``SessionEntry`` with an idle TTL; see the module docstring."""

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        *,
        on_evict: EvictHook | None = None,
    ) -> None:
        if max_sessions < 1:
            raise ConfigError(f"max_sessions = {max_sessions!r}: must be at least 1")
        if not ttl_s > 0:
            raise ConfigError(f"session_ttl_s = {ttl_s!r}: must be a number of seconds > 0")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._clock = clock
        self._wall_clock = wall_clock
        #: called for every entry that leaves the table; may be set after construction
        self.on_evict: EvictHook | None = on_evict
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()
        #: live sessions pinned per pool and backend: every entry's pins are a ``CountedPins`` of these
        self.pin_counts = PinCounts()

    def add_evict_hook(self, hook: EvictHook) -> None:
        """Call ``hook`` too for every entry that leaves, after the hooks set before (``on_evict``
        becomes one function calling each; with no hook set it is ``hook`` itself)."""
        first = self.on_evict
        if first is None:
            self.on_evict = hook
            return
        earlier: EvictHook = first

        def both(entry: SessionEntry, reason: EvictReason) -> None:
            earlier(entry, reason)
            hook(entry, reason)

        self.on_evict = both

    def __len__(self) -> int:
        """Entries held, including expired ones that no call has noticed yet (see ``sweep``)."""
        return len(self._entries)

    def get(self, session_id: str) -> SessionEntry | None:
        """The live entry, without marking it active; an expired one is evicted and None returned."""
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        if self._clock() - entry.last_seen > self.ttl_s:
            self._remove(entry, "ttl")
            return None
        return entry

    def touch(self, session_id: str) -> SessionEntry:
        """The entry for ``session_id`` (created if absent or expired), marked most recently active."""
        now = self._clock()
        entries = self._entries
        entry = entries.get(session_id)
        if entry is not None:
            if now - entry.last_seen <= self.ttl_s:
                entry.last_seen = now
                entry.last_active = self._wall_clock()
                entries.move_to_end(session_id)
                return entry
            self._remove(entry, "ttl")
        if len(entries) >= self.max_sessions:
            oldest = next(iter(entries.values()))
            self._remove(oldest, "ttl" if now - oldest.last_seen > self.ttl_s else "capacity")
        wall = self._wall_clock()
        entry = SessionEntry(session_id, created=wall, last_active=wall, last_seen=now,
                             pins=CountedPins(self.pin_counts))
        entries[session_id] = entry
        return entry

    def delete(self, session_id: str) -> bool:
        """Forget a session; False when it was not in the table (or had already expired)."""
        entry = self._entries.get(session_id)
        if entry is None:
            return False
        if self._clock() - entry.last_seen > self.ttl_s:
            self._remove(entry, "ttl")
            return False
        self._remove(entry, "deleted")
        return True

    def recent(self, limit: int, offset: int = 0) -> list[SessionEntry]:
        """Live entries, most recently active first, skipping ``offset`` and returning up to ``limit``.

        Raises ``BadRequestError`` (400) for a negative ``limit`` or ``offset``.
        """
        if limit < 0:
            raise BadRequestError(f"limit must be 0 or more, got {limit}", param="limit")
        if offset < 0:
            raise BadRequestError(f"offset must be 0 or more, got {offset}", param="offset")
        self.sweep()
        return list(islice(reversed(self._entries.values()), offset, offset + limit))

    def sweep(self) -> int:
        """Evict every expired entry (reason ``"ttl"``); returns how many left."""
        now = self._clock()
        ttl = self.ttl_s
        entries = self._entries
        evicted = 0
        while entries:
            oldest = next(iter(entries.values()))
            if now - oldest.last_seen <= ttl:
                break
            self._remove(oldest, "ttl")
            evicted += 1
        return evicted

    def _remove(self, entry: SessionEntry, reason: EvictReason) -> None:
        del self._entries[entry.session_id]
        if self.on_evict is not None:
            self.on_evict(entry, reason)
        pins = entry.pins
        if isinstance(pins, CountedPins):
            pins.release()

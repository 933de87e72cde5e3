"""Each session's last rendered prompt, kept for the incremental render of its next turn.

``PromptCache`` maps a session id to the ``rendering.incremental.PromptState`` its last chat request
rendered to. The tokens data path reads it before a local render (``get``), passes it as ``previous``
and stores the new state after (``put``): the next turn then tokenizes only its new tail. The states
are large (a long conversation's text and ids: tens of bytes per token), so the cache has its own
memory bound, ``max_bytes`` (config ``[tokens] prompt_cache_bytes``), counted with each state's
``nbytes`` estimate, and forgets the least recently used session first. ``max_bytes = 0`` keeps nothing
(every render is a full one). A session the session table forgets (idle TTL, capacity, ``DELETE``) is
dropped here too: ``attach(table)`` adds ``forget`` to the table's eviction hooks.

A state holds the prompt only, never the answer's token ids: the next turn's template renders the
answer as text again, and that text's tokens need not be the ids the engine generated.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from contract.errors import ConfigError

if TYPE_CHECKING:
    from rendering.incremental import PromptState
    from router.sessions.table import SessionEntry, SessionTable


class PromptCache:
    """Session id -> ``PromptState``, least recently used first, under ``max_bytes`` in all."""

    __slots__ = ("max_bytes", "nbytes", "_states")

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ConfigError(f"prompt_cache_bytes = {max_bytes!r}: must be 0 (off) or more")
        self.max_bytes = max_bytes
        #: the sum of the kept states' ``nbytes`` (as counted when they were put)
        self.nbytes = 0
        self._states: OrderedDict[str, tuple[PromptState, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._states

    def get(self, session_id: str) -> PromptState | None:
        """The session's last prompt state (now the most recently used), or None."""
        held = self._states.get(session_id)
        if held is None:
            return None
        self._states.move_to_end(session_id)
        return held[0]

    def put(self, session_id: str, state: PromptState) -> None:
        """Keep ``state`` as the session's last prompt (replacing the one before), then forget the least
        recently used sessions until the cache is within ``max_bytes``. A state larger than the whole
        bound is not kept (and the session's older state is dropped: it no longer describes it)."""
        self.drop(session_id)
        size = state.nbytes
        if size > self.max_bytes:
            return
        states = self._states
        while self.nbytes + size > self.max_bytes:
            _, (_, oldest) = states.popitem(last=False)
            self.nbytes -= oldest
        states[session_id] = (state, size)
        self.nbytes += size

    def drop(self, session_id: str) -> bool:
        """Forget the session's state; False when there was none."""
        held = self._states.pop(session_id, None)
        if held is None:
            return False
        self.nbytes -= held[1]
        return True

    def forget(self, entry: SessionEntry, reason: str) -> None:
        """The session table's eviction hook: the session left the table, its prompt goes too."""
        self.drop(entry.session_id)

    def attach(self, table: SessionTable) -> None:
        """Drop a session's state whenever ``table`` forgets the session."""
        table.add_evict_hook(self.forget)

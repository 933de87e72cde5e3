"""Responses API routing memory: which backend created a response id (vLLM keeps response state
in process memory, so a ``previous_response_id`` must go back there). A bounded LRU."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from contract.errors import ConfigError


class ResponseIndex:
    """``response_id -> (backend URL, session id or None)`` for the ``max_ids`` most recently used ids."""

    __slots__ = ("max_ids", "_ids", "on_remember")

    def __init__(self, max_ids: int) -> None:
        if max_ids < 0:
            raise ConfigError(f"max_response_ids = {max_ids!r}: must be 0 (remember none) or more")
        self.max_ids = max_ids
        self._ids: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        #: told of every id the proxy remembers (the shared state writes it for the other replicas)
        self.on_remember: Callable[[str, str, str | None], None] | None = None

    def remember(self, response_id: str, backend_url: str, session_id: str | None, *, share: bool = True) -> None:
        """Record (or overwrite) where ``response_id`` lives; evicts the least recently used id.
        ``share=False``: learnt from the shared state, not told back to it."""
        if self.max_ids == 0:
            return
        if share and self.on_remember is not None:
            self.on_remember(response_id, backend_url, session_id)
        ids = self._ids
        ids[response_id] = (backend_url, session_id)
        ids.move_to_end(response_id)
        if len(ids) > self.max_ids:
            ids.popitem(last=False)

    def lookup(self, response_id: str) -> tuple[str, str | None] | None:
        """``(backend URL, session id)`` for a remembered id (marking it recently used), else None."""
        found = self._ids.get(response_id)
        if found is not None:
            self._ids.move_to_end(response_id)
        return found

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._ids

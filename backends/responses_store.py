"""The Responses API store: responses kept in process memory for ``previous_response_id``.

Unlike vLLM (where ``VLLM_ENABLE_RESPONSES_API_STORE=1`` must be set), the store is ALWAYS on
here: every response created with ``store`` not false is kept, so ``GET /v1/responses/{id}`` and
``previous_response_id`` work out of the box. It is bounded: past ``max_entries`` the least
recently used response is dropped (vLLM's store never evicts). As in vLLM it lives in one
process, so follow-up turns must reach the same backend (the router's job).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from rendering.responses_objects import ResponseObject

DEFAULT_MAX_ENTRIES = 10_000


@dataclass(slots=True, eq=False)
class StoredResponse:
    response: ResponseObject
    #: the conversation as chat messages (``{"role", "content"}``), this response's answer last;
    #: instructions are not part of it (OpenAI semantics: instructions do not carry over to the next turn)
    conversation: list[dict[str, str]]


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def put(self, response_id: str, item: StoredResponse) -> None:
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)

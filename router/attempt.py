"""One request's journey through the proxy: what it resolved to and where it went.

Made by ``Proxy.handle`` for every request and read by the P/D hand-off (``router.pd``) and the
accounting; it holds no behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from router.membership import Backend, BackendSet
from router.placement.base import Outcome, Placement
from router.routes import Route

if TYPE_CHECKING:
    from router.sessions.table import SessionEntry
    from router.usage import Usage


class Attempt:
    """One request's journey: what it resolved to and where it went."""

    __slots__ = ("route", "request_id", "session_id", "entry", "started", "backend", "status", "pool", "home",
                 "ttfb", "outcome", "usage", "prompt_ids", "placement")

    def __init__(self, route: Route, request_id: str, started: float) -> None:
        self.route = route
        self.request_id = request_id
        self.session_id: str | None = None
        self.entry: SessionEntry | None = None
        self.started = started
        self.backend: Backend | None = None
        self.status = 0
        #: where it may go: the serving pool, or the candidate set of the model it names
        self.pool: BackendSet | None = None
        #: URL of the backend that must serve it when available (a stored Responses API id)
        self.home: str | None = None
        #: seconds from the start until the (last) backend's response head arrived
        self.ttfb: float | None = None
        #: the (last) placement's outcome
        self.outcome: Outcome | None = None
        #: the answer's token usage, when the router read it
        self.usage: Usage | None = None
        #: tokens mode: the rendered prompt's token ids (known before placement; None in text mode)
        self.prompt_ids: Sequence[int] | None = None
        #: the (last) placement decision (the decision header reads it)
        self.placement: Placement | None = None

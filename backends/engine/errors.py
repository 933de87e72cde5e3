"""What the engine raises to its callers: plain exceptions, no HTTP in them.

The backend's HTTP layer (``backends.http_errors``) maps each to a status and OpenAI's error
shape; nothing in ``backends/engine`` knows about HTTP::

    EngineError
     +-- EngineDeadError          the step loop is not running (stopped, or it failed)  -> 503
     +-- DuplicateRequestIdError  a request id already in flight in this engine         -> 400
"""

from __future__ import annotations


class EngineError(Exception):
    """Something the engine refuses or cannot do; ``param``: the request field it concerns."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EngineDeadError(EngineError):
    """The engine loop is not running (stopped, or it failed): nothing can be generated."""


class DuplicateRequestIdError(EngineError):
    """A request id already in flight in this engine."""

"""The raw front's settings as its connections and exchanges read them: fixed at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.config import FrontConfig
from router.sessions.agents import CAPTURED_HEADERS

#: the [front] settings' defaults (the schema's), for callers that give fewer
FRONT_DEFAULTS = FrontConfig()


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    #: a larger request body gets a 413 (``max_body_bytes``)
    max_body_bytes: int
    #: a body not whole this long after its head gets a 408 (``body_timeout_s``)
    body_timeout_s: float
    #: the client-side session header's name, lower case (``session_header``)
    session_header_b: bytes
    #: request headers never forwarded as received, lower case (``router.exchange.DROP_REQUEST`` and the session header)
    drop_request_b: frozenset[bytes]
    #: a larger request head gets a 400 and the connection closes (``max_head_bytes``)
    max_head_bytes: int = FRONT_DEFAULTS.max_head_bytes
    #: forwarded headers the parser also keeps for the proxy, lower case: the agent session headers
    #: (``router.sessions.agents``) and ``authorization`` (hashed only when a session id is derived)
    capture_b: frozenset[bytes] = field(init=False)
    #: the names the parser looks at at all (``drop_request_b`` and ``capture_b``): any other header
    #: costs one set lookup
    watch_b: frozenset[bytes] = field(init=False)

    def __post_init__(self) -> None:
        capture = frozenset(n.encode() for n in CAPTURED_HEADERS) | {b"authorization"}
        capture -= self.drop_request_b  # a session header configured under an agent's name is the session header
        object.__setattr__(self, "capture_b", capture)
        object.__setattr__(self, "watch_b", self.drop_request_b | capture)

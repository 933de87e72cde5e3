"""The route table: the routes the router proxies, how it reads their bodies, and which paths are
never forwarded. Both the proxy and the fronts (which serve the table's POST routes natively and
relay the rest) read it; it imports nothing of either.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote


@dataclass(frozen=True, slots=True)
class Route:
    """A proxied route and how the router reads its body."""

    name: str  # metric label
    path: str
    #: chat | completion | responses | generate | plain | other (a route the router does not name)
    kind: str

    @property
    def session_aware(self) -> bool:
        """An inference route of the router's session contract (stamping, usage accounting)."""
        return self.kind not in OPEN_KINDS


ROUTES: tuple[Route, ...] = (
    Route("chat", "/v1/chat/completions", "chat"),
    Route("completions", "/v1/completions", "completion"),
    Route("responses", "/v1/responses", "responses"),
    Route("generate", "/inference/v1/generate", "generate"),
    Route("tokenize", "/tokenize", "plain"),
    Route("detokenize", "/detokenize", "plain"),
)

#: every route the router does not name, any method (forwarded when ``Proxy.forwards`` says so)
OTHER = Route("other", "", "other")

#: kinds whose body is the backend's to judge: read only when it is a JSON object
OPEN_KINDS = frozenset(("plain", "other"))

#: the router's own routes: never forwarded (canonical paths; the prefixes cover what is below them)
ROUTER_PATHS = frozenset(("/health", "/metrics", "/v1/models"))
ROUTER_PREFIXES = ("/v1/sessions", "/admin")
NAMED_PATHS = frozenset(route.path for route in ROUTES)

#: a path a lenient server could read as another one: never forwarded (vLLM's routes are plain paths)
AMBIGUOUS = re.compile(r"//|\\|%2f|%5c|%00|(?:^|/)(?:\.|%2e){1,2}(?:/|$)", re.IGNORECASE)
_SLASHES = re.compile(r"/{2,}")
_PARAMS = re.compile(r";[^/]*")


def canonical_path(target: str) -> str:
    """The path of a request target as a lenient server might read it, for deciding what is never
    forwarded: query dropped, percent-decoded, lower case, ``\\`` as ``/``, ``;params`` dropped,
    repeated slashes merged, dot segments resolved."""
    path = unquote(target.partition("?")[0], errors="surrogateescape").lower().replace("\\", "/")
    return posixpath.normpath(_SLASHES.sub("/", _PARAMS.sub("", path)) or "/")


def path_rules(paths: Iterable[str]) -> tuple[frozenset[str], tuple[str, ...]]:
    """``(exact, prefixes)`` matching each of ``paths`` and everything below it (canonical)."""
    bases = [canonical_path(path).rstrip("/") for path in paths]
    return frozenset(base or "/" for base in bases), tuple(base + "/" for base in bases)

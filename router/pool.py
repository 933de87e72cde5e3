"""Backends and pools: the router's view of where it may send a request.

A ``Backend`` is one upstream server; a ``BackendPool`` is a named set of them (``default`` in
aggregated mode, ``prefill`` and ``decode`` in P/D mode). Membership changes rebuild nothing per
request: policies read ``pool.members`` and each backend's live state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from router.errors import ConfigError

POOL_DEFAULT = "default"
POOL_PREFILL = "prefill"
POOL_DECODE = "decode"


@dataclass(slots=True, eq=False)
class Backend:
    """One upstream server and the router's live knowledge of it."""

    url: str
    pool: str = POOL_DEFAULT
    #: label used in metrics and the admin API; defaults to the URL
    name: str = ""
    host: str = field(init=False)
    port: int = field(init=False)
    healthy: bool = True
    #: set by ``DELETE /admin/backends/{name}``: no new requests, removed when idle
    draining: bool = False
    #: requests this router has in flight on the backend
    in_flight: int = 0
    #: ``vllm:num_requests_running + vllm:num_requests_waiting`` last scraped (0 when not scraped)
    reported_load: float = 0.0
    consecutive_failures: int = 0
    #: monotonic time until which a passively ejected backend is skipped (half-open after)
    ejected_until: float = 0.0

    def __post_init__(self) -> None:
        self.url = normalize_url(self.url)
        parts = urlsplit(self.url)
        self.host = parts.hostname or ""
        self.port = parts.port or 80
        if not self.name:
            self.name = self.url

    @property
    def available(self) -> bool:
        """May receive new requests."""
        return self.healthy and not self.draining


def normalize_url(url: str) -> str:
    """Validate a backend base URL (``http://host:port``) and return it without a trailing slash.

    The messages say what to write instead: a URL without a scheme gets the ``http://`` form, a
    comma-joined list the advice to give one URL per backend.
    """
    if "," in url:
        raise ConfigError(f"backend URL {url!r} holds a comma: give one URL per backend")
    if "://" not in url:
        raise ConfigError(f"backend URL {url!r} has no scheme: add one, e.g. http://{url.lstrip('/')}")
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ConfigError(f"backend URL {url!r}: only http:// URLs are supported")
    if not parts.hostname:
        raise ConfigError(f"backend URL {url!r} has no host")
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"backend URL {url!r} has an invalid port") from exc
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(f"backend URL {url!r}: give only scheme, host and port, e.g. http://127.0.0.1:8100")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    return f"http://{host}:{port or 80}"


class BackendPool:
    """A named, ordered set of backends."""

    def __init__(self, name: str, backends: list[Backend] | None = None) -> None:
        self.name = name
        self.members: list[Backend] = []
        self._by_url: dict[str, Backend] = {}
        #: bumped on every membership change, so policies can cache per-membership work
        self.version = 0
        for backend in backends or ():
            self.add(backend)

    def add(self, backend: Backend) -> Backend:
        if backend.url in self._by_url:
            raise ConfigError(f"backend {backend.url} is already in pool {self.name!r}")
        backend.pool = self.name
        self.members.append(backend)
        self._by_url[backend.url] = backend
        self.version += 1
        return backend

    def remove(self, url: str) -> Backend | None:
        backend = self._by_url.pop(url, None)
        if backend is not None:
            self.members.remove(backend)
            self.version += 1
        return backend

    def get(self, url: str) -> Backend | None:
        return self._by_url.get(url)

    def find(self, name_or_url: str) -> Backend | None:
        backend = self._by_url.get(name_or_url)
        if backend is not None:
            return backend
        for candidate in self.members:
            if candidate.name == name_or_url:
                return candidate
        return None

    def available(self) -> list[Backend]:
        return [b for b in self.members if b.available]

    def total_in_flight(self) -> int:
        return sum(b.in_flight for b in self.members)

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.members)

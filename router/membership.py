"""Membership: the backends and their pools, the router's view of where it may send a request.

A ``Backend`` is one upstream server; a ``BackendPool`` is a named set of them (``default`` in
aggregated mode, ``prefill`` and ``decode`` in P/D mode). Membership changes rebuild nothing per
request: policies read ``pool.members`` and each backend's live state.

Models: each backend's served models (``Backend.models``, learned from its ``GET /v1/models`` by
the health checker) split a pool into *candidate sets*, one ``BackendSet`` per model, rebuilt when
membership or a backend's models change, never per request. ``pool.for_model(name)`` is one dict
lookup: the pool itself when every member may serve the model (the usual one-model cluster), the
members that serve it otherwise, and ``None`` when no member serves it. A backend whose models
are not known yet (never fetched, or it has no ``/v1/models``) is a candidate for every model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from contract.errors import ConfigError

POOL_DEFAULT = "default"
POOL_PREFILL = "prefill"
POOL_DECODE = "decode"


class Ledger:
    """What placement may know of a pool's backends without a pass over them (``kv_aware``'s
    no-pass settlement): kept by ``Backend.__setattr__`` for the backends of one ``BackendPool``.

    - ``added`` / ``drops``: in-flight units added to / removed from the pool's *available* members
      (``healthy`` and not ``draining``), counted as ``in_flight`` is written: between two moments,
      the change of ``added - drops`` is how much their in-flight total moved, and the change of
      ``drops`` bounds how far any one member's count fell.
    - ``version``: bumped whenever anything else a placement pass reads of a member changes value
      (``WATCHED``: availability, the scrape's queue and load fields, the learned constants; not
      ``reported_load``, which ``kv_aware`` reads only with a ``reported_load_weight``), when a
      member's in-flight count is written below 0, and when members join or leave.
    - ``inexact``: how many of the members' ``engine_waiting`` and ``others_at_scrape`` values are
      not whole numbers (or are negative), so that sums of them are not exact in floats; and 1 more
      while a member also belongs to another pool's ledger.

    The proxy's only cost is on its two ``in_flight`` writes per request (``Backend.admit``, ``release``).
    """

    __slots__ = ("added", "drops", "version", "inexact")

    def __init__(self) -> None:
        self.added = 0
        self.drops = 0
        self.version = 0
        self.inexact = 0


#: the ``Backend`` fields besides ``in_flight`` whose change bumps its pool's ``Ledger.version``
WATCHED = frozenset((
    "healthy", "draining", "engine_waiting", "in_flight_at_scrape", "others_at_scrape",
    "step_s", "prefill_s_per_token", "queued_request_s", "busy_s_per_request",
))
#: the watched fields whose values are summed (``Ledger.inexact`` counts those that are not whole, or negative)
_SUMMED = frozenset(("engine_waiting", "others_at_scrape"))


#: a field's write without ``Backend.__setattr__`` (``admit``, ``release``)
_set_field = object.__setattr__


def _inexact(value: float) -> int:
    """1 when ``value`` is not a whole number >= 0 (sums of it would not be exact in floats), else 0."""
    return 0 if value >= 0 and float(value).is_integer() else 1


@dataclass(slots=True, eq=False)
class Backend:
    """One upstream server and the router's live knowledge of it."""

    #: the pool's ``Ledger`` (None outside a pool): set by ``BackendPool.add``, kept by ``__setattr__`` (and
    #: ``admit``/``release``);
    #: the first field, so that ``__init__`` sets it before the others (``__setattr__`` reads it)
    ledger: Ledger | None = field(default=None, init=False, repr=False)
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
    # -- the engine's own load, scraped from its /metrics (``router.engine_load``; 0 when not scraped)
    #: ``vllm:num_requests_waiting``: requests the engine queues (real queueing, not batching)
    engine_waiting: float = 0.0
    #: ``vllm:num_requests_running``
    engine_running: float = 0.0
    #: ``vllm:kv_cache_usage_perc`` (0..1)
    kv_usage: float = 0.0
    #: the KV cache's size in tokens (``vllm:cache_config_info``: num_gpu_blocks x block_size; 0: unknown)
    kv_capacity_tokens: int = 0
    #: monotonic time of the last scrape (0.0: never)
    load_scraped_at: float = 0.0
    #: ``in_flight`` when it was scraped: ``in_flight - in_flight_at_scrape`` arrived since
    in_flight_at_scrape: int = 0
    #: the engine's requests at the scrape (running + waiting) beyond this router's ``in_flight`` then:
    #: other router replicas' or workers' (or direct clients'); ``in_flight + others_at_scrape`` is the
    #: engine's load as every replica sees it alike (0 when not scraped, or for a lone router)
    others_at_scrape: float = 0.0
    #: scrapes in a row, up to the last, that found the engine queueing (``engine_waiting > 0``)
    queued_scrapes: int = 0
    #: the least ``engine_waiting`` of the last ``QUEUE_SCRAPES`` (3) scrapes: the queue that persisted
    #: (0 unless all of them saw the engine queue; ``router.engine_load``)
    queued_floor: float = 0.0
    # -- the model's constants learned from that engine's counters (-1.0: not learned, use the configured)
    #: seconds to prefill one prompt token
    prefill_s_per_token: float = -1.0
    #: seconds before a request's first token besides its own prefill (its first step, and what it
    #: meets there: queueing, stalls)
    step_s: float = -1.0
    #: seconds of one decode step (the mean inter-token latency)
    decode_step_s: float = -1.0
    #: seconds each request the engine has waiting delays a new one
    queued_request_s: float = -1.0
    #: seconds one request in flight adds to a new request's first step, on average (its prefill share)
    busy_s_per_request: float = -1.0
    #: tokens a request generates there, on average (the KV a running request still grows by)
    output_tokens: float = -1.0
    consecutive_failures: int = 0
    #: monotonic time until which a passively ejected backend is skipped (half-open after)
    ejected_until: float = 0.0
    #: model ids its ``GET /v1/models`` lists (None: not known yet; set through ``BackendPool.set_models``)
    models: frozenset[str] | None = None
    #: the model cards of that answer, as received (the router's ``/v1/models`` merges them)
    model_cards: tuple[dict[str, Any], ...] = ()

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

    def admit(self) -> None:
        """One more of this router's requests in flight here (``in_flight += 1`` as ``__setattr__`` keeps
        the ledger, without its dispatch: the data path's writes)."""
        in_flight = self.in_flight + 1
        _set_field(self, "in_flight", in_flight)
        ledger = self.ledger
        if ledger is not None and self.healthy and not self.draining:
            ledger.added += 1

    def release(self) -> None:
        """One of this router's requests here ended (``in_flight -= 1``, as ``admit``)."""
        in_flight = self.in_flight - 1
        _set_field(self, "in_flight", in_flight)
        ledger = self.ledger
        if ledger is not None and self.healthy and not self.draining:
            ledger.drops += 1
            if in_flight < 0:
                ledger.version += 1

    def __setattr__(self, name: str, value: Any, _set: Any = object.__setattr__) -> None:
        """Set a field, keeping the pool's ``Ledger`` (its docstring): in-flight units added and
        dropped on available members, and a version bumped by any other change a placement pass reads."""
        if name == "in_flight":
            ledger = self.ledger
            if ledger is not None and self.healthy and not self.draining:
                moved = value - self.in_flight
                if moved > 0:
                    ledger.added += moved
                elif moved < 0:
                    ledger.drops -= moved
                    if value < 0:
                        ledger.version += 1
        elif name in WATCHED:
            ledger = self.ledger
            if ledger is not None:
                old = getattr(self, name)
                if old != value:
                    ledger.version += 1
                    if name in _SUMMED:
                        ledger.inexact += _inexact(value) - _inexact(old)
        _set(self, name, value)


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


class BackendSet:
    """An ordered set of backends that placement chooses from: a whole pool, or the candidate set
    of one model in it (see ``BackendPool.for_model``). Placement only reads it.

    ``name`` is the pool's name (session pins are per pool); ``key`` names this set for the
    per-set caches of policies (cursors, hash rings), and ``version`` changes whenever the set
    may have changed (its pool's ``version`` when it was built).
    """

    #: a pool's ``Ledger`` (``BackendPool``); None for a candidate set of some of its members
    ledger: Ledger | None = None

    def __init__(self, name: str, key: str, members: list[Backend], version: int = 0,
                 model: str | None = None) -> None:
        self.name = name
        self.key = key
        self.members = members
        self._by_url: dict[str, Backend] = {b.url: b for b in members}
        self.version = version
        #: the model this candidate set serves (None: a whole pool)
        self.model = model

    def describe(self) -> str:
        """How error messages name the set: ``pool 'default'`` or ``pool 'default' for model 'm'``."""
        where = f"pool {self.name!r}"
        return where if self.model is None else f"{where} for model {self.model!r}"

    def get(self, url: str) -> Backend | None:
        return self._by_url.get(url)

    def available(self) -> list[Backend]:
        return [b for b in self.members if b.available]

    def total_in_flight(self) -> int:
        return sum(b.in_flight for b in self.members)

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator[Backend]:
        return iter(self.members)


class BackendPool(BackendSet):
    """A named, ordered set of backends, and its candidate sets per model (module docstring)."""

    def __init__(self, name: str, backends: list[Backend] | None = None) -> None:
        super().__init__(name, name, [])
        #: what ``Backend.__setattr__`` keeps of the members for placement (``Ledger``)
        self.ledger = Ledger()
        #: model id -> its candidate set (``self`` when every member may serve it)
        self._by_model: dict[str, BackendSet] = {}
        #: members whose models are not known yet (None when there are none): any model may go there
        self._unknown: BackendSet | None = None
        for backend in backends or ():
            self.add(backend)

    def add(self, backend: Backend) -> Backend:
        if backend.url in self._by_url:
            raise ConfigError(f"backend {backend.url} is already in pool {self.name!r}")
        backend.pool = self.name
        ledger = self.ledger
        if backend.ledger is not None:  # it is in another pool too: neither ledger is exact any more
            backend.ledger.inexact += 1
            ledger.inexact += 1
        ledger.inexact += _inexact(backend.engine_waiting) + _inexact(backend.others_at_scrape)
        backend.ledger = ledger
        self.members.append(backend)
        self._by_url[backend.url] = backend
        self._changed()
        return backend

    def remove(self, url: str) -> Backend | None:
        backend = self._by_url.pop(url, None)
        if backend is not None:
            self.members.remove(backend)
            if backend.ledger is self.ledger:
                self.ledger.inexact -= _inexact(backend.engine_waiting) + _inexact(backend.others_at_scrape)
                backend.ledger = None
            self._changed()
        return backend

    def find(self, name_or_url: str) -> Backend | None:
        backend = self._by_url.get(name_or_url)
        if backend is not None:
            return backend
        for candidate in self.members:
            if candidate.name == name_or_url:
                return candidate
        return None

    # -- models ---------------------------------------------------------------------------------

    def set_models(self, backend: Backend, models: frozenset[str] | None,
                   cards: tuple[dict[str, Any], ...] = ()) -> bool:
        """Record what ``backend`` serves; rebuild the candidate sets when that changed. Returns
        whether the model ids changed."""
        backend.model_cards = cards
        if backend.models == models:
            return False
        backend.models = models
        if self._by_url.get(backend.url) is backend:
            self._changed()
        return True

    def for_model(self, model: object) -> BackendSet | None:
        """The candidate set for a request naming ``model``: the whole pool when it names none
        (absent or empty: vLLM then serves its own model; not a string: any backend rejects it),
        else the members that serve it plus those whose models are not known yet, or None when
        there are none (every member's models are known, and none lists it)."""
        if not model or not isinstance(model, str):
            return self
        found = self._by_model.get(model)
        return found if found is not None else self._unknown

    def _changed(self) -> None:
        """Membership or models changed: bump the version and rebuild the candidate sets."""
        self.version += 1
        self.ledger.version += 1
        members = self.members
        unknown = [b for b in members if b.models is None]
        if not unknown:
            self._unknown = None
        elif len(unknown) == len(members):
            self._unknown = self
        else:
            self._unknown = BackendSet(self.name, f"{self.name}\0unknown", unknown, self.version)
        by_model: dict[str, BackendSet] = {}
        for backend in members:
            for model in sorted(backend.models or ()):
                if model in by_model:
                    continue
                candidates = [b for b in members if b.models is None or model in b.models]
                by_model[model] = self if len(candidates) == len(members) else BackendSet(
                    self.name, f"{self.name}\0model:{model}", candidates, self.version, model)
        self._by_model = by_model

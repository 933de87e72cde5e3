"""The ``kv_aware`` policy as it was before its all-candidates path was made faster (commit 4ea8bc5),
kept verbatim (class renamed ``ReferenceKVAwarePolicy``; since then only the *evicted* rule, the room
at a move's target and the KV fit check added, a KV home's ties broken by rendezvous score and the
hash choice's allowance for other routers' requests, in their plainest forms) as the reference that
``test_kv_aware_equivalence`` compares the current policy's decisions against. Not used by the router.
"""


from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.membership import Backend, BackendSet
from router.placement.base import Outcome, Placement, PlacementHint, SessionPins
from router.placement.least_loaded import NOTHING_EXCLUDED, no_available_backend
from router.placement.session import Ring, load_bound, session_score

#: placements between two refreshes of a pool's load total and fastest constants on the sticky fast path
STATS_EVERY = 16
#: pools up to this size refresh them on every placement (one pass costs less than the bookkeeping)
SMALL_POOL = 8
#: at 100% KV usage the prompt is charged this many times more (eviction of its prefix, a preemption)
KV_PRESSURE_WEIGHT = 2.0
#: a backend that neither queues nor is KV-pressured is left only when its learned constants alone predict
#: this many times the other's TTFT (a slow engine: 5x and more); less is load-dependent noise (an
#: engine's step includes what it meets, so the busier one looks slower and sessions would wander)
SLOW_FACTOR = 3.0
EVICTED_TOKENS = 256

_EMPTY: Mapping[str, int] = {}


def usage_now(backend: Backend) -> float:
    """``backend``'s KV usage now, estimated from the scrape's: scaled by the engine's requests now
    against then. Then: this router's ``in_flight_at_scrape`` + ``others_at_scrape`` (+ 1). Now: then +
    the change of this router's in-flight count since, which, when other replicas or workers hold
    requests there too, stands for the engine's whole change in proportion (they serve alike traffic,
    and their requests finish and arrive as ours do, unseen here until the next scrape). A lone router:
    ``(in_flight + 1) / (in_flight_at_scrape + 1)``."""
    at = backend.in_flight_at_scrape
    others = backend.others_at_scrape
    change = backend.in_flight - at
    if others > 0 and at > 0:
        change = change * (at + others) / at
    then = at + others + 1
    return backend.kv_usage * (then + change) / then


class KVView(Protocol):
    """What the policy reads of the router's KV index (``router.kv.index.KVIndex``)."""

    def session_tokens(self, session_id: str) -> Mapping[str, int]: ...

    def prefix_tokens(self, prompt_ids: Sequence[int]) -> Mapping[str, int]: ...

    def has_events(self, backend_url: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class KVAwareSettings:
    """The ``[placement]`` settings of the ``kv_aware`` policy (ranges checked by the config schema)."""

    prefill_tokens_per_s: float = 4000.0
    per_request_step_s: float = 0.010
    queued_request_s: float = 0.1
    move_factor: float = 1.5
    move_margin_s: float = 0.005
    kv_pressure_from: float = 0.9
    max_load_factor: float = 2.0
    load_factor: float = 1.25
    sticky_headroom: int = 2
    reported_load_weight: float = 0.0


class _PoolStats:
    """Per candidate set: its load total and the cheapest constants among its available members."""

    __slots__ = ("version", "age", "total", "count", "min_step", "min_per_token")

    def __init__(self) -> None:
        self.version = -1
        self.age = 0
        self.total = 0.0
        self.count = 0
        self.min_step = 0.0
        self.min_per_token = 0.0


class ReferenceKVAwarePolicy:
    """``kv_aware``: see the module docstring."""

    name = "kv_aware"

    def __init__(self, settings: KVAwareSettings = KVAwareSettings(), *, kv: KVView | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        #: backend URL -> when the prefill work this router sent there is done, by the prediction's own
        #: prefill cost (``ahead``; one entry per backend URL placed on)
        self._ahead: dict[str, float] = {}
        #: backend -> (its ``load_scraped_at``, the prompts placed there since, in order)
        self._sent: dict[Backend, tuple[float, list[int]]] = {}
        #: the current placement's prompt tokens (as sized by the index)
        self._prompt = 0
        #: the clock at the current placement
        self._now = 0.0
        #: the router's KV index (None: no KV events; the pins stand in for it). Settable after construction.
        self.kv = kv
        self._per_token = 1.0 / settings.prefill_tokens_per_s
        self._step = settings.per_request_step_s
        self._queued = settings.queued_request_s
        self._factor = settings.move_factor
        self._margin = settings.move_margin_s
        self._kv_from = settings.kv_pressure_from
        self._kv_span = max(1e-9, 1.0 - settings.kv_pressure_from)
        self._weight = settings.reported_load_weight
        #: ``pool.key`` -> its members with their URL absorbed by blake2b (rendezvous ranking of new sessions)
        self._rings: dict[str, Ring] = {}
        self._stats: dict[str, _PoolStats] = {}
        #: ``pool.key`` -> where the next no-session scan starts (ties go round-robin)
        self._cursor: dict[str, int] = {}

    # ------------------------------------------------------------------ the prediction
    def predict(self, backend: Backend, prompt: int, cached: int) -> tuple[float, float]:
        """(predicted TTFT, of which waiting) for a ``prompt``-token request with ``cached`` tokens
        resident on ``backend``, in seconds (module docstring)."""
        per_token = backend.prefill_s_per_token
        if per_token < 0:
            per_token = self._per_token
        step = backend.step_s
        if step < 0:
            step = self._step
        wait = 0.0
        waiting = backend.engine_waiting
        if waiting > 0:
            queue = waiting + backend.in_flight - backend.in_flight_at_scrape
            if queue > 0:
                queued = backend.queued_request_s
                wait = queue * (queued if queued >= 0 else self._queued)
        busy = backend.busy_s_per_request
        if busy > 0:
            wait += (backend.in_flight + backend.others_at_scrape) * busy
        if backend.kv_usage > self._kv_from:
            wait += self._pressure_s(backend, prompt)
        if backend.in_flight > 0:  # none of this router's requests there: none of its prefill work either
            ahead = self._ahead.get(backend.url, 0.0) - self._now
            if ahead > 0:
                wait += ahead
        uncached = prompt - cached
        return step + (uncached if uncached > 0 else 0) * per_token + wait, wait

    def _pressure_s(self, backend: Backend, prompt: int) -> float:
        """The KV-pressure part of ``backend``'s wait for a ``prompt``-token request (module docstring)."""
        usage = usage_now(backend)
        if usage <= self._kv_from:
            return 0.0
        per_token = backend.prefill_s_per_token
        if per_token < 0:
            per_token = self._per_token
        return min(1.0, (usage - self._kv_from) / self._kv_span) * KV_PRESSURE_WEIGHT * prompt * per_token

    def _clearly_faster(self, slow: float, fast: float) -> bool:
        return slow > self._factor * fast + self._margin

    def _fits(self, backend: Backend, tokens: int) -> bool:
        """Whether a ``tokens``-token prompt fits ``backend``'s free KV cache now: the free share at the
        scrape, less the prompts placed there since; the requests finished since are taken oldest
        first (those in flight at the scrape lower the usage in ``usage_now``'s proportion, then those
        placed since return their prompts' average)."""
        if tokens <= 0:
            return True
        scrape, prompts = self._sent.get(backend, (None, []))
        if scrape != backend.load_scraped_at:
            prompts = []
        at = backend.in_flight_at_scrape
        finished = max(0, at + len(prompts) - backend.in_flight)
        old_done = min(finished, at)
        new_done = finished - old_done
        usage = backend.kv_usage
        if old_done > 0:
            others = backend.others_at_scrape
            change = old_done * (at + others) / at if others > 0 else old_done
            then = at + others + 1
            usage = usage * (then - change) / then
        charged = float(sum(prompts))
        if new_done > 0:
            charged = charged * (len(prompts) - new_done) / len(prompts) if new_done < len(prompts) else 0.0
        growth = 0.0
        if backend.output_tokens > 0:  # room for what this request and those there will generate
            growth = backend.output_tokens * (1.0 + 0.5 * (backend.in_flight + backend.others_at_scrape))
        return tokens + growth <= backend.kv_capacity_tokens * (1.0 - usage) - charged

    def _roomy(self, pool: BackendSet, exclude: frozenset[str], prompt: int, cached_map: Mapping[str, int] | None,
               pinned: Backend, bound: int) -> tuple[Backend, float, float, int] | None:
        """The fastest available backend but ``pinned``, within ``bound``, whose KV capacity is known
        and whose free KV holds the prompt's uncached tokens there (None: none)."""
        best: Backend | None = None
        best_ttft = math.inf
        best_wait = 0.0
        best_cached = 0
        weight = self._weight
        for backend in pool.members:
            if (backend is pinned or backend.kv_capacity_tokens <= 0 or not backend.available
                    or (exclude and backend.url in exclude)):
                continue
            load = backend.in_flight + backend.others_at_scrape + (weight * backend.reported_load if weight else 0.0)
            if bound and load + 1 > bound:
                continue
            cached = cached_map.get(backend.url, 0) if cached_map else 0
            if cached > prompt:
                cached = prompt
            if not self._fits(backend, prompt):
                continue
            ttft, wait = self.predict(backend, prompt, cached)
            if ttft < best_ttft:
                best, best_ttft, best_wait, best_cached = backend, ttft, wait, cached
        return None if best is None else (best, best_ttft, best_wait, best_cached)

    def _settled_slower(self, backend: Backend, prompt: int, cached: int, waiting: float, fast: float,
                        target: Backend) -> bool:
        """Whether ``backend``'s prediction counting only what justifies leaving it (module docstring,
        *hysteresis*) is clearly slower than ``fast``: its learned constants (medians over several
        scrape intervals), its KV pressure, and a queue of ``waiting`` requests (``engine_waiting``, or
        for a pin ``queued_floor``: what persisted over two scrapes), lowered by what finished since
        the scrape but never raised by what was sent since; never the in-flight ``busy`` term
        (in-flight counts wander by chance). Without a queue or pressure, by ``SLOW_FACTOR``."""
        per_token = backend.prefill_s_per_token
        if per_token < 0:
            per_token = self._per_token
        step = backend.step_s
        if step < 0:
            step = self._step
        wait = 0.0
        if waiting > 0:
            since = backend.in_flight - backend.in_flight_at_scrape
            queue = waiting + since if since < 0 else waiting
            if queue > 0:
                queued = backend.queued_request_s
                wait = queue * (queued if queued >= 0 else self._queued)
        if backend.kv_usage > self._kv_from:
            wait += self._pressure_s(backend, prompt)
        uncached = prompt - cached
        ttft = step + (uncached if uncached > 0 else 0) * per_token + wait
        if wait <= 0 and backend.step_s < 0 and backend.prefill_s_per_token < 0:
            return False  # nothing measured there yet: the configured constants are no evidence it is slower
        if wait > 0:
            return ttft > self._factor * fast + self._margin
        # a slow engine: against the target's prediction without the prefill work this router just
        # sent there (``ahead``, charged at a rate the target may not have learned yet)
        return ttft > max(self._factor, SLOW_FACTOR) * (fast - self._ahead_s(target)) + self._margin

    def _ahead_s(self, backend: Backend) -> float:
        """The ``ahead`` term of ``backend``'s prediction (module docstring)."""
        if backend.in_flight <= 0:
            return 0.0
        ahead = self._ahead.get(backend.url, 0.0) - self._now
        return ahead if ahead > 0 else 0.0

    # ------------------------------------------------------------------ the hot path
    def place(
        self,
        pool: BackendSet,
        session_id: str | None,
        entry: SessionPins | None,
        exclude: frozenset[str] = NOTHING_EXCLUDED,
        hint: PlacementHint | None = None,
    ) -> Placement:
        now = self._now = self._clock()
        placement = self._place(pool, session_id, entry, exclude, hint)
        # the chosen backend's prefill of this request is ahead of the next ones sent there (``ahead``)
        backend = placement.backend
        step = backend.step_s
        work = placement.predicted_ttft_s - placement.wait_s - (step if step >= 0 else self._step)
        if backend.kv_capacity_tokens > 0:
            scrape, prompts = self._sent.get(backend, (None, []))
            if scrape != backend.load_scraped_at:
                prompts = []
            self._sent[backend] = (backend.load_scraped_at, prompts + [self._prompt])
        if work > 0:
            ahead = self._ahead.get(backend.url, 0.0)
            self._ahead[backend.url] = (ahead if ahead > now and backend.in_flight > 0 else now) + work
        return placement

    def _place(self, pool: BackendSet, session_id: str | None, entry: SessionPins | None,
               exclude: frozenset[str], hint: PlacementHint | None) -> Placement:
        self._prompt = prompt = hint.prompt_tokens_estimate if hint is not None else 0
        if session_id is None or entry is None:
            return self._no_session(pool, exclude, prompt, self._prefix_map(hint))
        pins = entry.pins
        pin_url = pins.get(pool.name)
        pinned = pool.get(pin_url) if pin_url is not None else None
        if pinned is not None and pinned.available:
            if exclude and pin_url in exclude:
                cached_map = self._cached_map(session_id, hint)
                self._prompt = prompt = self._sized(prompt, cached_map, hint)
                target, ttft, wait, cached = self._fastest(pool, exclude, prompt, cached_map, None, 0, None)
                return Placement(target, Outcome.SPILL, "retry", cached, wait, ttft)
            return self._pinned(pool, session_id, pins, pinned, exclude, hint, prompt)
        outcome = Outcome.NEW if pin_url is None else (
            Outcome.REPIN_REMOVED if pinned is None else Outcome.REPIN_UNHEALTHY)
        return self._new(pool, session_id, pins, exclude, hint, prompt, outcome)

    def _pinned(self, pool: BackendSet, session_id: str, pins: dict[str, str], pinned: Backend,
                exclude: frozenset[str], hint: PlacementHint | None, prompt: int) -> Placement:
        cached_map = self._cached_map(session_id, hint)
        self._prompt = prompt = self._sized(prompt, cached_map, hint)
        pin_cached = -1
        other_cached = 0
        if cached_map:
            pin_cached = cached_map.get(pinned.url, -1)
            for url, tokens in cached_map.items():
                if url != pinned.url and tokens > other_cached:
                    other_cached = tokens
        # added with the *evicted* rule (not in 4ea8bc5): the pin lost most of the session's last turn
        index_held = max(pin_cached, 0)
        evicted = (hint is not None and hint.last_tokens - index_held >= EVICTED_TOKENS
                   and 2 * index_held < hint.last_tokens and self.kv is not None and self.kv.has_events(pinned.url))
        if pin_cached < 0:
            # the index holds none of the session on its pin: none is there when the pin's KV events
            # reach the index (evicted, or the engine restarted); the last prompt + answer otherwise
            kv = self.kv
            pin_cached = 0 if (kv is not None and kv.has_events(pinned.url)) or hint is None else hint.last_tokens
        if pin_cached > prompt:
            pin_cached = prompt
        if other_cached > prompt:
            other_cached = prompt
        pin_ttft, pin_wait = self.predict(pinned, prompt, pin_cached)
        stats = self._pool_stats(pool, exclude)
        if stats.count == 0:
            raise no_available_backend(pool)
        # the sticky fast path: no other backend can be clearly faster, and the pin is within the bound
        floor = stats.min_step + (prompt - other_cached) * stats.min_per_token
        fits = pinned.kv_capacity_tokens <= 0 or self._fits(pinned, prompt)
        if fits and not evicted and not self._clearly_faster(pin_ttft, floor) and pinned.in_flight + pinned.others_at_scrape + 1 <= self._safety_bound(
                stats.total, stats.count):
            return Placement(pinned, Outcome.STICKY, "cached", pin_cached, pin_wait, pin_ttft)
        if not fits:
            # the turn does not fit the pin's free KV (it would be preempted): the fastest backend it fits
            roomy = self._roomy(pool, exclude, prompt, cached_map, pinned, self._safety_bound(stats.total, stats.count))
            scrape, prompts = self._sent.get(pinned, (None, []))
            if scrape != pinned.load_scraped_at:
                prompts = []
            requests = pinned.in_flight_at_scrape + pinned.others_at_scrape + len(prompts)
            held = (pinned.kv_usage * pinned.kv_capacity_tokens + float(sum(prompts))) / requests if requests > 0 else math.inf
            if roomy is not None and prompt - roomy[3] <= held:
                target, ttft, wait, cached = roomy
                pins[pool.name] = target.url
                return Placement(target, Outcome.SPILL, "kv_pressure", cached, wait, ttft)
        # predict every candidate
        stats = self._refresh(pool, exclude)
        bound = self._safety_bound(stats.total, stats.count)
        target, ttft, wait, cached = self._fastest(pool, exclude, prompt, cached_map, pinned, bound, None)
        # added with the room-at-the-target rule: a move goes only where the turn fits
        if target is not pinned and (pin_ttft > ttft + self._margin if evicted else self._clearly_faster(pin_ttft, ttft)):
            target, ttft, wait, cached = self._room(pool, exclude, prompt, cached_map, pinned, bound,
                                                    target, ttft, wait, cached)
        if evicted and target is not pinned and pin_ttft > ttft + self._margin:
            pins[pool.name] = target.url
            return Placement(target, Outcome.SPILL, "cached" if cached > pin_cached else "evicted", cached, wait, ttft)
        if target is not pinned and self._clearly_faster(pin_ttft, ttft) and (
                cached > pin_cached or self._settled_slower(pinned, prompt, pin_cached, pinned.queued_floor, ttft, target)):
            pins[pool.name] = target.url
            pressure = self._pressure_s(pinned, prompt)
            if cached > pin_cached:  # the session's KV is there rather than on its pin (the index says)
                reason = "cached"
            else:
                reason = "kv_pressure" if pressure > 0 and pressure >= pin_wait - pressure else "wait"
            return Placement(target, Outcome.SPILL, reason, cached, wait, ttft)
        if pinned.in_flight + pinned.others_at_scrape + 1 > bound:
            # the safety net: the fastest backend within the bound (the pin is not: it is over it)
            target, ttft, wait, cached = self._fastest(pool, exclude, prompt, cached_map, None, bound, None)
            if target is not pinned:
                target, ttft, wait, cached = self._room(pool, exclude, prompt, cached_map, pinned, bound,
                                                        target, ttft, wait, cached)
            if target is not pinned and (pinned.busy_s_per_request <= 0 or ttft < pin_ttft):
                pins[pool.name] = target.url
                return Placement(target, Outcome.SPILL, "load", cached, wait, ttft)
        return Placement(pinned, Outcome.STICKY, "cached", pin_cached, pin_wait, pin_ttft)

    def _room(self, pool: BackendSet, exclude: frozenset[str], prompt: int, cached_map: Mapping[str, int] | None,
              pinned: Backend, bound: int, target: Backend, ttft: float, wait: float, cached: int
              ) -> tuple[Backend, float, float, int]:
        if target.kv_capacity_tokens <= 0 or self._fits(target, prompt):
            return target, ttft, wait, cached
        roomy = self._roomy(pool, exclude, prompt, cached_map, pinned, bound)
        return roomy if roomy is not None else (pinned, math.inf, 0.0, 0)

    def _new(self, pool: BackendSet, session_id: str, pins: dict[str, str], exclude: frozenset[str],
             hint: PlacementHint | None, prompt: int, outcome: Outcome) -> Placement:
        stats = self._refresh(pool, exclude)
        if stats.count == 0:
            raise no_available_backend(pool)
        cached_map = self._cached_map(session_id, hint)
        self._prompt = prompt = self._sized(prompt, cached_map, hint)
        home: Backend | None = None
        home_cached = 0
        reason = "hash"
        parent = hint.parent_session if hint is not None else None
        bound = self._safety_bound(stats.total, stats.count)
        if cached_map:
            # the index holds this session's own KV (another replica placed it, or this router
            # restarted): its home is where most of it is, as every replica sees alike
            home, home_cached = self._kv_home(pool, exclude, session_id, bound)
            if home is not None:
                reason = "cached"
        if home is None and parent is not None:
            home, home_cached = self._parent_home(pool, exclude, parent, hint)
            if home is not None and home.in_flight + home.others_at_scrape + 1 <= bound:
                reason = "parent"
            else:  # no parent known here, or its backend is over the safety bound
                home, home_cached = None, 0
        if home is None:
            home = self._hash_choice(pool, session_id, exclude, stats)
        if cached_map:
            home_cached = max(home_cached, cached_map.get(home.url, 0))
        if home_cached > prompt:
            home_cached = prompt
        home_ttft, home_wait = self.predict(home, prompt, home_cached)
        target, ttft, wait, cached = self._fastest(pool, exclude, prompt, cached_map, home, bound,
                                                   (home, home_cached))
        if target is not home and self._clearly_faster(home_ttft, ttft) and (
                cached > home_cached or self._settled_slower(home, prompt, home_cached, home.queued_floor, ttft, target)):
            pins[pool.name] = target.url
            return Placement(target, outcome, "cached" if cached > home_cached else "wait", cached, wait, ttft)
        pins[pool.name] = home.url
        return Placement(home, outcome, reason, home_cached, home_wait, home_ttft)

    def _no_session(self, pool: BackendSet, exclude: frozenset[str], prompt: int,
                    cached_map: Mapping[str, int] | None) -> Placement:
        members = pool.members
        count = len(members)
        best = math.inf
        for backend in members:
            if not backend.available or (exclude and backend.url in exclude):
                continue
            cached = cached_map.get(backend.url, 0) if cached_map else 0
            ttft = self.predict(backend, prompt, cached if cached < prompt else prompt)[0]
            if ttft < best:
                best = ttft
        if best == math.inf:
            raise no_available_backend(pool)
        limit = self._factor * best + self._margin
        index = self._cursor.get(pool.key, 0)
        if index >= count:
            index = 0
        chosen: Backend | None = None
        chosen_load = 0.0
        chosen_ttft = chosen_wait = 0.0
        chosen_cached = 0
        after = 0
        weight = self._weight
        for _ in range(count):
            backend = members[index]
            index += 1
            if index == count:
                index = 0
            if not backend.available or (exclude and backend.url in exclude):
                continue
            cached = cached_map.get(backend.url, 0) if cached_map else 0
            if cached > prompt:
                cached = prompt
            ttft, wait = self.predict(backend, prompt, cached)
            if ttft > limit:
                continue
            load = backend.in_flight + backend.others_at_scrape + (weight * backend.reported_load if weight else 0.0)
            if chosen is None or load < chosen_load:
                chosen, chosen_load, after = backend, load, index
                chosen_ttft, chosen_wait, chosen_cached = ttft, wait, cached
        assert chosen is not None  # the fastest is within its own limit
        self._cursor[pool.key] = after
        return Placement(chosen, Outcome.NO_SESSION, "least", chosen_cached, chosen_wait, chosen_ttft)

    # ------------------------------------------------------------------ helpers
    def _cached_map(self, session_id: str, hint: PlacementHint | None) -> Mapping[str, int] | None:
        """Backend URL -> tokens of this request's prompt resident there, from the KV index (None: no
        index, or it knows nothing of this session or prompt)."""
        kv = self.kv
        if kv is None:
            return None
        found = kv.session_tokens(session_id)  # O(1): the index keeps it per session
        if not found and hint is not None and hint.prompt_ids is not None:
            # tokens mode, a session the index has no blocks of yet (a new one): the prompt's own
            # resident prefix (a shared system prompt, a parent's context), one hash per block
            found = kv.prefix_tokens(hint.prompt_ids)
        return found or None

    @staticmethod
    def _sized(prompt: int, cached_map: Mapping[str, int] | None, hint: PlacementHint | None) -> int:
        """``prompt``, raised to the most of the session the KV index holds on any backend when the
        size is estimated from the body (text mode): the session's resident chain is an earlier prompt
        + answer of the conversation that this turn extends (module docstring, ``P``)."""
        if cached_map and hint is not None and hint.prompt_ids is None:
            top = max(cached_map.values())
            if top > prompt:
                return top
        return prompt

    def _prefix_map(self, hint: PlacementHint | None) -> Mapping[str, int] | None:
        kv = self.kv
        if kv is None or hint is None or hint.prompt_ids is None:
            return None
        return kv.prefix_tokens(hint.prompt_ids) or None

    def _kv_home(self, pool: BackendSet, exclude: frozenset[str], session_id: str,
                 bound: int) -> tuple[Backend | None, int]:
        """The available backend within ``bound`` that the KV index says holds most of the session's
        own tokens (ties: the session's highest rendezvous score), and those tokens."""
        kv = self.kv
        best: Backend | None = None
        best_tokens = 0
        if kv is None:
            return best, best_tokens
        eligible = []
        for url, tokens in kv.session_tokens(session_id).items():
            backend = pool.get(url)
            if (tokens <= 0 or backend is None or not backend.available or (exclude and url in exclude)
                    or backend.in_flight + backend.others_at_scrape + 1 > bound):
                continue
            eligible.append((tokens, session_score(url, session_id), backend))
        if eligible:
            best_tokens, _, best = max(eligible, key=lambda item: item[:2])
        return best, best_tokens
        for url, tokens in kv.session_tokens(session_id).items():
            if tokens <= 0 or tokens < best_tokens or (best is not None and tokens == best_tokens and url > best.url):
                continue
            backend = pool.get(url)
            if (backend is None or not backend.available or (exclude and url in exclude)
                    or backend.in_flight + backend.others_at_scrape + 1 > bound):
                continue
            best, best_tokens = backend, tokens
        return best, best_tokens

    def _parent_home(self, pool: BackendSet, exclude: frozenset[str], parent: str,
                     hint: PlacementHint | None) -> tuple[Backend | None, int]:
        """Where a child session's parent is: the available backend holding most of the parent's KV,
        else the parent's pin in this pool; and the parent's tokens there (what the child may reuse)."""
        kv = self.kv
        if kv is not None:
            best: Backend | None = None
            best_tokens = 0
            for url, tokens in kv.session_tokens(parent).items():
                backend = pool.get(url)
                if backend is None or not backend.available or (exclude and url in exclude):
                    continue
                if tokens > best_tokens:
                    best, best_tokens = backend, tokens
            if best is not None:
                return best, best_tokens
        parent_entry = hint.parent_entry if hint is not None else None
        if parent_entry is not None:
            url = parent_entry.pins.get(pool.name)
            backend = pool.get(url) if url is not None else None
            if backend is not None and backend.available and not (exclude and url in exclude):
                return backend, hint.prompt_tokens_estimate if hint is not None else 0
        return None, 0

    def _hash_choice(self, pool: BackendSet, session_id: str, exclude: frozenset[str], stats: _PoolStats) -> Backend:
        """The first candidate in rendezvous order within the load bound (other routers' requests at
        the last scrape counted past the first ``sticky_headroom``), else the least loaded."""
        bound = load_bound(self.settings.load_factor, stats.total, stats.count)
        ring = self._rings.get(pool.key)
        if ring is None or ring.version != pool.version:
            ring = self._rings[pool.key] = Ring(pool)
        key = session_id.encode()
        weight = self._weight
        best: Backend | None = None
        best_rank = (-1, "")
        least: Backend | None = None
        least_load = 0.0
        least_rank = (-1, "")
        for backend, state in ring.states:
            if not backend.available or (exclude and backend.url in exclude):
                continue
            h = state.copy()
            h.update(key)
            rank = (int.from_bytes(h.digest(), "little"), backend.url)
            load = backend.in_flight + backend.others_at_scrape + (weight * backend.reported_load if weight else 0.0)
            if load + 1 - min(backend.others_at_scrape, self.settings.sticky_headroom) <= bound:
                if rank > best_rank:
                    best, best_rank = backend, rank
            elif best is None and (least is None or load < least_load or (load == least_load and rank > least_rank)):
                least, least_load, least_rank = backend, load, rank
        if best is not None:
            return best
        if least is None:
            raise no_available_backend(pool)
        return least

    def _fastest(self, pool: BackendSet, exclude: frozenset[str], prompt: int, cached_map: Mapping[str, int] | None,
                 keep: Backend | None, bound: int, known: tuple[Backend, int] | None
                 ) -> tuple[Backend, float, float, int]:
        """The candidate with the lowest predicted TTFT among those within ``bound`` (0: no bound);
        ``keep`` takes part whatever its load (staying never needs room), and wins ties. ``known``:
        a backend whose cached tokens the caller knows better than the map (a parent's backend)."""
        best: Backend | None = None
        best_ttft = math.inf
        best_wait = 0.0
        best_cached = 0
        weight = self._weight
        for backend in pool.members:
            if not backend.available or (exclude and backend.url in exclude):
                continue
            if bound and backend is not keep:
                load = backend.in_flight + backend.others_at_scrape + (weight * backend.reported_load if weight else 0.0)
                if load + 1 > bound:
                    continue
            if known is not None and backend is known[0]:
                cached = known[1]
            else:
                cached = cached_map.get(backend.url, 0) if cached_map else 0
            if cached > prompt:
                cached = prompt
            ttft, wait = self.predict(backend, prompt, cached)
            if ttft < best_ttft or (ttft == best_ttft and backend is keep):
                best, best_ttft, best_wait, best_cached = backend, ttft, wait, cached
        if best is None:
            if keep is not None:
                ttft, wait = self.predict(keep, prompt, 0)
                return keep, ttft, wait, 0
            # everything is over the bound: the bound yields (it is a safety net, not a refusal)
            return self._fastest(pool, exclude, prompt, cached_map, None, 0, known)
        return best, best_ttft, best_wait, best_cached

    def _safety_bound(self, total: float, count: int) -> int:
        settings = self.settings
        mean_bound = math.ceil((total + 1) / count - 1e-9)
        return max(load_bound(settings.max_load_factor, total, count), mean_bound + settings.sticky_headroom)

    def _pool_stats(self, pool: BackendSet, exclude: frozenset[str]) -> _PoolStats:
        """The set's stats, refreshed when stale (module docstring): exact for small pools and retries."""
        stats = self._stats.get(pool.key)
        if (stats is None or exclude or stats.version != pool.version or stats.age >= STATS_EVERY
                or len(pool.members) <= SMALL_POOL):
            return self._refresh(pool, exclude)
        stats.age += 1
        return stats

    def _refresh(self, pool: BackendSet, exclude: frozenset[str]) -> _PoolStats:
        stats = self._stats.get(pool.key)
        if stats is None:
            stats = self._stats[pool.key] = _PoolStats()
        weight = self._weight
        total = 0.0
        count = 0
        min_step = math.inf
        min_per_token = math.inf
        for backend in pool.members:
            if not backend.available or (exclude and backend.url in exclude):
                continue
            total += backend.in_flight + backend.others_at_scrape + (weight * backend.reported_load if weight else 0.0)
            count += 1
            step = backend.step_s
            if step < 0:
                step = self._step
            per_token = backend.prefill_s_per_token
            if per_token < 0:
                per_token = self._per_token
            if step < min_step:
                min_step = step
            if per_token < min_per_token:
                min_per_token = per_token
        stats.total = total
        stats.count = count
        stats.min_step = min_step if count else 0.0
        stats.min_per_token = min_per_token if count else 0.0
        # stats taken with some backends excluded describe this request only: the next one refreshes
        stats.version = -1 if exclude else pool.version
        stats.age = 0
        return stats

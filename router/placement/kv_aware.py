"""The ``kv_aware`` policy (the default): each request where its predicted time to first token is lowest,
with a session staying where its KV is until moving is clearly cheaper (DESIGN.md §11).

**The prediction**, per available candidate backend ``b``, for a prompt of ``P`` tokens of which
``C(b)`` are cached there::

    ttft(b) = step(b) + (P - C(b)) * prefill(b) + wait(b)
    wait(b) = queue(b) * queued(b) + load(b) * busy(b) + pressure(b) * 2 * P * prefill(b) + ahead(b)

- ``step``, ``prefill`` (seconds per prompt token), ``queued`` (what each request the engine has
  waiting costs a newcomer) and ``busy`` (what one request in flight adds to a newcomer's first
  step on average: its share of prefill work) are learned per backend from the engine's own
  counters (``router.engine_load``; ``busy`` is 0 until learned), else the configured
  ``per_request_step_s``, ``1 / prefill_tokens_per_s`` and ``queued_request_s``.
- ``load`` is the engine's requests as every router replica sees them alike: this router's
  ``in_flight`` plus the engine's requests at the last scrape that were not this router's
  (``others_at_scrape``: other replicas' or workers'; 0 for a lone router). The busy term and the
  safety net count it, so replicas that see the same engines decide their spills alike rather
  than each on its own third of the traffic.
- ``queue`` counts only real queueing: the engine's ``vllm:num_requests_waiting`` at the last scrape,
  only while the engine queues (waiting > 0), corrected by what the router's own in-flight count did
  since (``in_flight - in_flight_at_scrape``: requests sent there since queue too, requests finished
  since drained it). An engine that is not queueing batches a newcomer into its next step, so
  in-flight counts that wander by chance (the issue's short-request complaint) do not count as a wait.
- ``pressure`` = how far the KV cache usage is past ``kv_pressure_from``, 0..1: near a full KV cache
  the session's cached prefix may be evicted and the request preempted (recomputed); at 100% the
  prompt is charged twice more. The usage is ``vllm:kv_cache_usage_perc`` at the scrape scaled by
  the engine's requests now against then (``usage_now``: ``(in_flight + 1) / (in_flight_at_scrape
  + 1)`` for a lone router; with other replicas' requests there, this router's change since the
  scrape stands for the engine's in proportion): running requests hold that cache, so as they
  finish (or sessions leave) the pressure fades before the next scrape, and sessions do not leave a
  pressured backend in a herd.
- ``ahead`` = the prefill work this router sent to ``b`` that is not done yet: each placement leaves
  its backend the prediction's own prefill term (uncached tokens x ``prefill``), done from the
  placement on (or from when what was already ahead is done) at that rate, so a newcomer waits for
  what remains (a virtual clock per backend, ``_ahead``; one read of the clock per placement). 0 while
  this router has no request in flight there (everything it sent is answered). An engine that batches
  everything into its running steps does not queue (``vllm:num_requests_waiting`` stays 0 while it
  prefills long prompts), so neither the queue nor the averaged ``busy`` term sees a burst of
  prefills; without this term, the sessions that had lost their KV all went to the backend predicted
  fastest at once and recomputed there together. Each replica counts only its own work.
- ``P``: exact in tokens mode; else estimated from the body's length (``bytes_per_token``), at
  least the session's last prompt + answer as this router saw it and, with the KV index, the most
  of the session resident on any backend (``_sized``: the conversation this turn extends), so a
  replica that did not serve the session's last turns sizes the prompt as the one that did.
- ``C(b)``: with the KV index (KV events), the session's resident tokens there
  (``KVIndex.session_tokens``, one lookup) or, in tokens mode when the index holds nothing of the
  session yet, the prompt's resident prefix (``KVIndex.prefix_tokens``: a hash per prompt block, so
  not paid on every turn), each at most ``P``. A backend whose events reach the index
  (``KVIndex.has_events``) and that holds none of the session has none (evicted, engine restarted).
  Only for a pin without events does the pin count as holding the session's last prompt + answer
  (``hint.last_tokens``); other backends nothing.

**Decisions** (``move_factor`` f, ``move_margin_s`` m: B is *clearly faster* than A when
``ttft(A) > f * ttft(B) + m``):

- pinned session, pin available: stays (STICKY, "cached") unless another backend is clearly faster
  (SPILL: "cached" when it holds more of the session's KV than the pin, else "wait" or
  "kv_pressure", the larger term of the pin's wait) or the pin is over the
  safety bound (SPILL, "load"). A move takes the pin along: the new backend now holds the freshest
  prefix. The fast path is O(1): the pin's prediction against a lower bound of any other
  backend's (the pool's smallest step and prefill cost, no wait, the most any other backend has
  cached), with the pool's load total refreshed every ``STATS_EVERY`` placements. In a small pool
  (``SMALL_POOL``: its stats are exact) where no other backend holds more of the session, it also
  settles when the pin's *settled* prediction (*hysteresis*, below) is not clearly slower than that
  bound (``_never_settled_slower``): another backend may then predict faster, but no move to it
  would pass the hysteresis. When none of that settles it (nor ``_settled``, *no pass*), the pass
  that refreshes the pool's stats also takes each candidate's *floor* (its prediction with that
  fewest uncached count and without the KV-pressure term, same operations, so never above its
  prediction) and only the candidates whose floor is clearly faster than the pin
  are predicted: the same choices as predicting all of them (the fastest matters only when it is
  clearly faster, and then its floor is too), e.g. none when every engine queues alike or has
  prefill work ahead alike. Any pass over the pool (this one, ``_refresh``, ``_scan``) leaves its
  load total to be carried forward by the pool's ``Ledger`` (below), so a small pool's next
  placements need no pass for it.
- *no pass* (``_settled``): when every engine queues alike the fast path's floor (no wait) is below
  the pin's prediction on every request, and that pass finds no rival each time. So the pass also
  leaves what it saw (``_Settle``): the available members' smallest queue ``Q`` (``waiting +
  in_flight - in_flight_at_scrape``, 0 when one does not queue), cost per queued request ``G``,
  load ``L`` (``in_flight + others_at_scrape``) and busy cost ``B`` (0 when one has none), and its
  load total. The pool's ``Ledger`` (``router.membership``, kept by ``Backend.__setattr__`` and
  ``admit``/``release``, so by every writer) counts the in-flight units added to and dropped from
  available members since, and bumps a version on any other change a pass reads (availability, the
  scrape's fields, learned constants, membership, an in-flight count below 0). While the version is
  the pass's, with ``D`` units dropped since, no member's in-flight count fell by more than ``D``,
  and each term of a candidate's floor is monotonic in its in-flight count and in each constant (none negative; the
  configured ``queued_request_s`` >= 0), so with ``predict``'s operations in its order (rounding is
  monotonic)::

      min_step + uncached * min_per_token + (max(0, Q - D) * G + max(0, L - D) * B + ahead)

  is at most every candidate's floor (the pin's included: a lower bound over more members is still
  one). ``ahead`` is ``max(0, A - now)`` with ``A`` the earliest end of the work ahead the pass saw
  (``_ahead``) while every member had requests in flight (their smallest count ``F``), and only while
  ``F > D``: a backend's end of work ahead only moves later while it has requests in flight (its
  term is 0 without, and a placement sent where none is in flight starts its clock anew), and no
  member's count can have reached 0 since. (In a burst of turns whose prompts are not all cached,
  every backend has work ahead, the pin's prediction is above the fast path's floor, which has no
  wait, and without this term every such turn ran the pass again to find no rival.) The fast path
  asks this bound before it gives up. When the pin is not clearly slower than it, no candidate is
  a rival: the pass would find none, and its stats are known without it: the load total is the
  pass's moved by ``added - drops``, exact because every load is a whole number
  (``Ledger.inexact``: else no answer), the count and cheapest constants are the pass's. Loads are
  not negative (a pass that sees one below 0 leaves nothing; an in-flight count written below 0
  bumps the version), so no busy term is. Not used with a ``reported_load_weight`` (its products
  are not whole numbers), with excluded backends, or on a model's candidate set (no ledger of its
  own). Requests finishing lower the bound: after about ``Q`` of them a pass runs
  again and takes a new snapshot.
- *hysteresis*: a move off the pin for "wait" or "kv_pressure" also needs the pin's *settled*
  prediction (``_settled_ttft``: its learned constants, its KV pressure, and of its queue only what
  persisted over its last three scrapes, ``Backend.queued_floor``, lowered by requests finished since
  but never raised by requests sent since; not the ``busy`` term) to be clearly slower than the
  target: one scrape that caught an engine queueing, or in-flight counts that wander, move nothing.
- *evicted*: when the pin's KV events reach the index and it holds less than half of the session's
  last prompt + answer there (``hint.last_tokens``), and at least ``EVICTED_TOKENS`` fewer, the turn
  recomputes what is gone wherever it goes: a move costs nothing a stay does not. It goes to the
  fastest backend within the bound, the pin only when that is not faster by more than the margin
  (SPILL, "evicted"; "cached" when the target holds more of the session), without the move factor and
  the hysteresis. A backend that evicts its sessions' prefixes between their turns holds more than
  its KV fits: the sessions that lost theirs leave it for one with less work ahead, and stay there.
  The floor of ``EVICTED_TOKENS`` keeps short conversations (a block or two, or an index a step
  behind the engine) on their pins.
- a pinned turn whose prompt does not fit the pin's free KV (``_fits``, ``_free_tokens``: the scraped
  ``kv_capacity_tokens`` x (1 - usage), less the prompts this router placed there since the scrape,
  with the requests finished since giving theirs back) would be preempted there, or preempt a
  running request. The whole prompt is charged, its cached prefix too: the engine counts cached
  blocks no running request holds as free (evictable), and the turn takes them back. Room is kept
  for what the requests will generate (``_growth``: the engine's learned ``output_tokens`` for this
  turn, half of it for each request there; running requests that grow past the free KV are what the
  engine preempts). It goes to the fastest backend within the bound whose known free KV holds it
  (SPILL, "kv_pressure") when its recompute there is no more than what a preemption on the pin
  recomputes (``_held_per_request``: the KV tokens a request there holds on average); else (a heavy
  session, whose move costs more than a preemption, or no room elsewhere) it is decided as usual.
- *room at the target*: every move off the pin ("evicted", "cached", "wait", "kv_pressure", "load")
  goes only where the turn's prompt fits the target's free KV (when its capacity is known): else to
  the fastest other backend where it fits, else nowhere (the pin keeps the turn). A move recomputes
  into the target's cache; where that cache is full, it preempts a running request.
- new session (no pin, or the pin is gone: REPIN_*): its *home* is, when the KV index holds its own
  tokens (another router replica placed it, or this router restarted: replicas subscribe to the same
  engines, so they agree without shared state), the backend holding most of them within the safety
  bound ("cached"; among backends holding as many, the first in the session's rendezvous order, so
  sessions every backend holds alike spread as new ones do); else the rendezvous-hash choice within
  the load bound (as the ``session`` policy places new sessions, so sessions spread the same way;
  other routers' requests seen at the last scrape count only past ``sticky_headroom`` of them) and
  within ``session_balance`` x the mean of the sessions pinned per backend ("balance" when that moves
  it down the rendezvous order; ``_hash_choice``, ``router.placement.spread``),
  or for a child agent session (``hint.parent_session``) the backend holding most of its parent's
  KV (else the parent's pin), with the parent's tokens there counted as cached ("parent"). It goes
  home unless another backend is clearly faster ("wait", or "cached" when that one holds more of
  its prompt), for "wait" than home's settled prediction too (its queue as it persisted over three scrapes).
- the pin already failed for this request (a retry): the fastest other backend, pin kept (SPILL, "retry").
- no session: the least loaded (``load``) of the backends within the margin of the fastest ("least").

**Safety net**: a backend may take a session's request only while ``load + 1 <=
max(ceil(max_load_factor * (total + 1) / n), ceil((total + 1) / n) + sticky_headroom)``; a pin over
it sheds the session ("load") to the fastest backend within it, and moves only go to backends
within it. Loose by design (default 2x the mean): it bounds the spread when predictions are wrong
(or blind: no scrape answers), it is not the signal. Once the pin's interference (``busy``) is learned,
its in-flight requests are in its prediction, and the net defers to it: a pin over the bound keeps a
session predicted faster there (its cached prefix is worth more than the pin's load; a move would
recompute it and slow the target's requests too) and sheds one predicted faster elsewhere, by any
margin.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.membership import Backend, BackendSet, Ledger
from router.placement.base import Outcome, Placement, PlacementHint, SessionPins
from router.placement.least_loaded import NOTHING_EXCLUDED, no_available_backend
from router.placement.session import Ring, load_bound, session_score
from router.placement.spread import PinCounts, balance_bound

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
#: a pinned session whose pin's KV events show it lost at least this many tokens of its last prompt +
#: answer there (and at least half of them) recomputes them wherever it goes: it is placed where it is
#: predicted fastest, without the move factor and hysteresis that guard a cached prefix
EVICTED_TOKENS = 256
#: seconds under ``_pinned``'s floor that ``_never_settled_slower`` compares with: far above the rounding of a
#: prediction less its ``ahead`` term (about 2e-16 x their sum: 1e-6 s needs an ``ahead`` of a century)
HYSTERESIS_SLACK_S = 1e-6
#: backends with an ``ahead`` entry before the entries whose work is done are dropped
AHEAD_PRUNE_AT = 1024
#: safety bounds a pool's stats remember by load total before the memo starts over (a few hundred recur)
BOUNDS_KEPT = 4096

_EMPTY: Mapping[str, int] = {}
#: an enum member read through its class costs a metaclass lookup: the hot path reads this global instead
_STICKY = Outcome.STICKY


def usage_now(backend: Backend, change: float | None = None) -> float:
    """``backend``'s KV usage now, estimated from the scrape's: scaled by the engine's requests now
    against then. Then: this router's ``in_flight_at_scrape`` + ``others_at_scrape`` (+ 1). Now: then +
    the change of this router's in-flight count since (``change``; by default ``in_flight -
    in_flight_at_scrape``), which, when other replicas or workers hold requests there too, stands for
    the engine's whole change in proportion (they serve alike traffic, and their requests finish and
    arrive as ours do, unseen here until the next scrape). A lone router:
    ``(in_flight + 1) / (in_flight_at_scrape + 1)``."""
    at = backend.in_flight_at_scrape
    others = backend.others_at_scrape
    if change is None:
        change = backend.in_flight - at
    if others > 0 and at > 0:
        change = change * (at + others) / at
    then = at + others + 1
    return backend.kv_usage * (then + change) / then


class KVView(Protocol):
    """What the policy reads of the router's KV index (``router.kv.index.KVIndex``)."""

    def catch_up(self) -> None: ...

    #: whether ``catch_up`` has anything to run (False: the placement does not call it)
    catch_up_hooked: bool

    @property
    def any_events(self) -> bool:
        """Whether any backend's events reach the index (False: it holds nothing, and is not read)."""
        ...

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
    #: new sessions skip a hash choice holding more than this x the mean pinned sessions (0: off)
    session_balance: float = 0.0


class _PoolStats:
    """Per candidate set: its load total and the cheapest constants among its available members; and, when
    the pass that took them could, the pool's ``Ledger`` then, so that the next placements know the total
    without a pass (``_pool_stats``)."""

    __slots__ = ("version", "age", "total", "count", "min_step", "min_per_token", "ledger", "ledger_version",
                 "base", "bounds")

    def __init__(self) -> None:
        self.version = -1
        self.age = 0
        self.total = 0.0
        self.count = 0
        self.min_step = 0.0
        self.min_per_token = 0.0
        #: the pool's ledger at the pass (None: the pass cannot be carried forward by it)
        self.ledger: Ledger | None = None
        self.ledger_version = -1
        #: the total at the pass less ``Ledger.added - Ledger.drops`` then (a whole number)
        self.base = 0.0
        #: load total -> the safety bound for ``count`` candidates (``bound``; a few totals recur)
        self.bounds: dict[float, int] = {}

    def bound(self, safety_bound: Callable[[float, int], int]) -> int:
        """The safety bound at the current total, remembered for ``count`` candidates."""
        bound = self.bounds[self.total] = safety_bound(self.total, self.count)
        if len(self.bounds) > BOUNDS_KEPT:
            self.bounds = {self.total: bound}
        return bound

    def record(self, total: float, count: int, min_step: float, min_per_token: float, pool: BackendSet,
               exclude: frozenset[str], whole: bool) -> None:
        """What one pass over ``pool`` found (``min_*`` are ``inf`` when ``count`` is 0). With backends
        excluded, the stats describe one request (the next placement refreshes them). Else, when ``total``
        is a sum of whole numbers (``whole``: no ``reported_load`` weight, and no member's summed field
        inexact), the pool's ``Ledger`` carries it forward (``_pool_stats``)."""
        self.total = total
        if count != self.count:
            self.bounds = {}
        self.count = count
        self.min_step = min_step if count else 0.0
        self.min_per_token = min_per_token if count else 0.0
        self.version = -1 if exclude else pool.version
        self.age = 0
        ledger = pool.ledger
        if ledger is None or exclude or not whole or ledger.inexact:
            self.ledger = None
            return
        self.ledger = ledger
        self.ledger_version = ledger.version
        self.base = total - (ledger.added - ledger.drops)


class _Settle:
    """What the last ``_rivals`` pass over a pool saw, for ``_settled`` (module docstring, *no pass*):
    valid while the pool's ``Ledger.version`` and ``version`` are those of the pass."""

    __slots__ = ("ledger", "version", "pool_version", "drops", "base", "count", "min_step", "min_per_token",
                 "queue", "queued", "load", "busy", "in_flight", "done")

    def __init__(self) -> None:
        self.ledger: Ledger | None = None
        self.version = -1
        self.pool_version = -1
        #: ``Ledger.drops`` at the pass
        self.drops = 0
        #: the load total at the pass less ``Ledger.added - Ledger.drops`` then (a whole number)
        self.base = 0.0
        self.count = 0
        self.min_step = 0.0
        self.min_per_token = 0.0
        #: the available members' smallest queue (``waiting + in_flight - in_flight_at_scrape``; 0 when
        #: one does not queue), smallest cost per queued request, smallest load, smallest ``busy`` (0
        #: when one has none)
        self.queue = 0.0
        self.queued = 0.0
        self.load = 0.0
        self.busy = 0.0
        #: the available members' smallest in-flight count, and earliest end of the prefill work this
        #: router sent there (``_ahead``; -inf when one has no request in flight, so no ``ahead`` term)
        self.in_flight = 0.0
        self.done = -math.inf


class KVAwarePolicy:
    """``kv_aware``: see the module docstring."""

    name = "kv_aware"

    def __init__(self, settings: KVAwareSettings = KVAwareSettings(), *, kv: KVView | None = None,
                 pin_counts: PinCounts | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        #: live sessions pinned per backend (the session table's), for ``session_balance``; None: new
        #: sessions go by the hash and the load bound only. Settable after construction.
        self.pin_counts = pin_counts
        self._balance = settings.session_balance
        #: backend URL -> when the prefill work this router sent there is done, by the prediction's own
        #: prefill cost (``ahead``); entries done are dropped once there are ``_prune_at`` (backends that
        #: left the pool leave none behind for long)
        self._ahead: dict[str, float] = {}
        self._prune_at = AHEAD_PRUNE_AT
        #: backend -> [its ``load_scraped_at``, requests, prompt tokens]: what this router placed there
        #: since that scrape (``_free_tokens``); once there are ``_sent_prune_at`` entries, those of
        #: backends gone from their pools are dropped
        self._sent: dict[Backend, list[float]] = {}
        self._sent_prune_at = AHEAD_PRUNE_AT
        #: the prompt tokens of the placement being made (``_place``; sized by the index in ``_sized``)
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
        #: the all-candidates floor (``_pinned``) is a floor: prefill costs and the move factor are not negative
        self._floor_ok = self._per_token >= 0 and self._factor >= 0
        #: ``_settled`` may answer (module docstring, *no pass*): its bound needs costs per queued request
        #: that are not negative, and a load total of whole numbers (no ``reported_load`` weight)
        self._settle_ok = self._floor_ok and self._queued >= 0 and not self._weight
        #: ``pool.key`` -> what its last ``_rivals`` pass saw (``_settled``)
        self._settles: dict[str, _Settle] = {}
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
        if backend.in_flight > 0:  # ``_ahead_s``, inlined (the hot path)
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
        """Whether a ``tokens``-token prompt fits ``backend``'s free KV cache now (``_free_tokens``),
        with room for what it and the requests there will generate (``_growth``)."""
        if tokens <= 0:
            return True
        need = tokens + self._growth(backend)
        count, charged = self._since_scrape(backend)
        # the free KV before the requests finished since the scrape give theirs back: a floor of
        # ``_free_tokens``, enough when the prompt fits it (most turns of a backend with room)
        if need <= backend.kv_capacity_tokens * (1.0 - backend.kv_usage) - charged:
            return True
        return need <= self._free_tokens(backend, count, charged)

    @staticmethod
    def _growth(backend: Backend) -> float:
        """The KV the requests on ``backend`` will still take as they generate, this one's included:
        its learned tokens per request (``output_tokens``; 0 until learned) for the new request, half
        of it for each request there now (they are half-way through on average)."""
        out = backend.output_tokens
        if out <= 0:
            return 0.0
        return out * (1.0 + 0.5 * (backend.in_flight + backend.others_at_scrape))

    @staticmethod
    def _free_tokens(backend: Backend, count: int, charged: float) -> float:
        """``backend``'s free KV tokens now (its capacity, ``kv_capacity_tokens``, known: > 0), from the
        scrape's: the free share then, less the ``charged`` prompt tokens of the ``count`` requests this
        router placed there since (``_since_scrape``), with the requests that finished since taken oldest
        first: those in flight at the scrape give their share of the usage back (``usage_now``'s
        proportion), then those sent since their prompts."""
        at = backend.in_flight_at_scrape
        usage = backend.kv_usage
        finished = at + count - backend.in_flight
        if finished > 0:
            done = finished if finished < at else at
            if done > 0:
                usage = usage_now(backend, -done)
            done = finished - done
            if done > 0:
                charged = charged * (count - done) / count if done < count else 0.0
        return backend.kv_capacity_tokens * (1.0 - usage) - charged

    def _since_scrape(self, backend: Backend) -> tuple[int, float]:
        """(requests, prompt tokens) this router placed on ``backend`` since its last scrape."""
        sent = self._sent.get(backend)
        if sent is None or sent[0] != backend.load_scraped_at:
            return 0, 0.0
        return int(sent[1]), sent[2]

    def _held_per_request(self, backend: Backend) -> float:
        """The KV tokens one request there holds on average: the scrape's used share and the prompts
        placed since (``_sent``) over the requests then and since (inf: none). A preemption recomputes
        about that much; a move off a full pin is worth it while its own recompute is no more."""
        count, charged = self._since_scrape(backend)
        requests = backend.in_flight_at_scrape + backend.others_at_scrape + count
        if requests <= 0:
            return math.inf
        return (backend.kv_usage * backend.kv_capacity_tokens + charged) / requests

    def _roomy(self, pool: BackendSet, exclude: frozenset[str], prompt: int, cached_map: Mapping[str, int] | None,
               pinned: Backend, bound: int) -> tuple[Backend, float, float, int] | None:
        """The fastest available backend but ``pinned``, within ``bound``, whose KV capacity is known
        and whose free KV holds the prompt (None: none)."""
        best: Backend | None = None
        best_ttft = math.inf
        best_wait = 0.0
        best_cached = 0
        weight = self._weight
        for backend in pool.members:
            if (backend is pinned or backend.kv_capacity_tokens <= 0 or not backend.available
                    or (exclude and backend.url in exclude)):
                continue
            load = backend.in_flight + backend.others_at_scrape
            if weight:
                load += weight * backend.reported_load
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

    def _settled_ttft(self, backend: Backend, prompt: int, cached: int) -> tuple[float, float]:
        """(prediction, of which waiting) of ``backend`` counting only what justifies leaving it (module
        docstring, *hysteresis*): its learned constants (medians over several scrape intervals), its KV
        pressure, and its queue as it persisted over three scrapes (``queued_floor``), lowered by what
        finished since the scrape but never raised by what was sent since; never the in-flight ``busy``
        term (in-flight counts wander by chance) nor the prefill work sent there (``ahead``: gone within
        a second or so)."""
        per_token = backend.prefill_s_per_token
        if per_token < 0:
            per_token = self._per_token
        step = backend.step_s
        if step < 0:
            step = self._step
        wait = 0.0
        waiting = backend.queued_floor
        if waiting > 0:
            since = backend.in_flight - backend.in_flight_at_scrape
            queue = waiting + since if since < 0 else waiting
            if queue > 0:
                queued = backend.queued_request_s
                wait = queue * (queued if queued >= 0 else self._queued)
        if backend.kv_usage > self._kv_from:
            wait += self._pressure_s(backend, prompt)
        uncached = prompt - cached
        return step + (uncached if uncached > 0 else 0) * per_token + wait, wait

    def _settled_slower(self, backend: Backend, prompt: int, cached: int, fast: float, target: Backend) -> bool:
        """Whether ``backend``'s settled prediction (``_settled_ttft``) is clearly slower than ``fast``,
        ``target``'s prediction (``_settled_slower_than``, with ``target``'s ``ahead`` term)."""
        return self._settled_slower_than(backend, prompt, cached, fast, fast - self._ahead_s(target))

    def _never_settled_slower(self, backend: Backend, prompt: int, cached: int, floor: float) -> bool:
        """Whether ``_settled_slower(backend, prompt, cached, fast, target)`` is False for every target
        whose prediction ``fast`` is at least ``floor``, less its ``ahead`` too (``_pinned``'s floor: no
        wait, the pool's cheapest constants, the most any other backend holds cached). Then no move off
        ``backend`` for "wait" or "kv_pressure" passes the hysteresis, whatever the others predict.
        ``fast - ahead`` is computed as ``(x + ahead) - ahead``: ``HYSTERESIS_SLACK_S`` covers its
        rounding below ``x``."""
        return not self._settled_slower_than(backend, prompt, cached, floor, floor - HYSTERESIS_SLACK_S)

    def _settled_slower_than(self, backend: Backend, prompt: int, cached: int, fast: float,
                             fast_less_ahead: float) -> bool:
        """Whether ``backend``'s settled prediction (``_settled_ttft``) is clearly slower than a target's
        ``fast``, of which ``fast_less_ahead`` is not the prefill work this router sent there. Without a
        queue or pressure, by ``SLOW_FACTOR``, and only on learned constants: a backend with none learned
        yet (just started, or back after a restart while the others learned theirs) is not judged slower
        by the configured ones, or it would get no traffic to learn from and stay empty."""
        ttft, wait = self._settled_ttft(backend, prompt, cached)
        if wait <= 0 and backend.step_s < 0 and backend.prefill_s_per_token < 0:
            return False  # nothing measured there yet: the configured constants are no evidence it is slower
        if wait > 0:
            return ttft > self._factor * fast + self._margin
        # a slow engine: against the target's prediction without the prefill work this router just
        # sent there (``ahead``, charged at a rate the target may not have learned yet)
        return ttft > max(self._factor, SLOW_FACTOR) * fast_less_ahead + self._margin

    def _ahead_s(self, backend: Backend) -> float:
        """The ``ahead`` term of ``backend``'s prediction (module docstring): none while none of this
        router's requests is in flight there (none of its prefill work either)."""
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
        kv = self.kv
        if kv is not None and kv.catch_up_hooked:
            kv.catch_up()  # the events that arrived since the index was last read (router.kv.service)
        if session_id is not None and entry is not None:
            pins = entry.pins
            pin_url = pins.get(pool.name)
            if pin_url is not None and not (exclude and pin_url in exclude):
                pinned = pool.get(pin_url)
                if pinned is not None and pinned.healthy and not pinned.draining:  # ``available``, inlined
                    return self._pinned(pool, session_id, pins, pinned, exclude, hint, now)
        return self._book(self._place(pool, session_id, entry, exclude, hint), now)

    def _book(self, placement: Placement, now: float) -> Placement:
        """What this router sent the chosen backend, for the next placements: the request's prefill is
        ahead of the next ones sent there (``ahead``), its prompt taken from the free KV there until the
        next scrape shows it (``_sent``). ``_pinned`` does the same for a sticky placement, inlined."""
        backend = placement.backend
        step = backend.step_s
        work = placement.predicted_ttft_s - placement.wait_s - (step if step >= 0 else self._step)
        if backend.kv_capacity_tokens > 0:
            sent = self._sent.get(backend)
            if sent is None or sent[0] != backend.load_scraped_at:
                self._sent_anew(backend, self._prompt)
            else:
                sent[1] += 1
                sent[2] += self._prompt
        if work > 0:
            self._push_ahead(backend.url, backend.in_flight, work, now)
        return placement

    def _sent_anew(self, backend: Backend, prompt: int) -> None:
        """The first request placed on ``backend`` since its last scrape (``_sent``)."""
        self._sent[backend] = [backend.load_scraped_at, 1.0, float(prompt)]
        if len(self._sent) > self._sent_prune_at:
            self._sent = {b: entry for b, entry in self._sent.items() if b.ledger is not None}
            self._sent_prune_at = max(AHEAD_PRUNE_AT, 2 * len(self._sent))

    def _push_ahead(self, url: str, in_flight: int, work: float, now: float) -> None:
        """``work`` seconds of prefill sent to the backend at ``url`` (``in_flight``: its requests now),
        done after what is ahead there already, if any (``ahead``)."""
        ahead = self._ahead.get(url, 0.0)
        self._ahead[url] = (ahead if ahead > now and in_flight > 0 else now) + work
        if len(self._ahead) > self._prune_at:
            self._ahead = {url: done for url, done in self._ahead.items() if done > now}
            self._prune_at = max(AHEAD_PRUNE_AT, 2 * len(self._ahead))

    def _place(self, pool: BackendSet, session_id: str | None, entry: SessionPins | None,
               exclude: frozenset[str], hint: PlacementHint | None) -> Placement:
        """Every request ``place`` does not give ``_pinned``: without a session, a retry whose pin failed,
        a session without an available pin."""
        self._prompt = prompt = hint.prompt_tokens_estimate if hint is not None else 0
        if session_id is None or entry is None:
            return self._no_session(pool, exclude, prompt, self._prefix_map(hint))
        pins = entry.pins
        pin_url = pins.get(pool.name)
        pinned = pool.get(pin_url) if pin_url is not None else None
        if pinned is not None and pinned.available:  # excluded (``place`` gave ``_pinned`` the others)
            cached_map = self._cached_map(session_id, hint)
            self._prompt = prompt = self._sized(prompt, cached_map, hint)
            target, ttft, wait, cached = self._fastest(pool, exclude, prompt, cached_map, None, 0, None)
            return Placement(target, Outcome.SPILL, "retry", cached, wait, ttft)
        outcome = Outcome.NEW if pin_url is None else (
            Outcome.REPIN_REMOVED if pinned is None else Outcome.REPIN_UNHEALTHY)
        return self._new(pool, session_id, pins, exclude, hint, prompt, outcome)

    def _pinned(self, pool: BackendSet, session_id: str, pins: dict[str, str], pinned: Backend,
                exclude: frozenset[str], hint: PlacementHint | None, now: float) -> Placement:
        """A pinned session's request, its pin available and not excluded, booked (``_book``): the sticky
        check (the fast floor, else the hysteresis, ``_never_settled_slower``, else ``_settled``), with ``_fits``
        and ``_book`` inlined (their operations in their order; they share one read of ``_sent``), then
        ``_off_pin`` when it does not settle the placement."""
        prompt = hint.prompt_tokens_estimate if hint is not None else 0
        kv = self.kv
        cached_map = None
        other_cached = 0
        evicted = False
        if kv is None or not kv.any_events:
            # no index, or no backend's events reach it (it holds nothing): the pin has the last prompt + answer
            pin_cached = hint.last_tokens if hint is not None else 0
        else:
            pin_cached = -1
            cached_map = self._cached_map(session_id, hint)
            prompt = self._sized(prompt, cached_map, hint)
            if cached_map:
                pin_cached = cached_map.get(pinned.url, -1)
                for url, tokens in cached_map.items():
                    if url != pinned.url and tokens > other_cached:
                        other_cached = tokens
            held = pin_cached if pin_cached > 0 else 0  # what the index holds of the session on its pin
            last = hint.last_tokens if hint is not None else 0
            lost = last - held >= EVICTED_TOKENS and held + held < last  # most of the last turn (*evicted*)
            # whether the pin's KV events reach the index: asked only when the answer matters, once
            events = (lost or pin_cached < 0) and kv.has_events(pinned.url)
            evicted = lost and events
            if pin_cached < 0:
                # the index holds none of the session on its pin: none is there when the pin's KV events
                # reach the index (evicted, or the engine restarted); the last prompt + answer otherwise
                pin_cached = 0 if events or hint is None else last
        if pin_cached > prompt:
            pin_cached = prompt
        if other_cached > prompt:
            other_cached = prompt
        pin_ttft, pin_wait = self.predict(pinned, prompt, pin_cached)
        in_flight = pinned.in_flight
        stats = self._pool_stats(pool, exclude)
        if stats.count == 0:
            raise no_available_backend(pool)
        # the sticky fast path: no other backend can be clearly faster, and the pin is within the bound
        floor = stats.min_step + (prompt - other_cached) * stats.min_per_token
        capacity = pinned.kv_capacity_tokens
        fits = True
        sent = None  # what this router sent the pin since its last scrape (``_sent``; capacity known)
        if capacity > 0:
            sent = self._sent.get(pinned)
            if sent is not None and sent[0] != pinned.load_scraped_at:
                sent = None
            if prompt > 0:  # _fits(pinned, prompt)
                out = pinned.output_tokens
                need = prompt + (out * (1.0 + 0.5 * (in_flight + pinned.others_at_scrape)) if out > 0 else 0.0)
                if sent is None:
                    count, charged = 0, 0.0
                else:
                    count, charged = int(sent[1]), sent[2]
                if need > capacity * (1.0 - pinned.kv_usage) - charged:
                    fits = need <= self._free_tokens(pinned, count, charged)
        sticky = fits and not evicted
        asked = False  # ``_settled`` was asked and had no answer (``_off_pin`` does not ask again)
        if sticky and pin_ttft > self._factor * floor + self._margin:
            # another backend may be clearly faster, but it would take the session only for "wait" or
            # "kv_pressure" (none holds more of it), which the hysteresis may refuse whatever it predicts
            # (a small pool's stats are exact, ``_pool_stats``: the safety bound is a pass's)
            sticky = (prompt >= 0 and self._floor_ok and other_cached <= pin_cached
                      and len(pool.members) <= SMALL_POOL
                      and self._never_settled_slower(pinned, prompt, pin_cached, floor))
            if not sticky and prompt >= 0 and self._settle_ok:
                # the fast floor has no wait: the pool's floor since its last pass may still rule out a rival
                settled = self._settled(pool, exclude, prompt - other_cached, pin_ttft)
                if settled is not None:
                    stats, sticky = settled, True
                else:
                    asked = True
        if sticky:
            bound = stats.bounds.get(stats.total)
            if bound is None:
                bound = stats.bound(self._safety_bound)
            if in_flight + pinned.others_at_scrape + 1 <= bound:
                # _book(placement, now)
                if capacity > 0:
                    if sent is None:
                        self._sent_anew(pinned, prompt)
                    else:
                        sent[1] += 1
                        sent[2] += prompt
                step = pinned.step_s
                work = pin_ttft - pin_wait - (step if step >= 0 else self._step)
                if work > 0:
                    self._push_ahead(pinned.url, in_flight, work, now)
                return Placement(pinned, _STICKY, "cached", pin_cached, pin_wait, pin_ttft)
        self._prompt = prompt
        return self._book(self._off_pin(pool, exclude, pins, pinned, prompt, cached_map, pin_cached, other_cached,
                                        evicted, fits, pin_ttft, pin_wait, stats, asked), now)

    def _off_pin(self, pool: BackendSet, exclude: frozenset[str], pins: dict[str, str], pinned: Backend,
                 prompt: int, cached_map: Mapping[str, int] | None, pin_cached: int, other_cached: int,
                 evicted: bool, fits: bool, pin_ttft: float, pin_wait: float, stats: _PoolStats,
                 asked: bool) -> Placement:
        """The rest of ``_pinned`` when the sticky check did not settle it (module docstring, *Decisions*);
        ``asked``: ``_pinned`` asked ``_settled`` already, without an answer."""
        if not fits:
            # the turn does not fit the pin's free KV (it would be preempted): the fastest backend it fits
            # unless its recompute there costs more than a preemption on the pin would (a heavy session)
            roomy = self._roomy(pool, exclude, prompt, cached_map, pinned, self._safety_bound(stats.total, stats.count))
            if roomy is not None and prompt - roomy[3] <= self._held_per_request(pinned):
                target, ttft, wait, cached = roomy
                pins[pool.name] = target.url
                return Placement(target, Outcome.SPILL, "kv_pressure", cached, wait, ttft)
        if evicted:
            # the turn recomputes what the pin lost wherever it goes: the fastest backend, the pin only
            # when it is as fast within the margin (no move factor, no hysteresis)
            bound, target, ttft, wait, cached = self._scan(pool, exclude, prompt, cached_map, pinned)
            if target is not pinned and pin_ttft > ttft + self._margin:
                target, ttft, wait, cached = self._room(pool, exclude, prompt, cached_map, pinned, bound,
                                                        target, ttft, wait, cached)
                if target is not pinned and pin_ttft > ttft + self._margin:
                    pins[pool.name] = target.url
                    return Placement(target, Outcome.SPILL, "cached" if cached > pin_cached else "evicted",
                                     cached, wait, ttft)
        elif prompt >= 0 and self._floor_ok:
            # predict only the candidates whose floor is clearly faster than the pin (``_rivals``): the
            # fastest within the bound is among them whenever it matters, i.e. when it is clearly faster
            settled = (self._settled(pool, exclude, prompt - other_cached, pin_ttft)
                       if self._settle_ok and not asked else None)
            if settled is not None:
                stats, rivals = settled, []
            else:
                stats, rivals = self._rivals(pool, exclude, prompt - other_cached, pin_ttft, pinned)
            bound = self._safety_bound(stats.total, stats.count)
            target, ttft, wait, cached = pinned, 0.0, 0.0, 0
            if rivals:
                target, ttft, wait, cached = self._fastest_rival(rivals, prompt, cached_map, pinned, bound)
        else:
            # predict every candidate (and refresh the stats) in one pass
            bound, target, ttft, wait, cached = self._scan(pool, exclude, prompt, cached_map, pinned)
        if target is not pinned and self._clearly_faster(pin_ttft, ttft):
            target, ttft, wait, cached = self._room(pool, exclude, prompt, cached_map, pinned, bound,
                                                    target, ttft, wait, cached)
        if target is not pinned and self._clearly_faster(pin_ttft, ttft) and (
                cached > pin_cached or self._settled_slower(pinned, prompt, pin_cached, ttft, target)):
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
        """A move off ``pinned`` to ``target``, checked against the target's free KV: kept when the
        turn's prompt fits there (or its KV capacity is unknown); else the fastest other
        backend whose free KV holds it (``_roomy``); else none (``pinned``, ttft inf): a turn moved
        where its prompt does not fit preempts there, its own recompute or a running request's."""
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
            home, reason = self._hash_choice(pool, session_id, exclude, stats)
        if cached_map:
            home_cached = max(home_cached, cached_map.get(home.url, 0))
        if home_cached > prompt:
            home_cached = prompt
        home_ttft, home_wait = self.predict(home, prompt, home_cached)
        target, ttft, wait, cached = self._fastest(pool, exclude, prompt, cached_map, home, bound,
                                                   (home, home_cached))
        if target is not home and self._clearly_faster(home_ttft, ttft) and (
                cached > home_cached or self._settled_slower(home, prompt, home_cached, ttft, target)):
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
            load = backend.in_flight + backend.others_at_scrape
            if weight:
                load += weight * backend.reported_load
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
        own tokens, and those tokens. Ties go to the session's rendezvous order (``session_score``):
        every replica picks the same, and sessions held alike on several backends (another router's
        spills, a prompt every backend has) spread over them instead of all going to one."""
        kv = self.kv
        best: Backend | None = None
        best_tokens = 0
        best_score = -1  # the rendezvous score of ``best``, computed at the first tie
        if kv is None:
            return best, best_tokens
        for url, tokens in kv.session_tokens(session_id).items():
            if tokens <= 0 or tokens < best_tokens:
                continue
            backend = pool.get(url)
            if (backend is None or not backend.available or (exclude and url in exclude)
                    or backend.in_flight + backend.others_at_scrape + 1 > bound):
                continue
            if best is not None and tokens == best_tokens:
                if best_score < 0:
                    best_score = session_score(best.url, session_id)
                score = session_score(url, session_id)
                if score < best_score:
                    continue
                best, best_score = backend, score
                continue
            best, best_tokens, best_score = backend, tokens, -1
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

    def _hash_choice(self, pool: BackendSet, session_id: str, exclude: frozenset[str],
                     stats: _PoolStats) -> tuple[Backend, str]:
        """The first candidate in rendezvous order (``session_score``, as the ``session`` policy ranks)
        within the load bound, else the least loaded (the earliest in that order among equals): one
        pass, no sort; with its reason ("hash", or "balance" below). Other routers' requests seen at the
        last scrape (``others_at_scrape``) count against the bound only past the first ``sticky_headroom``
        of them: they may have ended since, and at a few requests in flight the bound turns on one
        request, so one or two of them used to send every new session hashed to that backend to the
        other one, where it then stayed. A lone router (none seen) places exactly as the ``session``
        policy does, but for the balance.

        *Balance* (``session_balance`` f, with the session table's ``pin_counts``): when that choice holds
        more than ``balance_bound(f, T, n)`` - 1 of the ``T`` sessions pinned on the ``n`` candidates, the
        next candidate in rendezvous order within both bounds takes the session ("balance"; when none
        within the load bound has room, the hash choice does). Sessions stay where they are placed, so without
        it a hash's uneven draw stays for their lives. The counts are this process's (``pin_counts``;
        with ``[shared_state]`` every process reads a session's first pin before placing it)."""
        settings = self.settings
        bound = load_bound(settings.load_factor, stats.total, stats.count)
        headroom = settings.sticky_headroom
        ring = self._rings.get(pool.key)
        if ring is None or ring.version != pool.version:
            ring = self._rings[pool.key] = Ring(pool)
        key = session_id.encode()
        weight = self._weight
        counts = self.pin_counts.of(pool.name) if self.pin_counts is not None and self._balance else None
        within: list[tuple[tuple[int, str], Backend]] = []
        pinned = candidates = 0
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
            others = backend.others_at_scrape
            load = backend.in_flight + others
            if weight:
                load += weight * backend.reported_load
            if counts is not None:
                candidates += 1
                pinned += counts.get(backend.url, 0)
            if load + 1 - (others if others < headroom else headroom) <= bound:
                if rank > best_rank:
                    best, best_rank = backend, rank
                if counts is not None:
                    within.append((rank, backend))
            elif best is None and (least is None or load < least_load or (load == least_load and rank > least_rank)):
                least, least_load, least_rank = backend, load, rank
        if best is not None:
            if counts is None:
                return best, "hash"
            cap = balance_bound(self._balance, pinned, candidates)
            if counts.get(best.url, 0) < cap:
                return best, "hash"
            roomy = [(rank, backend) for rank, backend in within if counts.get(backend.url, 0) < cap]
            if roomy:
                return max(roomy, key=lambda item: item[0])[1], "balance"
            return best, "hash"
        if least is None:
            raise no_available_backend(pool)
        return least, "hash"

    def _rivals(self, pool: BackendSet, exclude: frozenset[str], uncached: int, pin_ttft: float,
                pinned: Backend) -> tuple[_PoolStats, list[Backend]]:
        """``_refresh``, and the candidates other than ``pinned`` whose *floor* is clearly faster than
        ``pin_ttft``, in member order. A candidate's floor is its prediction with ``uncached`` prompt
        tokens (the fewest any backend but the pin may have to prefill) and without its KV-pressure
        term, with ``predict``'s operations in ``predict``'s order: rounding is monotonic, that term is
        not negative (prompt >= 0, ``_floor_ok``), so no floor exceeds its prediction, and a candidate
        not in the list is not clearly faster than the pin. The ``ahead`` term is in the floor: a
        backend this router just sent prefill work to is rarely a rival, so the pin's prediction meets
        no other (``_fastest_rival`` is skipped) when every backend has work ahead alike. When
        ``_settled`` may use it, the pass also leaves what it saw for it (``_Settle``)."""
        stats = self._stats.get(pool.key)
        if stats is None:
            stats = self._stats[pool.key] = _PoolStats()
        weight = self._weight
        default_step = self._step
        default_per_token = self._per_token
        default_queued = self._queued
        factor = self._factor
        margin = self._margin
        total = 0.0
        count = 0
        min_step = math.inf
        min_per_token = math.inf
        # for ``_Settle``: the smallest queue, cost per queued request, load, busy, in-flight count, end of
        # the work ahead
        min_queue = min_queued = min_load = min_busy = min_done = min_in_flight = math.inf
        ahead_of = self._ahead.get
        now = self._now
        rivals: list[Backend] = []
        for backend in pool.members:
            if not backend.healthy or backend.draining or (exclude and backend.url in exclude):
                continue  # not ``available`` (its definition, inlined), or excluded
            in_flight = backend.in_flight
            load = in_flight + backend.others_at_scrape
            total += load + weight * backend.reported_load if weight else load
            count += 1
            step = backend.step_s
            if step < 0:
                step = default_step
            per_token = backend.prefill_s_per_token
            if per_token < 0:
                per_token = default_per_token
            if step < min_step:
                min_step = step
            if per_token < min_per_token:
                min_per_token = per_token
            if load < min_load:
                min_load = load
            wait = 0.0
            waiting = backend.engine_waiting
            if waiting > 0:
                queue = waiting + in_flight - backend.in_flight_at_scrape
                queued = backend.queued_request_s
                if queued < 0:
                    queued = default_queued
                if queue > 0:
                    wait = queue * queued
                if queue < min_queue:
                    min_queue = queue
                if queued < min_queued:
                    min_queued = queued
            else:
                min_queue = 0.0
            busy = backend.busy_s_per_request
            if busy > 0:
                wait += load * busy
                if busy < min_busy:
                    min_busy = busy
            else:
                min_busy = 0.0
            done = ahead_of(backend.url, 0.0) if in_flight > 0 else -math.inf
            if done < min_done:
                min_done = done
            if in_flight < min_in_flight:
                min_in_flight = in_flight
            if backend is pinned:
                continue
            if in_flight > 0:  # ``ahead``
                ahead = done - now
                if ahead > 0:
                    wait += ahead
            if pin_ttft > factor * (step + uncached * per_token + wait) + margin:
                rivals.append(backend)
        stats.record(total, count, min_step, min_per_token, pool, exclude, not weight)
        ledger = pool.ledger
        # a load below 0 (an in-flight count below 0: a bug elsewhere) would make a busy term negative
        if ledger is not None and self._settle_ok and not exclude and count and min_load >= 0:
            settle = self._settles.get(pool.key)
            if settle is None:
                settle = self._settles[pool.key] = _Settle()
            if stats.ledger is None:  # the ledger does not carry the total (here: ``Ledger.inexact``)
                settle.ledger = None  # some queue or load is not a whole number: no exact sums
            else:
                settle.ledger = ledger
                settle.version = stats.ledger_version
                settle.pool_version = pool.version
                settle.drops = ledger.drops
                settle.base = stats.base
                settle.count = count
                settle.min_step = stats.min_step
                settle.min_per_token = stats.min_per_token
                settle.queue = min_queue
                settle.queued = min_queued
                settle.load = min_load
                settle.busy = min_busy
                settle.in_flight = min_in_flight
                settle.done = min_done
        return stats, rivals

    def _settled(self, pool: BackendSet, exclude: frozenset[str], uncached: int, pin_ttft: float
                 ) -> _PoolStats | None:
        """``_rivals`` without a pass, when its answer is known to be none (module docstring, *no
        pass*): the stats it would leave, else None (a pass is needed)."""
        settle = self._settles.get(pool.key)
        ledger = pool.ledger
        if (settle is None or exclude or ledger is None or settle.ledger is not ledger
                or settle.version != ledger.version or settle.pool_version != pool.version):
            return None
        drops = ledger.drops - settle.drops  # no member's in-flight count fell by more since the pass
        queue = settle.queue - drops
        wait = queue * settle.queued if queue > 0 else 0.0
        load = settle.load - drops
        busy = settle.busy
        if load > 0 and busy > 0:
            wait += load * busy
        if settle.in_flight > drops:  # every member still has requests in flight, and work ahead as late
            ahead = settle.done - self._now
            if ahead > 0:
                wait += ahead
        if pin_ttft > self._factor * (settle.min_step + uncached * settle.min_per_token + wait) + self._margin:
            return None  # some candidate's floor may be clearly faster than the pin
        stats = self._stats.get(pool.key)
        if stats is None:
            stats = self._stats[pool.key] = _PoolStats()
        stats.record(settle.base + (ledger.added - ledger.drops), settle.count, settle.min_step, settle.min_per_token,
                     pool, exclude, True)
        return stats

    def _fastest_rival(self, rivals: list[Backend], prompt: int, cached_map: Mapping[str, int] | None,
                       keep: Backend, bound: int) -> tuple[Backend, float, float, int]:
        """``_fastest(pool, exclude, prompt, cached_map, keep, bound, None)`` when its answer matters:
        the fastest of ``rivals`` within ``bound``, unless ``keep`` is as fast (``_pinned``)."""
        best: Backend | None = None
        best_ttft = math.inf
        best_wait = 0.0
        best_cached = 0
        weight = self._weight
        for backend in rivals:
            if bound:
                load = backend.in_flight + backend.others_at_scrape
                if weight:
                    load += weight * backend.reported_load
                if load + 1 > bound:
                    continue
            cached = cached_map.get(backend.url, 0) if cached_map else 0
            if cached > prompt:
                cached = prompt
            ttft, wait = self.predict(backend, prompt, cached)
            if ttft < best_ttft:
                best, best_ttft, best_wait, best_cached = backend, ttft, wait, cached
        cached = cached_map.get(keep.url, 0) if cached_map else 0
        if cached > prompt:
            cached = prompt
        ttft, wait = self.predict(keep, prompt, cached)
        if best is None or ttft <= best_ttft:
            return keep, ttft, wait, cached
        return best, best_ttft, best_wait, best_cached

    def _scan(self, pool: BackendSet, exclude: frozenset[str], prompt: int, cached_map: Mapping[str, int] | None,
              keep: Backend) -> tuple[int, Backend, float, float, int]:
        """``_refresh`` then ``_fastest(pool, exclude, prompt, cached_map, keep, bound, None)`` with the
        refreshed safety bound, in one pass: (bound, and ``_fastest``'s answer). The pass finds the
        fastest candidate ignoring the bound (with ``_fastest``'s tie rule: ``keep`` wins ties, else
        the first in member order); when that one is within the bound (or is ``keep``) it is also the
        fastest within it, else ``_fastest`` runs again with the bound (rare: the fastest backend is
        also overloaded). The prediction is ``predict``'s, inlined, operation for operation (the same
        floats, so the same choices and the same header values)."""
        stats = self._stats.get(pool.key)
        if stats is None:
            stats = self._stats[pool.key] = _PoolStats()
        weight = self._weight
        default_step = self._step
        default_per_token = self._per_token
        default_queued = self._queued
        kv_from = self._kv_from
        total = 0.0
        count = 0
        min_step = math.inf
        min_per_token = math.inf
        best: Backend | None = None
        best_ttft = math.inf
        best_wait = 0.0
        best_cached = 0
        best_load = 0.0
        get = cached_map.get if cached_map else None
        ahead_of = self._ahead.get
        now = self._now
        none_cached = 0 if prompt >= 0 else prompt  # what ``_fastest`` makes of a backend holding nothing
        none_uncached = prompt - none_cached
        for backend in pool.members:
            if not backend.healthy or backend.draining or (exclude and backend.url in exclude):
                continue  # not ``available`` (its definition, inlined), or excluded
            in_flight = backend.in_flight
            held = in_flight + backend.others_at_scrape
            load = held + weight * backend.reported_load if weight else held
            total += load
            count += 1
            step = backend.step_s
            if step < 0:
                step = default_step
            per_token = backend.prefill_s_per_token
            if per_token < 0:
                per_token = default_per_token
            if step < min_step:
                min_step = step
            if per_token < min_per_token:
                min_per_token = per_token
            # predict(backend, prompt, cached)
            wait = 0.0
            waiting = backend.engine_waiting
            if waiting > 0:
                queue = waiting + in_flight - backend.in_flight_at_scrape
                if queue > 0:
                    queued = backend.queued_request_s
                    wait = queue * (queued if queued >= 0 else default_queued)
            busy = backend.busy_s_per_request
            if busy > 0:
                wait += held * busy
            if backend.kv_usage > kv_from:
                wait += self._pressure_s(backend, prompt)
            if in_flight > 0:
                ahead = ahead_of(backend.url, 0.0) - now
                if ahead > 0:
                    wait += ahead
            if get is not None:
                cached = get(backend.url, 0)
                if cached > prompt:
                    cached = prompt
                uncached = prompt - cached
            else:
                cached = none_cached
                uncached = none_uncached
            ttft = step + (uncached if uncached > 0 else 0) * per_token + wait
            if ttft < best_ttft or (ttft == best_ttft and backend is keep):
                best, best_ttft, best_wait, best_cached, best_load = backend, ttft, wait, cached, load
        stats.record(total, count, min_step, min_per_token, pool, exclude, not weight)
        bound = self._safety_bound(total, count)
        if best is None or (best is not keep and bound and best_load + 1 > bound):
            return (bound, *self._fastest(pool, exclude, prompt, cached_map, keep, bound, None))
        return bound, best, best_ttft, best_wait, best_cached

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
                load = backend.in_flight + backend.others_at_scrape
                if weight:
                    load += weight * backend.reported_load
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
            if not bound:  # no candidate at all (a retry whose pin was the only one left)
                raise no_available_backend(pool)
            # everything is over the bound: the bound yields (it is a safety net, not a refusal)
            return self._fastest(pool, exclude, prompt, cached_map, None, 0, known)
        return best, best_ttft, best_wait, best_cached

    def _safety_bound(self, total: float, count: int) -> int:
        """The most load a backend may carry after taking one more session request (module docstring,
        *Safety net*); the sticky fast path remembers it per pool and total (``_PoolStats.bound``)."""
        settings = self.settings
        mean_bound = math.ceil((total + 1) / count - 1e-9)
        return max(load_bound(settings.max_load_factor, total, count), mean_bound + settings.sticky_headroom)

    def _pool_stats(self, pool: BackendSet, exclude: frozenset[str]) -> _PoolStats:
        """The set's stats, refreshed when stale (module docstring): exact for small pools and retries.
        A small pool's stay exact without a pass while its ``Ledger`` shows nothing but in-flight counts
        changed since the last one: that pass's stats, its total moved by the in-flight units added and
        dropped since (whole numbers, so exactly the total a pass would find)."""
        stats = self._stats.get(pool.key)
        small = len(pool.members) <= SMALL_POOL
        if stats is not None and not exclude and small:
            ledger = stats.ledger
            if (ledger is not None and ledger.version == stats.ledger_version and stats.version == pool.version
                    and not ledger.inexact):
                stats.total = stats.base + (ledger.added - ledger.drops)
                return stats
        if stats is None or exclude or stats.version != pool.version or stats.age >= STATS_EVERY or small:
            return self._refresh(pool, exclude)
        stats.age += 1
        return stats

    def _refresh(self, pool: BackendSet, exclude: frozenset[str]) -> _PoolStats:
        stats = self._stats.get(pool.key)
        if stats is None:
            stats = self._stats[pool.key] = _PoolStats()
        weight = self._weight
        default_step = self._step
        default_per_token = self._per_token
        total = 0.0
        count = 0
        min_step = math.inf
        min_per_token = math.inf
        for backend in pool.members:
            if not backend.healthy or backend.draining or (exclude and backend.url in exclude):
                continue  # not ``available`` (its definition, inlined), or excluded
            in_flight = backend.in_flight
            load = in_flight + backend.others_at_scrape
            total += load + weight * backend.reported_load if weight else load
            count += 1
            step = backend.step_s
            if step < 0:
                step = default_step
            per_token = backend.prefill_s_per_token
            if per_token < 0:
                per_token = default_per_token
            if step < min_step:
                min_step = step
            if per_token < min_per_token:
                min_per_token = per_token
        stats.record(total, count, min_step, min_per_token, pool, exclude, not weight)
        return stats

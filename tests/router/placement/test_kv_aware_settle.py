"""The ``kv_aware`` policy's no-pass answer (``KVAwarePolicy._settled``) and what it relies on: the
pool's ``Ledger`` kept by ``Backend.__setattr__`` (``router.membership``). Whether the answers are the
same as with a pass is ``test_kv_aware_equivalence``'s job; here: that every change a pass would see
makes the next placement pass again, and that in-flight counts are counted as the proxy writes them."""

from __future__ import annotations

import random

import pytest

from router.membership import WATCHED, Backend, BackendPool
from router.placement import KVAwarePolicy, KVAwareSettings, Outcome, PlacementHint
from router.sessions.table import SessionEntry


def queueing_pool(n: int = 16, waiting: float = 5.0) -> BackendPool:
    pool = BackendPool("default", [Backend(f"http://127.0.0.1:{8100 + i}") for i in range(n)])
    for backend in pool.members:
        backend.engine_waiting = waiting
        backend.in_flight = 2
        backend.in_flight_at_scrape = 2
    return pool


class Counted(KVAwarePolicy):
    """The policy, counting its passes over the pool (``_rivals``) and its no-pass answers."""

    def __init__(self, settings: KVAwareSettings = KVAwareSettings()) -> None:
        super().__init__(settings)
        self.passes = 0
        self.settled = 0

    def _rivals(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.passes += 1
        return super()._rivals(*args, **kwargs)

    def _settled(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        found = super()._settled(*args, **kwargs)
        self.settled += found is not None
        return found


def place(policy: KVAwarePolicy, pool: BackendPool, pin: int = 0, prompt: int = 640) -> Outcome:
    entry = SessionEntry("s", 0.0, 0.0, 0.0)
    entry.pins["default"] = pool.members[pin].url
    placement = policy.place(pool, "s", entry, hint=PlacementHint(prompt, last_tokens=prompt))
    return placement.outcome


def test_a_pass_then_none_while_nothing_changes() -> None:
    pool, policy = queueing_pool(), Counted()
    for i in range(10):
        assert place(policy, pool, pin=i % 16) is Outcome.STICKY
    assert (policy.passes, policy.settled) == (1, 9)
    # requests sent meanwhile only raise queues: still no pass
    pool.members[3].in_flight += 4
    assert place(policy, pool) is Outcome.STICKY
    assert (policy.passes, policy.settled) == (1, 10)


@pytest.mark.parametrize("name,value", [
    ("healthy", False), ("draining", True), ("engine_waiting", 4.0), ("in_flight_at_scrape", 3),
    ("others_at_scrape", 1.0), ("step_s", 0.02), ("prefill_s_per_token", 0.001), ("queued_request_s", 0.2),
    ("busy_s_per_request", 0.01),
])
def test_any_change_a_pass_reads_makes_the_next_placement_pass(name: str, value: object) -> None:
    assert name in WATCHED
    pool, policy = queueing_pool(), Counted()
    place(policy, pool)
    place(policy, pool)
    assert (policy.passes, policy.settled) == (1, 1)
    setattr(pool.members[5], name, value)
    place(policy, pool)
    assert (policy.passes, policy.settled) == (2, 1)
    place(policy, pool)  # and settled again after that pass
    assert (policy.passes, policy.settled) == (2, 2)


def test_writing_the_same_value_again_changes_nothing() -> None:
    pool, policy = queueing_pool(), Counted()
    place(policy, pool)
    for backend in pool.members:  # a scrape that found everything as it was
        backend.engine_waiting = 5.0
        backend.in_flight_at_scrape = backend.in_flight
        backend.healthy = True
    place(policy, pool)
    assert (policy.passes, policy.settled) == (1, 1)


def test_finished_requests_lower_the_bound_until_a_pass_is_needed() -> None:
    # queues of 5 at 0.1 s each against a pin whose prompt is cached: the bound holds while a few
    # requests finish, not once every queue may have drained
    pool, policy = queueing_pool(waiting=5.0), Counted()
    place(policy, pool)
    drops = 0
    while policy.passes == 1:
        pool.members[1 + drops % 8].in_flight -= 1
        drops += 1
        place(policy, pool)
    assert 1 < drops <= 5
    assert policy.settled == drops - 1


def test_members_joining_or_leaving_make_it_pass() -> None:
    pool, policy = queueing_pool(), Counted()
    place(policy, pool)
    joined = Backend("http://127.0.0.1:9000", engine_waiting=5.0, in_flight=1, in_flight_at_scrape=1)
    pool.add(joined)
    place(policy, pool)
    assert policy.passes == 2
    pool.remove(joined.url)
    place(policy, pool)
    assert policy.passes == 3
    assert joined.ledger is None


def test_no_answer_without_exact_sums_or_on_a_candidate_set() -> None:
    pool, policy = queueing_pool(), Counted()
    pool.members[7].others_at_scrape = 0.5  # not a whole number: the load total would not be exact
    for _ in range(3):
        place(policy, pool)
    assert (policy.passes, policy.settled) == (3, 0)
    pool.members[7].others_at_scrape = 1.0
    place(policy, pool)
    place(policy, pool)
    assert (policy.passes, policy.settled) == (4, 1)
    # a model's candidate set (some members) has no ledger of its own
    for i, backend in enumerate(pool.members):
        pool.set_models(backend, frozenset({"m"} if i < 10 else {"other"}))
    subset = pool.for_model("m")
    assert subset is not None and subset is not pool and subset.ledger is None
    for _ in range(3):
        place(policy, subset)  # type: ignore[arg-type]
    assert policy.settled == 1
    # nor with a reported-load weight (its products are not whole numbers)
    weighted, pool = Counted(KVAwareSettings(reported_load_weight=0.5)), queueing_pool()
    for _ in range(3):
        place(weighted, pool)
    assert (weighted.passes, weighted.settled) == (3, 0)


def test_the_ledger_counts_what_the_proxy_writes() -> None:
    pool = queueing_pool(4)
    ledger = pool.ledger
    a, b = pool.members[0], pool.members[1]
    added, drops, version = ledger.added, ledger.drops, ledger.version
    a.in_flight += 1
    a.in_flight += 1
    b.in_flight -= 1
    assert (ledger.added - added, ledger.drops - drops, ledger.version) == (2, 1, version)
    b.healthy = False  # an unavailable member's requests are not counted (it is no candidate)
    version = ledger.version
    b.in_flight -= 1
    b.in_flight += 3
    assert (ledger.added - added, ledger.drops - drops, ledger.version) == (2, 1, version)
    a.in_flight = -1  # below zero (a bug elsewhere): no bound holds, the next placement passes
    assert ledger.version == version + 1
    assert Backend("http://127.0.0.1:9999").ledger is None  # outside a pool: nothing kept


@pytest.mark.parametrize("seed", range(5))
def test_admit_and_release_keep_the_ledger_as_the_writes_do(seed: int) -> None:
    """``Backend.admit`` / ``release`` (the data path's) leave the counts and the ledger exactly as
    ``in_flight += 1`` / ``-= 1`` do, availability changes and counts below zero included."""
    def run(by_method: bool) -> tuple[object, ...]:
        rng = random.Random(seed)
        pool = queueing_pool(3)
        ledger = pool.ledger
        assert ledger is not None
        for _ in range(200):
            member = rng.choice(pool.members)
            step = rng.random()
            if step < 0.45:
                member.admit() if by_method else setattr(member, "in_flight", member.in_flight + 1)
            elif step < 0.9:
                member.release() if by_method else setattr(member, "in_flight", member.in_flight - 1)
            elif step < 0.95:
                member.healthy = not member.healthy
            else:
                member.draining = not member.draining
        return ledger.added, ledger.drops, ledger.version, [m.in_flight for m in pool.members]

    assert run(True) == run(False)
    alone = Backend("http://127.0.0.1:9999")  # outside a pool: counted, no ledger
    alone.admit()
    alone.admit()
    alone.release()
    assert (alone.in_flight, alone.ledger) == (1, None)


def test_inexact_counts_fractional_and_negative_sums_and_shared_members() -> None:
    pool = queueing_pool(3)
    ledger = pool.ledger
    assert ledger.inexact == 0
    pool.members[0].engine_waiting = 1.5
    pool.members[1].others_at_scrape = -1.0
    assert ledger.inexact == 2
    pool.members[0].engine_waiting = 2.0
    assert ledger.inexact == 1
    pool.remove(pool.members[1].url)
    assert ledger.inexact == 0
    other = BackendPool("decode")
    other.add(pool.members[0])  # one Backend in two pools: neither ledger sees all of its writes
    assert ledger.inexact == 1 and other.ledger.inexact == 1


def test_no_answer_while_an_in_flight_count_is_negative() -> None:
    pool, policy = queueing_pool(), Counted()
    pool.members[4].in_flight = -1  # a bug elsewhere: loads below zero bound nothing
    for _ in range(3):
        place(policy, pool)
    assert (policy.passes, policy.settled) == (3, 0)
    pool.members[4].in_flight = 0
    place(policy, pool)
    place(policy, pool)
    assert (policy.passes, policy.settled) == (4, 1)


def two_backends_with_work_ahead(queued: float) -> tuple[BackendPool, Counted, list[float]]:
    """Two engines with 3 requests in flight and ``queued`` waiting at the last scrape (persisted over
    three), each sent 2 s of prefill work (8,000 new tokens at the configured 4,000 tokens/s), each
    placement by the fast path (its whole prompt is new anywhere); and the policy's clock."""
    now = [0.0]
    pool = BackendPool("default", [Backend(f"http://127.0.0.1:{8100 + i}") for i in range(2)])
    policy = Counted()
    policy._clock = lambda: now[0]  # type: ignore[method-assign]
    for backend in pool.members:
        backend.in_flight = backend.in_flight_at_scrape = 3
        backend.engine_waiting = backend.queued_floor = queued
    for backend in pool.members:
        entry = SessionEntry("w", 0.0, 0.0, 0.0)
        entry.pins["default"] = backend.url
        assert policy.place(pool, "w", entry, hint=PlacementHint(8000, last_tokens=0)).outcome is Outcome.STICKY
    assert policy.passes == 0
    return pool, policy, now


def turn(policy: KVAwarePolicy, pool: BackendPool, uncached: int = 8) -> Outcome:
    """A turn of 640 tokens, ``uncached`` of them new, pinned to the first backend; the proxy sends it."""
    entry = SessionEntry("s", 0.0, 0.0, 0.0)
    entry.pins["default"] = pool.members[0].url
    placement = policy.place(pool, "s", entry, hint=PlacementHint(640, last_tokens=640 - uncached))
    placement.backend.in_flight += 1
    return placement.outcome


def test_work_ahead_everywhere_settles_until_a_backend_may_have_emptied() -> None:
    """Engines that queue alike (3 waiting, persisted: the hysteresis alone does not settle the pin),
    each with prefill work this router sent ahead of a newcomer (``ahead``): the pin's prediction is
    above the fast path's floor, which has no wait. The pass finds no rival, and the next placements are
    settled from the earliest end of work ahead it saw, until as many requests finished as the fewest a
    member had in flight: that member may be empty (its work ahead no longer counts), a pass runs, and
    the emptied backend, clearly faster now, takes the session."""
    pool, policy, now = two_backends_with_work_ahead(3.0)
    assert turn(policy, pool) is Outcome.STICKY and (policy.passes, policy.settled) == (1, 0)
    for _ in range(5):
        now[0] += 0.01
        assert turn(policy, pool) is Outcome.STICKY
    assert (policy.passes, policy.settled) == (1, 5)
    pool.members[1].in_flight -= 3  # as many finished as the fewest in flight at the pass: it is empty
    assert turn(policy, pool) is Outcome.SPILL
    assert (policy.passes, policy.settled) == (2, 5)


def test_the_hysteresis_alone_keeps_a_pin_that_does_not_queue() -> None:
    """A pin that does not queue, with more work ahead than the other backend: the other predicts
    clearly faster, but it could take the session only for "wait", and the pin's settled prediction
    (no ``ahead``, no queue) is not clearly slower than any backend's floor: sticky without a pass or
    a no-pass answer (``_never_settled_slower``). Once the pin's queue persisted, the pass runs and the
    session moves."""
    pool, policy, now = two_backends_with_work_ahead(0.0)
    pin, other = pool.members
    other.in_flight = 0  # its work is done: nothing ahead there
    for _ in range(5):
        now[0] += 0.01
        assert turn(policy, pool) is Outcome.STICKY
    assert (policy.passes, policy.settled) == (0, 0)
    pin.step_s = other.step_s = 0.01  # learned alike: the pin is no slower by its constants
    assert turn(policy, pool) is Outcome.STICKY and policy.passes == 0
    pin.engine_waiting = pin.queued_floor = 6.0  # a queue that persisted over three scrapes
    assert turn(policy, pool) is Outcome.SPILL
    assert policy.passes == 1

"""The ``kv_aware`` policy's decisions (``router.placement.kv_aware``), on hand-set engine signals."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest

from contract.errors import NoHealthyBackendError
from router.membership import Backend, BackendPool
from router.placement import KVAwarePolicy, KVAwareSettings, Outcome, PlacementHint, SessionPolicy, make_policy
from router.placement.session import session_score
from router.sessions.table import SessionEntry, SessionTable

PROMPT = 2000  # tokens: 0.5 s to prefill at the default 4,000 tokens/s


def apart(settings: KVAwareSettings = KVAwareSettings(), **kw: object) -> KVAwarePolicy:
    """The policy on a clock that moves an hour per placement: requests here are far apart, so the
    prefill work each one sent (``ahead``) is done before the next (``test_prefill_work_sent_*``
    tests it on a clock of their own)."""
    clock = iter(range(0, 10**12, 3600))
    return KVAwarePolicy(settings, clock=lambda: float(next(clock)), **kw)  # type: ignore[arg-type]


def make_pool(n: int, first_port: int = 8100) -> BackendPool:
    return BackendPool("default", [Backend(f"http://127.0.0.1:{first_port + i}") for i in range(n)])


def table() -> SessionTable:
    return SessionTable(1000, 3600)


def hint(prompt: int = PROMPT, last: int | None = None, **extra: object) -> PlacementHint:
    return PlacementHint(prompt, last_tokens=prompt - 50 if last is None else last, **extra)  # type: ignore[arg-type]


class FakeKV:
    """The two reads the policy makes of the KV index."""

    #: a feeder is hooked: the policy calls ``catch_up`` before its reads
    catch_up_hooked = True

    def __init__(self, sessions: dict[str, dict[str, int]] | None = None,
                 prefixes: dict[tuple[int, ...], dict[str, int]] | None = None) -> None:
        self.sessions = sessions or {}
        self.prefixes = prefixes or {}
        #: backends whose KV events reach the index (``has_events``)
        self.live: set[str] = set()
        self.prefix_calls = 0
        #: reads of the index since the last ``catch_up`` (None: none yet), and the catch-ups
        self.reads_since_catch_up: int | None = None
        self.catch_ups = 0

    def catch_up(self) -> None:
        self.catch_ups += 1
        self.reads_since_catch_up = 0

    def session_tokens(self, session_id: str) -> Mapping[str, int]:
        if self.reads_since_catch_up is not None:
            self.reads_since_catch_up += 1
        return self.sessions.get(session_id, {})

    def has_events(self, backend_url: str) -> bool:
        return backend_url in self.live

    @property
    def any_events(self) -> bool:
        """As the index: False only while it holds nothing (then the policy does not read it)."""
        return bool(self.live) or any(self.sessions.values()) or any(self.prefixes.values())

    def prefix_tokens(self, prompt_ids: Sequence[int]) -> Mapping[str, int]:
        self.prefix_calls += 1
        return self.prefixes.get(tuple(prompt_ids), {})


def pinned(policy: KVAwarePolicy, pool: BackendPool, sessions: SessionTable, sid: str) -> tuple[SessionEntry, Backend]:
    entry = sessions.touch(sid)
    first = policy.place(pool, sid, entry, hint=hint(last=0))
    assert first.outcome is Outcome.NEW
    return entry, first.backend


def test_is_the_default_policy_and_session_stays_one_setting_away() -> None:
    from router.config import RouterConfig

    assert RouterConfig().placement.policy == "kv_aware"
    assert isinstance(make_policy("kv_aware", load_factor=1.25, reported_load_weight=0.0), KVAwarePolicy)
    assert isinstance(make_policy("session", load_factor=1.25, reported_load_weight=0.0), SessionPolicy)


def test_prediction_is_step_plus_uncached_prefill_plus_wait() -> None:
    policy = apart(KVAwareSettings(prefill_tokens_per_s=1000.0, per_request_step_s=0.01,
                                           queued_request_s=0.2, kv_pressure_from=0.8))
    b = Backend("http://127.0.0.1:8100")
    assert policy.predict(b, 500, 100) == pytest.approx((0.01 + 0.4, 0.0))
    b.engine_waiting, b.in_flight, b.in_flight_at_scrape = 2, 5, 3  # 2 queued + 2 sent since the scrape
    assert policy.predict(b, 500, 100) == pytest.approx((0.41 + 0.8, 0.8))
    b.in_flight = 1  # 2 of the requests there at the scrape finished since: the queue drained by 2
    assert policy.predict(b, 500, 100) == pytest.approx((0.41, 0.0))
    b.in_flight, b.engine_waiting = 5, 0  # not queueing: arrivals since the scrape are batched, not a wait
    assert policy.predict(b, 500, 100) == pytest.approx((0.41, 0.0))
    b.in_flight = b.in_flight_at_scrape = 3
    b.kv_usage = 0.9  # half-way from 0.8 to full: half of 2 x the prompt
    assert policy.predict(b, 500, 100) == pytest.approx((0.41 + 0.5, 0.5))
    b.in_flight = 1  # half the requests holding that cache finished: usage about 0.45, no pressure
    assert policy.predict(b, 500, 100) == pytest.approx((0.41, 0.0))
    b.kv_usage = 0.0
    b.step_s, b.prefill_s_per_token, b.busy_s_per_request = 0.05, 0.002, 0.01  # learned values win
    assert policy.predict(b, 500, 100) == pytest.approx((0.05 + 0.8 + 0.01, 0.01))  # 1 in flight x 10 ms


def test_sessions_stay_put_under_chance_in_flight_fluctuations() -> None:
    """The issue's short-request complaint: in-flight counts crossing mean + headroom by chance made
    sessions wander. Two backends that are not queueing: every request of every session stays."""
    rng = random.Random(7)
    for policy in (apart(), SessionPolicy()):
        pool, sessions = make_pool(2), table()
        ids = [f"s{i}" for i in range(64)]
        entries = {sid: sessions.touch(sid) for sid in ids}
        for sid in ids:
            policy.place(pool, sid, entries[sid], hint=hint(60, last=0))
        homes = {sid: entries[sid].pins["default"] for sid in ids}
        moved = 0
        for _ in range(5000):
            for backend in pool.members:  # c=16 spread by chance, as a closed loop sees it
                backend.in_flight = rng.randint(0, 16)
            sid = rng.choice(ids)
            placement = policy.place(pool, sid, entries[sid], hint=hint(60, last=40))
            moved += placement.backend.url != homes[sid]
        if isinstance(policy, KVAwarePolicy):
            assert moved == 0
            assert all(entries[sid].pins["default"] == homes[sid] for sid in ids)
        else:  # the old policy spills on those chance crossings (what the new default fixes)
            assert moved > 100


def test_a_saturated_pin_sheds_its_session_to_a_backend_with_headroom() -> None:
    policy, pool, sessions = apart(), make_pool(2), table()
    entry, pin = pinned(policy, pool, sessions, "s")
    other = next(b for b in pool.members if b is not pin)
    pin.engine_waiting = 30  # 30 queued x 0.1 s: 3 s of wait against a 0.5 s recompute elsewhere
    # one scrape saw it queue (the one before did not): not yet a reason to move (hysteresis)
    placement = policy.place(pool, "s", entry, hint=hint())
    assert (placement.backend, placement.outcome, placement.reason) == (pin, Outcome.STICKY, "cached")
    pin.queued_floor = 30  # the next scrape saw it queue too
    placement = policy.place(pool, "s", entry, hint=hint())
    assert (placement.backend, placement.outcome, placement.reason) == (other, Outcome.SPILL, "wait")
    assert entry.pins["default"] == other.url  # the pin moved with the freshest prefix
    assert placement.cached_tokens == 0 and placement.predicted_ttft_s == pytest.approx(0.01 + 0.5)
    # the next request stays on the new pin (its prefix is there now)
    again = policy.place(pool, "s", entry, hint=hint())
    assert (again.backend, again.outcome) == (other, Outcome.STICKY)


def test_a_short_queue_does_not_pay_for_recomputing_the_prefix() -> None:
    policy, pool, sessions = apart(), make_pool(2), table()
    entry, pin = pinned(policy, pool, sessions, "s")
    pin.engine_waiting = 3  # 0.3 s of queue < the 0.5 s prefill a move costs
    placement = policy.place(pool, "s", entry, hint=hint())
    assert (placement.backend, placement.outcome, placement.reason) == (pin, Outcome.STICKY, "cached")
    assert placement.cached_tokens == PROMPT - 50
    assert placement.wait_s == pytest.approx(0.3)


def test_a_kv_pressured_pin_sheds_its_session() -> None:
    policy, pool, sessions = apart(), make_pool(2), table()
    entry, pin = pinned(policy, pool, sessions, "s")
    pin.kv_usage = 0.99
    placement = policy.place(pool, "s", entry, hint=hint())
    assert (placement.outcome, placement.reason) == (Outcome.SPILL, "kv_pressure")
    assert placement.backend is not pin and entry.pins["default"] == placement.backend.url


def test_a_slow_backend_loses_its_sessions() -> None:
    policy, pool, sessions = apart(), make_pool(2), table()
    entry, pin = pinned(policy, pool, sessions, "s")
    pin.step_s = 2.0  # learned: its steps take 2 s (the other's are the configured 10 ms)
    placement = policy.place(pool, "s", entry, hint=hint())
    assert placement.backend is not pin and (placement.outcome, placement.reason) == (Outcome.SPILL, "wait")


def test_a_backend_with_nothing_learned_is_not_judged_slower_by_the_configured_constants() -> None:
    """The others learned they are fast (1 ms steps, 40,000 prompt tokens/s); one backend just came back
    (restarted: nothing learned, the configured 10 ms and 4,000 tokens/s stand in). New sessions hashed
    to it still go there, and its sessions stay: otherwise it would get no traffic to learn from. Once
    it has learned that it is slow, they leave."""
    policy, pool, sessions, ranking = apart(), make_pool(3), table(), SessionPolicy()
    back = pool.members[0]
    for backend in pool.members[1:]:
        backend.step_s, backend.prefill_s_per_token = 0.001, 0.000025
    hashed_there = [sid for sid in (f"n{i}" for i in range(60)) if ranking.candidates(pool, sid)[0] is back]
    assert hashed_there
    for sid in hashed_there:
        placement = policy.place(pool, sid, sessions.touch(sid), hint=hint(last=0))
        assert (placement.backend, placement.reason) == (back, "hash")
    placement = policy.place(pool, hashed_there[0], sessions.touch(hashed_there[0]), hint=hint())
    assert (placement.backend, placement.outcome) == (back, Outcome.STICKY)
    back.step_s, back.prefill_s_per_token = 0.2, 0.001  # learned: 200x and 40x slower
    placement = policy.place(pool, hashed_there[0], sessions.touch(hashed_there[0]), hint=hint())
    assert placement.backend is not back and (placement.outcome, placement.reason) == (Outcome.SPILL, "wait")


def test_new_sessions_go_by_rendezvous_hash_unless_it_is_clearly_slower() -> None:
    policy, pool, sessions, ranking = apart(), make_pool(4), table(), SessionPolicy()
    for i in range(40):
        sid = f"n{i}"
        placement = policy.place(pool, sid, sessions.touch(sid), hint=hint(last=0))
        assert (placement.outcome, placement.reason) == (Outcome.NEW, "hash")
        assert placement.backend is ranking.candidates(pool, sid)[0]
    hashed = ranking.candidates(pool, "late")[0]
    hashed.engine_waiting = 50  # one scrape caught it queueing (arrivals between two steps, say): stay
    placement = policy.place(pool, "late", sessions.touch("late"), hint=hint(last=0))
    assert placement.backend is hashed and (placement.outcome, placement.reason) == (Outcome.NEW, "hash")
    hashed.queued_floor = 50  # three scrapes in a row did: a real queue, the new session goes elsewhere
    placement = policy.place(pool, "late", table().touch("late"), hint=hint(last=0))  # met afresh
    assert placement.backend is not hashed and (placement.outcome, placement.reason) == (Outcome.NEW, "wait")


def test_a_child_session_goes_where_its_parent_is() -> None:
    policy, pool, sessions = apart(), make_pool(4), table()
    parent, parent_pin = pinned(policy, pool, sessions, "parent")
    for i in range(20):
        child = sessions.touch(f"child{i}")
        placement = policy.place(pool, f"child{i}", child,
                                 hint=hint(last=0, parent_session="parent", parent_entry=parent))
        assert (placement.backend, placement.outcome, placement.reason) == (parent_pin, Outcome.NEW, "parent")
        assert child.pins["default"] == parent_pin.url
    # with the KV index, where the parent's KV is wins over its pin
    holder = next(b for b in pool.members if b is not parent_pin)
    policy.kv = FakeKV(sessions={"parent": {holder.url: 1500}})
    placement = policy.place(pool, "kid", sessions.touch("kid"),
                             hint=hint(last=0, parent_session="parent", parent_entry=parent))
    assert (placement.backend, placement.reason, placement.cached_tokens) == (holder, "parent", 1500)


def test_the_kv_index_says_what_is_cached_where() -> None:
    policy, pool, sessions = apart(), make_pool(3), table()
    entry, pin = pinned(policy, pool, sessions, "s")
    holder = next(b for b in pool.members if b is not pin)
    # the index says the session's KV is elsewhere (its pin lost it): it follows its KV
    policy.kv = FakeKV(sessions={"s": {holder.url: PROMPT}})
    placement = policy.place(pool, "s", entry, hint=hint())
    assert (placement.backend, placement.outcome, placement.reason) == (holder, Outcome.SPILL, "cached")
    assert placement.cached_tokens == PROMPT and entry.pins["default"] == holder.url
    # tokens mode: a new session's prompt prefix resident on one backend draws it there
    ids = tuple(range(PROMPT))
    policy.kv = FakeKV(prefixes={ids: {pin.url: PROMPT - 16}})
    new = sessions.touch("fresh")
    placement = policy.place(pool, "fresh", new, hint=PlacementHint(PROMPT, ids))
    assert placement.backend is pin and placement.cached_tokens == PROMPT - 16
    assert placement.reason in ("hash", "cached")
    # a session the index knows costs one lookup: its prompt's blocks are not hashed on every turn
    index = policy.kv = FakeKV(sessions={"s": {holder.url: PROMPT}}, prefixes={ids: {pin.url: PROMPT - 16}})
    placement = policy.place(pool, "s", entry, hint=PlacementHint(PROMPT, ids))
    assert (placement.backend, placement.cached_tokens, index.prefix_calls) == (holder, PROMPT, 0)
    # each placement brings the index up to date once, before it reads it (router.kv.service)
    assert index.catch_ups == 1 and index.reads_since_catch_up is not None and index.reads_since_catch_up >= 1
    # an index no feeder is hooked to (no backend's events subscribed) is not asked to catch up
    index.catch_up_hooked = False
    policy.place(pool, "s", entry, hint=PlacementHint(PROMPT, ids))
    assert index.catch_ups == 1


def test_the_safety_net_bounds_the_spread() -> None:
    """A pin over max(ceil(max_load_factor x (total + 1) / n), ceil((total + 1) / n) + headroom) in
    flight sheds the session ("load") to the fastest backend within it. Over two backends a factor of
    2 never binds (one backend may carry all); from three on it does."""
    policy, pool, sessions = apart(), make_pool(2), table()
    entry, pin = pinned(policy, pool, sessions, "s")
    pin.in_flight = 80
    assert policy.place(pool, "s", entry, hint=hint()).outcome is Outcome.STICKY
    pool3, sessions3 = make_pool(3), table()
    entry3, pin3 = pinned(policy, pool3, sessions3, "t")
    others = [b for b in pool3.members if b is not pin3]
    pin3.in_flight, others[0].in_flight, others[1].in_flight = 8, 4, 4  # bound max(ceil(2 x 17 / 3), 6 + 2) = 12
    assert policy.place(pool3, "t", entry3, hint=hint()).outcome is Outcome.STICKY
    pin3.in_flight, others[0].in_flight, others[1].in_flight = 14, 2, 3  # bound max(ceil(2 x 20 / 3), 7 + 2) = 14
    placement = policy.place(pool3, "t", entry3, hint=hint())
    assert (placement.backend, placement.outcome, placement.reason) == (others[0], Outcome.SPILL, "load")
    assert entry3.pins["default"] == others[0].url


def test_the_safety_net_defers_to_a_prediction_that_sees_the_load() -> None:
    """Once the pin's interference is learned (``busy_s_per_request``), its in-flight requests are in
    its prediction: over the bound, a session whose cached prefix makes staying predicted faster stays
    (a move would recompute it, and slow the target's requests too); one that is predicted faster
    elsewhere still goes, without the move factor."""
    policy, pool, sessions = apart(), make_pool(3), table()
    entry, pin = pinned(policy, pool, sessions, "t")
    others = [b for b in pool.members if b is not pin]
    pin.in_flight, others[0].in_flight, others[1].in_flight = 14, 2, 3  # over the bound of 14
    for backend in pool.members:
        backend.busy_s_per_request = 0.01
    # 0.01 + 50 / 4000 + 14 x 0.01 = 0.16 s there, 0.01 + 0.5 + 0.02 = 0.53 s on the least busy
    placement = policy.place(pool, "t", entry, hint=hint())
    assert (placement.backend, placement.outcome, placement.reason) == (pin, Outcome.STICKY, "cached")
    # a turn the pin holds little of: 0.01 + 1.6 / 4 + 0.14 = 0.55 s there, faster (not 1.5x) elsewhere
    placement = policy.place(pool, "t", entry, hint=hint(last=400))
    assert (placement.backend, placement.outcome, placement.reason) == (others[0], Outcome.SPILL, "load")


def test_replicas_judge_the_safety_net_and_the_kv_usage_on_the_engines_whole_load() -> None:
    """Three router replicas share the engines' traffic, each with a third of it in flight. The safety
    net and the KV-usage correction count the engine's requests of the other replicas too
    (``others_at_scrape``), so each replica decides as one router carrying everything would."""
    def views() -> list[tuple[KVAwarePolicy, BackendPool, SessionEntry, Backend]]:
        out = []
        for _ in range(3):
            policy, pool, sessions = apart(), make_pool(4), table()
            entry, pin = pinned(policy, pool, sessions, "s")
            out.append((policy, pool, entry, pin))
        return out

    # the pin's engine holds 14 (this replica 5, the others 9), the other three 1 each: a lone router
    # with all 17 in flight has the bound max(ceil(2 x 18 / 4), 5 + 2) = 9 and sheds the session
    for policy, pool, entry, pin in views():
        for backend in pool.members:
            backend.in_flight, backend.others_at_scrape = (5, 9.0) if backend is pin else (0, 1.0)
        placement = policy.place(pool, "s", entry, hint=hint())
        assert (placement.outcome, placement.reason) == (Outcome.SPILL, "load")
    lone_policy, lone_pool, lone_entry, lone_pin = views()[0]
    for backend in lone_pool.members:
        backend.in_flight = 14 if backend is lone_pin else 1
    assert lone_policy.place(lone_pool, "s", lone_entry, hint=hint()).reason == "load"
    # at 2 of its own on the pin a replica blind to the others keeps the session (bound max(ceil(2 x 3
    # / 4), 1 + 2) = 3), while the engine holds 12 against 1s: counted whole, the pin is over the
    # bound (max(ceil(2 x 16 / 4), 4 + 2) = 8) and the session goes, as from a lone router
    blind, aware = views()[:2]
    for (policy, pool, entry, pin), others in ((blind, 0.0), (aware, 10.0)):
        for backend in pool.members:
            backend.in_flight, backend.others_at_scrape = (2, others) if backend is pin else (0, others and 1.0)
    assert blind[0].place(blind[1], "s", blind[2], hint=hint()).outcome is Outcome.STICKY
    assert aware[0].place(aware[1], "s", aware[2], hint=hint()).reason == "load"

    # KV usage 0.95 at the scrape with 3 of this replica's requests and 6 others' there; one of its
    # three finished since: the others' (unseen until the next scrape) are taken to have gone alike, so
    # the usage is that of a lone router whose 9 became 6: 0.95 x 7 / 10, under kv_pressure_from
    policy = apart(KVAwareSettings(kv_pressure_from=0.8))
    replica, lone = Backend("http://127.0.0.1:8100"), Backend("http://127.0.0.1:8101")
    replica.kv_usage, replica.in_flight_at_scrape, replica.in_flight, replica.others_at_scrape = 0.95, 3, 2, 6.0
    lone.kv_usage, lone.in_flight_at_scrape, lone.in_flight = 0.95, 9, 6
    assert policy.predict(replica, PROMPT, 0) == policy.predict(lone, PROMPT, 0)
    assert policy.predict(replica, PROMPT, 0)[1] == 0.0  # 0.665: no pressure
    # and two more of its requests arrived: 5 against 3, the engine's 9 taken to be 15
    replica.in_flight, lone.in_flight = 5, 15
    _, wait = policy.predict(replica, PROMPT, 0)
    assert wait == pytest.approx(policy.predict(lone, PROMPT, 0)[1]) and wait > 0
    # the free KV for the fit check is read the same way: 4,096 tokens at 95%, 2 of its 3 gone
    replica.kv_capacity_tokens = lone.kv_capacity_tokens = 4096
    replica.in_flight, lone.in_flight = 1, 3
    tokens = int(4096 * (1 - 0.95 * 4 / 10))
    assert policy._fits(replica, tokens) and policy._fits(lone, tokens)
    assert not policy._fits(replica, tokens + 2)


def test_a_retry_goes_elsewhere_and_keeps_the_pin() -> None:
    policy, pool, sessions = apart(), make_pool(2), table()
    entry, pin = pinned(policy, pool, sessions, "s")
    placement = policy.place(pool, "s", entry, frozenset({pin.url}), hint())
    assert placement.backend is not pin and (placement.outcome, placement.reason) == (Outcome.SPILL, "retry")
    assert entry.pins["default"] == pin.url


def test_a_dead_or_removed_pin_is_replaced() -> None:
    policy, pool, sessions = apart(), make_pool(3), table()
    entry, pin = pinned(policy, pool, sessions, "s")
    pin.healthy = False
    placement = policy.place(pool, "s", entry, hint=hint())
    assert placement.backend is not pin and placement.outcome is Outcome.REPIN_UNHEALTHY
    assert entry.pins["default"] == placement.backend.url
    moved_to = placement.backend
    pool.remove(moved_to.url)
    placement = policy.place(pool, "s", entry, hint=hint())
    assert placement.outcome is Outcome.REPIN_REMOVED and placement.backend is not moved_to
    for backend in pool.members:
        backend.healthy = False
    with pytest.raises(NoHealthyBackendError):
        policy.place(pool, "s", entry, hint=hint())
    with pytest.raises(NoHealthyBackendError):
        policy.place(pool, None, None, hint=hint())


def test_requests_without_a_session_go_to_the_least_loaded_of_the_fastest() -> None:
    policy, pool = apart(), make_pool(3)
    slow, busy, free = pool.members
    slow.step_s = 5.0
    busy.in_flight, free.in_flight = 4, 1
    for _ in range(5):
        placement = policy.place(pool, None, None, hint=hint(last=0))
        assert (placement.backend, placement.outcome, placement.reason) == (free, Outcome.NO_SESSION, "least")
    busy.in_flight = free.in_flight = 0  # ties take turns, never the slow one
    chosen = {policy.place(pool, None, None).backend.url for _ in range(4)}
    assert chosen == {busy.url, free.url}


def test_the_fast_path_on_a_large_pool_matches_a_full_prediction() -> None:
    """Pools over SMALL_POOL refresh the load total every STATS_EVERY placements; decisions made on
    the fast path are the ones a full prediction makes when nothing is clearly faster."""
    policy, pool, sessions = apart(), make_pool(64), table()
    entries = {f"s{i}": sessions.touch(f"s{i}") for i in range(500)}
    for sid, entry in entries.items():
        policy.place(pool, sid, entry, hint=hint(last=0))
    homes = {sid: e.pins["default"] for sid, e in entries.items()}
    rng = random.Random(3)
    for backend in pool.members:
        backend.in_flight = 4
    for _ in range(2000):
        for backend in rng.sample(pool.members, 8):  # ~256 in flight, each backend 2-6 (bound: 9)
            backend.in_flight = rng.randint(2, 6)
        sid = rng.choice(list(entries))
        placement = policy.place(pool, sid, entries[sid], hint=hint())
        assert (placement.outcome, placement.backend.url) == (Outcome.STICKY, homes[sid])
    # one backend starts queueing hard: its sessions leave it, the others stay
    victim = pool.get(homes["s0"])
    assert victim is not None
    victim.engine_waiting = victim.queued_floor = 100
    placement = policy.place(pool, "s0", entries["s0"], hint=hint())
    assert placement.backend is not victim and placement.outcome is Outcome.SPILL


def test_new_sessions_land_where_the_session_policy_would_put_them() -> None:
    """Without a prediction that tells backends apart, a new session's home is the session policy's
    choice: the first in rendezvous order within the load bound, else the least loaded."""
    rng = random.Random(11)
    pool, sessions = make_pool(5), table()
    ours, theirs = apart(), SessionPolicy()
    for i in range(300):
        for backend in pool.members:
            backend.in_flight = rng.choice((0, 0, 1, 2, 3, 8))
        sid = f"n{i}"
        mine = ours.place(pool, sid, sessions.touch(sid), hint=hint(last=0))
        other = theirs.place(pool, sid, SessionTable(10, 60).touch(sid))
        assert mine.backend is other.backend and mine.outcome is other.outcome is Outcome.NEW


def test_other_routers_requests_at_the_last_scrape_do_not_herd_new_sessions() -> None:
    """The load a new session's hash choice is bounded by counts other routers' requests as of the last
    scrape (``others_at_scrape``), which may have ended since. Two of them on one of two idle backends
    used to send every new session hashed there to the other, where it stayed (the overhead benchmark:
    91% of the requests on one backend); the first ``sticky_headroom`` of them now do not count, so the
    sessions spread as hashed. A backend that others keep really busier still sheds its new sessions."""
    pool = make_pool(2)
    a, b = pool.members
    for others, low, high in ((2, 80, 120), (20, 0, 0)):
        a.others_at_scrape = others
        policy, sessions = apart(), table()
        on_a = sum(policy.place(pool, f"s{i}", sessions.touch(f"s{i}"), hint=hint(last=0)).backend is a
                   for i in range(200))
        assert low <= on_a <= high, (others, on_a)


def test_an_index_with_events_from_the_pin_that_says_zero_is_trusted() -> None:
    """The pin's KV events reach the index and it holds none of the session there (evicted, engine
    restarted): nothing is cached there, not the last prompt + answer. A pin without events keeps
    the estimate."""
    policy, pool, sessions = apart(), make_pool(2), table()
    entry, pin = pinned(policy, pool, sessions, "s")
    kv = policy.kv = FakeKV()
    placement = policy.place(pool, "s", entry, hint=hint(last=1075))
    assert (placement.backend, placement.reason, placement.cached_tokens) == (pin, "cached", 1075)  # no events
    kv.live = {b.url for b in pool.members}
    placement = policy.place(pool, "s", entry, hint=hint(last=1075))
    assert placement.backend is pin and placement.cached_tokens == 0  # the index says 0: it is 0
    assert placement.predicted_ttft_s == pytest.approx(policy.predict(pin, PROMPT, 0)[0])
    # another backend holds some of it and the pin publishes no events: the pin keeps its estimate
    other = next(b for b in pool.members if b is not pin)
    kv.sessions = {"s": {other.url: 64}}
    kv.live = {other.url}
    placement = policy.place(pool, "s", entry, hint=hint(last=1075))
    assert (placement.backend, placement.cached_tokens) == (pin, 1075)


def test_a_session_whose_kv_the_pin_evicted_goes_where_it_is_served_fastest() -> None:
    """The pin's events say it lost the session's last prompt + answer (or most of it): the turn
    recomputes it wherever it goes, so it goes where its prefill starts soonest, without the move factor
    or the hysteresis that guard a cached prefix (busy 20 ms per request: the pin's 8 in flight cost 160
    ms, the other's 1 costs 20). Not when the pin kept half of it, or lost less than EVICTED_TOKENS,
    or is as fast within the margin, or its events do not reach the index."""
    from router.placement.kv_aware import EVICTED_TOKENS

    policy, pool, sessions = apart(), make_pool(2), table()
    entry, pin = pinned(policy, pool, sessions, "s")
    other = next(b for b in pool.members if b is not pin)
    for backend in pool.members:
        backend.busy_s_per_request = 0.02
    pin.in_flight, other.in_flight = 8, 1
    kv = policy.kv = FakeKV({"s": {pin.url: 320}})
    # without events from the pin, the index's silence is no evidence: the pin keeps its estimate
    placement = policy.place(pool, "s", entry, hint=hint(last=1500))
    assert (placement.backend, placement.outcome) == (pin, Outcome.STICKY)
    kv.live = {pin.url, other.url}
    # the pin kept 800 of the last 1,500 tokens: a move would recompute them, it stays
    kv.sessions = {"s": {pin.url: 800}}
    placement = policy.place(pool, "s", entry, hint=hint(last=1500))
    assert (placement.backend, placement.outcome, placement.cached_tokens) == (pin, Outcome.STICKY, 800)
    # lost less than EVICTED_TOKENS: a short conversation, or the index's events a step behind
    kv.sessions = {"s": {pin.url: 16}}
    placement = policy.place(pool, "s", entry, hint=hint(last=16 + EVICTED_TOKENS - 1))
    assert (placement.backend, placement.outcome) == (pin, Outcome.STICKY)
    # the pin as fast or faster (its queue gone): stays
    pin.in_flight = 1
    kv.sessions = {"s": {pin.url: 320}}
    placement = policy.place(pool, "s", entry, hint=hint(last=1500))
    assert (placement.backend, placement.outcome) == (pin, Outcome.STICKY)
    # 320 of 1,500 left on the pin, and the pin busier: 0.01 + 1.68 / 4 + 0.16 = 0.59 s there against
    # 0.01 + 2 / 4 + 0.02 = 0.53 s on the other
    pin.in_flight = 8
    placement = policy.place(pool, "s", entry, hint=hint(last=1500))
    assert (placement.backend, placement.outcome, placement.reason) == (other, Outcome.SPILL, "evicted")
    assert entry.pins["default"] == other.url and placement.cached_tokens == 0
    assert placement.predicted_ttft_s == pytest.approx(0.01 + PROMPT / 4000 + 0.02)
    # the 1.5x move factor would have kept it there
    assert not policy._clearly_faster(policy.predict(pin, PROMPT, 320)[0], placement.predicted_ttft_s)
    # where another backend holds more of the session than the pin, the reason says so
    entry.pins["default"] = pin.url
    kv.sessions = {"s": {pin.url: 0, other.url: 400}}
    placement = policy.place(pool, "s", entry, hint=hint(last=1500))
    assert (placement.backend, placement.reason, placement.cached_tokens) == (other, "cached", 400)


def test_prefill_work_sent_to_a_backend_is_waited_for_until_it_is_done() -> None:
    """An engine that batches everything into its running steps does not queue, so its scrape shows
    no wait while it prefills long prompts. The router knows what it sent: each placement leaves the
    chosen backend its prefill (the prediction's own prefill term) ahead of the next ones, done at the
    prefill rate from when it starts; none once this router has nothing in flight there."""
    now = [100.0]
    policy, pool = KVAwarePolicy(clock=lambda: now[0]), make_pool(2)

    def send(prompt: int = PROMPT) -> tuple[Backend, float]:
        placement = policy.place(pool, None, None, hint=hint(prompt))
        placement.backend.in_flight += 1  # the proxy counts it in flight
        return placement.backend, placement.wait_s

    a, wait = send()  # 2,000 uncached tokens: 0.5 s of prefill at 4,000 tokens/s
    assert wait == 0.0
    b, wait = send()  # a has 0.5 s of prefill ahead of a newcomer: the other one, idle
    assert b is not a and wait == 0.0
    now[0] += 0.2  # 0.3 s left on each
    c, wait = send()
    assert wait == pytest.approx(0.3)
    d, wait = send()  # c now has 0.3 + 0.5 s ahead: the other one
    assert d is not c and wait == pytest.approx(0.3)
    now[0] += 0.3  # the first two are done: 0.5 s left on each
    assert policy.place(pool, None, None, hint=hint()).wait_s == pytest.approx(0.5)
    c.in_flight = 0  # every request this router sent there is answered: nothing of its work is left
    placement = policy.place(pool, None, None, hint=hint())
    assert placement.backend is c and placement.wait_s == 0.0
    now[0] += 10.0  # long done everywhere
    assert policy.place(pool, None, None, hint=hint()).wait_s == 0.0


def test_the_prefill_work_entries_of_backends_that_left_are_dropped() -> None:
    """One ``ahead`` entry per backend placed on; entries whose work is done go once there are many
    (backends replaced by discovery would otherwise leave one each for ever)."""
    from router.placement.kv_aware import AHEAD_PRUNE_AT

    now = [0.0]
    policy = KVAwarePolicy(clock=lambda: now[0])
    for i in range(3 * AHEAD_PRUNE_AT):
        policy.place(make_pool(1, 20000 + i), None, None, hint=hint())  # a new backend each time
        now[0] += 1.0  # each placement's 0.5 s of prefill is done before the next
    assert len(policy._ahead) <= AHEAD_PRUNE_AT + 1


def test_a_session_met_for_the_first_time_goes_where_the_index_holds_its_kv() -> None:
    """Another replica placed the session (or this router restarted): no pin here, but the index
    (every replica subscribes to the same engines) says where its tokens are. It goes there, not to
    its rendezvous-hash choice, so replicas agree without shared state."""
    pool = make_pool(4)
    for sid in (f"s{i}" for i in range(20)):
        policy, sessions = apart(), table()
        home = policy.place(pool, sid, sessions.touch(sid), hint=hint(last=0)).backend  # the hash choice
        holder = next(b for b in pool.members if b is not home)
        policy.kv = FakeKV(sessions={sid: {holder.url: 1024, home.url: 0}})
        fresh = table().touch(sid)
        placement = policy.place(pool, sid, fresh, hint=hint(last=0))
        assert (placement.backend, placement.outcome, placement.reason) == (holder, Outcome.NEW, "cached")
        assert placement.cached_tokens == 1024 and fresh.pins["default"] == holder.url
    # most tokens win; ties go to the session's rendezvous order (what every replica picks); over the
    # bound: not there
    policy = apart()
    a, b, c, _ = pool.members
    policy.kv = FakeKV(sessions={"t": {c.url: 512, b.url: 512, a.url: 128}})
    first, second = sorted((b, c), key=lambda x: session_score(x.url, "t"), reverse=True)
    assert policy.place(pool, "t", table().touch("t"), hint=hint(last=0)).backend is first
    first.in_flight = 50
    placement = policy.place(pool, "t", table().touch("t"), hint=hint(last=0))
    assert placement.backend is second and placement.reason == "cached"
    # it is still a prediction: a KV holder that is clearly slower loses the session
    first.in_flight = 0
    c.step_s = b.step_s = a.step_s = 5.0
    placement = policy.place(pool, "t", table().touch("t"), hint=hint(last=0))
    assert placement.backend is pool.members[3] and placement.reason == "wait"


def test_sessions_held_alike_on_every_backend_spread_over_them() -> None:
    """The index holds each new session's tokens equally on every backend (other routers sent its turns
    to each, or its prompt is one every backend has): ties follow each session's rendezvous order, so
    the sessions spread over the backends instead of all going to one, and two replicas agree."""
    pool = make_pool(4)
    held = {f"s{i}": {b.url: 256 for b in pool.members} for i in range(400)}
    chosen: list[list[str]] = []
    for _ in range(2):  # two replicas, each meeting every session for the first time
        policy = apart()
        policy.kv = FakeKV(sessions=held)
        chosen.append([policy.place(pool, sid, table().touch(sid), hint=hint(last=0)).backend.url for sid in held])
    assert chosen[0] == chosen[1]
    counts = {b.url: chosen[0].count(b.url) for b in pool.members}
    assert all(60 <= n <= 140 for n in counts.values()), counts  # 100 each expected


def test_a_replica_that_missed_the_last_turns_sizes_the_prompt_by_the_index() -> None:
    """Text mode estimates the prompt from the body (low for this tokenizer) and the session's last
    prompt + answer this router saw. A replica that did not serve the last turns knows an older, smaller
    one; the index (the same on every replica) holds the session's resident chain, an earlier prompt +
    answer of the conversation: the prompt is at least that, so both replicas decide alike."""
    pool = make_pool(3)
    placements = []
    for last in (2400, 700):  # the replica that served the previous turn; one that served turn 1 only
        policy, sessions = apart(), table()
        kv = policy.kv = FakeKV()
        entry, pin = pinned(policy, pool, sessions, "s")
        kv.sessions = {"s": {pin.url: 2384}}
        kv.live = {b.url for b in pool.members}
        pin.kv_capacity_tokens, pin.kv_usage = 4096, 0.5  # 2,048 free: a 2,500-token prompt's tail fits
        placement = policy.place(pool, "s", entry, hint=PlacementHint(600, last_tokens=last))
        placements.append((placement.backend.url, placement.outcome, placement.reason, placement.cached_tokens,
                           placement.predicted_ttft_s))
    assert placements[0] == placements[1]
    assert placements[0][3] == 2384  # not capped at the body's 600-token estimate
    # tokens mode: the prompt is exact and is not raised (a shorter conversation than the index's chain)
    policy, sessions = apart(), table()
    kv = policy.kv = FakeKV()
    entry, pin = pinned(policy, pool, sessions, "t")
    kv.sessions = {"t": {pin.url: 2384}}
    kv.live = {b.url for b in pool.members}
    placement = policy.place(pool, "t", entry, hint=PlacementHint(1000, prompt_ids=list(range(1000))))
    assert placement.cached_tokens == 1000


def test_a_move_goes_only_where_the_turn_fits_the_targets_free_kv() -> None:
    """Every move off the pin recomputes the turn's uncached tokens at the target: where its free KV
    cannot hold them, the turn would preempt there. The fastest backend whose free KV holds them takes
    it instead, and when none does, the pin keeps it. Capacity unknown (never scraped): no check."""
    policy, pool, sessions = apart(), make_pool(3), table()
    entry, pin = pinned(policy, pool, sessions, "s")
    fast, roomy = (b for b in pool.members if b is not pin)
    for backend in pool.members:
        backend.busy_s_per_request = 0.02
        backend.kv_capacity_tokens = 4 * PROMPT
    pin.in_flight, fast.in_flight, roomy.in_flight = 8, 0, 2
    kv = policy.kv = FakeKV({"s": {pin.url: 320}})
    kv.live = {b.url for b in pool.members}
    fast.kv_usage = 1 - (PROMPT - 16) / (4 * PROMPT)  # 16 tokens short of the prompt
    # evicted (320 of 1,500 left on the pin): the fastest is full, the next one holds the prompt
    placement = policy.place(pool, "s", entry, hint=hint(last=1500))
    assert (placement.backend, placement.outcome, placement.reason) == (roomy, Outcome.SPILL, "evicted")
    # none holds it: the pin keeps the turn (it fits there: usage 0)
    entry.pins["default"] = pin.url
    roomy.kv_usage = fast.kv_usage
    placement = policy.place(pool, "s", entry, hint=hint(last=1500))
    assert (placement.backend, placement.outcome) == (pin, Outcome.STICKY)
    # the same for a move for the pin's wait (the session's prefix cached on the pin; a queue of 20
    # requests there, 0.1 s each, seen over three scrapes)
    kv.sessions = {"s": {pin.url: PROMPT - 50}}
    pin.in_flight = pin.in_flight_at_scrape = 4
    pin.engine_waiting = pin.queued_floor = 20.0
    pin.queued_request_s = 0.1
    placement = policy.place(pool, "s", entry, hint=hint())
    assert (placement.backend, placement.outcome) == (pin, Outcome.STICKY)
    roomy.kv_usage = 0.0
    placement = policy.place(pool, "s", entry, hint=hint())
    assert (placement.backend, placement.outcome, placement.reason) == (roomy, Outcome.SPILL, "wait")
    # capacity unknown: the fastest, unchecked
    entry.pins["default"] = pin.url
    for backend in pool.members:
        backend.kv_capacity_tokens = 0
    placement = policy.place(pool, "s", entry, hint=hint())
    assert (placement.backend, placement.outcome, placement.reason) == (fast, Outcome.SPILL, "wait")


def test_the_safety_net_sheds_only_where_the_turn_fits() -> None:
    """A pin over the in-flight bound (its interference not learned yet) sheds the session to the
    fastest backend within the bound, but only where the turn's uncached tokens fit the free KV."""
    policy, pool, sessions = apart(), make_pool(3), table()
    entry, pin = pinned(policy, pool, sessions, "s")
    pin.in_flight = 40  # over the bound: max(ceil(2 * 41 / 3), ceil(41 / 3) + 2) = 28
    for backend in pool.members:
        backend.kv_capacity_tokens = 4 * PROMPT
        if backend is not pin:
            backend.kv_usage = 0.9  # 800 tokens free: the 2,000-token prompt (nothing cached there) does not fit
    placement = policy.place(pool, "s", entry, hint=hint())
    assert (placement.backend, placement.outcome) == (pin, Outcome.STICKY)
    other = next(b for b in pool.members if b is not pin)
    other.kv_usage = 0.5
    placement = policy.place(pool, "s", entry, hint=hint())
    assert (placement.backend, placement.outcome, placement.reason) == (other, Outcome.SPILL, "load")


def test_a_small_pools_load_total_is_carried_forward_by_its_ledger_exactly() -> None:
    """Between passes, a small pool's stats take their total from the pool's ``Ledger`` (no pass): always
    the total a pass finds, through in-flight counts that rise and fall, other routers' requests at a
    scrape, a backend going unhealthy and back, and counts written on unavailable members."""
    rng = random.Random(11)
    pool = make_pool(4)
    policy = apart()
    passes = 0
    real_refresh = policy._refresh

    def counting(*args: object) -> object:
        nonlocal passes
        passes += 1
        return real_refresh(*args)  # type: ignore[arg-type]

    policy._refresh = counting  # type: ignore[method-assign]
    for step in range(2000):
        backend = rng.choice(pool.members)
        roll = rng.random()
        if roll < 0.45:
            backend.in_flight += 1
        elif roll < 0.9:
            backend.in_flight = max(0, backend.in_flight - 1)
        elif roll < 0.95:
            backend.healthy = not backend.healthy
        else:
            backend.others_at_scrape = float(rng.choice((0, 1, 3)))
        stats = policy._pool_stats(pool, frozenset())
        expected = sum(b.in_flight + b.others_at_scrape for b in pool.members if b.available)
        assert (stats.total, stats.count) == (expected, sum(b.available for b in pool.members)), step
    assert passes < 400  # most placements needed no pass (only the ~10% of steps that changed more)

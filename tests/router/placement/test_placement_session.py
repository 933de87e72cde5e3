"""The ``session`` policy: every outcome, the load bound, and the exact properties of DESIGN.md §5."""

from __future__ import annotations

import hashlib
import math
import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.errors import ConfigError, NoHealthyBackendError
from router.config import config_from_mapping
from router.placement import Outcome, SessionPolicy, load_bound, make_policy, session_score, sticky_bound
from router.placement.session import DEFAULT_STICKY_HEADROOM
from router.membership import Backend, BackendPool
from router.sessions.table import SessionTable


def make_pool(n: int, name: str = "default", first_port: int = 8100) -> BackendPool:
    return BackendPool(name, [Backend(f"http://127.0.0.1:{first_port + i}") for i in range(n)])


def make_table() -> SessionTable:
    return SessionTable(max_sessions=1_000_000, ttl_s=3600.0)


def policy(load_factor: float = 1.25, weight: float = 0.0, headroom: int = DEFAULT_STICKY_HEADROOM) -> SessionPolicy:
    made = make_policy("session", load_factor=load_factor, reported_load_weight=weight, sticky_headroom=headroom)
    assert isinstance(made, SessionPolicy)
    return made


def loads(pool: BackendPool) -> list[int]:
    return [b.in_flight for b in pool.members]


# -- the bound and the score -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("factor", "total", "available", "expected"),
    [
        (1.25, 3, 4, 2),  # 1.25 * 4 / 4 = 1.25 -> 2
        (1.0, 3, 4, 1),  # exactly 1
        (1.0, 0, 4, 1),  # an idle pool admits one request anywhere
        (1.25, 999, 4, 313),  # 1.25 * 1000 / 4 = 312.5
        (1.1, 9, 1, 11),  # float 1.1 * 10 = 11.000000000000002, still 11
        (2.0, 7, 3, 6),  # 16 / 3 = 5.33
    ],
)
def test_load_bound_examples(factor: float, total: int, available: int, expected: int) -> None:
    assert load_bound(factor, total, available) == expected


@given(
    factor=st.sampled_from(["1", "1.05", "1.1", "1.2", "1.25", "1.3", "1.5", "1.75", "2", "3.3"]),
    total=st.integers(min_value=0, max_value=100_000),
    available=st.integers(min_value=1, max_value=128),
)
def test_load_bound_is_the_exact_ceiling(factor: str, total: int, available: int) -> None:
    exact = math.ceil(Fraction(factor) * (total + 1) / available)
    assert load_bound(float(factor), total, available) == exact


def test_score_is_blake2b_of_url_and_session_and_ranks_candidates() -> None:
    url, sid = "http://127.0.0.1:8100", "sess-42"
    digest = hashlib.blake2b(b"http://127.0.0.1:8100\0sess-42", digest_size=8).digest()
    assert session_score(url, sid) == int.from_bytes(digest, "little")
    pool = make_pool(6)
    p = policy()
    for i in range(200):
        sid = f"conv-{i}"
        ranked = p.candidates(pool, sid)
        scores = [session_score(b.url, sid) for b in ranked]
        assert scores == sorted(scores, reverse=True)
        assert {b.url for b in ranked} == {b.url for b in pool.members}


def test_candidates_leave_out_unavailable_and_excluded_and_follow_membership() -> None:
    pool = make_pool(4)
    p = policy()
    full = p.candidates(pool, "s")
    full[0].healthy = False
    full[1].draining = True
    assert p.candidates(pool, "s", frozenset({full[2].url})) == [full[3]]
    full[0].healthy = True
    full[1].draining = False
    pool.remove(full[3].url)  # membership change: the cached ring must be rebuilt
    assert p.candidates(pool, "s") == full[:3]
    added = pool.add(Backend("http://127.0.0.1:9999"))
    assert added in p.candidates(pool, "s")


def test_bad_settings_are_config_errors() -> None:
    # the ranges are the config schema's, checked once when it loads (the policy no longer re-checks)
    backends = [{"url": "http://127.0.0.1:8100"}]
    with pytest.raises(ConfigError, match="load_factor"):
        config_from_mapping({"placement": {"load_factor": 0.9}, "backends": backends})
    with pytest.raises(ConfigError, match="load_factor"):
        config_from_mapping({"placement": {"load_factor": float("nan")}, "backends": backends})
    with pytest.raises(ConfigError, match="reported_load_weight"):
        config_from_mapping({"placement": {"reported_load_weight": -1.0}, "backends": backends})


# -- every outcome ---------------------------------------------------------------------------


def test_new_pins_the_top_candidate_then_sticky() -> None:
    pool, p, table = make_pool(4), policy(), make_table()
    entry = table.touch("sess-a")
    top = p.candidates(pool, "sess-a")[0]
    first = p.place(pool, "sess-a", entry)
    assert (first.backend, first.outcome) == (top, Outcome.NEW)
    assert entry.pins == {"default": top.url}
    again = p.place(pool, "sess-a", entry)
    assert (again.backend, again.outcome) == (top, Outcome.STICKY)


def test_pins_are_per_pool() -> None:
    prefill, decode = make_pool(3, "prefill", 8100), make_pool(3, "decode", 8200)
    p, entry = policy(), make_table().touch("s")
    a = p.place(decode, "s", entry)
    b = p.place(prefill, "s", entry)
    assert entry.pins == {"decode": a.backend.url, "prefill": b.backend.url}
    assert p.place(decode, "s", entry).outcome is Outcome.STICKY
    assert p.place(prefill, "s", entry).outcome is Outcome.STICKY


@pytest.mark.parametrize(("headroom", "last_sticky"), [(0, 1), (1, 2), (2, 3), (3, 5)])
def test_sticky_up_to_the_sticky_bound_then_spill_moves_the_pin(headroom: int, last_sticky: int) -> None:
    pool, p, entry = make_pool(4), policy(1.25, headroom=headroom), make_table().touch("s")
    ranked = p.candidates(pool, "s")
    pinned = p.place(pool, "s", entry).backend
    assert pinned is ranked[0]
    # Others carry 1 each; the pin carries x. Bound = ceil(1.25 * (3 + x + 1) / 4); sticky bound
    # = max(bound, ceil((3 + x + 1) / 4) + headroom).
    for other in ranked[1:]:
        other.in_flight = 1
    x = 0
    while x + 1 <= sticky_bound(load_bound(1.25, 3 + x, 4), 3 + x, 4, headroom):
        pinned.in_flight = x
        placed = p.place(pool, "s", entry)
        assert (placed.backend, placed.outcome) == (pinned, Outcome.STICKY)
        x += 1
    # worked by hand, e.g. headroom 2: x = 3 -> ceil(7 / 4) + 2 = 4 = x + 1; x = 4 -> 4 < 5
    assert x - 1 == last_sticky
    pinned.in_flight = x  # now x + 1 > sticky bound >= bound
    spilled = p.place(pool, "s", entry)
    assert (spilled.backend, spilled.outcome) == (ranked[1], Outcome.SPILL)
    assert entry.pins == {"default": ranked[1].url}  # the session moved with its freshest prefix
    assert p.place(pool, "s", entry).outcome is Outcome.STICKY  # and stays there
    # The new pin and the next candidate over their bounds: the spill goes further down the ranking.
    # Loads 5, 9, 0, 0: bound = ceil(1.25 * 15 / 4) = 5, sticky bound <= ceil(15 / 4) + 3 = 7.
    ranked[0].in_flight, ranked[1].in_flight, ranked[2].in_flight, ranked[3].in_flight = 5, 9, 0, 0
    spilled = p.place(pool, "s", entry)
    assert (spilled.backend, spilled.outcome) == (ranked[2], Outcome.SPILL)
    assert entry.pins == {"default": ranked[2].url}
    # Load gone: sticky on the new pin.
    for b in pool.members:
        b.in_flight = 0
    placed = p.place(pool, "s", entry)
    assert (placed.backend, placed.outcome) == (ranked[2], Outcome.STICKY)


def test_headroom_keeps_a_pinned_session_home_at_low_concurrency() -> None:
    # 10 in flight over 4 backends, 4 of them on the pin: the factor's bound is
    # ceil(1.25 * 11 / 4) = 4, so the plain bound spills; the headroom allows ceil(11 / 4) + 2 = 5.
    def scenario(headroom: int) -> Outcome:
        pool, p, entry = make_pool(4), policy(1.25, headroom=headroom), make_table().touch("s")
        ranked = p.candidates(pool, "s")
        p.place(pool, "s", entry)
        for backend, load in zip(ranked, (4, 2, 2, 2)):
            backend.in_flight = load
        return p.place(pool, "s", entry).outcome

    assert scenario(0) is Outcome.SPILL
    assert scenario(2) is Outcome.STICKY
    # New sessions still meet the factor's bound: a fresh session never lands on a backend at 4.
    pool, p, table = make_pool(4), policy(1.25), make_table()
    for backend in pool.members:
        backend.in_flight = 2
    pool.members[0].in_flight = 4
    for i in range(200):
        placed = p.place(pool, f"n{i}", table.touch(f"n{i}"))
        assert placed.backend is not pool.members[0]


@pytest.mark.parametrize("load_factor", [1.25, 1.5, 2.0])
@pytest.mark.parametrize("headroom", [1, 2, 4])
def test_headroom_changes_nothing_once_the_factor_leaves_room(load_factor: float, headroom: int) -> None:
    for n in (2, 4, 8):
        for total in range(0, 4000):
            bound = load_bound(load_factor, total, n)
            mean = Fraction(total + 1, n)
            if (Fraction(load_factor) - 1) * mean >= headroom:
                assert sticky_bound(bound, total, n, headroom) == bound
            assert bound <= sticky_bound(bound, total, n, headroom) <= max(bound, math.ceil(mean) + headroom)
        assert sticky_bound(load_bound(load_factor, 10, n), 10, n, 0) == load_bound(load_factor, 10, n)


def test_new_session_over_the_bound_is_pinned_where_it_went() -> None:
    pool, p, entry = make_pool(2), policy(1.0), make_table().touch("s")
    ranked = p.candidates(pool, "s")
    ranked[0].in_flight = 1  # bound = ceil(1 * 2 / 2) = 1: the top candidate is full
    placed = p.place(pool, "s", entry)
    assert (placed.backend, placed.outcome) == (ranked[1], Outcome.NEW)
    assert entry.pins == {"default": ranked[1].url}


def test_excluded_but_available_pin_spills_and_keeps_the_pin() -> None:
    pool, p, entry = make_pool(4), policy(), make_table().touch("s")
    ranked = p.candidates(pool, "s")
    p.place(pool, "s", entry)
    placed = p.place(pool, "s", entry, frozenset({ranked[0].url}))
    assert (placed.backend, placed.outcome) == (ranked[1], Outcome.SPILL)
    assert entry.pins == {"default": ranked[0].url}
    assert p.place(pool, "s", entry).backend is ranked[0]


@pytest.mark.parametrize("how", ["unhealthy", "draining"])
def test_unavailable_pin_is_repinned(how: str) -> None:
    pool, p, entry = make_pool(4), policy(), make_table().touch("s")
    ranked = p.candidates(pool, "s")
    p.place(pool, "s", entry)
    if how == "unhealthy":
        ranked[0].healthy = False
    else:
        ranked[0].draining = True
    placed = p.place(pool, "s", entry)
    assert (placed.backend, placed.outcome) == (ranked[1], Outcome.REPIN_UNHEALTHY)
    assert entry.pins == {"default": ranked[1].url}
    # The old pin coming back does not move the session again.
    ranked[0].healthy, ranked[0].draining = True, False
    assert p.place(pool, "s", entry).backend is ranked[1]


def test_removed_pin_is_repinned() -> None:
    pool, p, entry = make_pool(3), policy(), make_table().touch("s")
    ranked = p.candidates(pool, "s")
    p.place(pool, "s", entry)
    pool.remove(ranked[0].url)
    placed = p.place(pool, "s", entry)
    assert (placed.backend, placed.outcome) == (ranked[1], Outcome.REPIN_REMOVED)
    assert entry.pins == {"default": ranked[1].url}


def test_no_session_goes_to_the_least_loaded_and_writes_no_pin() -> None:
    pool, p = make_pool(3), policy()
    pool.members[0].in_flight = 2
    pool.members[1].in_flight = 1
    pool.members[2].in_flight = 3
    placed = p.place(pool, None, None)
    assert (placed.backend, placed.outcome) == (pool.members[1], Outcome.NO_SESSION)
    entry = make_table().touch("s")
    placed = p.place(pool, None, entry)  # an entry without an id is still session-less
    assert (placed.backend, placed.outcome) == (pool.members[1], Outcome.NO_SESSION)
    assert entry.pins == {}
    assert p.place(pool, "s", None).outcome is Outcome.NO_SESSION


def test_no_session_ties_rotate() -> None:
    pool, p = make_pool(3), policy()
    chosen = [p.place(pool, None, None).backend for _ in range(6)]
    assert chosen == pool.members * 2


@pytest.mark.parametrize("session", [None, "s"])
def test_no_available_backend_is_a_503_naming_the_pool(session: str | None) -> None:
    pool, p = make_pool(2, "decode"), policy()
    entry = make_table().touch("s") if session else None
    pool.members[0].healthy = False
    with pytest.raises(NoHealthyBackendError, match="'decode'") as caught:
        p.place(pool, session, entry, frozenset({pool.members[1].url}))
    assert caught.value.status == 503
    pool.members[1].draining = True
    with pytest.raises(NoHealthyBackendError):
        p.place(pool, session, entry)
    with pytest.raises(NoHealthyBackendError, match="'empty'"):
        p.place(BackendPool("empty"), session, entry)
    assert entry is None or entry.pins == {}


def test_exclusion_shrinks_the_bound_population() -> None:
    # Excluded backends count neither in the total nor in n.
    pool, p, entry = make_pool(3), policy(1.0, headroom=0), make_table().touch("s")
    ranked = p.candidates(pool, "s")
    p.place(pool, "s", entry)
    ranked[0].in_flight = 1
    ranked[1].in_flight = 0
    ranked[2].in_flight = 100
    # Without exclusion: bound = ceil(102 / 3) = 34, the pin (load 1) is within it.
    assert p.place(pool, "s", entry).outcome is Outcome.STICKY
    # Excluding the busy one: bound = ceil(2 / 2) = 1, the pin (load 1) is over it.
    placed = p.place(pool, "s", entry, frozenset({ranked[2].url}))
    assert (placed.backend, placed.outcome) == (ranked[1], Outcome.SPILL)
    assert entry.pins == {"default": ranked[1].url}  # a load spill moves the pin


def test_reported_load_is_blended_with_its_weight() -> None:
    pool, entry = make_pool(2), make_table().touch("s")
    p = policy(1.0, weight=0.5, headroom=0)
    ranked = p.candidates(pool, "s")
    p.place(pool, "s", entry)
    ranked[0].reported_load = 4.0  # load 2.0; other 0: bound = ceil(3 / 2) = 2, 3 > 2
    placed = p.place(pool, "s", entry)
    assert (placed.backend, placed.outcome) == (ranked[1], Outcome.SPILL)
    # The same scraped load without weight is ignored.
    entry.pins["default"] = ranked[0].url
    assert policy(1.0, weight=0.0, headroom=0).place(pool, "s", entry).outcome is Outcome.STICKY


def test_fractional_loads_with_no_backend_in_bound_take_the_least_loaded() -> None:
    pool, entry = make_pool(2), make_table().touch("s")
    p = policy(1.0, weight=1.0, headroom=0)
    ranked = p.candidates(pool, "s")
    # Loads 1.4 and 1.3: total 2.7, bound ceil(3.7 / 2) = 2; both + 1 exceed it.
    for b, reported in ((ranked[0], 0.4), (ranked[1], 0.3)):
        b.in_flight, b.reported_load = 1, reported
    placed = p.place(pool, "s", entry)
    assert (placed.backend, placed.outcome) == (ranked[1], Outcome.NEW)
    # Pinned on the least loaded and over the bound: nowhere better, so it stays (sticky).
    assert p.place(pool, "s", entry).outcome is Outcome.STICKY
    # Pinned elsewhere: the spill goes to the least loaded.
    entry.pins["default"] = ranked[0].url
    placed = p.place(pool, "s", entry)
    assert (placed.backend, placed.outcome) == (ranked[1], Outcome.SPILL)
    assert entry.pins == {"default": ranked[1].url}


# -- properties (exact) ----------------------------------------------------------------------


def test_a_healthy_session_never_moves_over_1000_requests() -> None:
    pool, p, table = make_pool(8), policy(), make_table()
    sessions = [f"sess-{i:03d}" for i in range(40)]
    home: dict[str, Backend] = {}
    for turn in range(1000):
        for sid in sessions:
            placed = p.place(pool, sid, table.touch(sid))
            if turn == 0:
                assert placed.outcome is Outcome.NEW
                home[sid] = placed.backend
            else:
                assert (placed.backend, placed.outcome) == (home[sid], Outcome.STICKY)
    assert len({b.url for b in home.values()}) > 1  # the sessions really spread


def test_removing_a_backend_moves_exactly_its_sessions() -> None:
    pool, p, table = make_pool(5), policy(), make_table()
    sessions = [f"sess-{i}" for i in range(1000)]
    before = {sid: p.place(pool, sid, table.touch(sid)).backend.url for sid in sessions}
    second = {sid: p.candidates(pool, sid)[1].url for sid in sessions}
    gone = pool.members[2].url
    pool.remove(gone)
    outcomes: dict[Outcome, int] = {}
    for sid in sessions:
        placed = p.place(pool, sid, table.touch(sid))
        outcomes[placed.outcome] = outcomes.get(placed.outcome, 0) + 1
        if before[sid] == gone:
            assert placed.outcome is Outcome.REPIN_REMOVED
            assert placed.backend.url == second[sid]  # rendezvous: the next choice takes over
        else:
            assert (placed.backend.url, placed.outcome) == (before[sid], Outcome.STICKY)
    on_gone = sum(1 for url in before.values() if url == gone)
    assert on_gone > 100
    assert outcomes == {Outcome.REPIN_REMOVED: on_gone, Outcome.STICKY: 1000 - on_gone}


def test_adding_a_backend_moves_no_pinned_session() -> None:
    pool, p, table = make_pool(4), policy(), make_table()
    sessions = [f"sess-{i}" for i in range(1000)]
    before = {sid: p.place(pool, sid, table.touch(sid)).backend.url for sid in sessions}
    added = pool.add(Backend("http://127.0.0.1:8199"))
    for sid in sessions:
        placed = p.place(pool, sid, table.touch(sid))
        assert (placed.backend.url, placed.outcome) == (before[sid], Outcome.STICKY)
    fresh = [p.place(pool, f"new-{i}", table.touch(f"new-{i}")).backend for i in range(200)]
    assert added in fresh  # the new backend does take new sessions


def _steady_load_run(load_factor: float, seed: int, skewed: bool,
                     headroom: int = DEFAULT_STICKY_HEADROOM) -> dict[Outcome, int]:
    """1,000 sessions over 4 backends: ramp up to 1,000 in flight, then 5,000 steady steps
    (release one request, place one). Checks the bound after every placement."""
    rng = random.Random(seed)
    pool, p, table = make_pool(4), policy(load_factor, headroom=headroom), make_table()
    sessions = [f"sess-{seed}-{i}" for i in range(1000)]
    in_flight: list[Backend] = []
    outcomes = dict.fromkeys(Outcome, 0)

    def place(sid: str) -> None:
        total = len(in_flight)
        placed = p.place(pool, sid, table.touch(sid))
        outcomes[placed.outcome] += 1
        placed.backend.in_flight += 1
        in_flight.append(placed.backend)
        # The chosen backend is within the bound computed before the placement ...
        assert placed.backend.in_flight <= load_bound(load_factor, total, 4)

    # Ramp-up: the total only grows, so max <= ceil(c * total / n) holds at every step.
    for sid in sessions:
        place(sid)
        assert max(loads(pool)) <= math.ceil(load_factor * len(in_flight) / 4 - 1e-9)
    steady_total = len(in_flight)
    bound = load_bound(load_factor, steady_total - 1, 4)  # = ceil(c * total / n)
    # Skewed: half the requests come from 5 sessions that all rank backend 0 first.
    hot = [sid for sid in sessions if p.candidates(pool, sid)[0] is pool.members[0]][:5]
    for _ in range(5000):
        done = in_flight.pop(rng.randrange(len(in_flight)))
        done.in_flight -= 1
        sid = rng.choice(hot) if skewed and rng.random() < 0.5 else rng.choice(sessions)
        place(sid)
        assert max(loads(pool)) <= bound
        assert sum(loads(pool)) == steady_total
    # The bound really held the mean within the factor (up to rounding).
    assert max(loads(pool)) / (steady_total / 4) <= load_factor + 4 / steady_total
    while in_flight:
        in_flight.pop().in_flight -= 1
    assert loads(pool) == [0, 0, 0, 0]
    return outcomes


# load_factor 1.0 asks for a perfectly even load: that takes sticky_headroom 0 (config/router.toml).
@pytest.mark.parametrize(("load_factor", "headroom"), [(1.0, 0), (1.25, 0), (1.25, DEFAULT_STICKY_HEADROOM), (2.0, 4)])
def test_steady_load_stays_within_the_factor(load_factor: float, headroom: int) -> None:
    outcomes = _steady_load_run(load_factor, seed=7, skewed=False, headroom=headroom)
    assert outcomes[Outcome.NEW] == 1000
    assert outcomes[Outcome.STICKY] > 0


def test_skewed_load_spills_and_stays_within_the_factor() -> None:
    outcomes = _steady_load_run(1.25, seed=11, skewed=True)
    assert outcomes[Outcome.SPILL] > 0  # the bound did bite
    assert outcomes[Outcome.REPIN_UNHEALTHY] == outcomes[Outcome.REPIN_REMOVED] == 0


def test_sessions_that_all_prefer_one_backend_are_spread_by_the_bound() -> None:
    pool, p, table = make_pool(4), policy(1.25), make_table()
    favourite = pool.members[0]
    crowd = [sid for sid in (f"c-{i}" for i in range(2000)) if p.candidates(pool, sid)[0] is favourite][:200]
    assert len(crowd) == 200
    for count, sid in enumerate(crowd, start=1):
        placed = p.place(pool, sid, table.touch(sid))
        placed.backend.in_flight += 1
        assert max(loads(pool)) <= math.ceil(1.25 * count / 4 - 1e-9)
    assert favourite.in_flight <= math.ceil(1.25 * 200 / 4)
    assert min(loads(pool)) > 0


# -- a model-based check of every decision under random operations -----------------------------

_op = st.one_of(
    st.tuples(st.just("place"), st.integers(0, 11), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 10_000), st.booleans()),
    st.tuples(st.just("health"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("drain"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("remove"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("add"), st.integers(0, 5), st.booleans()),
)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(_op, max_size=120),
    load_factor=st.sampled_from([1.0, 1.25, 1.5, 3.0]),
    headroom=st.sampled_from([0, 1, 2, 3]),
)
def test_every_decision_follows_the_rules(ops: list[tuple[str, int, bool]], load_factor: float,
                                          headroom: int) -> None:
    urls = [f"http://127.0.0.1:{8100 + i}" for i in range(6)]
    pool = BackendPool("default", [Backend(u) for u in urls[:4]])
    p, table = policy(load_factor, headroom=headroom), make_table()
    running: list[Backend] = []
    for op, arg, flag in ops:
        if op == "place":
            sid = f"s{arg}"
            entry = table.touch(sid)
            exclude = frozenset({urls[arg % 6]}) if flag else frozenset()
            eligible = [b for b in pool.members if b.available and b.url not in exclude]
            if not eligible:
                with pytest.raises(NoHealthyBackendError):
                    p.place(pool, sid, entry, exclude)
                continue
            total = sum(b.in_flight for b in eligible)
            bound = load_bound(load_factor, total, len(eligible))
            ranked = p.candidates(pool, sid, exclude)
            assert set(ranked) == set(eligible)
            pin = entry.pins.get("default")
            pinned = pool.get(pin) if pin else None
            sticky_limit = max(bound, math.ceil(Fraction(total + 1, len(eligible))) + headroom)
            placed = p.place(pool, sid, entry, exclude)
            assert placed.backend in eligible
            if placed.outcome is Outcome.STICKY:
                assert placed.backend.in_flight + 1 <= sticky_limit
            else:
                assert placed.backend.in_flight + 1 <= bound  # integer loads, c >= 1: always someone
            if pinned is not None and pinned.available and pinned.url in exclude:
                first_fit = next(b for b in ranked if b.in_flight + 1 <= bound)
                assert (placed.backend, placed.outcome) == (first_fit, Outcome.SPILL)
                assert entry.pins["default"] == pin
            elif pin is None or pinned is None or pinned not in eligible:
                expected = (
                    Outcome.NEW if pin is None else Outcome.REPIN_REMOVED if pinned is None else Outcome.REPIN_UNHEALTHY
                )
                first_fit = next(b for b in ranked if b.in_flight + 1 <= bound)
                assert (placed.backend, placed.outcome) == (first_fit, expected)
                assert entry.pins["default"] == first_fit.url
            elif pinned.in_flight + 1 <= sticky_limit:
                assert (placed.backend, placed.outcome) == (pinned, Outcome.STICKY)
                assert entry.pins["default"] == pin
            else:
                first_fit = next(b for b in ranked if b is not pinned and b.in_flight + 1 <= bound)
                assert (placed.backend, placed.outcome) == (first_fit, Outcome.SPILL)
                assert entry.pins["default"] == first_fit.url  # a load spill moves the pin
            placed.backend.in_flight += 1
            running.append(placed.backend)
        elif op == "release" and running:
            running.pop(arg % len(running)).in_flight -= 1
        elif op in ("health", "drain"):
            backend = pool.get(urls[arg])
            if backend is not None:
                if op == "health":
                    backend.healthy = flag
                else:
                    backend.draining = flag
        elif op == "remove" and len(pool) > 1:
            pool.remove(urls[arg])
        elif op == "add" and pool.get(urls[arg]) is None:
            pool.add(Backend(urls[arg]))

"""``make_policy`` and the session-blind policies (``round_robin``, ``least_loaded``)."""

from __future__ import annotations

import pytest

from contract.errors import ConfigError, NoHealthyBackendError
from router.placement import (
    POLICY_NAMES,
    KVAwarePolicy,
    LeastLoadedPolicy,
    Outcome,
    RoundRobinPolicy,
    SessionPolicy,
    make_policy,
)
from router.membership import Backend, BackendPool
from router.sessions.table import SessionTable


def make_pool(n: int, name: str = "default", first_port: int = 8100) -> BackendPool:
    return BackendPool(name, [Backend(f"http://127.0.0.1:{first_port + i}") for i in range(n)])


def test_make_policy_by_name() -> None:
    kinds = {"kv_aware": KVAwarePolicy, "session": SessionPolicy, "round_robin": RoundRobinPolicy,
             "least_loaded": LeastLoadedPolicy}
    assert set(POLICY_NAMES) == set(kinds)
    for name, kind in kinds.items():
        made = make_policy(name, load_factor=1.25, reported_load_weight=0.0)
        assert isinstance(made, kind)
        assert made.name == name
    session = make_policy("session", load_factor=1.5, reported_load_weight=0.25)
    assert isinstance(session, SessionPolicy) and session.load_factor == 1.5


def test_make_policy_rejects_unknown_names() -> None:
    # the numbers' ranges are the config schema's (tests/router/test_config_load.py), checked once at load
    with pytest.raises(ConfigError, match=r"'consistent_hash'.*kv_aware, session, round_robin, least_loaded"):
        make_policy("consistent_hash", load_factor=1.25, reported_load_weight=0.0)


# -- round_robin -----------------------------------------------------------------------------


def test_round_robin_cycles_and_skips_unavailable_and_excluded() -> None:
    pool, p = make_pool(4), RoundRobinPolicy()
    a, b, c, d = pool.members
    assert [p.place(pool, None, None).backend for _ in range(8)] == [a, b, c, d] * 2
    b.healthy = False
    c.draining = True
    assert [p.place(pool, "s", None).backend for _ in range(4)] == [a, d, a, d]
    assert p.place(pool, None, None, frozenset({a.url})).backend is d
    assert p.place(pool, None, None, frozenset({a.url})).backend is d


def test_round_robin_is_session_blind_and_writes_no_pin() -> None:
    pool, p = make_pool(3), RoundRobinPolicy()
    entry = SessionTable(10, 60.0).touch("s")
    placed = [p.place(pool, "s", entry) for _ in range(3)]
    assert [x.backend for x in placed] == pool.members
    assert {x.outcome for x in placed} == {Outcome.NO_SESSION}
    assert entry.pins == {}


def test_round_robin_keeps_one_cursor_per_pool_and_survives_shrinking() -> None:
    prefill, decode, p = make_pool(2, "prefill", 8100), make_pool(3, "decode", 8200), RoundRobinPolicy()
    assert p.place(prefill, None, None).backend is prefill.members[0]
    assert p.place(decode, None, None).backend is decode.members[0]
    assert p.place(decode, None, None).backend is decode.members[1]
    assert p.place(prefill, None, None).backend is prefill.members[1]
    decode.remove(decode.members[2].url)  # the cursor (2) is now past the end
    assert p.place(decode, None, None).backend is decode.members[0]


def test_round_robin_without_available_backend_raises() -> None:
    pool, p = make_pool(2, "decode"), RoundRobinPolicy()
    for b in pool.members:
        b.healthy = False
    with pytest.raises(NoHealthyBackendError, match="'decode'"):
        p.place(pool, None, None)
    with pytest.raises(NoHealthyBackendError):
        p.place(BackendPool("empty"), None, None)


# -- least_loaded ----------------------------------------------------------------------------


def test_least_loaded_takes_the_smallest_load() -> None:
    pool, p = make_pool(4), LeastLoadedPolicy()
    for backend, load in zip(pool.members, (3, 1, 2, 1)):
        backend.in_flight = load
    first = p.place(pool, "s", None)
    assert (first.backend, first.outcome) == (pool.members[1], Outcome.NO_SESSION)
    # Equal loads rotate: the scan resumes after the last choice.
    assert p.place(pool, None, None).backend is pool.members[3]
    assert p.place(pool, None, None).backend is pool.members[1]
    pool.members[1].healthy = False
    assert p.place(pool, None, None).backend is pool.members[3]
    assert p.place(pool, None, None, frozenset({pool.members[3].url})).backend is pool.members[2]


def test_least_loaded_spreads_a_simulated_load_evenly() -> None:
    pool, p = make_pool(4), LeastLoadedPolicy()
    for _ in range(101):
        p.place(pool, None, None).backend.in_flight += 1
    assert sorted(b.in_flight for b in pool.members) == [25, 25, 25, 26]


def test_least_loaded_blends_reported_load() -> None:
    pool = make_pool(2)
    pool.members[0].reported_load = 10.0
    pool.members[1].in_flight = 3
    assert LeastLoadedPolicy(reported_load_weight=0.5).place(pool, None, None).backend is pool.members[1]
    assert LeastLoadedPolicy(reported_load_weight=0.0).place(pool, None, None).backend is pool.members[0]


def test_least_loaded_without_available_backend_raises() -> None:
    pool, p = make_pool(2, "prefill"), LeastLoadedPolicy()
    with pytest.raises(NoHealthyBackendError, match="'prefill'"):
        p.place(pool, None, None, frozenset(b.url for b in pool.members))

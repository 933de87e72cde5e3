"""The session table: LRU order, idle TTL, capacity, eviction reasons, pagination, JSON view."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.errors import BadRequestError, ConfigError
from router.sessions.table import SessionEntry, SessionTable, SessionView


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def __call__(self, entry: SessionEntry, reason: str) -> None:
        self.events.append((entry.session_id, reason))


def make(max_sessions: int = 100, ttl_s: float = 60.0) -> tuple[SessionTable, FakeClock, FakeClock, Recorder]:
    clock, wall, recorder = FakeClock(), FakeClock(1_700_000_000.0), Recorder()
    table = SessionTable(max_sessions, ttl_s, clock, wall, on_evict=recorder)
    return table, clock, wall, recorder


def ids(entries: list[SessionEntry]) -> list[str]:
    return [e.session_id for e in entries]


def test_touch_creates_once_and_returns_the_same_entry() -> None:
    table, clock, wall, _ = make()
    assert table.get("a") is None
    entry = table.touch("a")
    assert (entry.session_id, entry.created, entry.last_active, entry.requests) == ("a", wall.now, wall.now, 0)
    assert entry.pins == {}
    clock.advance(5)
    wall.advance(5)
    assert table.touch("a") is entry
    assert entry.last_active == wall.now and entry.created == wall.now - 5
    assert table.get("a") is entry
    assert len(table) == 1


def test_get_does_not_refresh_but_touch_does() -> None:
    table, clock, _, recorder = make(ttl_s=10)
    table.touch("a")
    clock.advance(8)
    assert table.get("a") is not None
    clock.advance(3)  # idle 11 s: get() did not count as activity
    assert table.get("a") is None
    assert recorder.events == [("a", "ttl")]
    assert len(table) == 0

    table.touch("b")
    clock.advance(8)
    table.touch("b")
    clock.advance(8)  # idle 8 s since the last touch
    assert table.get("b") is not None


def test_ttl_boundary_is_idle_longer_than_ttl() -> None:
    table, clock, _, _ = make(ttl_s=10)
    table.touch("a")
    clock.advance(10)
    assert table.get("a") is not None
    clock.advance(0.001)
    assert table.get("a") is None


def test_touch_after_expiry_starts_a_new_session() -> None:
    table, clock, wall, recorder = make(ttl_s=10)
    old = table.touch("a")
    old.requests = 7
    old.pins["default"] = "http://127.0.0.1:8100"
    clock.advance(11)
    wall.advance(11)
    new = table.touch("a")
    assert new is not old
    assert (new.requests, new.pins, new.created) == (0, {}, wall.now)
    assert recorder.events == [("a", "ttl")]


def test_capacity_evicts_the_least_recently_active() -> None:
    table, clock, _, recorder = make(max_sessions=3)
    for sid in "abc":
        table.touch(sid)
        clock.advance(1)
    table.touch("a")  # order now b, c, a
    table.touch("d")
    assert recorder.events == [("b", "capacity")]
    assert ids(table.recent(10)) == ["d", "a", "c"]
    assert len(table) == 3
    table.touch("e")
    assert recorder.events[-1] == ("c", "capacity")
    assert table.get("b") is None and table.get("c") is None


def test_capacity_eviction_of_an_expired_entry_is_reported_as_ttl() -> None:
    table, clock, _, recorder = make(max_sessions=2, ttl_s=10)
    table.touch("a")
    clock.advance(5)
    table.touch("b")
    clock.advance(6)  # a idle 11 s (expired, not yet swept), b idle 6 s
    table.touch("c")
    assert recorder.events == [("a", "ttl")]
    table.touch("d")
    assert recorder.events == [("a", "ttl"), ("b", "capacity")]


def test_sweep_evicts_only_expired_entries_and_stops_early() -> None:
    table, clock, _, recorder = make(ttl_s=10)
    for i in range(5):
        table.touch(f"s{i}")
        clock.advance(2)
    # s0 idle 10 s, s1 8 s, ...: nothing is past the TTL yet
    assert table.sweep() == 0
    clock.advance(5)  # s0 15, s1 13, s2 11, s3 9, s4 7
    assert table.sweep() == 3
    assert recorder.events == [("s0", "ttl"), ("s1", "ttl"), ("s2", "ttl")]
    assert ids(table.recent(10)) == ["s4", "s3"]
    assert table.sweep() == 0


def test_sweep_stops_at_the_first_live_entry() -> None:
    """The LRU order makes a sweep cost O(evicted): entries after a live one are never examined."""
    seen: list[str] = []
    table, clock, _, _ = make(ttl_s=10)
    for sid in ("old", "live", "newer"):
        table.touch(sid)
    clock.advance(11)
    table.touch("live")
    table.touch("newer")
    original = table._remove  # observe which entries the sweep removes

    def spy(entry: SessionEntry, reason: str) -> None:  # type: ignore[misc]
        seen.append(entry.session_id)
        original(entry, reason)  # type: ignore[arg-type]

    table._remove = spy  # type: ignore[method-assign]
    assert table.sweep() == 1
    assert seen == ["old"]


def test_delete_reports_deleted_and_is_false_for_unknown_or_expired() -> None:
    table, clock, _, recorder = make(ttl_s=10)
    table.touch("a")
    table.touch("b")
    assert table.delete("a") is True
    assert table.delete("a") is False
    assert table.delete("never") is False
    assert table.get("a") is None
    clock.advance(11)
    assert table.delete("b") is False  # it had expired: gone, but as "ttl"
    assert recorder.events == [("a", "deleted"), ("b", "ttl")]
    assert len(table) == 0


def test_recent_is_most_recently_active_first_and_paginates() -> None:
    table, clock, _, _ = make()
    for i in range(10):
        table.touch(f"s{i}")
        clock.advance(1)
    table.touch("s3")
    expected = ["s3", "s9", "s8", "s7", "s6", "s5", "s4", "s2", "s1", "s0"]
    assert ids(table.recent(100)) == expected
    assert ids(table.recent(3)) == expected[:3]
    assert ids(table.recent(3, offset=3)) == expected[3:6]
    assert ids(table.recent(5, offset=8)) == expected[8:]
    assert table.recent(5, offset=10) == []
    assert table.recent(0) == []
    pages = [ids(table.recent(4, offset=o)) for o in range(0, 10, 4)]
    assert sum(pages, []) == expected


def test_recent_leaves_out_expired_entries() -> None:
    table, clock, _, recorder = make(ttl_s=10)
    table.touch("old")
    clock.advance(6)
    table.touch("new")
    clock.advance(6)
    assert ids(table.recent(10)) == ["new"]
    assert recorder.events == [("old", "ttl")]


def test_recent_rejects_negative_paging_with_a_400() -> None:
    table, _, _, _ = make()
    with pytest.raises(BadRequestError, match="limit") as caught:
        table.recent(-1)
    assert caught.value.status == 400 and caught.value.param == "limit"
    with pytest.raises(BadRequestError, match="offset"):
        table.recent(10, offset=-5)


def test_bad_bounds_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="max_sessions"):
        SessionTable(0, 60.0)
    with pytest.raises(ConfigError, match="session_ttl_s"):
        SessionTable(10, 0.0)


def test_on_evict_may_be_set_after_construction() -> None:
    table = SessionTable(1, 60.0)
    table.touch("a")
    table.touch("b")  # no hook yet: silently evicted
    recorder = Recorder()
    table.on_evict = recorder
    table.touch("c")
    assert recorder.events == [("b", "capacity")]


def test_json_view_has_the_contract_fields() -> None:
    table, _, wall, _ = make()
    entry = table.touch("sess-1")
    entry.requests = 3
    entry.pins["decode"] = "http://127.0.0.1:8201"
    entry.pins["prefill"] = "http://127.0.0.1:8100"
    entry.record_usage(100, 20, 60)
    entry.record_usage(150, 10, 100)
    entry.errors = 1
    entry.last_backend = "http://127.0.0.1:8201"
    view = entry.to_json()
    assert isinstance(view, SessionView)
    decoded = msgspec.json.decode(msgspec.json.encode(view))
    assert decoded == {
        "session_id": "sess-1",
        "pins": {"decode": "http://127.0.0.1:8201", "prefill": "http://127.0.0.1:8100"},
        "requests": 3,
        "created": wall.now,
        "last_active": wall.now,
        "prompt_tokens": 250,
        "completion_tokens": 30,
        "cached_tokens": 160,
        "errors": 1,
        "last_backend": "http://127.0.0.1:8201",
        "session_hash": hashlib.blake2b(b"sess-1", digest_size=8).hexdigest(),  # its /metrics label
        "parent": None,  # no x-parent-session-id (router.sessions.agents)
        "kv": {},  # nothing known resident (router.kv)
    }
    kv_view = msgspec.json.decode(msgspec.json.encode(entry.to_json(kv={"http://127.0.0.1:8201": 4096})))
    assert kv_view["kv"] == {"http://127.0.0.1:8201": 4096}
    assert entry.cached_ratio == pytest.approx(160 / 250)
    # The view is a snapshot: later pin changes do not leak into it.
    entry.pins["decode"] = "http://127.0.0.1:8202"
    assert view.pins["decode"] == "http://127.0.0.1:8201"


def test_duration_and_cached_ratio_of_a_fresh_entry() -> None:
    table, clock, wall, _ = make()
    entry = table.touch("a")
    assert (entry.duration, entry.cached_ratio) == (0.0, 0.0)
    clock.advance(30)
    wall.advance(30)
    table.touch("a")
    assert entry.duration == 30.0


# -- against a reference model ---------------------------------------------------------------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("touch"), st.integers(0, 15)),
        st.tuples(st.just("get"), st.integers(0, 15)),
        st.tuples(st.just("delete"), st.integers(0, 15)),
        st.tuples(st.just("wait"), st.integers(0, 8)),
        st.tuples(st.just("sweep"), st.just(0)),
    ),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(ops=_ops, max_sessions=st.integers(1, 6))
def test_matches_a_simple_model(ops: list[tuple[str, int]], max_sessions: int) -> None:
    """Every entry leaves exactly once, with the right reason; the table never exceeds its bound."""
    ttl = 10.0
    table, clock, _, recorder = make(max_sessions=max_sessions, ttl_s=ttl)
    model: dict[str, float] = {}  # id -> last touch time, in insertion = activity order
    expected: list[tuple[str, str]] = []

    def expire(sid: str) -> bool:
        if sid in model and clock.now - model[sid] > ttl:
            del model[sid]
            expected.append((sid, "ttl"))
            return True
        return False

    for op, arg in ops:
        sid = f"s{arg}"
        if op == "touch":
            expire(sid)
            if sid in model:
                del model[sid]
            elif len(model) >= max_sessions:
                oldest = next(iter(model))
                if not expire(oldest):
                    del model[oldest]
                    expected.append((oldest, "capacity"))
            model[sid] = clock.now
            assert table.touch(sid).session_id == sid
        elif op == "get":
            expire(sid)
            assert (table.get(sid) is not None) == (sid in model)
        elif op == "delete":
            expire(sid)
            present = sid in model
            if present:
                del model[sid]
                expected.append((sid, "deleted"))
            assert table.delete(sid) is present
        elif op == "wait":
            clock.advance(arg)
        else:
            for old in [s for s, t in model.items() if clock.now - t > ttl]:
                expire(old)
            table.sweep()
        assert len(table) <= max_sessions
        assert recorder.events == expected
    live = [s for s, t in model.items() if clock.now - t <= ttl]
    assert ids(table.recent(100)) == list(reversed(live))

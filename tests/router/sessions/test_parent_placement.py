"""A child agent session's first request goes where its parent is: the ``session`` policy reads the
parent's entry from the placement hint (router.sessions.agents, router.placement.session), and
through real HTTP the child lands on the parent's backend."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from router.membership import Backend, BackendPool
from router.placement import Outcome, SessionPolicy, make_policy
from router.placement.base import PlacementHint
from router.sessions.table import SessionTable
from tests.conftest import MakeRouter
from tests.fakes import EchoBackend

FRONTS = ("raw", "aiohttp")


def make_pool(n: int) -> BackendPool:
    return BackendPool("default", [Backend(f"http://127.0.0.1:{8300 + i}") for i in range(n)])


def session_policy() -> SessionPolicy:
    made = make_policy("session", load_factor=1.25, reported_load_weight=0.0, sticky_headroom=2)
    assert isinstance(made, SessionPolicy)
    return made


def children_hashed_elsewhere(policy: SessionPolicy, pool: BackendPool, home: str, count: int) -> list[str]:
    """Child ids whose own hash choice is not ``home`` (so following the parent is observable)."""
    found = []
    i = 0
    while len(found) < count:
        sid = f"child-{i}"
        if policy.candidates(pool, sid)[0].url != home:
            found.append(sid)
        i += 1
    return found


def test_a_child_is_pinned_where_its_parent_is() -> None:
    pool, policy, table = make_pool(4), session_policy(), SessionTable(1000, 3600.0)
    parent = table.touch("parent")
    home = policy.place(pool, "parent", parent).backend
    for sid in children_hashed_elsewhere(policy, pool, home.url, 5):
        child = table.touch(sid)
        hint = PlacementHint(parent_session="parent", parent_entry=parent)
        placed = policy.place(pool, sid, child, hint=hint)
        assert (placed.backend, placed.outcome, placed.reason) == (home, Outcome.NEW, "parent")
        assert child.pins == {"default": home.url}
        # from then on it is a session like any other: sticky to its own pin
        assert policy.place(pool, sid, child).outcome is Outcome.STICKY


def test_without_a_usable_parent_pin_the_child_is_hashed() -> None:
    pool, policy, table = make_pool(4), session_policy(), SessionTable(1000, 3600.0)
    parent = table.touch("parent")
    home = policy.place(pool, "parent", parent).backend
    sid = children_hashed_elsewhere(policy, pool, home.url, 1)[0]
    hashed = policy.candidates(pool, sid)[0]

    def place_child(exclude: frozenset[str] = frozenset()) -> Backend:
        child = table.touch(sid)
        child.pins.clear()
        placed = policy.place(pool, sid, child, exclude, PlacementHint(parent_session="parent", parent_entry=parent))
        assert placed.outcome is Outcome.NEW and placed.reason == "hash"
        return placed.backend

    assert place_child(frozenset({home.url})) is hashed  # the parent's backend already failed this request
    home.in_flight = 10  # far over the sticky bound
    assert place_child() is hashed
    home.in_flight = 0
    home.healthy = False
    assert place_child() is hashed
    home.healthy = True
    parent.pins.clear()  # the parent has no pin in this pool
    assert place_child() is hashed


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.mark.parametrize("policy_name", ["session", "kv_aware"])
@pytest.mark.parametrize("front", FRONTS)
async def test_children_land_on_the_parents_backend(make_router: MakeRouter, http: aiohttp.ClientSession,
                                                    front: str, policy_name: str) -> None:
    fakes = [EchoBackend(f"b{i}") for i in range(4)]
    router = await make_router(front, fakes=fakes, named=True, policy=policy_name)
    body = {"model": "m", "messages": [{"role": "system", "content": "tools"}, {"role": "user", "content": "go"}]}

    async def send(headers: dict[str, str]) -> str:
        async with http.post(router.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            return resp.headers["X-Session-ID"]

    assert await send({"x-session-affinity": "ses_parent"}) == "ses_parent"
    parent = router.state.sessions.get("ses_parent")
    assert parent is not None
    home = parent.pins["default"]
    pool = router.state.serving_pool
    children = children_hashed_elsewhere(session_policy(), pool, home, 6)  # both policies hash new sessions alike
    for sid in children:
        assert await send({"x-session-affinity": sid, "x-parent-session-id": "ses_parent"}) == sid
    served = {s.headers["x-session-id"][0]: f.name for f in fakes for s in f.seen}
    home_name = next(b.name for b in pool.members if b.url == home)
    assert {served[sid] for sid in children} == {home_name}
    for sid in children:
        entry = router.state.sessions.get(sid)
        assert entry is not None and entry.pins == {"default": home} and entry.parent == "ses_parent"

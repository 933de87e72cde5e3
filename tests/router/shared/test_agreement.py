"""``Agreement``: which placements are off a session's first choice, why, and which pin changes reach the
shared state; the first choice is computed only when a pin changes (never per sticky request)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from router.app import PROXY
from router.membership import Backend, BackendPool
from router.placement.base import Outcome, Placement
from router.placement.session import SessionPolicy, session_score
from router.sessions.table import SessionTable
from router.shared import agreement as agreement_module
from router.shared.agreement import Agreement, first_choice, off_first_reason
from tests.conftest import MakeRouter


class Writer:
    def __init__(self) -> None:
        self.moves: list[tuple[Any, ...]] = []

    def pin_moved(self, session_id: str, pool: str, url: str, reason: str, *, publish: bool = True,
                  new: bool = False) -> None:
        self.moves.append((session_id, pool, url, reason, publish, new))


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every first-choice computation, by session."""
    calls: list[str] = []
    real = agreement_module.first_choice

    def counted(pool: Any, session_id: str) -> Any:
        calls.append(session_id)
        return real(pool, session_id)

    monkeypatch.setattr(agreement_module, "first_choice", counted)
    return calls


def pool_of(n: int) -> BackendPool:
    return BackendPool("default", [Backend(f"http://127.0.0.1:{9000 + i}") for i in range(n)])


def test_first_choice_is_the_highest_rendezvous_score_among_available_backends() -> None:
    pool = pool_of(4)
    ranked = sorted(pool.members, key=lambda b: session_score(b.url, "s"), reverse=True)
    assert first_choice(pool, "s") is ranked[0]
    ranked[0].healthy = False
    assert first_choice(pool, "s") is ranked[1]
    for backend in pool.members:
        backend.healthy = False
    assert first_choice(pool, "s") is None


def test_sticky_requests_on_the_first_choice_count_nothing_and_hash_nothing(hashes: list[str]) -> None:
    pool, writer = pool_of(3), Writer()
    agreement = Agreement(writer, refresh_s=100.0)
    policy, table = SessionPolicy(), SessionTable(100, 600.0)
    entry = table.touch("s")
    for request in range(5):
        before = entry.pins.get("default")
        placement = policy.place(pool, "s", entry)
        agreement.placed(pool, "s", entry, before, placement, float(request))
    # in use past refresh_s: written again (alive in Redis), not pushed, still not counted
    agreement.placed(pool, "s", entry, entry.pins["default"], policy.place(pool, "s", entry), 101.0)
    assert writer.moves[-1] == ("s", "default", entry.pins["default"], "", False, False)
    writer.moves.pop()
    assert entry.pins["default"] == first_choice(pool, "s").url
    assert hashes == ["s"]  # once, when the pin was set
    assert agreement.counts == {} and entry.off_first == ""
    # the new pin written once (a replica meeting the session later reads it), as new: not pushed
    assert writer.moves == [("s", "default", entry.pins["default"], "", True, True)]


def test_a_spill_moves_the_pin_off_first_choice_counts_each_request_and_is_written_once(hashes: list[str]) -> None:
    pool, writer = pool_of(2), Writer()
    agreement = Agreement(writer, refresh_s=100.0)
    policy, table = SessionPolicy(sticky_headroom=0), SessionTable(100, 600.0)
    entry = table.touch("s")
    first = first_choice(pool, "s")
    other = next(b for b in pool.members if b is not first)
    placement = policy.place(pool, "s", entry)
    agreement.placed(pool, "s", entry, None, placement, 0.0)
    writer.moves.clear()
    first.in_flight = 10  # over the bound: the session spills and its pin moves
    placement = policy.place(pool, "s", entry)
    agreement.placed(pool, "s", entry, first.url, placement, 1.0)
    assert placement.outcome is Outcome.SPILL and entry.pins["default"] == other.url
    assert entry.off_first == "load" and agreement.counts == {"load": 1}
    assert writer.moves == [("s", "default", other.url, "load", True, False)]
    for t in (2.0, 3.0):  # sticky on the moved pin: counted, no hashing, no write
        before = entry.pins["default"]
        agreement.placed(pool, "s", entry, before, policy.place(pool, "s", entry), t)
    assert agreement.counts == {"load": 3} and len(hashes) == 2 and len(writer.moves) == 1
    # still in use after refresh_s: written again without a push (keeps its TTL alive)
    agreement.placed(pool, "s", entry, other.url, policy.place(pool, "s", entry), 102.0)
    assert writer.moves[-1] == ("s", "default", other.url, "load", False, False)
    # back on the first choice (its pin's backend gone): written (a move, with why it moved: the others
    # judge against their own first choice), no longer counted here
    first.in_flight = 0
    pool.remove(other.url)
    before = entry.pins["default"]
    placement = policy.place(pool, "s", entry)
    agreement.placed(pool, "s", entry, before, placement, 103.0)
    assert entry.pins["default"] == first.url and entry.off_first == ""
    assert writer.moves[-1] == ("s", "default", first.url, "repin", True, False)
    assert agreement.counts == {"load": 4}


def test_requests_away_from_their_pin_are_compared_with_the_first_choice() -> None:
    pool = pool_of(2)
    agreement = Agreement(None)
    table = SessionTable(100, 600.0)
    entry = table.touch("s")
    first = first_choice(pool, "s")
    other = next(b for b in pool.members if b is not first)
    entry.pins["default"] = first.url
    # a retry elsewhere (pin kept), a Responses follow-up at its response's backend
    agreement.placed(pool, "s", entry, first.url, Placement(other, Outcome.SPILL, "retry"), 0.0)
    agreement.placed(pool, "s", entry, first.url, Placement(other, Outcome.STICKY, "cached"), 0.0)
    assert agreement.counts == {"retry": 1, "response": 1}
    # without a pin (a session-blind policy) nothing is compared
    blind = table.touch("t")
    agreement.placed(pool, "t", blind, None, Placement(other, Outcome.NO_SESSION, "least"), 0.0)
    assert agreement.counts == {"retry": 1, "response": 1}


@pytest.mark.parametrize(("outcome", "reason", "label"), [
    (Outcome.NEW, "hash", "load"), (Outcome.NEW, "parent", "parent"), (Outcome.NEW, "wait", "wait"),
    (Outcome.SPILL, "kv_pressure", "kv_pressure"), (Outcome.SPILL, "retry", "retry"),
    (Outcome.REPIN_REMOVED, "unavailable", "repin"), (Outcome.REPIN_UNHEALTHY, "unavailable", "repin"),
    (Outcome.STICKY, "cached", "response"), (Outcome.SPILL, "surprise", "other"),
])
def test_reasons(outcome: Outcome, reason: str, label: str) -> None:
    assert off_first_reason(Placement(Backend("http://127.0.0.1:1"), outcome, reason)) == label


@pytest.mark.parametrize("policy", ["session", "kv_aware"])
async def test_the_proxy_skips_only_placements_the_agreement_has_nothing_to_do_for(
        make_router: MakeRouter, monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    """Through a router: ``Agreement.placed`` is not called for a request on its unchanged pin when that
    pin is the session's first choice and no shared state is kept; a session off its first choice is
    counted on every request, and with a shared state a pin in use is refreshed there."""
    calls: list[str] = []
    real = Agreement.placed

    def counted(self: Agreement, pool: Any, session_id: str, *args: Any) -> None:
        calls.append(session_id)
        real(self, pool, session_id, *args)

    monkeypatch.setattr(Agreement, "placed", counted)
    router = await make_router("raw", n=2, placement={"policy": policy})
    agreement = router.app[PROXY].agreement
    assert agreement is not None
    async with aiohttp.ClientSession() as http:
        async def turn() -> None:
            async with http.post(f"{router.url}/v1/chat/completions", headers={"X-Session-ID": "s"},
                                 json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}) as resp:
                assert resp.status == 200
                await resp.read()

        await turn()  # a new pin: compared with the first choice (it is the first choice: two idle backends)
        assert calls == ["s"]
        entry = router.state.sessions.get("s")
        assert entry is not None and entry.off_first == ""
        for _ in range(3):
            await turn()
        assert calls == ["s"] and agreement.counts == {}
        entry.off_first = "load"  # as when a spill moved it off its first choice
        for _ in range(2):
            await turn()
        assert len(calls) == 3 and agreement.counts == {"load": 2}
        entry.off_first = ""
        writer = Writer()
        agreement.shared = writer
        entry.shared_until = 0.0  # due for a refresh in the shared state
        await turn()
        assert len(calls) == 4 and writer.moves == [("s", "default", entry.pins["default"], "", False, False)]

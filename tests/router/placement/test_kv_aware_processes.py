"""``kv_aware`` end to end with real processes: a router (the default policy, the decision header on)
before two ``session-backend`` processes, one of them slow. The router learns that from the engine's
own ``/metrics`` and the sessions pinned there leave it; the fast backend's sessions stay put."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import pytest

from router.placement import session_score
from tests.support import kill_alive, start_backend, start_router

SESSIONS = 12
#: a short shared prefix: a session on the slow engine leaves it when that engine's TTFT (its step,
#: with the prefix cached) is clearly above the fast one's TTFT recomputing the whole prompt; a long
#: prefix makes that margin thin on a loaded machine, where the fast engine's Python overhead counts
SYSTEM = "You are a careful assistant who answers in full sentences. " * 2


def chat(turns: list[str]) -> dict[str, object]:
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"messages": messages, "max_tokens": 6, "ignore_eos": True}


@pytest.mark.slow
async def test_sessions_leave_a_slow_backend_and_stay_on_a_fast_one(tmp_path: Path) -> None:
    fast = start_backend(str(tmp_path), speed="0.2")
    slow = start_backend(str(tmp_path), speed="30")
    config = tmp_path / "router.toml"
    config.write_text("[health]\ninterval_s = 0.2\n[placement]\ndecision_header = true\n")
    router = None
    try:
        router = start_router(str(tmp_path), "--config", str(config), "--backend", fast.url, "--backend", slow.url)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            histories: dict[str, list[str]] = {f"conv-{i}": [f"Question {i}: tell me about topic {i}."]
                                               for i in range(SESSIONS)}

            async def turn(sid: str) -> tuple[str, str]:
                async with http.post(router.url + "/v1/chat/completions", json=chat(histories[sid]),
                                     headers={"X-Session-ID": sid}) as resp:
                    assert resp.status == 200, await resp.text()
                    answer = (await resp.json())["choices"][0]["message"]["content"]
                    decision = resp.headers["X-Session-Router-Decision"]
                histories[sid] += [answer, f"And then, {sid}?"]
                async with http.get(router.url + f"/v1/sessions/{sid}") as resp:
                    pin = (await resp.json())["pins"]["default"]
                return pin, decision

            first = dict(zip(histories, [p for p, _ in await asyncio.gather(*(turn(s) for s in histories))]))
            on_slow = [sid for sid, pin in first.items() if pin == slow.url]
            on_fast = [sid for sid, pin in first.items() if pin == fast.url]
            assert on_slow and on_fast, first  # the hash spreads them over both
            decisions: list[str] = []
            pins: dict[str, str] = {}
            # turns, while the health checker scrapes both engines, until every session is on the fast
            # one: bounded by time, not by a number of rounds (the learned constants need 3 scrapes,
            # which take longer on a loaded machine)
            deadline = asyncio.get_running_loop().time() + 30.0
            while True:
                results = await asyncio.gather(*(turn(s) for s in histories))
                pins = dict(zip(histories, (p for p, _ in results)))
                decisions += [d for _, d in results]
                if all(pin == fast.url for pin in pins.values()) or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.3)  # pacing between rounds, not a condition
        assert all(pins[sid] == fast.url for sid in on_slow), (pins, decisions[-24:])
        assert all(pins[sid] == fast.url for sid in on_fast), pins  # never moved to the slow one
        moves = [d for d in decisions if d.startswith("spill;")]
        assert len(moves) == len(on_slow) and all(d.endswith(";reason=wait") for d in moves), decisions
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async with http.get(router.url + "/metrics") as resp:
                metrics = await resp.text()
        assert 'session_router_placement_decisions_total{outcome="spill",policy="kv_aware",reason="wait"}' in metrics
    finally:
        kill_alive(*(p for p in (router, fast, slow) if p is not None))


def hashed_to(urls: tuple[str, str], sid: str) -> str:
    return max(urls, key=lambda url: (session_score(url, sid), url))


@pytest.mark.slow
async def test_an_uneven_hash_draw_of_new_sessions_is_evened_out(tmp_path: Path) -> None:
    """100 sessions of which 66 hash to one of two real backends: the router (``session_balance =
    1.05``) pins at most 53 there, says ``balance`` for each one it passed on, and
    keeps every session where it put it."""
    one = start_backend(str(tmp_path))
    two = start_backend(str(tmp_path))
    router = None
    try:
        config = tmp_path / "router.toml"
        config.write_text("[placement]\ndecision_header = true\nsession_balance = 1.05\n")
        router = start_router(str(tmp_path), "--config", str(config), "--backend", one.url, "--backend", two.url)
        urls = (one.url, two.url)
        names = [f"conv-{i}" for i in range(2000)]
        ids = ([s for s in names if hashed_to(urls, s) == one.url][:66]
               + [s for s in names if hashed_to(urls, s) == two.url][:34])
        random.Random(5).shuffle(ids)
        timeout = aiohttp.ClientTimeout(total=30)
        body = {"messages": [{"role": "user", "content": "Hello there."}], "max_tokens": 2}
        async with aiohttp.ClientSession(timeout=timeout) as http:

            async def turn(sid: str) -> tuple[str, str]:
                async with http.post(router.url + "/v1/chat/completions", json=body,
                                     headers={"X-Session-ID": sid}) as resp:
                    assert resp.status == 200, await resp.text()
                    decision = resp.headers["X-Session-Router-Decision"]
                async with http.get(router.url + f"/v1/sessions/{sid}") as resp:
                    return (await resp.json())["pins"]["default"], decision

            first = {sid: await turn(sid) for sid in ids}
            again = {sid: await turn(sid) for sid in ids}
            async with http.get(router.url + "/metrics") as resp:
                metrics = await resp.text()
        on_one = [sid for sid, (pin, _) in first.items() if pin == one.url]
        assert 47 <= len(on_one) <= 53, len(on_one)
        passed_on = [sid for sid, (pin, decision) in first.items() if decision.endswith(";reason=balance")]
        assert passed_on and all(first[sid][0] != hashed_to(urls, sid) for sid in passed_on)
        assert all(pin == hashed_to(urls, sid) and d.startswith("new;") and d.endswith(";reason=hash")
                   for sid, (pin, d) in first.items() if sid not in passed_on)
        assert all(pin == first[sid][0] and d.startswith("sticky;") for sid, (pin, d) in again.items())
        assert ('session_router_placement_decisions_total{outcome="new",policy="kv_aware",reason="balance"} '
                f"{float(len(passed_on))}") in metrics
    finally:
        kill_alive(*(p for p in (router, one, two) if p is not None))

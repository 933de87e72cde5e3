"""Router metrics through real HTTP: the bounded per-session series (top-K), their removal on
eviction, cumulative totals on re-admission, the session-level histograms, and every metric
name and label set that issue 5 lists.

The router is the in-process app of ``router.app.create_app`` (served by pytest-aiohttp on
127.0.0.1) in front of ``tests.fakes.EchoBackend`` servers. Every EchoBackend answer reports
usage ``prompt_tokens=10, completion_tokens=3, cached_tokens=4``, so expected token counts are
exact multiples of those. The fixture sets ``session_label = "id"`` (the ids themselves as label
values, so the series can be compared with the session table by id) and an admin token for the
session listing (an admin action); the default ``"hash"`` and ``"none"`` have tests of their own.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from router.state import ROUTER_STATE
from tests.conftest import MakeRouter
from tests.fakes import EchoBackend
from tests.support import eventually as shared_eventually

K = 5
TOKEN = "metrics-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT, COMPLETION, CACHED = 10, 3, 4  # EchoBackend's usage per answer

#: every per-session metric family of the router (exposition sample name -> extra labels)
SESSION_SAMPLES = {
    "session_router_session_requests_total": set(),
    "session_router_session_tokens_total": {"kind"},
    "session_router_session_errors_total": set(),
    "session_router_session_backend_info": {"backend"},
}

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("_sum", "_count", "_created"),
    "info": ("_info",),
}


# --------------------------------------------------------------------------- exposition helpers
@dataclass
class Exposition:
    """A parsed ``/metrics`` page: every sample, and every name a query may use."""

    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)
    #: family names and every sample name they can produce (declared even without samples)
    names: set[str] = field(default_factory=set)
    types: dict[str, str] = field(default_factory=dict)

    def values(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        return [(lab, v) for n, lab, v in self.samples
                if n == name and all(lab.get(k) == want for k, want in labels.items())]

    def value(self, name: str, **labels: str) -> float:
        """The one sample matching; 0.0 when there is none (an unlabelled child not created yet)."""
        found = self.values(name, **labels)
        assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples: {found}"
        return found[0][1] if found else 0.0

    def sessions(self, name: str) -> set[str]:
        return {lab["session"] for lab, _ in self.values(name) if "session" in lab}

    def label_sets(self, name: str) -> set[frozenset[str]]:
        return {frozenset(lab) for lab, _ in self.values(name)}


def parse_exposition(text: str) -> Exposition:
    exp = Exposition()
    for family in text_string_to_metric_families(text):
        exp.types[family.name] = family.type
        exp.names.add(family.name)
        exp.names.update(family.name + s for s in _SUFFIXES.get(family.type, ()))
        for sample in family.samples:
            exp.names.add(sample.name)
            exp.samples.append((sample.name, dict(sample.labels), float(sample.value)))
    return exp


async def scrape(client: TestClient) -> Exposition:
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    return parse_exposition(await resp.text())


eventually = functools.partial(shared_eventually, timeout=10.0)


# --------------------------------------------------------------------------- the router under test
Factory = Callable[..., Awaitable[tuple[TestClient, list[EchoBackend]]]]


@pytest.fixture
def router(make_router: MakeRouter) -> Factory:
    async def make(n: int = 2, dead: int = 0, **overrides: Any) -> tuple[TestClient, list[EchoBackend]]:
        settings: dict[str, Any] = {"session_metrics_top_k": K, "session_label": "id", "admin_token": TOKEN}
        settings.update(overrides)
        served = await make_router("client", n=n, dead=dead, named=True, **settings)
        assert served.client is not None
        return served.client, served.fakes

    return make


def chat(session: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "session_id": session,
                            "messages": [{"role": "user", "content": f"hello from {session}"}]}
    body.update(extra)
    return body


async def send(client: TestClient, session: str, **extra: Any) -> int:
    resp = await client.post("/v1/chat/completions", json=chat(session, **extra))
    await resp.read()
    return resp.status


@dataclass
class Model:
    """What the test expects: per-session totals and the most-recently-active order."""

    requests: dict[str, int] = field(default_factory=dict)
    ok: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    order: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def record(self, session: str, ok: bool) -> None:
        self.requests[session] = self.requests.get(session, 0) + 1
        if ok:
            self.ok[session] = self.ok.get(session, 0) + 1
        else:
            self.errors[session] = self.errors.get(session, 0) + 1
        self.order[session] = None
        self.order.move_to_end(session)

    def forget(self, session: str) -> None:
        for table in (self.requests, self.ok, self.errors):
            table.pop(session, None)
        self.order.pop(session, None)

    def top(self, k: int) -> set[str]:
        return set(list(self.order)[-k:])


def assert_top_k(exp: Exposition, model: Model, k: int, where: str) -> None:
    expected = model.top(k)
    for name in SESSION_SAMPLES:
        got = exp.sessions(name)
        assert len(got) <= k, f"{where}: {name} carries {len(got)} sessions > K={k}: {sorted(got)}"
    # every exported session has its full set of series, and the set is exactly the top K
    for name in ("session_router_session_requests_total", "session_router_session_errors_total",
                 "session_router_session_backend_info"):
        assert exp.sessions(name) == expected, f"{where}: {name} sessions {sorted(exp.sessions(name))} != {sorted(expected)}"
    for kind in ("prompt", "completion", "cached"):
        got = {lab["session"] for lab, _ in exp.values("session_router_session_tokens_total", kind=kind)}
        assert got == expected, f"{where}: tokens{{kind={kind}}} sessions {sorted(got)} != {sorted(expected)}"
    for sid in expected:
        ok = model.ok.get(sid, 0)
        assert exp.value("session_router_session_requests_total", session=sid) == model.requests[sid], where
        assert exp.value("session_router_session_errors_total", session=sid) == model.errors.get(sid, 0), where
        assert exp.value("session_router_session_tokens_total", session=sid, kind="prompt") == PROMPT * ok, where
        assert exp.value("session_router_session_tokens_total", session=sid, kind="completion") == COMPLETION * ok, where
        assert exp.value("session_router_session_tokens_total", session=sid, kind="cached") == CACHED * ok, where
        assert len(exp.values("session_router_session_backend_info", session=sid)) == 1, where


# --------------------------------------------------------------------------- top-K bound
async def test_session_series_stay_within_top_k_and_follow_recency(router: Factory) -> None:
    """10 x K sessions with revisits and errors: after every request the session-labelled series
    are exactly the K most recently active sessions, never more, each with its cumulative totals."""
    client, fakes = await router(max_sessions=10_000)
    model = Model()
    sessions = [f"s{i:03d}" for i in range(10 * K)]
    checked = 0
    for i, sid in enumerate(sessions):
        plan = [sid]
        if i % 3 == 2:
            plan.append(sessions[i // 2])  # revisit an older session: pushed out of the top K long ago
        if i % 7 == 6:
            plan.append(sessions[i - 1])  # a second turn while still in the top K
        for turn_sid in plan:
            fail = i % 11 == 10 and turn_sid == sid  # an upstream 400 counts as an error of the session
            for f in fakes:
                f.status = 400 if fail else 200
            status = await send(client, turn_sid)
            assert status == (400 if fail else 200)
            model.record(turn_sid, ok=not fail)
            assert_top_k(await scrape(client), model, K, where=f"after request {checked} ({turn_sid})")
            checked += 1
    assert checked > 10 * K
    assert len(model.requests) == 10 * K
    assert state_of(client).metrics.exported_sessions() == list(model.order)[-K:]
    # the table still holds every session with its full detail (not only the top K)
    resp = await client.get("/v1/sessions", params={"limit": "1000"}, headers=AUTH)
    listed = (await resp.json())["data"]
    assert [s["session_id"] for s in listed] == list(reversed(model.order))
    assert {s["session_id"]: s["requests"] for s in listed} == model.requests


async def test_readmitted_session_carries_cumulative_totals(router: Factory) -> None:
    client, _ = await router()
    for _ in range(3):
        assert await send(client, "veteran") == 200
    for i in range(K):  # push it out of the top K (it stays in the session table)
        assert await send(client, f"newcomer-{i}") == 200
    exp = await scrape(client)
    assert "veteran" not in exp.sessions("session_router_session_requests_total")
    assert await send(client, "veteran") == 200
    exp = await scrape(client)
    assert exp.value("session_router_session_requests_total", session="veteran") == 4
    assert exp.value("session_router_session_tokens_total", session="veteran", kind="prompt") == 4 * PROMPT
    assert exp.value("session_router_session_tokens_total", session="veteran", kind="cached") == 4 * CACHED
    assert "newcomer-0" not in exp.sessions("session_router_session_requests_total")
    assert len(exp.sessions("session_router_session_requests_total")) == K


def state_of(client: TestClient) -> Any:
    return client.server.app[ROUTER_STATE]


# --------------------------------------------------------------------------- eviction
def histogram_count(exp: Exposition, name: str) -> float:
    return exp.value(name + "_count")


async def test_deleted_session_series_disappear_at_once_and_histograms_observe(router: Factory) -> None:
    client, _ = await router()
    for _ in range(3):
        assert await send(client, "doomed") == 200
    assert await send(client, "bystander") == 200
    exp = await scrape(client)
    assert "doomed" in exp.sessions("session_router_session_requests_total")
    assert histogram_count(exp, "session_router_session_turns") == 0

    resp = await client.delete("/v1/sessions/doomed")
    assert resp.status == 200
    exp = await scrape(client)
    for name in SESSION_SAMPLES:
        assert "doomed" not in exp.sessions(name), name
    assert exp.sessions("session_router_session_requests_total") == {"bystander"}
    assert exp.value("session_router_session_evictions_total", reason="deleted") == 1
    # the session-level histograms got exactly this session's lifetime, without a session label
    assert histogram_count(exp, "session_router_session_turns") == 1
    assert exp.value("session_router_session_turns_sum") == 3
    assert exp.value("session_router_session_turns_bucket", le="2.0") == 0
    assert exp.value("session_router_session_turns_bucket", le="3.0") == 1
    assert histogram_count(exp, "session_router_session_duration_seconds") == 1
    assert histogram_count(exp, "session_router_session_cached_token_ratio") == 1
    ratio = CACHED / PROMPT
    assert exp.value("session_router_session_cached_token_ratio_sum") == pytest.approx(ratio)
    assert exp.value("session_router_session_cached_token_ratio_bucket", le="0.3") == 0
    assert exp.value("session_router_session_cached_token_ratio_bucket", le="0.4") == 1
    for name in ("session_router_session_turns_bucket", "session_router_session_duration_seconds_bucket",
                 "session_router_session_cached_token_ratio_bucket"):
        assert all("session" not in lab for lab, _ in exp.values(name))

    # a session that comes back after leaving the table starts a new life
    assert await send(client, "doomed") == 200
    exp = await scrape(client)
    assert exp.value("session_router_session_requests_total", session="doomed") == 1
    assert (await client.delete("/v1/sessions/doomed")).status == 200
    assert (await client.delete("/v1/sessions/doomed")).status == 404
    exp = await scrape(client)
    assert exp.value("session_router_session_evictions_total", reason="deleted") == 2
    assert histogram_count(exp, "session_router_session_turns") == 2


async def test_capacity_eviction_removes_series_with_a_tiny_table(router: Factory) -> None:
    """max_sessions (3) below K (5): the table, not the top K, bounds the series."""
    client, _ = await router(max_sessions=3)
    for i in range(4 * K):
        sid = f"cap-{i}"
        assert await send(client, sid) == 200
        exp = await scrape(client)
        live = {f"cap-{j}" for j in range(max(0, i - 2), i + 1)}
        for name in SESSION_SAMPLES:
            assert exp.sessions(name) == live, (i, name, exp.sessions(name))
        assert exp.value("session_router_sessions_active") == len(live)
        evicted = max(0, i - 2)
        assert exp.value("session_router_session_evictions_total", reason="capacity") == evicted
        assert histogram_count(exp, "session_router_session_turns") == evicted


async def test_ttl_expiry_removes_series(router: Factory) -> None:
    client, _ = await router(session_ttl_s=0.3)
    started = time.monotonic()
    for i in range(3):
        assert await send(client, f"idle-{i}") == 200
    exp = await scrape(client)
    if time.monotonic() - started < 0.3:  # a very slow machine may already have expired them
        assert exp.sessions("session_router_session_requests_total") == {"idle-0", "idle-1", "idle-2"}

    async def expired() -> bool:
        exp = await scrape(client)  # /metrics sweeps expired sessions before rendering
        return (not any(exp.sessions(name) for name in SESSION_SAMPLES)
                and exp.value("session_router_session_evictions_total", reason="ttl") == 3)

    await eventually(expired, what="TTL expiry of 3 sessions")
    exp = await scrape(client)
    assert histogram_count(exp, "session_router_session_turns") == 3
    assert exp.value("session_router_sessions_active") == 0
    assert (await client.get("/v1/sessions/idle-0")).status == 404


async def test_session_deleted_during_its_stream_leaves_no_series(router: Factory) -> None:
    """A request that finishes after its session left the table must not re-create its series."""
    client, fakes = await router(n=1)
    gate = asyncio.Event()
    fakes[0].gates[1] = gate
    resp = await client.post("/v1/chat/completions", json=chat("mid-stream", stream=True))
    assert resp.status == 200
    assert (await client.delete("/v1/sessions/mid-stream")).status == 200
    gate.set()
    await resp.read()
    exp = await scrape(client)
    for name in SESSION_SAMPLES:
        assert "mid-stream" not in exp.sessions(name), name


# --------------------------------------------------------------------------- every metric of issue 5
EXPECTED_LABELS: dict[str, frozenset[str]] = {
    "session_router_requests_total": frozenset({"route", "backend", "status_class"}),
    "session_router_request_duration_seconds_bucket": frozenset({"route", "le"}),
    "session_router_request_duration_seconds_count": frozenset({"route"}),
    "session_router_time_to_first_byte_seconds_bucket": frozenset({"route", "le"}),
    "session_router_tokens_total": frozenset({"kind"}),
    "session_router_backend_in_flight": frozenset({"pool", "backend"}),
    "session_router_backend_healthy": frozenset({"pool", "backend"}),
    "session_router_placements_total": frozenset({"policy", "outcome"}),
    "session_router_retries_total": frozenset({"reason"}),
    "session_router_sessions_active": frozenset(),
    "session_router_session_evictions_total": frozenset({"reason"}),
    "session_router_session_turns_bucket": frozenset({"le"}),
    "session_router_session_duration_seconds_bucket": frozenset({"le"}),
    "session_router_session_cached_token_ratio_bucket": frozenset({"le"}),
    "session_router_session_requests_total": frozenset({"session"}),
    "session_router_session_tokens_total": frozenset({"session", "kind"}),
    "session_router_session_errors_total": frozenset({"session"}),
    "session_router_session_backend_info": frozenset({"session", "backend"}),
}


async def test_every_router_metric_and_label_set(router: Factory) -> None:
    client, fakes = await router(n=2)
    # non-streaming, streaming with usage (counted), streaming without (not counted: nothing to count)
    assert await send(client, "m-1") == 200
    assert await send(client, "m-1") == 200
    resp = await client.post("/v1/chat/completions",
                             json=chat("m-2", stream=True, stream_options={"include_usage": True}))
    assert resp.status == 200 and b"[DONE]" in await resp.read()
    resp = await client.post("/v1/chat/completions", json=chat("m-3", stream=True))
    assert resp.status == 200 and b"[DONE]" in await resp.read()
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "session_id": "m-4"})
    assert resp.status == 200
    # a retry: the first candidate answers 503, the other 200
    fakes[0].status = 503
    fakes[1].status = 503
    retried = await client.post("/v1/chat/completions", json=chat("m-5"))
    assert retried.status == 503  # both busy: retries exhausted, the last 503 relayed
    fakes[0].status = fakes[1].status = 200
    assert (await client.delete("/v1/sessions/m-4")).status == 200

    exp = await scrape(client)
    for name, labels in EXPECTED_LABELS.items():
        assert exp.label_sets(name) == {labels}, f"{name}: label sets {exp.label_sets(name)} != {{{set(labels)}}}"
    # declared even before a P/D request happened; label set checked on the metric object
    assert "session_router_pd_fallback_total" in exp.names
    assert state_of(client).metrics.pd_fallbacks._labelnames == ("reason",)

    b0, b1 = fakes[0].name, fakes[1].name
    ok_chat = sum(v for lab, v in exp.values("session_router_requests_total", route="chat", status_class="2xx"))
    assert ok_chat == 4
    assert {lab["backend"] for lab, _ in exp.values("session_router_requests_total")} <= {b0, b1}
    assert sum(v for _, v in exp.values("session_router_requests_total", route="chat", status_class="5xx")) == 1
    assert exp.value("session_router_request_duration_seconds_count", route="chat") == 5
    assert exp.value("session_router_request_duration_seconds_count", route="completions") == 1
    assert exp.value("session_router_time_to_first_byte_seconds_count", route="chat") == 5
    # usage: 2 non-stream chats + 1 stream with include_usage + 1 completion = 4 answers with usage
    assert exp.value("session_router_tokens_total", kind="prompt") == 4 * PROMPT
    assert exp.value("session_router_tokens_total", kind="completion") == 4 * COMPLETION
    assert exp.value("session_router_tokens_total", kind="cached") == 4 * CACHED
    assert {lab["backend"] for lab, _ in exp.values("session_router_backend_in_flight")} == {b0, b1}
    assert all(v == 0 for _, v in exp.values("session_router_backend_in_flight"))
    assert exp.value("session_router_placements_total", policy="kv_aware", outcome="new") == 5
    assert exp.value("session_router_placements_total", policy="kv_aware", outcome="sticky") >= 1
    assert exp.value("session_router_placement_decisions_total", policy="kv_aware", outcome="new",
                     reason="hash") == 5
    assert exp.value("session_router_placement_decisions_total", policy="kv_aware", outcome="sticky",
                     reason="cached") >= 1
    # placements by policy and outcome are the decisions summed over their reasons
    for labels, total in exp.values("session_router_placements_total"):
        assert total == sum(v for _, v in exp.values("session_router_placement_decisions_total", **labels))
    assert {frozenset(lab.items()) for lab, _ in exp.values("session_router_placements_total")} == {
        frozenset((k, v) for k, v in lab.items() if k != "reason")
        for lab, _ in exp.values("session_router_placement_decisions_total")}
    assert exp.value("session_router_retries_total", reason="status_503") == 2  # retries = 2 by default
    assert exp.value("session_router_sessions_active") == 4
    assert exp.value("session_router_session_evictions_total", reason="deleted") == 1
    assert exp.value("session_router_session_errors_total", session="m-5") == 1
    assert exp.value("session_router_session_backend_info", session="m-1") == 1


async def test_in_flight_and_health_gauges_are_live(router: Factory) -> None:
    client, fakes = await router(n=1, dead=1, health_interval_s=0.05, health_timeout_s=0.5)
    live = fakes[0].name

    async def dead_is_down() -> bool:
        exp = await scrape(client)
        return (exp.value("session_router_backend_healthy", backend="dead0", pool="default") == 0
                and exp.value("session_router_backend_healthy", backend=live, pool="default") == 1)

    await eventually(dead_is_down, what="the health checker to mark the dead backend down")
    gate = asyncio.Event()
    fakes[0].gates[0] = gate
    resp = await client.post("/v1/chat/completions", json=chat("inflight", stream=True))
    assert resp.status == 200
    exp = await scrape(client)
    assert exp.value("session_router_backend_in_flight", backend=live, pool="default") == 1
    assert exp.value("session_router_backend_in_flight", backend="dead0", pool="default") == 0
    gate.set()
    await resp.read()
    exp = await scrape(client)
    assert exp.value("session_router_backend_in_flight", backend=live, pool="default") == 0
    transitions = exp.values("session_router_backend_health_transitions_total", backend="dead0", to="unhealthy")
    assert transitions and transitions[0][1] >= 1


@pytest.mark.parametrize("max_idle", [None, 2])
async def test_upstream_connections_kept_up_to_max_idle_and_counted(router: Factory, max_idle: int | None) -> None:
    """Six streams held open at once need six connections; once they end, the pool keeps
    ``[upstream] max_idle_per_host`` of them (256 by default: all six), and a second wave of six
    opens only the ones it did not keep. The metrics show both."""
    overrides: dict[str, Any] = {} if max_idle is None else {"upstream": {"max_idle_per_host": max_idle}}
    client, fakes = await router(n=1, **overrides)
    kept = 6 if max_idle is None else max_idle
    opened_total = "session_router_upstream_connections_opened_total"

    async def wave(opened_before: int) -> None:
        gate = fakes[0].gates[0] = asyncio.Event()
        seen = len(fakes[0].seen)
        resps = [await client.post("/v1/chat/completions", json=chat(f"keep-{i}", stream=True)) for i in range(6)]
        await eventually(lambda: len(fakes[0].seen) == seen + 6, what="six streams at the backend")
        exp = await scrape(client)
        (address,) = {lab["address"] for lab, _ in exp.values("session_router_upstream_connections")}
        assert exp.value("session_router_upstream_connections", address=address, state="busy") == 6
        assert exp.value(opened_total) == opened_before + 6 - min(kept, opened_before)
        gate.set()
        for resp in resps:
            assert resp.status == 200 and b"[DONE]" in await resp.read()

        async def released() -> bool:
            exp = await scrape(client)
            return (exp.value("session_router_upstream_connections", address=address, state="busy") == 0
                    and exp.value("session_router_upstream_connections", address=address, state="idle") == kept)

        await eventually(released, what=f"{kept} idle connections kept")

    await wave(0)
    await wave(6)
    exp = await scrape(client)
    assert exp.types["session_router_upstream_connections_opened"] == "counter"
    assert exp.value(opened_total) == 12 - kept


async def test_top_k_zero_exports_no_session_series(router: Factory) -> None:
    client, _ = await router(session_metrics_top_k=0)
    for i in range(3):
        assert await send(client, f"z-{i}") == 200
    exp = await scrape(client)
    assert not any(exp.sessions(name) for name in SESSION_SAMPLES)
    assert exp.value("session_router_sessions_active") == 3
    assert (await client.delete("/v1/sessions/z-0")).status == 200
    exp = await scrape(client)
    assert histogram_count(exp, "session_router_session_turns") == 1

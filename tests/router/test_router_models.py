"""Routing by the request's ``model`` (issue 11, item 19).

Backends serving different models: each request goes to the backends that list its model in
``GET /v1/models`` (learned by the health checker), per pool; a model no backend lists is the
router's own 404 in vLLM's shape; a request without a model goes anywhere. Unit tests of the
pool's candidate sets, in-process routers on both fronts, and real ``session-backend`` processes.
"""

from __future__ import annotations

import json
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import generate_latest

from bench.procs import free_ports
from router.placement import RoundRobinPolicy, SessionPolicy
from router.membership import Backend, BackendPool
from router.sessions.table import SessionEntry
from tests.router.routing_support import FRONTS, ModelBackend, Serve, ask
from tests.support import Proc, metric_sum, start_backend, start_router, wait_until

NOT_FOUND = {"message": "The model `gamma` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}


# ------------------------------------------------------------------------ candidate sets (unit)


def pool_of(*models: frozenset[str] | None) -> BackendPool:
    pool = BackendPool("default", [Backend(f"http://127.0.0.1:{9000 + i}") for i in range(len(models))])
    for backend, served in zip(pool.members, models):
        if served is not None:
            pool.set_models(backend, served)
    return pool


def urls(candidates: Any) -> list[str]:
    return [b.url for b in candidates.members]


def test_before_any_model_is_known_every_model_may_go_anywhere() -> None:
    pool = pool_of(None, None)
    assert pool.for_model("anything") is pool
    assert pool.for_model(None) is pool and pool.for_model("") is pool and pool.for_model(7) is pool


def test_one_model_everywhere_is_the_whole_pool() -> None:
    pool = pool_of(frozenset({"m"}), frozenset({"m", "lora-1"}))
    assert pool.for_model("m") is pool  # the usual cluster: placement and its caches are unchanged
    assert urls(pool.for_model("lora-1")) == ["http://127.0.0.1:9001"]
    assert pool.for_model("other") is None


def test_candidate_sets_are_precomputed_and_follow_changes() -> None:
    pool = pool_of(frozenset({"a"}), frozenset({"b"}), None)
    a = pool.for_model("a")
    assert a is not None and urls(a) == ["http://127.0.0.1:9000", "http://127.0.0.1:9002"]  # + the unknown one
    assert pool.for_model("a") is a  # the same object: nothing is built per request
    assert urls(pool.for_model("zzz")) == ["http://127.0.0.1:9002"]  # only the backend not known yet
    assert a.name == "default" and a.key != pool.key and a.describe() == "pool 'default' for model 'a'"
    version = pool.version
    assert not pool.set_models(pool.members[0], frozenset({"a"}))  # unchanged: nothing rebuilt
    assert pool.version == version and pool.for_model("a") is a
    assert pool.set_models(pool.members[2], frozenset({"b"}))  # learned: it serves b, not a
    assert pool.version > version
    assert urls(pool.for_model("a")) == ["http://127.0.0.1:9000"]
    assert urls(pool.for_model("b")) == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert pool.for_model("zzz") is None
    pool.remove("http://127.0.0.1:9000")
    assert pool.for_model("a") is None
    pool.add(Backend("http://127.0.0.1:9003"))  # a new backend may serve anything until its models are known
    assert urls(pool.for_model("a")) == ["http://127.0.0.1:9003"]


def test_placement_runs_on_the_candidate_set() -> None:
    pool = pool_of(frozenset({"a"}), frozenset({"a"}), frozenset({"b"}), frozenset({"b"}))
    a, b = pool.for_model("a"), pool.for_model("b")
    assert a is not None and b is not None
    policy = SessionPolicy()
    for i in range(50):
        entry = SessionEntry(f"s{i}", 0.0, 0.0, 0.0)
        first = policy.place(a, entry.session_id, entry).backend
        assert first.models == frozenset({"a"})
        first.in_flight += 1  # loads differ, the pin holds
        assert policy.place(a, entry.session_id, entry).backend is first
        assert entry.pins == {"default": first.url}
    # each candidate set has its own round-robin cursor
    rr = RoundRobinPolicy()
    picks = [rr.place(s, None, None).backend.url for s in (a, b, a, b)]
    assert picks == ["http://127.0.0.1:9000", "http://127.0.0.1:9002", "http://127.0.0.1:9001",
                     "http://127.0.0.1:9003"]


# ------------------------------------------------------------------- in-process, both fronts


def two_models() -> list[ModelBackend]:
    return [ModelBackend("a0", ["alpha"]), ModelBackend("a1", ["alpha"]),
            ModelBackend("b0", ["beta"]), ModelBackend("b1", ["beta", "beta-lora"])]


@pytest.mark.parametrize("front", FRONTS)
async def test_requests_go_to_the_backends_of_their_model(serve: Serve, front: str) -> None:
    routed = await serve(front, backends=two_models())
    for i in range(8):
        model = ("alpha", "beta")[i % 2]
        status, _, body = await ask(routed, "POST", "/v1/completions", json_body={"model": model, "prompt": "x"})
        assert status == 200, body
        assert json.loads(body)["backend"][0] == model[0]
    # with a session: sticky within the model's backends
    for i in range(6):
        status, headers, body = await ask(routed, "POST", "/v1/chat/completions", headers={"X-Session-ID": "s-beta"},
                                          json_body={"model": "beta-lora", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and json.loads(body)["backend"] == "b1" and headers["x-session-id"] == "s-beta"
    # tokenize is routed by model as well; no model goes anywhere
    status, _, body = await ask(routed, "POST", "/tokenize", json_body={"model": "alpha", "prompt": "x"})
    assert status == 200 and json.loads(body)["backend"].startswith("a")
    seen = set()
    for i in range(64):  # 64 distinct sessions: all on 2 of the 4 backends by chance has odds of ~2**-60
        status, _, body = await ask(routed, "POST", "/v1/completions", json_body={"prompt": "x"},
                                    headers={"X-Session-ID": f"any-{i}"})
        assert status == 200
        seen.add(json.loads(body)["backend"])
    assert len(seen) > 2  # not confined to one model's backends


@pytest.mark.parametrize("front", FRONTS)
async def test_a_model_no_backend_serves_is_the_routers_404(serve: Serve, front: str) -> None:
    routed = await serve(front, backends=two_models())
    for path, body in (("/v1/completions", {"model": "gamma", "prompt": "x"}),
                       ("/v1/chat/completions", {"model": "gamma", "messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/embeddings", {"model": "gamma", "input": "x"})):
        status, headers, answer = await ask(routed, "POST", path, json_body=body, headers={"X-Session-ID": "s-g"})
        assert status == 404, answer
        assert json.loads(answer) == {"error": NOT_FOUND}
        assert headers["x-request-id"] and headers["content-type"].startswith("application/json")
    assert routed.all_hits() == []  # no backend was asked
    assert routed.state.sessions.get("s-g") is None  # nor was a session made for it
    # the union of the models, each once
    status, _, answer = await ask(routed, "GET", "/v1/models")
    assert status == 200
    assert sorted(card["id"] for card in json.loads(answer)["data"]) == ["alpha", "beta", "beta-lora"]


@pytest.mark.parametrize("front", FRONTS)
async def test_models_are_refreshed_by_the_health_checker(serve: Serve, front: str) -> None:
    known, unknown = ModelBackend("k", ["alpha"]), ModelBackend("u", None)  # u has no /v1/models
    routed = await serve(front, backends=[known, unknown])
    state = routed.state
    assert state.health is not None
    k, u = state.pools["default"].members
    assert (k.models, u.models) == (frozenset({"alpha"}), None)
    # a backend whose models are not known is a candidate for every model
    for _ in range(3):
        status, _, body = await ask(routed, "POST", "/v1/completions", json_body={"model": "beta", "prompt": "x"})
        assert status == 200 and json.loads(body)["backend"] == "u"
    # k now serves beta instead of alpha: the next health round learns it and routing follows
    known.models = ["beta"]
    await state.health.check_now()
    assert k.models == frozenset({"beta"})
    for _ in range(3):
        status, _, body = await ask(routed, "POST", "/v1/completions", json_body={"model": "alpha", "prompt": "x"})
        assert status == 200 and json.loads(body)["backend"] == "u"
    # a failed fetch keeps what was known
    known.fail["/v1/models"] = 500
    await state.health.check_now()
    assert k.models == frozenset({"beta"})
    # an empty list: it serves no model by name (requests without a model may still go there)
    del known.fail["/v1/models"]
    known.models = []
    await state.health.check_now()
    assert k.models == frozenset()
    for _ in range(3):
        status, _, body = await ask(routed, "POST", "/v1/completions", json_body={"model": "beta", "prompt": "x"})
        assert status == 200 and json.loads(body)["backend"] == "u"


@pytest.mark.parametrize("front", FRONTS)
async def test_pd_filters_the_prefill_and_the_decode_pool(serve: Serve, front: str) -> None:
    routed = await serve(front, prefill=[ModelBackend("pa", ["alpha"]), ModelBackend("pb", ["beta"])],
                         decode=[ModelBackend("da", ["alpha"]), ModelBackend("db", ["beta"])])
    for model in ("alpha", "beta", "alpha", "beta"):
        status, _, body = await ask(routed, "POST", "/v1/completions", json_body={"model": model, "prompt": "x"})
        assert status == 200 and json.loads(body)["backend"] == "d" + model[0]
    for name in ("pa", "pb", "da", "db"):
        hits = routed.hits(name)
        assert len(hits) == 2 and all(json.loads(h.body)["model"][0] == name[1] for h in hits), name
    # the decode legs carry the params their own model's prefill returned
    assert {json.loads(h.body)["kv_transfer_params"]["remote_engine_id"] for h in routed.hits("da")} == {"pa"}
    assert metric_sum(_scrape(routed), "session_router_pd_fallback_total") == 0
    # no prefill instance of a model: decode-only (counted), not a 404; no decode instance: the 404
    routed.state.pools["prefill"].set_models(routed.state.pools["prefill"].members[0], frozenset({"other"}))
    status, _, body = await ask(routed, "POST", "/v1/completions", json_body={"model": "alpha", "prompt": "x"})
    assert status == 200 and json.loads(body)["backend"] == "da"
    assert metric_sum(_scrape(routed), "session_router_pd_fallback_total", reason="no_prefill") == 1
    status, _, body = await ask(routed, "POST", "/v1/completions", json_body={"model": "other", "prompt": "x"})
    assert status == 404 and json.loads(body)["error"]["param"] == "model"


def _scrape(routed: Any) -> str:
    return generate_latest(routed.state.metrics.registry).decode()


# ------------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def mixed() -> Iterator[tuple[list[Proc], list[Proc]]]:
    """Two session-backend processes per model, and a router on each front before all four."""
    log_dir = tempfile.mkdtemp(prefix="router-models-")
    backends = [start_backend(log_dir, model=model) for model in ("alpha", "alpha", "beta", "beta")]
    routers: list[Proc] = []
    try:
        for front, port in zip(FRONTS, free_ports(len(FRONTS))):
            routers.append(start_router(log_dir, "--front", front, "--log-level", "info",
                                        *[a for b in backends for a in ("--backend", b.url)], port=port))
        for router in routers:  # the first health round has learned every backend's models
            wait_until(lambda: router.log().count("serves models") >= 4, timeout=20, what="models learned")
        yield routers, backends
    finally:
        for proc in [*routers, *backends]:
            proc.stop()


def call(url: str, method: str = "GET", body: Any = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


@pytest.mark.slow
@pytest.mark.parametrize("front", FRONTS)
def test_real_backends_with_different_models(mixed: tuple[list[Proc], list[Proc]], front: str) -> None:
    routers, backends = mixed
    router = routers[FRONTS.index(front)]
    status, _, body = call(router.url + "/v1/models")
    assert status == 200 and sorted(c["id"] for c in json.loads(body)["data"]) == ["alpha", "beta"]
    for i in range(8):  # the issue: 6 of these 8 were a 404
        model = ("alpha", "beta")[i % 2]
        status, headers, body = call(router.url + "/v1/completions", "POST",
                                     {"model": model, "prompt": f"turn {i}", "max_tokens": 2},
                                     {"X-Session-ID": f"{front}-{model}-{i // 2}"})
        assert status == 200, body
        assert json.loads(body)["model"] == model
    # a session sticks to one backend of its model
    for _ in range(3):
        status, _, body = call(router.url + "/v1/chat/completions", "POST",
                               {"model": "beta", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                               {"X-Session-ID": f"{front}-sticky"})
        assert status == 200 and json.loads(body)["model"] == "beta"
    _, _, body = call(router.url + f"/v1/sessions/{front}-sticky")
    session = json.loads(body)
    pin = session["pins"]["default"]
    assert session["requests"] == 3 and session["last_backend"] == pin
    assert pin in (backends[2].url, backends[3].url)
    # a model nobody serves: the router's 404, no backend asked
    before = [metric_sum(call(b.url + "/metrics")[2].decode(), "vllm:request_success_total") for b in backends]
    status, headers, body = call(router.url + "/v1/completions", "POST", {"model": "gamma", "prompt": "x"})
    assert status == 404 and json.loads(body) == {"error": NOT_FOUND} and headers["x-request-id"]
    text = call(router.url + "/metrics")[2].decode()
    assert metric_sum(text, "session_router_requests_total", backend="none", status_class="4xx") >= 1
    assert [metric_sum(call(b.url + "/metrics")[2].decode(), "vllm:request_success_total") for b in backends] == before
    # no model: the backend's own model answers
    status, _, body = call(router.url + "/v1/completions", "POST", {"prompt": "x", "max_tokens": 2})
    assert status == 200 and json.loads(body)["model"] in ("alpha", "beta")
    # a route the router does not name, served by session-backend: forwarded
    status, _, body = call(router.url + "/version")
    assert status == 200 and "version" in json.loads(body)


@pytest.mark.parametrize("front", FRONTS)
async def test_a_model_whose_backends_are_all_down_is_a_503(serve: Serve, front: str) -> None:
    routed = await serve(front, backends=two_models())
    for backend in routed.state.pools["default"].members:
        if backend.models == frozenset({"alpha"}):
            backend.healthy = False
    status, _, body = await ask(routed, "POST", "/v1/completions", json_body={"model": "alpha", "prompt": "x"})
    error = json.loads(body)["error"]
    assert status == 503 and error["type"] == "ServiceUnavailableError"
    assert "pool 'default' for model 'alpha'" in error["message"]
    assert routed.all_hits() == []
    status, _, body = await ask(routed, "POST", "/v1/completions", json_body={"model": "beta", "prompt": "x"})
    assert status == 200

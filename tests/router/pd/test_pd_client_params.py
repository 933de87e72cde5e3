"""Issue 11, item 3 (router side): a client's own ``kv_transfer_params`` reach no backend unless
``trust_client_kv_params = true``: not on the proxied routes, not on either P/D leg, not on the P/D
fallback path. Real backends (or recording fakes) on loopback, in process."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from backends.app import create_app as create_backend_app
from backends.engine.config import EngineConfig
from backends.frontend import ENGINE
from contract.errors import BadRequestError, InvalidJSONError
from router import bodies
from router.app import create_app as create_router_app
from router.config import config_from_mapping
from router.state import ROUTER_STATE
from tests.conftest import MakeRouter
from tests.fakes import EchoBackend
from tests.support import free_port

PLACEHOLDER = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}
PROMPT = "the sea and the river run to the mountain " * 8
DEAD = "127.0.0.9"  # nothing listens there


def router_sample(router: Any, name: str, **labels: str) -> float:
    value = router.server.app[ROUTER_STATE].metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def stripped_count(router: Any, route: str) -> float:
    return router_sample(router, "session_router_kv_params_stripped_total", route=route)


# ---- the body rewrite --------------------------------------------------------------------------


def fields_of(body: bytes) -> bodies.RoutingFields:
    return bodies.decode_routing_fields(body)


@pytest.mark.parametrize("session_aware", [True, False])
def test_a_body_without_the_key_is_forwarded_as_is(session_aware: bool) -> None:
    body = json.dumps({"prompt": "kv_transfer_params is only a word here", "max_tokens": 3}).encode()
    assert bodies.without_kv_transfer_params(body, fields_of(body) if session_aware else None) is None


@pytest.mark.parametrize("session_aware", [True, False])
@pytest.mark.parametrize("raw", [
    b'{"prompt": "x", "kv_transfer_params": {"do_remote_decode": true}, "max_tokens": 3}',
    b'{"prompt": "x", "kv_transfer_params": null, "max_tokens": 3}',
    b'{"prompt": "x", "kv_transfer_param\\u0073": {"do_remote_decode": true}, "max_tokens": 3}',  # escaped key
    b'{"prompt": "x", "kv_transfer_params": {"a": 1}, "kv_transfer_params": {"b": 2}, "max_tokens": 3}',
])
def test_the_key_is_removed_however_it_is_written(raw: bytes, session_aware: bool) -> None:
    out = bodies.without_kv_transfer_params(raw, fields_of(raw) if session_aware else None)
    assert out is not None
    assert msgspec.json.decode(out) == {"prompt": "x", "max_tokens": 3}


def test_only_the_top_level_key_is_removed() -> None:
    raw = json.dumps({"prompt": "x", "vllm_xargs": {"kv_transfer_params": 1}}).encode()
    assert bodies.without_kv_transfer_params(raw, fields_of(raw)) is None


def test_a_plain_body_that_is_not_a_json_object_is_left_to_the_backend() -> None:
    for raw in (b"--boundary\r\nkv_transfer_params\r\n", b'["kv_transfer_params"]', b"\\u0000 not json"):
        assert bodies.without_kv_transfer_params(raw, None) is None


@pytest.mark.parametrize("value", ['"x"', "5", "[]", "true"])
def test_params_of_the_wrong_type_are_a_400_as_at_a_backend(value: str) -> None:
    raw = b'{"prompt": "x", "kv_transfer_params": ' + value.encode() + b"}"
    with pytest.raises(BadRequestError, match="must be an object or null") as err:
        bodies.without_kv_transfer_params(raw, fields_of(raw))
    assert err.value.status == 400 and err.value.param == "kv_transfer_params"


def test_a_body_that_cannot_be_reencoded_is_a_400() -> None:
    raw = b'{"prompt": "x", "temperature": 1e400, "kv_transfer_params": {"do_remote_decode": true}}'
    with pytest.raises(InvalidJSONError, match="kv_transfer_params"):
        bodies.without_kv_transfer_params(raw, fields_of(raw))


# ---- through the router: a `both` backend holds nothing for a client ------------------------------


async def both_behind_router(aiohttp_server: Any, aiohttp_client: Any, **settings: Any) -> tuple[Any, Any]:
    backend = await aiohttp_server(create_backend_app(EngineConfig(role="both", speed=0.0)), host="127.0.0.1")
    config = config_from_mapping({"backends": [{"url": f"http://127.0.0.1:{backend.port}"}],
                                  "health_interval_s": 3600.0, **settings})
    router = await aiohttp_client(create_router_app(config))
    return backend.app, router


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}),
    ("/inference/v1/generate", {"token_ids": list(range(300, 380)), "sampling_params": {"max_tokens": 1}}),
])
async def test_client_params_make_no_backend_hold_blocks(aiohttp_server: Any, aiohttp_client: Any, path: str,
                                                          body: dict[str, Any]) -> None:
    backend, router = await both_behind_router(aiohttp_server, aiohttp_client)
    for i in range(8):  # the eight requests
        resp = await router.post(path, json={**body, "kv_transfer_params": PLACEHOLDER},
                                 headers={"X-Session-ID": f"attacker-{i}"})
        assert resp.status == 200, await resp.text()
        assert (await resp.json()).get("kv_transfer_params") is None
    engine = backend[ENGINE]
    assert engine.core.num_held == 0 and engine.core.kv_cache_usage == 0
    route = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
             "/inference/v1/generate": "generate"}[path]
    assert stripped_count(router, route) == 8
    metrics = await (await router.get("/metrics")).text()
    assert f'session_router_kv_params_stripped_total{{route="{route}"}} 8.0' in metrics


async def test_trusted_client_params_are_forwarded(aiohttp_server: Any, aiohttp_client: Any) -> None:
    backend, router = await both_behind_router(aiohttp_server, aiohttp_client, trust_client_kv_params=True)
    resp = await router.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1,
                                                      "kv_transfer_params": PLACEHOLDER})
    assert resp.status == 200
    params = (await resp.json())["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    assert backend[ENGINE].core.num_held == 1
    assert stripped_count(router, "completions") == 0


# ---- every route, and the P/D legs, seen by recording fakes -----------------------------------------


async def test_plain_routes_are_stripped_and_clean_bodies_pass_byte_for_byte(make_router: MakeRouter) -> None:
    served = await make_router("client")
    fake, router = served.fakes[0], served.client
    assert router is not None
    clean = b'{"prompt":  "hello",   "model": "m"}'
    dirty = b'{"prompt": "hello", "kv_transfer_param\\u0073": {"do_remote_decode": true}}'
    for path in ("/tokenize", "/v1/embeddings"):  # a named plain route, and one the catch-all forwards
        fake.seen.clear()
        for raw in (clean, dirty):
            resp = await router.post(path, data=raw, headers={"Content-Type": "application/json"})
            assert resp.status == 200
        assert fake.seen[0].body == clean  # untouched: the original bytes
        assert json.loads(fake.seen[1].body) == {"prompt": "hello"}
    assert stripped_count(router, "tokenize") == 1 and stripped_count(router, "other") == 1


async def pd_router(aiohttp_server: Any, aiohttp_client: Any, prefill_url: str, **settings: Any) -> tuple[Any, Any]:
    decode = EchoBackend("decode")
    server = await aiohttp_server(decode.app(), host="127.0.0.1")
    config = config_from_mapping({"prefill": [{"url": prefill_url}],
                                  "decode": [{"url": f"http://127.0.0.1:{server.port}"}],
                                  "health_interval_s": 3600.0, "retry_backoff_s": 0.001, **settings})
    return decode, await aiohttp_client(create_router_app(config))


AIMED = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "y", "remote_block_ids": [0],
         "remote_host": "127.0.0.1", "remote_port": 9}


@pytest.mark.parametrize("trust", [False, True])
async def test_the_fallback_path_forwards_no_client_params(aiohttp_server: Any, aiohttp_client: Any,
                                                           trust: bool) -> None:
    decode, router = await pd_router(aiohttp_server, aiohttp_client, f"http://{DEAD}:{free_port()}",
                                     trust_client_kv_params=trust)
    resp = await router.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": AIMED})
    assert resp.status == 200
    # the prefill is found dead by the start-up health check or by the connection itself
    assert sum(router_sample(router, "session_router_pd_fallback_total", reason=r)
               for r in ("connect", "no_prefill")) == 1
    (seen,) = decode.seen
    forwarded = json.loads(seen.body)
    if trust:
        assert forwarded["kv_transfer_params"] == AIMED  # trusted: forwarded as the client sent them
    else:
        assert "kv_transfer_params" not in forwarded and forwarded["prompt"] == PROMPT


async def test_both_legs_carry_only_the_handoffs_params(aiohttp_server: Any, aiohttp_client: Any) -> None:
    prefill = await aiohttp_server(create_backend_app(EngineConfig(role="prefill", speed=0.0)), host="127.0.0.1")
    decode, router = await pd_router(aiohttp_server, aiohttp_client, f"http://127.0.0.1:{prefill.port}")
    resp = await router.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": AIMED})
    assert resp.status == 200
    (seen,) = decode.seen
    params = json.loads(seen.body)["kv_transfer_params"]
    # the prefill's own answer (it held the blocks), not the client's
    assert params["remote_engine_id"] == prefill.app[ENGINE].core.engine_id != AIMED["remote_engine_id"]
    assert params["remote_port"] == prefill.port and prefill.app[ENGINE].core.num_held == 1


async def test_a_body_the_hand_off_cannot_decode_is_a_400_not_a_500(aiohttp_server: Any, aiohttp_client: Any) -> None:
    decode, router = await pd_router(aiohttp_server, aiohttp_client, f"http://{DEAD}:{free_port()}")
    resp = await router.post("/v1/completions", data=b'{"prompt": "x", "max_tokens": 4, "temperature": 1e400}',
                             headers={"Content-Type": "application/json"})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["code"] == 400 and "P/D hand-off" in error["message"]
    assert decode.seen == []  # answered by the router, no leg sent

"""A client that disconnects during either P/D leg aborts the work on the instance that holds it.

The router and both backends run in process on real loopback sockets (the router with
``handler_cancellation``, as its CLI runs it): the engines are inspected directly.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

from backends.app import create_app as create_backend_app
from backends.engine.config import EngineConfig
from backends.frontend import ENGINE, FRONTEND
from router.app import create_app as create_router_app
from router.config import config_from_mapping
from router.state import ROUTER_STATE
from tests.support import eventually


wait_for = functools.partial(eventually, timeout=10.0)


async def topology(aiohttp_server: Any, aiohttp_client: Any, prefill_speed: float,
                   decode_speed: float) -> tuple[Any, Any, Any]:
    servers = []
    for role, speed in (("prefill", prefill_speed), ("decode", decode_speed)):
        app = create_backend_app(EngineConfig(role=role, speed=speed))
        servers.append(await aiohttp_server(app, host="127.0.0.1"))  # handler_cancellation is on
    prefill, decode = servers
    config = config_from_mapping({"prefill": [{"url": str(prefill.make_url("/")).rstrip("/")}],
                                  "decode": [{"url": str(decode.make_url("/")).rstrip("/")}]})
    router = await aiohttp_client(create_router_app(config), server_kwargs={"handler_cancellation": True})
    return prefill.app, decode.app, router


def router_idle(router: Any) -> bool:
    state = router.server.app[ROUTER_STATE]
    return all(b.in_flight == 0 for pool in state.all_pools() for b in pool.members)


async def test_disconnect_during_the_prefill_leg_aborts_the_prefill(aiohttp_server: Any, aiohttp_client: Any) -> None:
    prefill, decode, router = await topology(aiohttp_server, aiohttp_client, prefill_speed=20.0, decode_speed=0.0)
    p_engine, d_engine = prefill[ENGINE], decode[ENGINE]
    body = {"token_ids": [4 + i % 389 for i in range(1500)], "sampling_params": {"max_tokens": 8}}
    task = asyncio.create_task(router.post("/inference/v1/generate", json=body, headers={"X-Session-ID": "pd-gone"}))
    await wait_for(lambda: p_engine.num_running == 1, what="the prefill leg to run")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: p_engine.metrics.request_success["abort"] == 1 and p_engine.num_running == 0,
                   what="the prefill engine to abort the request")
    assert p_engine.core.num_held == 0 and p_engine.core.kv_cache_usage == 0
    assert prefill[FRONTEND].in_flight == 0
    await wait_for(lambda: router_idle(router), what="the router's in-flight counts to return to 0")
    # the decode leg never started
    assert sum(d_engine.metrics.request_success.values()) == 0 and d_engine.num_running == 0


async def test_disconnect_during_the_decode_leg_aborts_the_decode(aiohttp_server: Any, aiohttp_client: Any) -> None:
    prefill, decode, router = await topology(aiohttp_server, aiohttp_client, prefill_speed=0.0, decode_speed=1.0)
    p_engine, d_engine = prefill[ENGINE], decode[ENGINE]
    body = {"messages": [{"role": "user", "content": "tell me a long story about the sea " * 6}],
            "max_tokens": 500, "ignore_eos": True, "stream": True}
    resp = await router.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "pd-gone"})
    assert resp.status == 200
    first = await resp.content.readline()
    assert first.startswith(b"data: ")
    assert d_engine.num_running == 1
    resp.close()
    await wait_for(lambda: d_engine.metrics.request_success["abort"] == 1 and d_engine.num_running == 0,
                   what="the decode engine to abort the request")
    assert d_engine.core.kv_cache_usage == 0 and decode[FRONTEND].in_flight == 0
    await wait_for(lambda: router_idle(router), what="the router's in-flight counts to return to 0")
    # the prefill leg had finished and its blocks were pulled (so freed) before decoding began
    assert p_engine.metrics.request_success["length"] == 1 and p_engine.core.num_held == 0
    assert decode[FRONTEND].kv is not None and decode[FRONTEND].kv.metrics.pulls == 1

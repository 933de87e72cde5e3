"""Issue 11, item 3 (P/D): when the decode leg fails or the client leaves before it completed, the
router tells the prefill instance to free the blocks it holds for that decode
(``POST /internal/kv/release``) at once, instead of after the hold timeout (480 s here, the
default). A real prefill backend and a real or scripted decode on loopback, in process."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

from backends.app import create_app as create_backend_app
from backends.engine.config import EngineConfig
from backends.frontend import ENGINE
from router.app import PROXY
from router.app import create_app as create_router_app
from router.config import config_from_mapping
from router.pd import Handoff
from router.state import ROUTER_STATE
from tests.fakes import EchoBackend
from tests.support import eventually

wait_for = functools.partial(eventually, timeout=10.0)
BODY = {"prompt": "the sea and the river run to the mountain " * 8, "max_tokens": 4}


def releases(router: Any, result: str) -> float:
    registry = router.server.app[ROUTER_STATE].metrics.registry
    return registry.get_sample_value("session_router_pd_kv_releases_total", {"result": result}) or 0.0


async def topology(aiohttp_server: Any, aiohttp_client: Any, decode_url: str | None = None,
                   fake: EchoBackend | None = None, **settings: Any) -> tuple[Any, Any]:
    """A prefill backend (480 s hold timeout), one decode (a fake, or ``decode_url``) and a router."""
    prefill = await aiohttp_server(create_backend_app(EngineConfig(role="prefill", speed=0.0)), host="127.0.0.1")
    if fake is not None:
        decode_url = f"http://127.0.0.1:{(await aiohttp_server(fake.app(), host='127.0.0.1')).port}"
    config = config_from_mapping({"prefill": [{"url": f"http://127.0.0.1:{prefill.port}"}],
                                  "decode": [{"url": decode_url}], "health_interval_s": 3600.0,
                                  "retry_backoff_s": 0.001, **settings})
    router = await aiohttp_client(create_router_app(config), server_kwargs={"handler_cancellation": True})
    engine = prefill.app[ENGINE]
    assert engine.config.kv_hold_timeout_s == 480.0
    return engine, router


async def released_promptly(engine: Any, router: Any) -> None:
    await wait_for(lambda: engine.core.num_held == 0 and releases(router, "released") == 1,
                   what="the prefill's held blocks to be released")
    assert engine.core.kv_cache_usage == 0 and engine.core.holds.freed["released"] == 1
    assert engine.core.holds.freed["expired"] == 0


@pytest.mark.parametrize("status", [500, 503, 400])
async def test_a_decode_leg_answering_an_error_releases(aiohttp_server: Any, aiohttp_client: Any,
                                                        status: int) -> None:
    fake = EchoBackend("decode", status=status)
    engine, router = await topology(aiohttp_server, aiohttp_client, fake=fake)
    resp = await router.post("/v1/completions", json=BODY, headers={"X-Session-ID": "rel"})
    assert resp.status == status
    assert fake.seen and b'"do_remote_prefill":true' in fake.seen[-1].body  # the decode got the hand-off
    await released_promptly(engine, router)


async def test_an_unreachable_decode_releases(aiohttp_server: Any, aiohttp_client: Any) -> None:
    """The decode instance is up when the router checks it, gone when the decode leg connects."""
    fake = EchoBackend("decode")
    server = await aiohttp_server(fake.app(), host="127.0.0.1")
    engine, router = await topology(aiohttp_server, aiohttp_client, decode_url=f"http://127.0.0.1:{server.port}")
    health = router.server.app[ROUTER_STATE].health
    await wait_for(lambda: health is not None and health.rounds >= 1, what="the router's first health round")
    await server.close()
    resp = await router.post("/v1/completions", json=BODY)
    assert resp.status in (502, 503)  # refused; retried until no decode instance is left
    assert not fake.seen
    await released_promptly(engine, router)
    assert router_errors(router, "connect") >= 1


def router_errors(router: Any, reason: str) -> float:
    registry = router.server.app[ROUTER_STATE].metrics.registry
    return sum(s.value for m in registry.collect() if m.name == "session_router_upstream_errors"
               for s in m.samples if s.labels.get("reason") == reason)


async def test_a_decode_leg_timing_out_releases(aiohttp_server: Any, aiohttp_client: Any) -> None:
    fake = EchoBackend("decode", stall=True)
    engine, router = await topology(aiohttp_server, aiohttp_client, fake=fake, first_byte_timeout_s=0.3, retries=0)
    resp = await router.post("/v1/completions", json=BODY)
    assert resp.status == 504
    await released_promptly(engine, router)


async def test_a_client_leaving_between_the_legs_releases(aiohttp_server: Any, aiohttp_client: Any) -> None:
    fake = EchoBackend("decode", stall=True)
    engine, router = await topology(aiohttp_server, aiohttp_client, fake=fake)
    task = asyncio.create_task(router.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": BODY["prompt"]}], "max_tokens": 4, "stream": True}))
    await asyncio.wait_for(fake.stalled.wait(), 10)  # the prefill is done and holds; the decode leg waits
    assert engine.core.num_held == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await released_promptly(engine, router)
    await wait_for(fake.cancelled.is_set, what="the decode leg to be cancelled")


async def test_a_successful_decode_releases_nothing(aiohttp_server: Any, aiohttp_client: Any) -> None:
    decode = await aiohttp_server(create_backend_app(EngineConfig(role="decode", speed=0.0)), host="127.0.0.1")
    engine, router = await topology(aiohttp_server, aiohttp_client, decode_url=f"http://127.0.0.1:{decode.port}")
    for stream in (False, True):
        resp = await router.post("/v1/completions", json={**BODY, "stream": stream})
        assert resp.status == 200
        await resp.read()
    assert engine.core.holds.freed["pulled"] == 2 and engine.core.num_held == 0
    assert sum(releases(router, r) for r in ("released", "not_held", "failed")) == 0


async def test_a_release_after_the_pull_finds_nothing(aiohttp_server: Any, aiohttp_client: Any) -> None:
    """A decode that pulled, then failed mid-stream: the release is sent and answered 404 (not_held)."""
    fake = EchoBackend("decode", break_after=1)
    engine, router = await topology(aiohttp_server, aiohttp_client, fake=fake)
    resp = await router.post("/v1/completions", json={**BODY, "stream": True})
    assert resp.status == 200
    await resp.read()
    # the fake pulled nothing, so here the blocks are still held and the release frees them
    await released_promptly(engine, router)
    # a second release of the same hand-off (what a pulled one gets) is a 404, counted as not_held
    app = router.server.app
    pd = app[PROXY].pd
    assert pd is not None
    params = {"remote_engine_id": engine.core.engine_id, "remote_request_id": "gone", "remote_block_ids": [1]}
    pd.release(Handoff(b"", params, app[ROUTER_STATE].pools["prefill"].members[0]))
    await wait_for(lambda: releases(router, "not_held") == 1, what="the release to be answered 404")

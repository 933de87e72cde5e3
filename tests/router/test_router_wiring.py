"""The app factory's wiring: the proxy and the P/D hand-off are given their collaborators (not the
app's state), the health checker exists before the app runs, the raw front's connections get a
frozen settings object and callbacks (not the front), and the app's one error middleware answers
what handlers raise in OpenAI's error shape with ``X-Request-Id``."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from aiohttp import web

from router.app import PROXY, build_proxy, build_state, create_admin_app, create_app, error_middleware
from router.config import BackendConfig, RouterConfig
from tests.support import router_config
from router.front.server import RawFront
from router.front.settings import ConnectionSettings
from router.health import HealthChecker
from router.membership import POOL_PREFILL
from router.state import ROUTER_STATE

#: nothing listens there: the health checker never gets to it in these tests
DEAD = "http://127.0.0.9:9"


def test_the_health_checker_exists_before_the_app_runs() -> None:
    state = build_state(RouterConfig(backends=[BackendConfig(DEAD)]))
    assert isinstance(state.health, HealthChecker)
    assert not state.health.running  # started by the app's lifecycle, with the app's client


def test_the_proxy_is_given_the_state_s_collaborators() -> None:
    state = build_state(RouterConfig(backends=[BackendConfig(DEAD)]))
    proxy = build_proxy(state)
    assert not hasattr(proxy, "state")
    assert proxy.pool is state.serving_pool
    assert proxy.health is state.health
    assert proxy.sessions is state.sessions and proxy.responses is state.responses
    assert proxy.upstream is state.upstream and proxy.metrics is state.metrics and proxy.policy is state.policy
    assert proxy.request_ids is state.request_ids
    assert proxy.pd is None


def test_the_pd_handoff_is_given_the_prefill_pool_and_the_same_health_checker() -> None:
    config = RouterConfig(prefill=[BackendConfig(DEAD, name="p")], decode=[BackendConfig("http://127.0.0.9:10", name="d")])
    state = build_state(config)
    proxy = build_proxy(state)
    assert proxy.pd is not None and not hasattr(proxy.pd, "state")
    assert proxy.pd.prefill_pool is state.pools[POOL_PREFILL]
    assert proxy.pd.health is state.health and proxy.pd.upstream is state.upstream
    assert proxy.pd.fallback is config.pd.fallback


async def test_raw_connections_get_frozen_settings_and_hooks_not_the_front() -> None:
    app = create_app(router_config(backends=[BackendConfig(DEAD)], max_body_bytes=1234, body_timeout_s=7.0))
    front = RawFront(app[PROXY], "127.0.0.1", 9, max_body_bytes=1234, body_timeout_s=7.0)
    try:
        settings = front.settings
        assert (settings.max_body_bytes, settings.body_timeout_s) == (1234, 7.0)
        with pytest.raises(dataclasses.FrozenInstanceError):
            settings.max_body_bytes = 1  # type: ignore[misc]
        assert not hasattr(ConnectionSettings(1, 1.0, b"x", frozenset()), "__dict__")  # slots
        assert front.hooks.handle == app[PROXY].handle
        assert front.hooks.ids is app[ROUTER_STATE].request_ids
    finally:
        await front.relay.close()


async def test_both_apps_answer_raised_errors_through_the_one_middleware(aiohttp_client: Any) -> None:
    config = router_config(backends=[BackendConfig(DEAD)], health_interval_s=3600.0, admin_port=1,
                          admin_token="t0k3n")
    app = create_app(config)
    admin = create_admin_app(app)
    assert error_middleware in app.middlewares and error_middleware in admin.middlewares
    client = await aiohttp_client(app)
    admin_client = await aiohttp_client(admin)

    resp = await client.get("/v1/completions", headers={"X-Request-Id": "rid-405"})  # a POST route
    assert resp.status == 405
    assert resp.headers["Content-Type"] == "application/json"
    assert resp.headers["X-Request-Id"] == "rid-405"
    assert json.loads(await resp.read()) == {"error": {
        "message": "method GET is not allowed on /v1/completions", "type": "MethodNotAllowedError",
        "param": None, "code": 405}}

    resp = await client.get("/v1/sessions/nope")
    assert resp.status == 404 and resp.headers["X-Request-Id"]
    assert json.loads(await resp.read())["error"]["type"] == "NotFoundError"

    resp = await admin_client.get("/admin/backends")  # no token
    assert resp.status == 401 and resp.headers["X-Request-Id"]
    assert json.loads(await resp.read())["error"]["type"] == "AuthenticationError"


async def test_the_middleware_leaves_other_answers_and_exceptions_alone() -> None:
    request: Any = object()

    async def ok(_: web.Request) -> web.StreamResponse:
        return web.Response(text="fine")

    async def http_error(_: web.Request) -> web.StreamResponse:
        raise web.HTTPRequestEntityTooLarge(max_size=1, actual_size=2)

    assert (await error_middleware(request, ok)).text == "fine"
    with pytest.raises(web.HTTPRequestEntityTooLarge):
        await error_middleware(request, http_error)

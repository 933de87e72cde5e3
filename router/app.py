"""The router's app factory: state, the data path's wiring, lifecycle (``cleanup_ctx``), routes, and
the app's one error middleware.

Errors: a handler of the app (``router.endpoints``, ``router.admin``, the router's 404/405) raises a
``SessionRouterError`` and ``error_middleware`` answers it in OpenAI's shape; every answer gets
``X-Request-Id`` in ``_stamp_request_id``. The proxied routes answer their own errors (front-agnostic,
``Proxy._error``), so nothing reaches the middleware from them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from contract.errors import MethodNotAllowedError, NotFoundError, SessionRouterError
from router import admin, endpoints
from router.access_log import AccessLog
from router.backend_changes import BackendChanges
from router.config import RouterConfig
from router.discovery.metrics import DiscoveryMetrics
from router.discovery.service import Discovery
from router.exchange import REQUEST_ID_HEADER
from router.front.aiohttp_adapter import proxy_handler
from router.health import HealthChecker
from router.kv.index import KVIndex
from router.kv.metrics import KVMetrics
from router.kv.service import KVEvents
from router.membership import POOL_DECODE, POOL_DEFAULT, POOL_PREFILL, Backend, BackendPool, normalize_url
from router.metrics import RouterMetrics
from router.engine_load import EngineLoad
from router.placement import build_policy
from router.pd import PDHandoff
from router.proxy import Proxy, response_drops
from router.routes import OTHER, ROUTES
from router.sessions.responses import ResponseIndex
from router.sessions.table import SessionTable
from router.shared import Agreement, SharedState
from router.shared.metrics import SharedMetrics
from router.state import ROUTER_STATE, RouterState
from router.tokens.render_client import POOL_RENDER, RemoteRenderer, build_render_pool

if TYPE_CHECKING:
    from router.tokens.mode import TokensMode
from router.upstream import UpstreamLimits, UpstreamPool, UpstreamTimeouts

#: the app's ``Proxy``: the raw front (``router.front``) serves the hot routes through the same one
PROXY: web.AppKey[Proxy] = web.AppKey("proxy", Proxy)
#: tokens mode's model, renderer and handlers (absent in text mode)
TOKENS: web.AppKey[TokensMode] = web.AppKey("tokens")
#: the discovery sources of the pools not configured static (absent when every pool is)
DISCOVERY: web.AppKey[Discovery] = web.AppKey("discovery", Discovery)
#: the subscriptions to the engines' KV events (absent with [kv_events] enabled = false)
KV_EVENTS: web.AppKey[KVEvents] = web.AppKey("kv_events", KVEvents)
#: the shared state of replicas and workers in Redis (absent without shared_state)
SHARED_STATE: web.AppKey[SharedState] = web.AppKey("shared_state", SharedState)


def build_pools(config: RouterConfig) -> dict[str, BackendPool]:
    """The backend pools, and in tokens mode with render servers the ``render`` pool beside them (the
    one health checker and the metrics see it as they see backends)."""
    pools: dict[str, BackendPool]
    if config.pd_mode:
        pools = {
            POOL_PREFILL: BackendPool(POOL_PREFILL, [Backend(b.url, name=b.name) for b in config.prefill]),
            POOL_DECODE: BackendPool(POOL_DECODE, [Backend(b.url, name=b.name) for b in config.decode]),
        }
    else:
        pools = {POOL_DEFAULT: BackendPool(POOL_DEFAULT, [Backend(b.url, name=b.name) for b in config.backends])}
    if config.tokens.enabled and (config.tokens.render_urls or config.discovery.render.source != "static"):
        pools[POOL_RENDER] = build_render_pool(config.tokens.render_urls)
    return pools


def build_state(config: RouterConfig, registry: CollectorRegistry | None = None) -> RouterState:
    metrics = RouterMetrics(registry or CollectorRegistry(), top_k=config.sessions.metrics_top_k,
                            session_label=config.sessions.label)
    sessions = SessionTable(config.sessions.max_sessions, config.sessions.ttl_s)
    sessions.on_evict = metrics.session_evicted
    pools = build_pools(config)
    kv = build_kv_index(config, sessions)
    health = HealthChecker.from_config(
        config, list(pools.values()),
        on_change=lambda backend, healthy: metrics.health_transitions.labels(
            backend.name, "healthy" if healthy else "unhealthy").inc(),
        # kv_aware reads the engines' own load and learns their speed from their /metrics
        engine_load=EngineLoad(learn=config.placement.learn, prefill_tokens_per_s=config.placement.prefill_tokens_per_s,
                               per_request_step_s=config.placement.per_request_step_s)
        if config.placement.policy == "kv_aware" else None,
    )
    state = RouterState(
        config=config,
        pools=pools,
        policy=build_policy(config.placement, kv=kv, pin_counts=sessions.pin_counts),
        sessions=sessions,
        responses=ResponseIndex(config.sessions.max_response_ids),
        metrics=metrics,
        upstream=UpstreamPool(UpstreamTimeouts(config.upstream.connect_timeout_s, config.upstream.first_byte_timeout_s,
                                               config.upstream.total_timeout_s),
                              UpstreamLimits(max_idle_per_host=config.upstream.max_idle_per_host,
                                             max_head_bytes=config.upstream.max_head_bytes,
                                             max_body_bytes=config.upstream.max_body_bytes),
                              drop_headers=response_drops(config.sessions.header)),
        health=health,
        changes=BackendChanges(pools, health, config.drain_timeout_s),
        access_log=AccessLog(config.front.access_log, config.front.access_log_file) if config.front.access_log != "off" else None,
        kv=kv,
    )
    metrics.attach_live(state.all_pools, sessions)
    upstream = state.upstream
    metrics.attach_upstream(lambda: upstream.connects, upstream.stats)
    return state


def build_kv_index(config: RouterConfig, sessions: SessionTable) -> KVIndex | None:
    """The KV index placement reads (None with ``[kv_events] enabled = false``); a session that
    leaves the table is forgotten by it."""
    if config.kv_events.enabled is False:
        return None
    index = KVIndex(max_blocks=config.kv_events.max_blocks, block_size_hint=config.kv_events.block_size)
    sessions.add_evict_hook(lambda entry, _reason: index.forget_session(entry.session_id))
    return index


def build_kv_events(state: RouterState) -> KVEvents | None:
    """The subscriptions feeding ``state.kv``: every pool's backends but the render servers', and the
    ones joining at runtime (``state.changes``); their metrics on the router's registry."""
    if state.kv is None:
        return None
    config = state.config
    metrics = KVMetrics(state.kv)
    state.metrics.registry.register(metrics)
    configured = {normalize_url(b.url): b for b in (*config.backends, *config.prefill, *config.decode)}
    events = KVEvents(state.kv, config.kv_events,
                      lambda: [pool for name, pool in state.pools.items() if name != POOL_RENDER], metrics,
                      configured=configured, request_timeout_s=config.health.timeout_s)
    state.changes.subscribe(events)
    state.health.add_change_hook(events.health_changed)
    return events


def build_proxy(state: RouterState) -> Proxy:
    """The data path, given its collaborators from ``state`` (and the P/D hand-off in P/D mode)."""
    config = state.config
    pd = None
    if config.pd_mode:
        pd = PDHandoff(state.pools[POOL_PREFILL], policy=state.policy, metrics=state.metrics,
                       upstream=state.upstream, health=state.health, fallback=config.pd.fallback)
    proxy = Proxy(config, pool=state.serving_pool, policy=state.policy, sessions=state.sessions,
                  responses=state.responses, metrics=state.metrics, upstream=state.upstream, health=state.health,
                  request_ids=state.request_ids, access_log=state.access_log, pd=pd)
    proxy.kv = state.kv
    return proxy


def build_shared(state: RouterState, proxy: Proxy) -> SharedState | None:
    """The off-first-choice metric on every router, and with ``shared_state`` the Redis the proxy
    writes pin moves and Responses ids to and reads them from (``router.shared``)."""
    config = state.config
    agreement = proxy.agreement = Agreement(refresh_s=config.sessions.ttl_s / 2)
    metrics = SharedMetrics(agreement.counts, shared=bool(config.shared_state.url))
    state.metrics.registry.register(metrics)
    if not config.shared_state.url:
        return None
    shared = SharedState(config.shared_state, sessions=state.sessions, responses=state.responses, metrics=metrics,
                         pool=proxy.pool, ttl_s=config.sessions.ttl_s,
                         max_response_ids=config.sessions.max_response_ids)
    agreement.shared = proxy.shared = shared
    return shared


def build_tokens(state: RouterState, proxy: Proxy) -> TokensMode:
    """Tokens mode (``[tokens] upstream_api = "tokens"``): the model, the renderer and the handlers the
    proxy calls for chat and completions instead of forwarding (set on ``proxy.tokens``). Imported here:
    text mode never loads the tokenizer and template libraries."""
    from router.tokens.mode import build_tokens_mode

    mode = build_tokens_mode(state.config, proxy, render_pool=state.pools.get(POOL_RENDER),
                             upstream=state.upstream, health=state.health, sessions=state.sessions,
                             metrics=state.metrics)
    proxy.tokens = mode.handlers()
    from router.tokens.render_routes import side_handlers  # /v1/responses, /tokenize, /detokenize

    remote = mode.renderer if isinstance(mode.renderer, RemoteRenderer) else None
    proxy.tokens.update(side_handlers(proxy.tokens["chat"], mode.model,
                                      mode.local.renderer if mode.local is not None else None, remote,
                                      state.config.sessions.header))
    return mode


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[ROUTER_STATE]
    state.http = aiohttp.ClientSession(auto_decompress=False)
    state.health.start(state.http)
    sweeper = asyncio.create_task(_sweep_sessions(state))
    kv_events = app.get(KV_EVENTS)
    if kv_events is not None:
        kv_events.start(state.http)
    discovery = app.get(DISCOVERY)
    if discovery is not None:
        discovery.start()
    shared = app.get(SHARED_STATE)
    if shared is not None:
        shared.start()
        await shared.joined()  # before the process listens: its first requests read what the others wrote
    try:
        yield
    finally:
        if shared is not None:
            await shared.stop()
        if discovery is not None:
            await discovery.stop()
        if kv_events is not None:
            await kv_events.stop()
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        await state.health.stop()
        await state.upstream.close()
        await state.http.close()
        if state.access_log is not None:
            state.access_log.close()


async def _sweep_sessions(state: RouterState) -> None:
    interval = max(0.5, min(60.0, state.config.sessions.ttl_s / 10))
    while True:
        await asyncio.sleep(interval)
        state.sessions.sweep()


def _catch_all(proxy: Proxy) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Every request no route matched: forwarded to a backend (``OTHER``) unless it is the router's
    own path or denied (``Proxy.forwards``), then the router's 404/405."""
    forward = proxy_handler(proxy, OTHER)

    async def handle(request: web.Request) -> web.StreamResponse:
        if proxy.forwards(request.raw_path):
            return await forward(request)
        return await _not_found(request)

    return handle


async def _not_found(request: web.Request) -> web.Response:
    known = {r.path for r in ROUTES} | {"/health", "/metrics", "/v1/models", "/v1/sessions"}
    if request.path in known:
        raise MethodNotAllowedError(f"method {request.method} is not allowed on {request.path}")
    raise NotFoundError(f"no route {request.method} {request.path}: not a route of the router, and not "
                        "forwarded to backends (proxy_deny, or a path with empty or dot segments); "
                        "see the README for the router's routes")


@web.middleware
async def error_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
    """A ``SessionRouterError`` raised by a handler: its status and OpenAI's error body."""
    try:
        return await handler(request)
    except SessionRouterError as exc:
        return web.Response(status=exc.status, body=exc.body(), content_type="application/json")


async def _stamp_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer of the aiohttp app carries ``X-Request-Id`` (the client's, else a new one), as the
    proxied routes' answers do: the router's own routes, the admin API and their errors alike."""
    if REQUEST_ID_HEADER not in response.headers:
        response.headers[REQUEST_ID_HEADER] = (request.headers.get(REQUEST_ID_HEADER)
                                               or request.app[ROUTER_STATE].request_ids.next())


def create_app(config: RouterConfig, *, registry: CollectorRegistry | None = None) -> web.Application:
    app = web.Application(client_max_size=config.front.max_body_bytes, middlewares=[error_middleware])
    state = build_state(config, registry)
    app[ROUTER_STATE] = state
    app.cleanup_ctx.append(_lifecycle)
    app.on_response_prepare.append(_stamp_request_id)
    proxy = app[PROXY] = build_proxy(state)
    shared = build_shared(state, proxy)
    if shared is not None:
        app[SHARED_STATE] = shared
    kv_events = build_kv_events(state)
    if kv_events is not None:
        app[KV_EVENTS] = kv_events
    if config.discovery.pools():
        discovery_metrics = DiscoveryMetrics()
        discovery_metrics.register(state.metrics.registry)
        app[DISCOVERY] = Discovery(config.discovery, state.changes, discovery_metrics)
    if config.tokens.enabled:
        app[TOKENS] = build_tokens(state, proxy)
        app[endpoints.TOKENS_MODEL] = app[TOKENS].model
    for route in ROUTES:
        app.router.add_post(route.path, proxy_handler(proxy, route))
    app.router.add_get("/health", endpoints.health)
    app.router.add_get("/v1/models", endpoints.models)
    app.router.add_get("/metrics", endpoints.metrics)
    app.router.add_get("/v1/sessions/{session_id}", endpoints.get_session)
    app.router.add_delete("/v1/sessions/{session_id}", endpoints.delete_session)
    if admin.on_data_port(config):  # GET /v1/sessions (every session) is an admin action
        admin.add_admin_routes(app, config)
    else:
        admin.add_unserved_routes(app, config)
    app.router.add_route("*", "/{tail:.*}", _catch_all(proxy))
    return app


def create_admin_app(main_app: web.Application) -> web.Application:
    """The admin API on its own app, sharing the main app's state (for ``admin_port``)."""
    app = web.Application(middlewares=[error_middleware])
    state = app[ROUTER_STATE] = main_app[ROUTER_STATE]
    app.on_response_prepare.append(_stamp_request_id)
    admin.add_admin_routes(app, state.config)
    app.router.add_route("*", "/{tail:.*}", _not_found)
    return app

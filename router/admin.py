"""Admin API: list, add, and drain-and-remove backends; bearer-token protected when configured."""

from __future__ import annotations

import asyncio
import hmac

import msgspec
from aiohttp import web

from router.errors import AuthenticationError, BadRequestError, ConfigError, NotFoundError, SessionRouterError
from router.pool import POOL_DEFAULT, Backend
from router.state import ROUTER_STATE, RouterState
from router.api import error_response, json_response


class AddBackend(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    name: str = ""
    pool: str = POOL_DEFAULT


class BackendView(msgspec.Struct):
    name: str
    url: str
    pool: str
    healthy: bool
    draining: bool
    in_flight: int
    reported_load: float


def _view(backend: Backend) -> BackendView:
    return BackendView(backend.name, backend.url, backend.pool, backend.healthy, backend.draining,
                       backend.in_flight, backend.reported_load)


def _authorize(request: web.Request, state: RouterState) -> None:
    token = state.config.admin_token
    if not token:
        return
    supplied = request.headers.get("Authorization", "")
    expected = "Bearer " + token
    if not hmac.compare_digest(supplied.encode(), expected.encode()):
        raise AuthenticationError("the admin API needs 'Authorization: Bearer <admin_token>'")


async def list_backends(request: web.Request) -> web.Response:
    state = request.app[ROUTER_STATE]
    try:
        _authorize(request, state)
    except SessionRouterError as exc:
        return error_response(exc)
    return json_response({"data": [_view(b) for pool in state.pools.values() for b in pool.members]})


async def add_backend(request: web.Request) -> web.Response:
    state = request.app[ROUTER_STATE]
    try:
        _authorize(request, state)
        try:
            spec = msgspec.json.decode(await request.read(), type=AddBackend)
        except msgspec.MsgspecError as exc:
            raise BadRequestError(f"invalid backend: {exc}; send {{\"url\": \"http://host:port\"}}") from None
        pool = state.pools.get(spec.pool)
        if pool is None:
            raise BadRequestError(f"unknown pool {spec.pool!r}; pools: {', '.join(state.pools)}")
        try:
            backend = pool.add(Backend(spec.url, name=spec.name))
        except ConfigError as exc:
            raise BadRequestError(str(exc)) from None
        if state.health is not None:
            await state.health.check_backend(backend)
    except SessionRouterError as exc:
        return error_response(exc)
    return json_response(_view(backend), status=201)


async def remove_backend(request: web.Request) -> web.Response:
    """Drain (no new requests), wait for in-flight ones up to ``drain_timeout_s``, then remove."""
    state = request.app[ROUTER_STATE]
    name = request.match_info["name"]
    try:
        _authorize(request, state)
        backend = state.find_backend(name)
        if backend is None:
            raise NotFoundError(f"no backend named {name!r}; GET /admin/backends lists them")
    except SessionRouterError as exc:
        return error_response(exc)
    backend.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.config.drain_timeout_s
    while backend.in_flight > 0 and loop.time() < deadline:
        await asyncio.sleep(0.05)
    drained = backend.in_flight == 0
    state.pools[backend.pool].remove(backend.url)
    return json_response({"name": backend.name, "url": backend.url, "removed": True, "drained": drained})


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/backends", list_backends)
    app.router.add_post("/admin/backends", add_backend)
    app.router.add_delete("/admin/backends/{name:.+}", remove_backend)

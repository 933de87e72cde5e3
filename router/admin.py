"""Admin API: list, add, and drain-and-remove backends, and list every session; bearer-token protected.

Where it is served (``router.app``):

- ``admin_port`` set: only on its own listener on ``admin_host`` (default 127.0.0.1), with the
  token when ``admin_token`` is set (start-up refuses a non-loopback ``admin_host`` without one);
- ``admin_port = 0`` and ``admin_token`` set: on the data port, every call with
  ``Authorization: Bearer <admin_token>``;
- neither: nowhere (404 naming the settings).

``GET /v1/sessions`` (every session, with its id) is an admin action and lives with the admin API;
``GET``/``DELETE /v1/sessions/{id}`` stay on the data port for anyone holding the id.
Errors are raised (``contract.errors``); the app's ``error_middleware`` answers them.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from contract.errors import AuthenticationError, BadRequestError, ConfigError, NotFoundError, PermissionDeniedError
from router import endpoints
from router.backend_allow import BackendAllowList, BackendNotAllowed
from router.config import RouterConfig
from router.endpoints import json_response
from router.membership import POOL_DEFAULT, Backend
from router.state import ROUTER_STATE, RouterState

#: bounds on what POST /admin/backends accepts
MAX_NAME_CHARS = 128
MAX_URL_CHARS = 512
#: the parsed ``admin_backend_allow`` of the app serving the admin API
BACKEND_ALLOW: web.AppKey[BackendAllowList] = web.AppKey("backend_allow", BackendAllowList)


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
    #: the engine's own load at the last scrape of its /metrics (router.engine_load; 0 when not scraped)
    engine_waiting: float = 0.0
    engine_running: float = 0.0
    kv_usage: float = 0.0
    #: kv_aware's constants learned from it (null: not learned, and the configured value applies; or
    #: too fast to measure, for the prefill rate)
    step_s: float | None = None
    prefill_tokens_per_s: float | None = None
    #: tokens a request generates there on average (null: not learned yet); the KV cache's size in
    #: tokens (0: the engine does not say): what kv_aware's fit check reads
    output_tokens: float | None = None
    kv_capacity_tokens: int = 0


def _view(backend: Backend) -> BackendView:
    per_token = backend.prefill_s_per_token
    return BackendView(backend.name, backend.url, backend.pool, backend.healthy, backend.draining,
                       backend.in_flight, backend.reported_load, backend.engine_waiting, backend.engine_running,
                       backend.kv_usage, backend.step_s if backend.step_s >= 0 else None,
                       1.0 / per_token if per_token > 0 else None,
                       backend.output_tokens if backend.output_tokens > 0 else None, backend.kv_capacity_tokens)


def _authorize(request: web.Request, state: RouterState) -> None:
    token = state.config.admin.token
    if not token:
        return
    supplied = request.headers.get("Authorization", "")
    expected = "Bearer " + token
    if not hmac.compare_digest(supplied.encode(), expected.encode()):
        raise AuthenticationError("the admin API needs 'Authorization: Bearer <admin_token>'")


async def list_backends(request: web.Request) -> web.Response:
    state = request.app[ROUTER_STATE]
    _authorize(request, state)
    return json_response({"data": [_view(b) for pool in state.pools.values() for b in pool.members]})


async def add_backend(request: web.Request) -> web.Response:
    state = request.app[ROUTER_STATE]
    _authorize(request, state)
    try:
        spec = msgspec.json.decode(await request.read(), type=AddBackend)
    except msgspec.MsgspecError as exc:
        raise BadRequestError(f"invalid backend: {exc}; send {{\"url\": \"http://host:port\"}}") from None
    pool = state.pools.get(spec.pool)
    if pool is None:
        raise BadRequestError(f"unknown pool {spec.pool!r}; pools: {', '.join(state.pools)}", param="pool")
    candidate = _new_backend(spec)
    _check_unique(candidate, spec.pool, state)
    try:
        await request.app[BACKEND_ALLOW].check(candidate.host, candidate.port)
    except BackendNotAllowed as exc:
        raise PermissionDeniedError(str(exc), param="url") from None
    _check_unique(candidate, spec.pool, state)  # again: a concurrent call may have added it meanwhile
    # checked before it takes traffic; unique once more right before it enters (the check awaited)
    backend = await state.changes.add(spec.pool, candidate, recheck=lambda: _check_unique(candidate, spec.pool, state))
    return json_response(_view(backend), status=201)


def _new_backend(spec: AddBackend) -> Backend:
    """The backend ``spec`` asks for, or ``BadRequestError``: a URL that is not ``http://host:port``
    (port 1..65535) or is over ``MAX_URL_CHARS``, a name over ``MAX_NAME_CHARS`` or not visible ASCII."""
    if len(spec.url) > MAX_URL_CHARS:
        raise BadRequestError(f"url: at most {MAX_URL_CHARS} characters, got {len(spec.url)}", param="url")
    try:
        port = urlsplit(spec.url).port
    except ValueError:
        port = None  # Backend() below says what is wrong with it
    if port == 0:
        raise BadRequestError(f"backend URL {spec.url!r} has port 0; give the port the backend listens on "
                              f"(1..65535), e.g. http://127.0.0.1:8100", param="url")
    if spec.name and (len(spec.name) > MAX_NAME_CHARS or not all(0x21 <= ord(c) <= 0x7E for c in spec.name)):
        shown = spec.name if len(spec.name) <= 40 else spec.name[:40] + "..."
        raise BadRequestError(f"name {shown!r} ({len(spec.name)} characters): give 1..{MAX_NAME_CHARS} visible "
                              f"ASCII characters (no spaces or control characters), or leave it out to use "
                              f"the URL", param="name")
    try:
        return Backend(spec.url, name=spec.name)
    except ConfigError as exc:
        raise BadRequestError(exc.message, param="url") from None


def _check_unique(backend: Backend, pool_name: str, state: RouterState) -> None:
    """``BadRequestError`` for a URL already in the pool, or a name already used by any backend as
    its name or URL (``DELETE /admin/backends/{name}`` must name exactly one backend)."""
    if state.pools[pool_name].get(backend.url) is not None:
        raise BadRequestError(f"backend {backend.url} is already in pool {pool_name!r}; "
                              f"GET /admin/backends lists them", param="url")
    for other in (b for p in state.pools.values() for b in p.members):
        if backend.name in (other.name, other.url):
            raise BadRequestError(f"backend name {backend.name!r} is already used by {other.url} in pool "
                                  f"{other.pool!r}; give this backend a name of its own", param="name")


async def list_sessions(request: web.Request) -> web.Response:
    """``GET /v1/sessions``: every session with its id, so an admin action."""
    _authorize(request, request.app[ROUTER_STATE])
    return await endpoints.list_sessions(request)


async def remove_backend(request: web.Request) -> web.Response:
    """Drain (no new requests), wait for in-flight ones up to ``drain_timeout_s``, then remove."""
    state = request.app[ROUTER_STATE]
    name = request.match_info["name"]
    _authorize(request, state)
    backend = state.find_backend(name)
    if backend is None:
        raise NotFoundError(f"no backend named {name!r}; GET /admin/backends lists them")
    drained = await state.changes.remove(backend)
    return json_response({"name": backend.name, "url": backend.url, "removed": True, "drained": drained})


def on_data_port(config: RouterConfig) -> bool:
    """Whether the data port serves the admin API: only without an admin listener and with a token."""
    return config.admin.port == 0 and bool(config.admin.token)


def add_admin_routes(app: web.Application, config: RouterConfig) -> None:
    """The admin API (and the session listing) on ``app``: the data app when ``on_data_port``,
    else the admin listener's app."""
    app[BACKEND_ALLOW] = BackendAllowList(config.admin.backend_allow)
    app.router.add_get("/admin/backends", list_backends)
    app.router.add_post("/admin/backends", add_backend)
    app.router.add_delete("/admin/backends/{name:.+}", remove_backend)
    app.router.add_get("/v1/sessions", list_sessions)


def add_unserved_routes(app: web.Application, config: RouterConfig) -> None:
    """On a data app without the admin API: its paths (and the session listing) answer 404 saying
    where the admin API is, or how to turn it on."""
    if config.admin.port:
        where = "it is served on its own listener (admin_port, on admin_host), not on this port"
    else:
        where = ("it is off: set admin_token to serve it here (every call with 'Authorization: Bearer "
                 "<admin_token>'), or admin_port to serve it on its own listener on admin_host (default 127.0.0.1)")

    async def admin_not_here(request: web.Request) -> web.Response:
        raise NotFoundError(f"no route {request.method} {request.path}: the admin API is not "
                            f"served on this port; {where}")

    async def listing_not_here(request: web.Request) -> web.Response:
        raise NotFoundError(
            "listing every session (GET /v1/sessions) is an admin action and the admin API is not served on "
            f"this port; {where}. GET /v1/sessions/{{id}} shows one session to whoever has its id")

    app.router.add_get("/v1/sessions", listing_not_here)
    app.router.add_route("*", "/admin", admin_not_here)
    app.router.add_route("*", "/admin/{tail:.*}", admin_not_here)

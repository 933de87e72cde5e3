"""The app factory of session-backend: which routes are served where, and the engine's lifecycle.

Routes (vLLM's, where a client or router can see them), by surface:

- always: ``GET /health``, ``/load``, ``/metrics``, ``/v1/models`` and (ours) ``/v1/sessions``,
  ``/v1/sessions/{id}``                                                       (``instance_routes``);
  ``GET /kv_event_sources``, ``POST /reset_prefix_cache``                      (``kv_events.routes``);
  ``POST /inference/v1/generate``                                              (``generate_route``);
  ``POST /internal/kv/pull``: the P/D side channel of a prefill (or ``both``) instance, unless it is
  served on a dedicated listener (``create_side_channel_app``); ``POST /internal/kv/release``
  (the router's "the decode leg will not come")                                   (``kv_transfer``)
- unless ``tokens_only``: ``POST /v1/completions``, ``/v1/chat/completions`` (``openai_routes``),
  ``POST /v1/responses``, ``GET /v1/responses/{id}`` (``responses_api``), ``GET /version``
  (``instance_routes``), ``POST /tokenize``, ``/detokenize`` (``render_routes``: the renderer's)
- ``scale_out``: ``POST /v1/chat/completions/render``, ``/v1/completions/render``,
  ``/v1/chat/completions/derender``, ``/v1/completions/derender`` (``render_routes``)
- ``scale_out`` or ``tokens_only``: ``POST /inference/v1/abort_requests``, ``/abort_requests``
  (``abort_route``)

``tokens_only`` is vLLM's ``--tokens-only`` engine (every other path is a 404; stop strings are
refused); ``scale_out`` is ``--enable-scale-out``. Unlike vLLM, ``/inference/v1/generate`` is served
without ``--enable-scale-out`` too (routers and benchmarks of this project use it), and a tokens-only
backend answers ``/v1/models`` (a real one does not; the router copes with both).

Every error is vLLM's JSON ``{"error": {"message", "type", "param", "code"}}``, produced in ONE
place (``backends.http_errors.error_middleware``). Every response carries ``X-Request-Id``.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Sequence

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry

from backends import abort_route, generate_route, instance_routes, openai_routes, responses_api
from backends.render_routes import RENDERING, add_render_routes, add_tokenizer_routes, render_service
from backends.engine.client import AsyncEngine
from backends.engine.config import EngineConfig
from backends.frontend import ENGINE, FRONTEND, REQUEST_IDS, Frontend
from backends.http_errors import error_middleware
from backends.kv_events import routes as kv_event_routes
from backends.kv_events.service import KV_EVENTS, KVEvents, lifecycle as kv_events_lifecycle
from backends.kv_transfer.agent import KVTransfer
from backends.kv_transfer.allow_list import AllowList
from backends.kv_transfer.pull_client import DEFAULT_PULL_TIMEOUT_S
from backends.responses_store import DEFAULT_MAX_ENTRIES, ResponseStore
from backends.tokenizer import Tokenizer
from contract.kv_events import KVEventsConfig
from rendering.model import DEFAULT_MODEL_DIR, RenderModel, load_model

log = logging.getLogger(__name__)

#: request bodies above this are a 413 (prompts of a long context fit easily)
MAX_BODY_BYTES = 64 * 1024 * 1024
EngineFactory = Callable[[EngineConfig, CollectorRegistry], AsyncEngine]


# ---- the app factory ------------------------------------------------------------------------


def engine_config_for(config: EngineConfig, tokenizer: Tokenizer) -> EngineConfig:
    """``config`` with the generated ids and eos taken from the model's tokenizer, and
    ``max_model_len`` lowered to the KV-cache capacity when that cannot hold one full sequence
    (vLLM refuses to start then; here the served context shrinks, with a warning)."""
    capacity = config.num_blocks * config.block_size
    max_model_len = config.max_model_len
    if capacity < max_model_len:
        log.warning("KV cache holds %d tokens (%d blocks of %d), less than max_model_len %d: serving "
                    "max_model_len %d", capacity, config.num_blocks, config.block_size, max_model_len, capacity)
        max_model_len = capacity
    return msgspec.structs.replace(
        config,
        max_model_len=max_model_len,
        gen_token_ids=tokenizer.generation_ids,
        # no eos id in the model's files: sequences end by length (or stop ids) only
        eos_token_id=tokenizer.eos_token_id if tokenizer.eos_token_id is not None else -1,
        eos_probability=config.eos_probability if tokenizer.eos_token_id is not None else 0.0,
    )


def create_app(
    config: EngineConfig,
    *,
    model: RenderModel | None = None,
    scale_out: bool = False,
    tokens_only: bool = False,
    prompt_tokens_details: bool = True,
    registry: CollectorRegistry | None = None,
    max_stored_responses: int = DEFAULT_MAX_ENTRIES,
    max_body_bytes: int = MAX_BODY_BYTES,
    engine_factory: EngineFactory | None = None,
    kv_allow: Sequence[str] = (),
    kv_pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
    kv_side_channel_on_data_port: bool = True,
    kv_events: KVEventsConfig | None = None,
    kv_events_host: str = "127.0.0.1",
    kv_events_int_hashes: bool = True,
) -> web.Application:
    """Build a backend app; the engine starts and stops with the app (``cleanup_ctx``).

    ``model`` is the loaded model folder (its name and context length then replace ``config.model``
    and ``config.max_model_len``); without one, the shipped model is loaded under ``config.model``
    with ``config.max_model_len``. The engine generates the model's word ids (``backends.vocabulary``)
    and its eos. ``scale_out``/``tokens_only`` choose the routes (module docstring).
    ``prompt_tokens_details``: vLLM's ``--enable-prompt-tokens-details`` for the text routes' usage.
    ``registry`` defaults to a fresh one (never the global registry).

    P/D: ``kv_allow`` lists the ``HOST:PORT`` side channels a decode instance may pull from (empty:
    loopback hosts only; ``ValueError`` for a malformed entry); an engine without a
    ``kv_engine_id`` gets a unique one. A prefill (or ``both``) instance serves the side channel
    on this app unless ``kv_side_channel_on_data_port`` is false (then serve
    ``create_side_channel_app(app)`` on its own listener and set ``config.kv_host/kv_port``).

    KV-cache events: ``kv_events`` is vLLM's ``--kv-events-config`` (``backends/kv_events``); when it
    publishes, the engine reports its prefix-cache changes and the sockets open at start-up
    (``tcp://*:0`` binds on ``kv_events_host``); block hashes go out as ints (vLLM's default) unless
    ``kv_events_int_hashes`` is false. ``GET /kv_event_sources`` is served either way.
    """
    if model is None:
        model = load_model(DEFAULT_MODEL_DIR, served_model_name=config.model, max_model_len=config.max_model_len)
    else:
        config = msgspec.structs.replace(config, model=model.name, max_model_len=model.max_model_len)
    tokenizer = Tokenizer(model)
    config = engine_config_for(config, tokenizer)
    if config.max_model_len != model.max_model_len:  # shrunk to the KV cache: render with the served context
        model = dataclasses.replace(model, max_model_len=config.max_model_len)
    if not config.kv_engine_id:
        unique = f"{config.model}-engine-{config.engine_index}-{secrets.token_hex(4)}"
        config = msgspec.structs.replace(config, kv_engine_id=unique)
    registry = registry if registry is not None else CollectorRegistry()
    engine = (engine_factory or AsyncEngine)(config, registry)
    kv = KVTransfer(config, engine, registry, allow=AllowList(kv_allow), pull_timeout_s=kv_pull_timeout_s)
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes)
    fe = Frontend(config=config, model=model, tokenizer=tokenizer, engine=engine, registry=registry,
                  store=ResponseStore(max_stored_responses), kv=kv, tokens_only=tokens_only,
                  prompt_tokens_details=prompt_tokens_details)
    app[FRONTEND] = fe
    app[ENGINE] = engine
    app[REQUEST_IDS] = fe.ids
    events = KVEvents(kv_events, block_size=config.block_size, host=kv_events_host, registry=registry,
                      int_hashes=kv_events_int_hashes)
    if events.sink is not None:
        engine.core.attach_kv_events(events.sink)
    app[KV_EVENTS] = events
    app.cleanup_ctx.append(kv_events_lifecycle)  # before the engine's: opened first, closed last
    app.cleanup_ctx.append(_engine_lifecycle)
    if kv.serves_pulls:  # the release is served on the data port even with a dedicated side channel
        kv.add_routes(app, pull=kv_side_channel_on_data_port)

    generate_route.add_routes(app)
    instance_routes.add_instance_routes(app)
    kv_event_routes.add_routes(app)
    if scale_out or tokens_only:
        abort_route.add_routes(app)
    if not tokens_only:
        app[RENDERING] = render_service(model, registry, fe.renderer)
        openai_routes.add_routes(app)
        responses_api.add_routes(app)
        instance_routes.add_text_routes(app)
        add_tokenizer_routes(app)
        if scale_out:
            add_render_routes(app)
    return app


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE]
    await engine.start()
    try:
        yield
    finally:
        kv = app[FRONTEND].kv
        if kv is not None:
            await kv.close()
        await engine.stop()


def create_side_channel_app(main_app: web.Application) -> web.Application:
    """An app serving only the P/D side channel (``POST /internal/kv/pull``) of ``main_app``'s
    engine, for a dedicated ``--kv-port`` listener. Run it while ``main_app`` runs."""
    fe = main_app[FRONTEND]
    if fe.kv is None or not fe.kv.serves_pulls:
        raise ValueError("only a prefill or both-role backend serves the KV side channel")
    app = web.Application(middlewares=[error_middleware], client_max_size=1024 * 1024)
    app[FRONTEND] = fe
    app[ENGINE] = fe.engine
    app[REQUEST_IDS] = fe.ids
    fe.kv.add_routes(app)
    return app


__all__ = ["create_app", "create_side_channel_app", "engine_config_for"]

"""The app factory of session-backend: which routes are served where, and the engine's lifecycle.

Routes (vLLM's, where a client or router can see them):

- ``POST /v1/completions``, ``/v1/chat/completions``, ``/inference/v1/generate``  (``openai_routes``)
- ``POST /v1/responses``, ``GET /v1/responses/{id}``                               (``responses_api``)
- ``POST /tokenize``, ``/detokenize``; ``GET /v1/models``, ``/health``, ``/load``, ``/version``,
  ``/metrics``, ``/v1/sessions``, ``/v1/sessions/{id}``                      (``instance_routes``)
- ``POST /internal/kv/pull``: the P/D side channel of a prefill (or ``both``) instance, unless it is
  served on a dedicated listener (``create_side_channel_app``); ``POST /internal/kv/release``
  (the router's "the decode leg will not come") on both                           (``kv_transfer``)

Every error is vLLM's JSON ``{"error": {"message", "type", "param", "code"}}``, produced in ONE
place (``backends.http_errors.error_middleware``). Every response carries ``X-Request-Id``.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Callable, Sequence

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry

from backends import instance_routes, openai_routes, responses_api
from backends.engine.client import AsyncEngine
from backends.engine.config import EngineConfig
from backends.frontend import ENGINE, FRONTEND, Frontend
from backends.http_errors import error_middleware
from backends.kv_transfer.agent import KVTransfer
from backends.kv_transfer.allow_list import AllowList
from backends.kv_transfer.pull_client import DEFAULT_PULL_TIMEOUT_S
from backends.responses_store import DEFAULT_MAX_ENTRIES, ResponseStore
from backends.tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: request bodies above this are a 413 (prompts of a long context fit easily)
MAX_BODY_BYTES = 64 * 1024 * 1024
EngineFactory = Callable[[EngineConfig, CollectorRegistry], AsyncEngine]


# ---- the app factory ------------------------------------------------------------------------


def engine_config_for(config: EngineConfig, tokenizer: Tokenizer) -> EngineConfig:
    """``config`` with the generated-token range and eos taken from the tokenizer, and
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
        gen_token_min=tokenizer.gen_token_min,
        gen_token_max=tokenizer.gen_token_max,
        eos_token_id=tokenizer.eos_token_id,
    )


def create_app(
    config: EngineConfig,
    *,
    registry: CollectorRegistry | None = None,
    max_stored_responses: int = DEFAULT_MAX_ENTRIES,
    max_body_bytes: int = MAX_BODY_BYTES,
    engine_factory: EngineFactory | None = None,
    kv_allow: Sequence[str] = (),
    kv_pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
    kv_side_channel_on_data_port: bool = True,
) -> web.Application:
    """Build a backend app; the engine starts and stops with the app (``cleanup_ctx``).

    The generated-token range of ``config`` is replaced by the tokenizer's (every generated id
    decodes to a readable word). ``registry`` defaults to a fresh one (never the global registry).

    P/D: ``kv_allow`` lists the ``HOST:PORT`` side channels a decode instance may pull from (empty:
    loopback hosts only; ``ValueError`` for a malformed entry); an engine without a
    ``kv_engine_id`` gets a unique one. A prefill (or ``both``) instance serves the side channel
    on this app unless ``kv_side_channel_on_data_port`` is false (then serve
    ``create_side_channel_app(app)`` on its own listener and set ``config.kv_host/kv_port``).
    """
    tokenizer = Tokenizer()
    config = engine_config_for(config, tokenizer)
    if not config.kv_engine_id:
        unique = f"{config.model}-engine-{config.engine_index}-{secrets.token_hex(4)}"
        config = msgspec.structs.replace(config, kv_engine_id=unique)
    registry = registry if registry is not None else CollectorRegistry()
    engine = (engine_factory or AsyncEngine)(config, registry)
    kv = KVTransfer(config, engine, registry, allow=AllowList(kv_allow), pull_timeout_s=kv_pull_timeout_s)
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes)
    app[FRONTEND] = Frontend(config=config, tokenizer=tokenizer, engine=engine, registry=registry,
                             store=ResponseStore(max_stored_responses), kv=kv)
    app[ENGINE] = engine
    app.cleanup_ctx.append(_engine_lifecycle)
    if kv.serves_pulls:  # the release is served on the data port even with a dedicated side channel
        kv.add_routes(app, pull=kv_side_channel_on_data_port)

    openai_routes.add_routes(app)
    responses_api.add_routes(app)
    instance_routes.add_routes(app)
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
    fe.kv.add_routes(app)
    return app


__all__ = ["create_app", "create_side_channel_app", "engine_config_for"]

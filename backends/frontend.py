"""The per-application state of a session-backend HTTP app and its typed keys.

``Frontend`` (under ``FRONTEND``) holds what every route shares: the engine config, the model and its
tokenizer, engine, metrics registry, response store, request ids, the in-flight count and the P/D
agent; ``ENGINE`` is the engine again, for the app's lifecycle and tests; ``REQUEST_IDS`` the id
generator every app of this package has (a render server has no ``Frontend``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry

from backends.engine.client import AsyncEngine
from backends.engine.config import EngineConfig
from backends.engine.errors import EngineDeadError
from backends.responses_store import ResponseStore
from backends.tokenizer import Tokenizer
from contract.errors import NotFoundError
from contract.ids import IdGenerator
from rendering.model import RenderModel
from rendering.render import Renderer

if TYPE_CHECKING:
    from backends.kv_transfer.agent import KVTransfer

REQUEST_ID_HEADER = "X-Request-Id"


def package_version() -> str:
    try:
        return metadata.version("session-router")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0.0.0"


@dataclass(eq=False)
class Frontend:
    """Per-application state of the HTTP frontend (stored under ``FRONTEND`` in the app)."""

    config: EngineConfig
    model: RenderModel
    tokenizer: Tokenizer
    engine: AsyncEngine
    registry: CollectorRegistry
    store: ResponseStore
    ids: IdGenerator = field(default_factory=IdGenerator)
    created: int = field(default_factory=lambda: int(time.time()))
    version: str = field(default_factory=package_version)
    #: generation requests being served now (``GET /load``)
    in_flight: int = 0
    #: P/D: the KV transfer agent (side channel, pulls, prompt-source counters); None in bare tests
    kv: "KVTransfer | None" = None
    #: ``--tokens-only``: no detokenization, so stop strings and text output are refused
    tokens_only: bool = False
    #: vLLM's ``--enable-prompt-tokens-details`` (on by default here): the text routes' usage reports
    #: ``prompt_tokens_details.cached_tokens`` when the prefix cache served part of the prompt
    prompt_tokens_details: bool = True
    #: the model's renderer (``rendering.render``): chat prompts, /tokenize, the render routes
    renderer: Renderer = field(init=False)

    def __post_init__(self) -> None:
        self.renderer = Renderer(self.model)

    @property
    def fingerprint(self) -> str:
        return f"session-backend-{self.version}"

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model:
            raise NotFoundError(f"The model `{model}` does not exist. Valid aliases: {self.config.model}.",
                                param="model")

    def check_engine(self) -> None:
        """Fail with a 503 before a stream starts when the engine loop is not running."""
        if not self.engine.is_running:
            raise EngineDeadError("The engine is not running; this backend cannot generate. Try another backend.")

    def base_request_id(self, request: web.Request, body_request_id: str | None) -> str:
        """vLLM's order: the X-Request-Id header, else the body's request_id, else a fresh id."""
        rid = request.headers.get(REQUEST_ID_HEADER) or body_request_id or self.ids.next()
        request[REQUEST_ID_KEY] = rid
        return rid

    def engine_request_id(self, external_id: str) -> str:
        """The engine's internal id: unique even when clients reuse an X-Request-Id (as vLLM does)."""
        return f"{external_id}-{self.ids.next()[-8:]}"


#: the base request id chosen for this request, echoed as X-Request-Id by the middleware
REQUEST_ID_KEY = web.RequestKey("request_id", str)


#: the frontend state: config, model, tokenizer, engine, response store, ids, in-flight count
FRONTEND = web.AppKey("frontend", Frontend)
#: the request id generator of any app of this package (the frontend's own, or a render server's)
REQUEST_IDS = web.AppKey("request_ids", IdGenerator)
#: the engine (also reachable as ``app[FRONTEND].engine``)
ENGINE = web.AppKey("engine", AsyncEngine)

"""Tokens mode, assembled once at start-up from ``[tokens]``: the model, the renderer (local or
remote), the per-session prompt cache, the engine aborts and the route handlers the proxy calls
instead of forwarding (``Proxy.tokens``).

The app factory (``router.app``) calls ``build_tokens_mode`` when ``upstream_api = "tokens"``; text
mode builds none of it. A model folder that cannot be loaded stops start-up with a
``ConfigError`` naming the file.
"""

from __future__ import annotations

from contract.errors import ConfigError
from rendering.model import RenderModel, load_model
from rendering.render import Renderer
from router.config import RouterConfig
from router.health import HealthChecker
from router.membership import BackendPool
from router.metrics import RouterMetrics
from router.proxy import Proxy, RouteHandler
from router.sessions.table import SessionTable
from router.tokens.engine import EngineAborts
from router.tokens.flow import TokensRoutes
from router.tokens.prompt_cache import PromptCache
from router.tokens.render_client import RemoteRenderer
from router.tokens.renderers import LocalRenderer, RenderService
from router.upstream import UpstreamPool


class TokensMode:
    """What tokens mode holds for the app's lifetime."""

    def __init__(self, model: RenderModel, renderer: RenderService, local: LocalRenderer | None,
                 prompts: PromptCache | None, aborts: EngineAborts, routes: TokensRoutes) -> None:
        self.model = model
        self.renderer = renderer
        self.local = local
        self.prompts = prompts
        self.aborts = aborts
        self.routes = routes

    def handlers(self) -> dict[str, RouteHandler]:
        """Route name -> handler for ``Proxy.tokens`` (chat and completions here)."""
        return self.routes.handlers()


def load_tokens_model(config: RouterConfig) -> RenderModel:
    tokens = config.tokens
    try:
        return load_model(tokens.model_dir, served_model_name=tokens.served_model_name or None,
                          max_model_len=tokens.max_model_len or None)
    except ConfigError as exc:
        raise ConfigError(f"tokens.model_dir: {exc.message}") from None


def build_tokens_mode(config: RouterConfig, proxy: Proxy, *, render_pool: BackendPool | None,
                      upstream: UpstreamPool, health: HealthChecker, sessions: SessionTable,
                      metrics: RouterMetrics) -> TokensMode:
    """Load the model and build the renderer, cache and handlers (``render_pool``: the render servers,
    None to render locally)."""
    model = load_tokens_model(config)
    local: LocalRenderer | None = None
    renderer: RenderService
    if render_pool is None:
        local = LocalRenderer(Renderer(model), metrics.render)
        renderer = local
    else:
        renderer = RemoteRenderer(render_pool, upstream=upstream, health=health, metrics=metrics.render,
                                  retries=config.upstream.retries, retry_backoff_s=config.upstream.retry_backoff_s,
                                  total_timeout_s=config.upstream.total_timeout_s, max_token_id=model.max_token_id)
    prompts: PromptCache | None = None
    if local is not None and config.tokens.prompt_cache_bytes > 0:
        prompts = PromptCache(config.tokens.prompt_cache_bytes)
        prompts.attach(sessions)  # a session the table forgets takes its prompt state with it
    aborts = EngineAborts(upstream, on_result=lambda result: metrics.engine_aborts.labels(result).inc())
    routes = TokensRoutes(proxy, model=model, renderer=renderer, local=local, prompts=prompts, aborts=aborts)
    return TokensMode(model, renderer, local, prompts, aborts, routes)

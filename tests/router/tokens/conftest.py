"""Fixtures of the tokens-mode tests: tokens-only engines (``session-backend``'s app with the shipped
model, served in-process on loopback) and a router in tokens mode before them (``make_router``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from backends.app import create_app as create_backend_app
from backends.engine.config import EngineConfig
from backends.frontend import ENGINE
from rendering.model import DEFAULT_MODEL_DIR, RenderModel, load_model

MODEL_DIR = str(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="session")
def tiny_model() -> RenderModel:
    return load_model(DEFAULT_MODEL_DIR)


class Engine:
    """A tokens-only engine for ``make_router(fakes=[...])``: ``app()`` builds it once."""

    def __init__(self, name: str, model: RenderModel, *, speed: float = 0.0, role: str = "both",
                 eos_probability: float = 0.0) -> None:
        self.name = name
        self.model = model
        self.config = EngineConfig(speed=speed, role=role, eos_probability=eos_probability)
        self._app: web.Application | None = None

    def app(self) -> web.Application:
        if self._app is None:
            self._app = create_backend_app(self.config, model=self.model, tokens_only=True)
        return self._app

    @property
    def engine(self) -> Any:
        assert self._app is not None
        return self._app[ENGINE]

    def idle(self) -> bool:
        """Nothing running or waiting in the engine core."""
        return self.engine.num_running == 0 and self.engine.num_waiting == 0


def tokens_settings(**extra: Any) -> dict[str, Any]:
    return {"tokens": {"upstream_api": "tokens", "model_dir": MODEL_DIR, **extra}}


MakeTokensRouter = Callable[..., Awaitable[Any]]

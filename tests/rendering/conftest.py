"""Fixtures for rendering tests: the shipped tiny-llama model (loaded once) and its renderer; the
golden cases recorded from vLLM 0.32's render server (tests/rendering/data/*.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rendering.model import DEFAULT_MODEL_DIR, RenderModel, load_model
from rendering.render import Renderer

DATA = Path(__file__).parent / "data"

#: how the golden cases were recorded: `vllm launch render` with --max-model-len 2048
GOLDEN_NAME = "tiny-llama"
GOLDEN_MAX_MODEL_LEN = 2048


def golden_cases(name: str) -> list[dict[str, Any]]:
    """The cases of ``data/<name>.jsonl``: ``{"request", "status", "response"}`` each."""
    with (DATA / f"{name}.jsonl").open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="session")
def tiny_model() -> RenderModel:
    return load_model(DEFAULT_MODEL_DIR, served_model_name=GOLDEN_NAME, max_model_len=GOLDEN_MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def renderer(tiny_model: RenderModel) -> Renderer:
    return Renderer(tiny_model)

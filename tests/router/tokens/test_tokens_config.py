"""``[tokens]`` settings and their flags: defaults, tokens mode's requirements, start-up errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.errors import ConfigError
from router.config import TokensConfig, build_config, config_from_mapping

REPO = Path(__file__).resolve().parents[3]
MODEL = str(REPO / "models" / "tiny-llama")
BACKEND = ["--backend", "http://127.0.0.1:8100"]


def error_of(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        build_config(argv)
    return info.value.message


def test_text_mode_is_the_default() -> None:
    config = build_config(BACKEND)
    assert config.tokens == TokensConfig()
    assert not config.tokens.enabled and config.tokens.render_urls == []


def test_flags_set_tokens_mode() -> None:
    config = build_config([*BACKEND, "--upstream-api", "tokens", "--model-dir", MODEL, "--served-model-name", "tl",
                           "--max-model-len", "512", "--render", "http://127.0.0.1:8300/", "--render",
                           "http://127.0.0.1:8301", "--prompt-cache-bytes", "0"])
    tokens = config.tokens
    assert tokens.enabled and tokens.model_dir == MODEL and tokens.served_model_name == "tl"
    assert tokens.max_model_len == 512 and tokens.prompt_cache_bytes == 0
    assert tokens.render_urls == ["http://127.0.0.1:8300", "http://127.0.0.1:8301"]


def test_render_local_flag_and_default() -> None:
    assert build_config([*BACKEND, "--upstream-api", "tokens", "--model-dir", MODEL]).tokens.render == "local"
    assert build_config([*BACKEND, "--upstream-api", "tokens", "--model-dir", MODEL,
                         "--render", "local"]).tokens.render_urls == []


def test_the_file_section() -> None:
    config = config_from_mapping({"backends": [{"url": "http://127.0.0.1:8100"}],
                                  "tokens": {"upstream_api": "tokens", "model_dir": MODEL,
                                             "render": ["http://127.0.0.1:8300"]}})
    assert config.tokens.enabled and config.tokens.render_urls == ["http://127.0.0.1:8300"]


@pytest.mark.parametrize(("argv", "expected"), [
    (["--upstream-api", "tokens"], "tokens.model_dir: tokens mode (--upstream-api tokens) needs the model folder"),
    (["--upstream-api", "tokens", "--model-dir", "/nonexistent/model"],
     "--model-dir: '/nonexistent/model' is not a directory"),
    (["--model-dir", MODEL], "--model-dir: only used in tokens mode"),
    (["--render", "http://127.0.0.1:8300"], "--render: only used in tokens mode"),
    (["--upstream-api", "tokens", "--model-dir", MODEL, "--render", "127.0.0.1:8300"],
     "--render[0]: backend URL '127.0.0.1:8300' has no scheme"),
    (["--upstream-api", "tokens", "--model-dir", MODEL, "--render", "http://a:1", "--render", "http://a:1/"],
     "--render[1]: http://a:1 is listed twice"),
    (["--upstream-api", "tokens", "--model-dir", MODEL, "--prompt-cache-bytes", "-1"],
     "--prompt-cache-bytes: must be >= 0 (0 = no incremental render), got -1"),
    (["--upstream-api", "text"], "argument --upstream-api: invalid choice"),
])
def test_start_up_errors(argv: list[str], expected: str) -> None:
    assert expected in error_of([*BACKEND, *argv])


def test_file_errors_name_the_section_key() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_mapping({"backends": [{"url": "http://127.0.0.1:8100"}],
                             "tokens": {"upstream_api": "tokens", "model_dir": MODEL, "render": []}})
    assert info.value.message.startswith("tokens.render: an empty list names no render server")
    with pytest.raises(ConfigError) as info:
        config_from_mapping({"backends": [{"url": "http://127.0.0.1:8100"}],
                             "tokens": {"upstream_api": "tokens", "model_dir": MODEL, "render": "remote"}})
    assert info.value.message == "tokens.render: \"local\" or a list of render server URLs, got 'remote'"
    with pytest.raises(ConfigError) as info:
        config_from_mapping({"backends": [{"url": "http://127.0.0.1:8100"}], "tokens": {"upstream_api": "grpc"}})
    assert info.value.message == "tokens.upstream_api: must be one of openai, tokens, got 'grpc'"

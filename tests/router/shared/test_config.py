"""``shared_state``: the top-level URL, the ``[shared_state]`` section, ``--shared-state``, and the errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.errors import ConfigError
from router.config import build_config, config_from_mapping, load_config

BACKEND = [{"url": "http://127.0.0.1:8100"}]


def test_off_by_default() -> None:
    assert config_from_mapping({"backends": BACKEND}).shared_state.url == ""


def test_the_top_level_url_is_the_sections_url(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text('shared_state = "redis://redis:6379/0"\n[[backends]]\nurl = "http://127.0.0.1:8100"\n')
    shared = load_config(str(path)).shared_state
    assert shared.url == "redis://redis:6379/0" and shared.read_timeout_s == 0.05


def test_the_section_with_its_settings() -> None:
    config = config_from_mapping({"backends": BACKEND, "shared_state": {
        "url": "unix:///run/redis.sock", "key_prefix": "fleet-a:", "read_timeout_s": 0.02, "queue_size": 10}})
    assert (config.shared_state.url, config.shared_state.key_prefix, config.shared_state.queue_size) == (
        "unix:///run/redis.sock", "fleet-a:", 10)


def test_the_flag_overrides_the_file(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text('shared_state = "redis://a:6379/0"\n')
    config = build_config(["--config", str(path), "--backend", "http://127.0.0.1:8100",
                           "--shared-state", "rediss://b:6380/1"])
    assert config.shared_state.url == "rediss://b:6380/1"


@pytest.mark.parametrize(("data", "message"), [
    ({"shared_state": "http://redis:6379"}, "shared_state: 'http://redis:6379' is not a Redis URL"),
    ({"shared_state": {"url": "redis://r", "read_timeout_s": 0}}, "shared_state.read_timeout_s"),
    ({"shared_state": {"url": "redis://r", "backoff_min_s": 2.0, "backoff_max_s": 1.0}},
     "shared_state.backoff_max_s: must be at least backoff_min_s"),
    ({"shared_state": {"urls": "redis://r"}}, "urls"),
])
def test_errors_name_the_key(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config_from_mapping({"backends": BACKEND, **data})
    assert message in str(caught.value)


def test_a_bad_flag_value_names_the_flag() -> None:
    with pytest.raises(ConfigError, match="--shared-state: 'redis:/x' is not a Redis URL"):
        build_config(["--backend", "http://127.0.0.1:8100", "--shared-state", "redis:/x"])

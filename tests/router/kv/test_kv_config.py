"""``[kv_events]``, the backends' ``kv_events``/``kv_replay``/``kv_topic`` and ``--kv-events``."""

from __future__ import annotations

import pytest

from contract.errors import ConfigError
from router.config import build_config, config_from_mapping

URL = "http://127.0.0.1:8100"


def test_defaults() -> None:
    config = config_from_mapping({"backends": [{"url": URL}]})
    assert config.kv_events.enabled == "auto"
    assert config.kv_events.max_blocks == 1_000_000
    assert config.backends[0].kv_events == ""


def test_a_backends_event_endpoints_are_kept_through_validation() -> None:
    config = config_from_mapping({"backends": [{"url": URL + "/", "kv_events": "tcp://127.0.0.1:5557",
                                                "kv_replay": "tcp://127.0.0.1:5558", "kv_topic": "kv@a"}]})
    backend = config.backends[0]
    assert (backend.url, backend.kv_events, backend.kv_replay, backend.kv_topic) == (
        URL, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv@a")


@pytest.mark.parametrize(("entry", "message"), [
    ({"kv_events": "http://127.0.0.1:5557"}, r"backends\[0\]\.kv_events: 'http://127.0.0.1:5557' is not a ZMQ endpoint"),
    ({"kv_events": "ipc:///tmp/kv.sock", "kv_replay": "udp://x"}, r"backends\[0\]\.kv_replay: 'udp://x'"),
    ({"kv_replay": "tcp://127.0.0.1:5558"}, r"backends\[0\]\.kv_replay: set only with kv_events"),
    ({"kv_topic": "kv@a"}, r"backends\[0\]\.kv_topic: set only with kv_events"),
])
def test_bad_backend_event_settings_are_refused(entry: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_mapping({"backends": [{"url": URL, **entry}]})


def test_bad_section_values_are_refused() -> None:
    with pytest.raises(ConfigError, match="kv_events.enabled"):
        config_from_mapping({"backends": [{"url": URL}], "kv_events": {"enabled": "yes"}})
    with pytest.raises(ConfigError, match="kv_events.max_blocks"):
        config_from_mapping({"backends": [{"url": URL}], "kv_events": {"max_blocks": 0}})


@pytest.mark.parametrize(("word", "enabled"), [("auto", "auto"), ("on", True), ("off", False)])
def test_the_flag(word: str, enabled: object) -> None:
    assert build_config(["--backend", URL, "--kv-events", word]).kv_events.enabled == enabled


def test_a_bad_flag_value_says_what_to_give() -> None:
    with pytest.raises(ConfigError, match="give auto, on or off"):
        build_config(["--backend", URL, "--kv-events", "maybe"])

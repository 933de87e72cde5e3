"""The Responses API id index: remembers where a response lives, bounded LRU."""

from __future__ import annotations

import pytest

from contract.errors import ConfigError
from router.sessions.responses import ResponseIndex


def test_remember_and_lookup() -> None:
    index = ResponseIndex(10)
    assert index.lookup("resp_1") is None
    index.remember("resp_1", "http://127.0.0.1:8100", "sess-a")
    index.remember("resp_2", "http://127.0.0.1:8101", None)
    assert index.lookup("resp_1") == ("http://127.0.0.1:8100", "sess-a")
    assert index.lookup("resp_2") == ("http://127.0.0.1:8101", None)
    assert "resp_1" in index and "resp_3" not in index
    assert len(index) == 2


def test_remember_again_overwrites() -> None:
    index = ResponseIndex(10)
    index.remember("r", "http://127.0.0.1:8100", "a")
    index.remember("r", "http://127.0.0.1:8101", "b")
    assert index.lookup("r") == ("http://127.0.0.1:8101", "b")
    assert len(index) == 1


def test_bounded_and_least_recently_used_goes_first() -> None:
    index = ResponseIndex(3)
    for i in range(3):
        index.remember(f"r{i}", f"http://127.0.0.1:{8100 + i}", None)
    assert index.lookup("r0") is not None  # r0 is now the most recently used
    index.remember("r3", "http://127.0.0.1:8103", None)
    assert index.lookup("r1") is None
    assert [index.lookup(f"r{i}") is not None for i in (0, 2, 3)] == [True, True, True]
    for i in range(4, 100):
        index.remember(f"r{i}", "http://127.0.0.1:8100", None)
        assert len(index) == 3
    assert [r for r in (f"r{i}" for i in range(100)) if r in index] == ["r97", "r98", "r99"]


def test_zero_remembers_nothing_and_negative_is_a_config_error() -> None:
    index = ResponseIndex(0)
    index.remember("r", "http://127.0.0.1:8100", "s")
    assert index.lookup("r") is None and len(index) == 0
    with pytest.raises(ConfigError, match="max_response_ids"):
        ResponseIndex(-1)

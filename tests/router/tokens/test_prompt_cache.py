"""PromptCache: per-session prompt states under a byte bound, LRU, dropped with their session; and the
session table's extra eviction hook it attaches with."""

from __future__ import annotations

from typing import cast

import pytest
from tokenizers import Tokenizer

from contract.errors import ConfigError
from rendering.incremental import PromptEncoder, PromptState
from rendering.model import DEFAULT_MODEL_DIR
from router.sessions.table import SessionEntry, SessionTable
from router.tokens.prompt_cache import PromptCache


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder(Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json")))


def state(encoder: PromptEncoder, words: int) -> PromptState:
    return encoder.encode("<s><|user|>\n" + "word " * words + "\n<|assistant|>\n")


class Sized:
    """Stands for a PromptState of a given ``nbytes`` (all the cache reads of it)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def sized(nbytes: int) -> PromptState:
    return cast(PromptState, Sized(nbytes))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_get_put_drop(encoder: PromptEncoder) -> None:
    cache = PromptCache(10_000_000)
    first, second = state(encoder, 10), state(encoder, 20)
    assert cache.get("a") is None
    cache.put("a", first)
    assert cache.get("a") is first and "a" in cache and len(cache) == 1
    assert cache.nbytes == first.nbytes
    cache.put("a", second)  # the session's newer state replaces the older one
    assert cache.get("a") is second and len(cache) == 1 and cache.nbytes == second.nbytes
    assert cache.drop("a") is True and cache.drop("a") is False
    assert cache.get("a") is None and cache.nbytes == 0


def test_least_recently_used_goes_first_under_the_byte_bound() -> None:
    cache = PromptCache(300)
    for sid in "abc":
        cache.put(sid, sized(100))
    assert cache.get("a") is not None  # "a" is now the most recently used: "b" is the oldest
    cache.put("d", sized(100))
    assert "b" not in cache and all(sid in cache for sid in "acd") and cache.nbytes == 300
    cache.put("e", sized(150))  # needs the room of two: "c" and then "a" go
    assert {sid for sid in "abcde" if sid in cache} == set("de") and cache.nbytes == 250
    cache.put("d", sized(50))  # a smaller state for "d" frees room
    assert cache.nbytes == 200 and len(cache) == 2


def test_a_state_larger_than_the_bound_is_not_kept(encoder: PromptEncoder) -> None:
    small, huge = state(encoder, 5), state(encoder, 5000)
    cache = PromptCache(huge.nbytes - 1)
    cache.put("a", small)
    cache.put("other", small)
    cache.put("a", huge)
    assert "a" not in cache and cache.get("other") is small and cache.nbytes == small.nbytes


def test_zero_bytes_keeps_nothing(encoder: PromptEncoder) -> None:
    cache = PromptCache(0)
    cache.put("a", state(encoder, 1))
    assert cache.get("a") is None and len(cache) == 0 and cache.nbytes == 0


def test_negative_bound_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="prompt_cache_bytes"):
        PromptCache(-1)


@pytest.mark.parametrize("reason", ["ttl", "capacity", "deleted"])
def test_sessions_the_table_forgets_are_dropped(encoder: PromptEncoder, reason: str) -> None:
    clock = Clock()
    seen: list[tuple[str, str]] = []

    def metrics_hook(entry: SessionEntry, why: str) -> None:
        seen.append((entry.session_id, why))

    table = SessionTable(2, 10.0, clock, clock, on_evict=metrics_hook)
    cache = PromptCache(10_000_000)
    cache.attach(table)
    for sid in ("a", "b"):
        table.touch(sid)
        cache.put(sid, state(encoder, 3))
    if reason == "ttl":
        clock.now += 11
        table.sweep()
        gone = ["a", "b"]
    elif reason == "capacity":
        table.touch("c")
        gone = ["a"]
    else:
        table.delete("b")
        gone = ["b"]
    assert [sid for sid in ("a", "b") if sid not in cache] == gone
    # the hook set before (metrics) still sees every eviction, first
    assert seen == [(sid, reason) for sid in gone]


def test_add_evict_hook_without_an_earlier_hook_is_the_hook_itself() -> None:
    table = SessionTable(1, 10.0)
    assert table.on_evict is None

    def hook(entry: SessionEntry, why: str) -> None:
        pass

    table.add_evict_hook(hook)
    assert table.on_evict is hook

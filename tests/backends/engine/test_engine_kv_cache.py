"""Prefix-cache keys, reference counts and LRU eviction of ``backends.engine.kv_cache``."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from backends.engine.kv_cache import NONE_HASH, KVCacheManager, hash_block, hash_full_blocks, token_bytes

B = 4


def test_keys_chain_from_the_parent() -> None:
    tokens = list(range(10, 22))  # 3 full blocks of 4
    keys = hash_full_blocks(tokens, B)
    assert len(keys) == 3
    assert keys[0] == hash_block(NONE_HASH, tokens[0:4])
    assert keys[1] == hash_block(keys[0], tokens[4:8])
    assert keys[2] == hash_block(keys[1], tokens[8:12])
    # the same block content under a different parent is a different key
    assert hash_block(NONE_HASH, tokens[4:8]) != keys[1]
    # the definition: blake2b-128 over parent || int64 LE token ids
    assert keys[0] == hashlib.blake2b(NONE_HASH + token_bytes(tokens[0:4]), digest_size=16).digest()


def test_only_full_blocks_are_keyed_and_a_shared_prefix_shares_keys() -> None:
    a = hash_full_blocks(list(range(11)), B)  # 2 full blocks + 3 tokens
    b = hash_full_blocks(list(range(8)) + [99, 98, 97, 96, 95], B)
    assert len(a) == 2 and len(b) == 3
    assert a == b[:2]
    assert hash_full_blocks([1, 2, 3], B) == []


def test_cache_salt_goes_into_the_first_block_only_and_changes_the_chain() -> None:
    tokens = list(range(8))
    plain = hash_full_blocks(tokens, B)
    salted = hash_full_blocks(tokens, B, cache_salt="tenant-a")
    other = hash_full_blocks(tokens, B, cache_salt="tenant-b")
    assert salted[0] != plain[0] and salted[0] != other[0]
    assert salted[1] != plain[1]  # through the chain
    assert salted[1] == hash_block(salted[0], tokens[4:8])  # block 1 itself carries no salt


def test_keys_are_stable_across_processes() -> None:
    """No salted ``hash()``: another interpreter (another PYTHONHASHSEED) computes the same key."""
    code = "from backends.engine.kv_cache import hash_full_blocks; print(hash_full_blocks(list(range(32)), 16, 's')[1].hex())"
    env_keys = []
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        )
        env_keys.append(out.stdout.strip())
    assert env_keys[0] == env_keys[1] == hash_full_blocks(list(range(32)), 16, "s")[1].hex()


def test_token_ids_outside_int64_still_hash() -> None:
    assert len(hash_block(NONE_HASH, [2**70, -(2**70), 1, 2])) == 16


def test_allocate_free_refcounts_and_usage() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=B)
    assert kv.usage == 0.0 and kv.num_free_blocks == 4
    blocks = kv.allocate(3)
    assert len(set(blocks)) == 3 and kv.usage == 0.75
    assert all(kv.ref_cnt[b] == 1 for b in blocks)
    kv.touch(blocks[:1])
    assert kv.ref_cnt[blocks[0]] == 2
    kv.free(blocks)
    assert kv.ref_cnt[blocks[0]] == 1 and kv.usage == 0.25
    kv.free(blocks[:1])
    assert kv.usage == 0.0 and kv.num_free_blocks == 4
    with pytest.raises(MemoryError):
        kv.allocate(5)


def test_cached_blocks_survive_free_and_are_hit_until_evicted_lru() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=B)
    keys = [bytes([i]) * 16 for i in range(3)]
    blocks = kv.allocate(3)
    for b, k in zip(blocks, keys):
        assert kv.cache_block(b, k)
    kv.free(blocks)  # reverse order: the tail block joins the LRU first
    assert kv.num_evictable_blocks == 3 and kv.usage == 0.0
    assert [kv.cached_block(k) for k in keys] == blocks
    # a prefix hit takes block 0 out of the LRU and references it
    kv.touch([blocks[0]])
    assert not kv.is_evictable(blocks[0]) and kv.usage == pytest.approx(1 / 3)
    # no free block left: allocation evicts the least recently used: the tail (key 2) first
    (new,) = kv.allocate(1)
    assert new == blocks[2] and kv.cached_block(keys[2]) is None
    assert kv.cached_block(keys[1]) == blocks[1]
    (new2,) = kv.allocate(1)
    assert new2 == blocks[1] and kv.cached_block(keys[1]) is None
    # block 0 is referenced: it cannot be evicted
    with pytest.raises(MemoryError):
        kv.allocate(1)
    assert kv.cached_block(keys[0]) == blocks[0]


def test_free_uncached_blocks_are_used_before_evicting_cached_ones() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=B)
    a, b = kv.allocate(2)
    kv.cache_block(a, b"k" * 16)
    kv.free([a, b])  # a -> evictable (keyed), b -> free (unkeyed)
    got = kv.allocate(2)
    assert a not in got  # the keyed block stays cached
    assert kv.cached_block(b"k" * 16) == a


def test_duplicate_content_keeps_the_first_block_keyed() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=B)
    a, b = kv.allocate(2)
    assert kv.cache_block(a, b"x" * 16)
    assert not kv.cache_block(b, b"x" * 16)
    assert kv.cached_block(b"x" * 16) == a and kv.block_hash[b] is None
    kv.free([a, b])
    assert kv.num_evictable_blocks == 1 and kv.num_free_blocks == 2


def test_insert_cached_for_pulled_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=B)
    held = kv.allocate(1)  # one block stays referenced
    keys = hash_full_blocks(list(range(20)), B)  # 5 keys, only 3 blocks available
    assert kv.insert_cached(keys) == 3
    assert [kv.cached_block(k) is not None for k in keys] == [True, True, True, False, False]
    assert kv.usage == 0.25  # pulled blocks are unreferenced (evictable)
    # inserting again is idempotent and refreshes LRU; still no room for the 4th
    assert kv.insert_cached(keys) == 3
    kv.free(held)
    assert kv.insert_cached(keys) == 4


def test_pulled_blocks_count_as_external_until_their_first_hit() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=B)
    local = kv.allocate(1)
    keys = hash_full_blocks(list(range(16)), B)  # 4 keys
    assert kv.cache_block(local[0], keys[0])  # the first block was already cached here
    assert kv.insert_cached(keys) == 4
    blocks = [kv.cached_block(k) for k in keys]
    assert kv.take_external(blocks) == 3  # only the three the pull added
    assert kv.take_external(blocks) == 0  # after the first hit they are local cache
    # a pulled block evicted before anyone hit it is forgotten with its key
    kv.free(local)
    kv.insert_cached(hash_full_blocks(list(range(100, 108)), B))  # 2 new external blocks, 0 free left
    fresh = [kv.cached_block(k) for k in hash_full_blocks(list(range(100, 108)), B)]
    reused = kv.allocate(kv.num_free_blocks)  # evicts everything, the external blocks included
    assert set(fresh) <= set(reused) and kv.take_external(fresh) == 0
    kv.free(reused)
    kv.insert_cached(hash_full_blocks(list(range(200, 204)), B))
    assert kv.reset_prefix_cache() >= 1
    assert kv.take_external(range(6)) == 0


def test_reset_prefix_cache_drops_only_unreferenced_keys() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=B)
    a, b = kv.allocate(2)
    kv.cache_block(a, b"a" * 16)
    kv.cache_block(b, b"b" * 16)
    kv.free([b])
    assert kv.reset_prefix_cache() == 1
    assert kv.cached_block(b"a" * 16) == a and kv.cached_block(b"b" * 16) is None

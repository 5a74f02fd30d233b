"""The block pool, the prefix cache and the KV cache manager, without a model."""

from __future__ import annotations

import pytest

from tandem.server.engine.block_pool import NULL_BLOCK, BlockPool, BlockPoolError
from tandem.server.engine.kv_cache_manager import KVCacheManager
from tandem.server.engine.prefix_cache import PrefixCache, chain_hashes

from .utils import make_request


def test_allocate_and_free_track_reference_counts() -> None:
    pool = BlockPool(8, None)
    assert pool.num_free == 7  # block 0 is the padding page
    blocks = pool.allocate(3)
    assert NULL_BLOCK not in blocks
    assert pool.num_free == 4
    pool.share(blocks[:1])
    pool.free(blocks)
    assert pool.num_free == 6 and pool.ref_count(blocks[0]) == 1
    pool.free(blocks[:1])
    pool.check_all_free()


def test_double_free_and_overallocation_raise() -> None:
    pool = BlockPool(4, None)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(BlockPoolError):
        pool.free(blocks[:1])
    with pytest.raises(BlockPoolError):
        pool.allocate(4)


def test_freed_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(5, None)
    a, b, c, d = pool.allocate(4)
    pool.free([a, b])  # freed tail first: b then a
    pool.free([c])
    assert pool.allocate(3) == [b, a, c]


def test_prefix_cache_checks_tokens_on_hit() -> None:
    cache = PrefixCache()
    cache.insert(5, block_hash=1234, token_ids=[1, 2, 3, 4])
    assert cache.lookup(1234, [1, 2, 3, 4]) == 5
    assert cache.lookup(1234, [1, 2, 3, 9]) is None  # a hash collision is not a hit
    cache.evict(5)
    assert cache.lookup(1234, [1, 2, 3, 4]) is None


def test_hash_chain_depends_on_the_whole_prefix() -> None:
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chain_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different parent
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == a  # partial blocks are not hashed


def test_cached_blocks_survive_free_until_reused_then_are_evicted() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    first = make_request(list(range(1, 11)), "a")
    assert kv.allocate(first, 10, kv.find_cached_prefix(first))
    first.num_computed_tokens = 10
    kv.cache_full_blocks(first, first.num_computed_tokens)
    assert kv.pool.num_cached == 2
    kv.free(first)
    assert kv.pool.num_free == 5 and kv.pool.num_cached == 2

    second = make_request(list(range(1, 11)) + [42], "b")
    prefix = kv.find_cached_prefix(second)
    assert len(prefix.block_ids) == 2
    assert kv.allocate(second, 3, prefix)
    assert second.num_computed_tokens == 8 and second.num_cached_tokens == 8
    assert kv.prefix_cache.hit_rate > 0
    kv.free(second)

    hog = make_request(list(range(100, 120)), "c")
    assert kv.allocate(
        hog, 20, kv.find_cached_prefix(hog)
    )  # takes every block: the cache is evicted
    assert kv.pool.num_cached == 0
    kv.free(hog)
    kv.pool.check_all_free()


def test_a_full_prompt_hit_still_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = make_request(list(range(8)), "a")
    kv.allocate(first, 8, kv.find_cached_prefix(first))
    first.num_computed_tokens = 8
    kv.cache_full_blocks(first, first.num_computed_tokens)
    again = make_request(list(range(8)), "b")
    assert len(kv.find_cached_prefix(again).block_ids) == 1


def test_allocation_counts_cached_free_blocks_it_revives() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    first = make_request([1, 2, 3, 4, 5, 6], "a")
    assert kv.allocate(first, 6, kv.find_cached_prefix(first))
    first.num_computed_tokens = 6
    kv.cache_full_blocks(first, first.num_computed_tokens)
    kv.free(first)
    second = make_request([1, 2, 3, 4, 9, 9, 9], "b")
    prefix = kv.find_cached_prefix(second)
    assert len(prefix.block_ids) == 2
    # 2 cached blocks leave the free queue and 2 new ones are needed: 4 > 3 free
    assert not kv.allocate(second, 3, prefix)
    assert kv.pool.num_free == 3 and second.block_ids == []

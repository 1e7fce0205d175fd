"""BlockPool: allocation, reference counts and the prefix cache."""

from __future__ import annotations

import pytest

from kvrecover.engine.block_pool import BlockPool
from kvrecover.kv_layout import NULL_BLOCK_ID, hash_block_tokens


def test_null_block_is_never_allocated():
    pool = BlockPool(5, enable_caching=True)
    assert pool.num_usable_blocks == pool.num_free_blocks == 4
    blocks = pool.allocate(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert NULL_BLOCK_ID not in [b.block_id for b in blocks]
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="asked for 1 blocks with 0 free"):
        pool.allocate(1)
    for block in blocks:
        pool.release(block)
    assert NULL_BLOCK_ID not in [b.block_id for b in pool.allocate(4)]


def test_too_few_blocks_is_a_value_error():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1, enable_caching=True)


def test_ref_counts_free_a_block_only_when_the_last_holder_releases():
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.allocate(1)
    assert block.ref_count == 1
    pool.cache(block, hash_block_tokens(None, [1, 2]), [1, 2])
    pool.touch(block)  # a second request hits it
    assert block.ref_count == 2
    assert pool.num_free_blocks == 2
    pool.release(block)
    assert block.ref_count == 1 and pool.num_free_blocks == 2
    pool.release(block)
    assert block.ref_count == 0 and pool.num_free_blocks == 3
    # Freed but still cached: a hit takes it back off the free list.
    assert pool.lookup(block.block_hash, [1, 2]) is block
    pool.touch(block)
    assert block.ref_count == 1 and pool.num_free_blocks == 2


def test_freed_cached_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.allocate(4)
    hashes = []
    for i, block in enumerate(blocks):
        h = hash_block_tokens(None, [i, i])
        pool.cache(block, h, [i, i])
        hashes.append(h)
    # Free in the order 3, 1, 4, 2 (block ids).
    order = [blocks[2], blocks[0], blocks[3], blocks[1]]
    for block in order:
        pool.release(block)
    assert all(pool.lookup(h, [i, i]) is not None for i, h in enumerate(hashes))
    (evicted,) = pool.allocate(1)
    assert evicted.block_id == order[0].block_id
    # The evicted block lost its identity; the others stay hit-able.
    assert evicted.block_hash is None and evicted.token_ids is None
    assert pool.lookup(hashes[2], [2, 2]) is None
    assert pool.lookup(hashes[0], [0, 0]) is blocks[0]
    # A hit on a free block moves it out of the LRU order: the next eviction skips it.
    pool.touch(blocks[0])
    (evicted,) = pool.allocate(1)
    assert evicted.block_id == order[2].block_id


def test_lookup_compares_token_ids_to_rule_out_collisions():
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.allocate(1)
    h = hash_block_tokens(None, [7, 8, 9])
    pool.cache(block, h, [7, 8, 9])
    assert pool.lookup(h, [7, 8, 9]) is block
    # Same hash, other tokens (a forged or colliding hash) is a miss.
    assert pool.lookup(h, [7, 8, 10]) is None
    assert pool.lookup(hash_block_tokens(None, [1]), [7, 8, 9]) is None


def test_cache_first_writer_wins_and_uncache_forgets():
    pool = BlockPool(4, enable_caching=True)
    first, second = pool.allocate(2)
    h = hash_block_tokens(None, [1, 2])
    pool.cache(first, h, [1, 2])
    pool.cache(second, h, [1, 2])
    assert pool.lookup(h, [1, 2]) is first
    assert second.block_hash is None
    pool.uncache(first)
    assert pool.lookup(h, [1, 2]) is None
    assert first.block_hash is None and first.token_ids is None
    pool.cache(second, h, [1, 2])
    assert pool.lookup(h, [1, 2]) is second


def test_caching_disabled_never_caches():
    pool = BlockPool(4, enable_caching=False)
    (block,) = pool.allocate(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache(block, h, [1, 2])
    assert block.block_hash is None
    assert pool.lookup(h, [1, 2]) is None

"""KVCacheManager: prefix hits, allocation, freeing and invalidation of blocks."""

from __future__ import annotations

from kvrecover.engine.kv_cache_manager import KVCacheManager
from kvrecover.engine.request import Request
from kvrecover.kv_layout import NULL_BLOCK_ID
from kvrecover.sampling import SamplingParams

BLOCK = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, None, token_ids, SamplingParams(max_tokens=4), frozenset(), 0, 1024)


def run_prefill(manager: KVCacheManager, request: Request) -> None:
    """What the scheduler does for a request computed in one step: hit, allocate, cache."""
    hits = manager.find_cached_prefix(request)
    assert manager.allocate(request, request.num_tokens, hits)
    request.num_computed_tokens = request.num_tokens
    manager.cache_computed_blocks(request)


def test_allocate_and_free_return_every_block():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK, enable_prefix_caching=True)
    request = make_request("a", list(range(10)))
    assert manager.allocate(request, 10)
    assert len(request.block_ids) == 3
    assert NULL_BLOCK_ID not in request.block_ids
    assert manager.pool.num_free_blocks == 2
    # Growing by one token within the last block needs nothing new; past it one block.
    assert manager.allocate(request, 12)
    assert len(request.block_ids) == 3
    assert manager.allocate(request, 13)
    assert len(request.block_ids) == 4
    other = make_request("b", list(range(100, 110)))
    assert not manager.can_allocate(other, 10)
    assert not manager.allocate(other, 10)
    assert other.block_ids == [] and manager.pool.num_free_blocks == 1
    manager.free(request)
    assert request.block_ids == [] and manager.pool.num_free_blocks == 5
    assert all(manager.block(i).ref_count == 0 for i in range(1, 6))


def test_find_cached_prefix_hits_full_blocks_of_an_equal_prefix():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    first = make_request("a", list(range(11)))  # blocks [0-3] [4-7] + partial
    run_prefill(manager, first)
    assert first.num_cached_blocks == 2
    second = make_request("b", list(range(9)) + [99, 98, 97])
    hits = manager.find_cached_prefix(second)
    assert [b.block_id for b in hits.blocks[0]] == first.block_ids[:2]
    diverging = make_request("c", [0, 1, 2, 77] + list(range(4, 12)))
    assert len(manager.find_cached_prefix(diverging)) == 0
    # Hits are shared: allocating takes a reference on each.
    assert manager.allocate(second, second.num_tokens, hits)
    assert second.block_ids[:2] == first.block_ids[:2]
    assert [manager.block(i).ref_count for i in second.block_ids[:2]] == [2, 2]


def test_find_cached_prefix_never_covers_the_last_token():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    first = make_request("a", list(range(12)))  # exactly three full blocks
    run_prefill(manager, first)
    assert first.num_cached_blocks == 3
    same = make_request("b", list(range(12)))
    hits = manager.find_cached_prefix(same)
    # The third block holds the last token, whose logits must be computed.
    assert len(hits) == 2
    longer = make_request("c", list(range(13)))
    assert len(manager.find_cached_prefix(longer)) == 3
    assert len(manager.find_cached_prefix(make_request("d", [0, 1, 2, 3]))) == 0


def test_freed_blocks_stay_hit_able_and_disabled_caching_never_hits():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    first = make_request("a", list(range(9)))
    run_prefill(manager, first)
    cached_ids = first.block_ids[:2]
    manager.free(first)
    hits = manager.find_cached_prefix(make_request("b", list(range(9))))
    assert [b.block_id for b in hits.blocks[0]] == cached_ids

    plain = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=False)
    first = make_request("a", list(range(9)))
    run_prefill(plain, first)
    assert len(plain.find_cached_prefix(make_request("b", list(range(9))))) == 0


def test_can_allocate_counts_free_hit_blocks_as_used():
    # 4 usable blocks; a freed cached prefix of 2 blocks sits on the free list.
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK, enable_prefix_caching=True)
    first = make_request("a", list(range(9)))
    run_prefill(manager, first)
    manager.free(first)
    second = make_request("b", list(range(8)) + [50] * 8)  # 16 tokens = 4 blocks
    hits = manager.find_cached_prefix(second)
    assert len(hits) == 2
    assert manager.can_allocate(second, 16, hits)  # 2 hits + 2 fresh of the 2 other free
    assert not manager.can_allocate(second, 17, hits)
    assert manager.allocate(second, 16, hits)
    assert manager.pool.num_free_blocks == 0
    assert second.num_cached_blocks == 2


def test_make_private_from_keeps_private_blocks_and_uncaches_them():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    request = make_request("a", list(range(13)))
    run_prefill(manager, request)
    block_ids = list(request.block_ids)
    manager.make_private_from(request, 1)
    assert request.block_ids == block_ids  # recomputed in place
    assert request.num_cached_blocks == 1
    assert manager.block(block_ids[0]).block_hash is not None
    assert all(manager.block(i).block_hash is None for i in block_ids[1:])
    assert len(manager.find_cached_prefix(make_request("b", list(range(13))))) == 1


def test_make_private_from_swaps_shared_blocks_for_fresh_ones():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    owner = make_request("a", list(range(13)))
    run_prefill(manager, owner)
    sharer = make_request("b", list(range(12)) + [40, 41])
    run_prefill(manager, sharer)
    shared = owner.block_ids[:3]
    assert sharer.block_ids[:3] == shared
    # Block 1 of the shared prefix failed to load for `sharer`; block 2 is valid but shared.
    manager.uncache_blocks({shared[1]})
    manager.make_private_from(sharer, 1)
    assert sharer.block_ids[0] == shared[0]
    assert sharer.block_ids[1] not in owner.block_ids
    assert sharer.block_ids[2] not in owner.block_ids
    # The owner keeps its blocks; the invalid one left the prefix cache, the valid one did not.
    assert owner.block_ids[:3] == shared
    assert manager.block(shared[1]).block_hash is None
    assert manager.block(shared[2]).block_hash is not None
    assert [manager.block(i).ref_count for i in shared] == [2, 1, 1]
    assert sharer.num_cached_blocks == 1
    hits = manager.find_cached_prefix(make_request("c", list(range(13))))
    assert [b.block_id for b in hits.blocks[0]] == shared[:1]


def test_make_private_from_without_spare_blocks_drops_the_tail():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK, enable_prefix_caching=True)
    owner = make_request("a", list(range(9)))  # 3 blocks, 2 full and cached
    run_prefill(manager, owner)
    sharer = make_request("b", list(range(9)))
    hits = manager.find_cached_prefix(sharer)
    assert len(hits) == 2
    assert manager.allocate(sharer, 8, hits)
    assert manager.pool.num_free_blocks == 0
    manager.uncache_blocks({owner.block_ids[1]})
    manager.make_private_from(sharer, 1)
    assert sharer.block_ids == owner.block_ids[:1]
    assert manager.block(owner.block_ids[1]).ref_count == 1
    assert manager.block(owner.block_ids[1]).block_hash is None


def test_blocks_completed_by_later_chunks_and_decodes_get_cached():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    request = make_request("a", list(range(14)))
    # Chunked prefill: 6 tokens (block 1 half full), then the remaining 8.
    assert manager.allocate(request, 6)
    request.num_computed_tokens = 6
    manager.cache_computed_blocks(request)
    assert request.num_cached_blocks == 1
    assert manager.allocate(request, 14)
    request.num_computed_tokens = 14
    manager.cache_computed_blocks(request)
    assert request.num_cached_blocks == 3
    # A decoded token fills block 3.
    request.append_output_token(14)
    request.append_output_token(15)
    assert manager.allocate(request, 16)
    request.num_computed_tokens = 16
    manager.cache_computed_blocks(request)
    assert request.num_cached_blocks == 4
    probe = make_request("b", list(range(17)))
    assert [b.block_id for b in manager.find_cached_prefix(probe).blocks[0]] == request.block_ids


def test_uncache_blocks_ignores_ids_outside_the_pool():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    request = make_request("a", list(range(9)))
    run_prefill(manager, request)
    manager.uncache_blocks({NULL_BLOCK_ID, -3, 8, 10**9})
    assert len(manager.find_cached_prefix(make_request("b", list(range(9))))) == 2
    manager.uncache_blocks({request.block_ids[1]})
    assert len(manager.find_cached_prefix(make_request("c", list(range(9))))) == 1


def test_take_and_release_blocks_hand_references_over():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    request = make_request("a", list(range(12)))
    assert manager.allocate(request, 12)
    taken = manager.take_blocks(request, 1)
    assert len(taken) == 2 and len(request.block_ids) == 1
    assert all(manager.block(i).ref_count == 1 for i in taken)
    assert manager.pool.num_free_blocks == 4
    manager.release_blocks(taken)
    assert manager.pool.num_free_blocks == 6
    manager.free(request)
    assert manager.pool.num_free_blocks == 7

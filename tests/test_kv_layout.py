"""kv_layout: the layout fingerprint, chain hashes and block arithmetic."""

from __future__ import annotations

import torch

from kvrecover.kv_layout import (
    KVCacheLayout,
    blocks_needed,
    hash_block_tokens,
    latest_resume_point,
    resume_points,
    stores_state_at,
    update_block_hashes,
)


def test_blocks_needed():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_hash_chain_depends_on_parent_and_tokens():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    assert len(first) == 16
    assert first != hash_block_tokens(None, [1, 2, 3, 5])
    # Same tokens after different prefixes are different blocks.
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    other_parent = hash_block_tokens(None, [9, 9, 9, 9])
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(other_parent, [5, 6, 7, 8])


def test_update_block_hashes_covers_full_blocks_only_and_extends():
    tokens = list(range(10))
    hashes: list[bytes] = []
    update_block_hashes(hashes, tokens, block_size=4)
    assert len(hashes) == 2  # tokens 8, 9 are a partial block
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    update_block_hashes(hashes, tokens + [10, 11], block_size=4)
    assert len(hashes) == 3
    assert hashes[2] == hash_block_tokens(hashes[1], [8, 9, 10, 11])


def test_layout_sizes_and_fingerprint():
    layout = KVCacheLayout("m", torch.float16, block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    assert layout.block_shape == (2, 4, 2, 8)
    assert layout.block_nbytes == 3 * 2 * 4 * 2 * 8 * 2
    assert layout.fingerprint == KVCacheLayout("m", torch.float16, 4, 3, 2, 8).fingerprint
    assert len(layout.fingerprint) == 16
    for other in (KVCacheLayout("n", torch.float16, 4, 3, 2, 8),
                  KVCacheLayout("m", torch.float32, 4, 3, 2, 8),
                  KVCacheLayout("m", torch.float16, 8, 3, 2, 8)):
        assert other.fingerprint != layout.fingerprint


def test_resume_points_are_the_multiples_of_k_strictly_inside_the_load():
    assert list(resume_points(0, 10, 2)) == [2, 4, 6, 8]  # neither 0 nor the end block 10
    assert list(resume_points(4, 10, 2)) == [6, 8]  # a load starting at a multiple
    assert list(resume_points(3, 10, 2)) == [4, 6, 8]
    assert list(resume_points(0, 9, 3)) == [3, 6]  # the end block 9, a multiple: excluded
    assert list(resume_points(0, 10, 1)) == list(range(1, 10))
    assert list(resume_points(2, 7, 16)) == []  # K larger than the load
    assert list(resume_points(0, 16, 16)) == []  # K = the load: only its end
    assert list(resume_points(5, 6, 1)) == []  # one block


def test_the_latest_resume_point_at_or_before_the_first_invalid_block():
    points = resume_points(0, 10, 2)  # 2, 4, 6, 8
    assert latest_resume_point(points, 6) == 6  # the first invalid block at a multiple
    assert latest_resume_point(points, 7) == 6
    assert latest_resume_point(points, 9) == 8  # the last block (or the end state)
    assert latest_resume_point(points, 20) == 8  # beyond the load
    assert latest_resume_point(points, 1) is None  # before the first multiple
    assert latest_resume_point(points, 0) is None
    assert latest_resume_point(resume_points(4, 10, 2), 4) is None  # the load's start
    assert latest_resume_point(resume_points(2, 7, 16), 5) is None  # K larger than the load
    assert latest_resume_point([3, 9], 8) == 3  # any ascending boundaries (a worker's list)


def test_a_producer_stores_states_at_the_last_loadable_boundary_and_every_kth_before():
    # 4-token blocks, a 23-token prompt: loadable up to boundary 5 (22 // 4).
    stored = [b for b in range(0, 8) if stores_state_at(b, 23, 4, 2)]
    assert stored == [2, 4, 5]
    assert [b for b in range(0, 8) if stores_state_at(b, 23, 4, 1024)] == [5]
    assert [b for b in range(0, 4) if stores_state_at(b, 4, 4, 1)] == []  # nothing loadable
    assert [b for b in range(0, 4) if stores_state_at(b, 5, 4, 1)] == [1]

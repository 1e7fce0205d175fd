"""kv_layout: the layout fingerprint, chain hashes and block arithmetic."""

from __future__ import annotations

import torch

from kvrecover.kv_layout import KVCacheLayout, blocks_needed, hash_block_tokens, update_block_hashes


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

"""kv_groups: building groups from layer windows, and what a window needs."""

from __future__ import annotations

import pytest
import torch

from kvrecover.kv_groups import (
    KVCacheGroup,
    build_kv_groups,
    layer_slots,
    single_group,
)
from kvrecover.kv_layout import KVCacheLayout


def gemma3_windows(num_layers: int = 26, window: int = 512) -> list[int | None]:
    """Five local layers, then one global, repeated."""
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_gemma3_pattern_splits_the_local_kind_into_groups_of_the_global_size():
    groups = build_kv_groups(gemma3_windows())
    assert groups[0] == KVCacheGroup(None, (5, 11, 17, 23))
    local = [g.layer_indices for g in groups[1:]]
    assert local == [(0, 1, 2, 3), (4, 6, 7, 8), (9, 10, 12, 13), (14, 15, 16, 18),
                     (19, 20, 21, 22), (24, 25)]
    assert all(g.window == 512 for g in groups[1:])
    slots = layer_slots(groups)
    assert (slots[5].group, slots[5].tensor) == (0, 0)
    assert (slots[25].group, slots[25].tensor) == (6, 1)
    assert sorted(i for g in groups for i in g.layer_indices) == list(range(26))


def test_gemma2_alternating_layers_make_two_groups_of_equal_size():
    windows = [4096 if i % 2 == 0 else None for i in range(8)]
    assert build_kv_groups(windows) == (
        KVCacheGroup(None, (1, 3, 5, 7)), KVCacheGroup(4096, (0, 2, 4, 6)))


def test_all_full_attention_is_the_single_group_and_keeps_the_layout():
    groups = build_kv_groups([None] * 6)
    assert groups == single_group(6)
    plain = KVCacheLayout("m", torch.float32, 16, 6, 2, 8)
    grouped = KVCacheLayout("m", torch.float32, 16, 6, 2, 8, groups=groups)
    assert grouped.fingerprint == plain.fingerprint
    assert grouped.block_nbytes == plain.block_nbytes == 6 * 2 * 16 * 2 * 8 * 4
    assert plain.num_cache_tensors == 6


def test_a_windowed_layout_has_another_fingerprint_and_blocks_of_one_group():
    plain = KVCacheLayout("m", torch.float32, 16, 12, 2, 8)
    windows = gemma3_windows(12, 32)
    grouped = KVCacheLayout("m", torch.float32, 16, 12, 2, 8, groups=build_kv_groups(windows))
    other_window = KVCacheLayout("m", torch.float32, 16, 12, 2, 8,
                                 groups=build_kv_groups(gemma3_windows(12, 64)))
    assert len({plain.fingerprint, grouped.fingerprint, other_window.fingerprint}) == 3
    assert grouped.num_cache_tensors == 2  # 2 global layers: groups of 2
    assert grouped.block_nbytes * 6 == plain.block_nbytes


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "8"])
def test_a_bad_window_is_a_value_error_naming_the_layer(window):
    with pytest.raises(ValueError, match="layer 1 has sliding window"):
        build_kv_groups([None, window])


def test_first_needed_block_follows_q_minus_w_lt_k():
    group = KVCacheGroup(4, (0,))
    # Queries from 8 on read keys >= 5: block 1 (4..7) is still needed.
    assert group.first_needed_block(8, 4) == 1
    assert group.first_needed_block(11, 4) == 2  # keys >= 8
    assert group.first_needed_block(3, 4) == 0
    assert KVCacheGroup(None, (0,)).first_needed_block(1000, 4) == 0
    # A load to 16 brings the window before 16 (block 3) and one more window.
    assert group.first_loaded_block(16, 4) == 2


# ----- issue 23: recurrent (linear-attention) layers belong to no group --------------------
def test_recurrent_layers_have_no_group_and_no_cache_tensor():
    from kvrecover.kv_groups import LayerSlot, layer_slot_map

    groups = build_kv_groups([None] * 4, recurrent_layers=[0, 2])
    assert groups == (KVCacheGroup(None, (1, 3)),)
    assert layer_slot_map(groups, 4) == [None, LayerSlot(0, 0), None, LayerSlot(0, 1)]
    with pytest.raises(ValueError, match="full_attention layer"):
        build_kv_groups([None] * 2, recurrent_layers=[0, 1])

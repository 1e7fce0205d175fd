"""The one-launch Triton `align_by_expert` (`ops/triton/moe_align.py`) gives the torch
version's `ExpertBlocks` bit for bit: random routings over top-k, expert counts, token
counts and block sizes, skewed ones (all to one expert, every expert used, experts with
exactly a block of rows), no tokens, and the size limit. On CUDA, or on the CPU under
TRITON_INTERPRET=1."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from conftest import TRITON_DEVICE, TRITON_TESTS

from kvrecover.ops.reference.grouped_moe import align_by_expert

pytestmark = TRITON_TESTS


def assert_same_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    from kvrecover.ops.triton.moe_align import align_by_expert_triton

    topk_ids = topk_ids.to(TRITON_DEVICE)
    empty = torch.empty
    # Poisoned outputs: an element the kernel missed must not keep a freed buffer's
    # sentinels (the allocator hands the last case's buffers back).
    with mock.patch.object(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(-7)):
        got = align_by_expert_triton(topk_ids, num_experts, block_m)
    expected = align_by_expert(topk_ids, num_experts, block_m)
    case = (tuple(topk_ids.shape), num_experts, block_m)
    assert got.sorted_ids.dtype == got.block_expert.dtype == torch.int32, case
    assert torch.equal(got.sorted_ids, expected.sorted_ids), case
    assert torch.equal(got.block_expert, expected.block_expert), case
    assert (got.num_blocks, got.num_assignments, got.block_m) == (
        expected.num_blocks, expected.num_assignments, expected.block_m), case


def routed(num_tokens: int, top_k: int, num_experts: int,
           generator: torch.Generator) -> torch.Tensor:
    """Each token's `top_k` distinct experts, at random (int64, as `torch.topk` gives)."""
    return torch.stack([torch.randperm(num_experts, generator=generator)[:top_k]
                        for _ in range(num_tokens)])


ALL_TOKENS = (1, 2, 3, 16, 17, 64, 100)
# (top_k, experts, token counts): every top-k and expert count of the models' range
# (two token counts at 512 experts: 512 programs are slow in the interpreter).
SHAPES = [(1, 4, ALL_TOKENS), (2, 8, ALL_TOKENS), (4, 60, ALL_TOKENS), (8, 64, ALL_TOKENS),
          (8, 128, ALL_TOKENS), (10, 128, ALL_TOKENS), (10, 512, (3, 100))]


@pytest.mark.parametrize("top_k,num_experts,token_counts", SHAPES)
def test_random_routings_give_the_torch_blocks(top_k, num_experts, token_counts):
    generator = torch.Generator().manual_seed(top_k * 1000 + num_experts)
    for index, num_tokens in enumerate(token_counts):
        block_m = (16, 32, 64)[(index + top_k) % 3]  # each block size over the shapes
        assert_same_blocks(routed(num_tokens, top_k, num_experts, generator),
                           num_experts, block_m)


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_skewed_routings_give_the_torch_blocks(block_m):
    generator = torch.Generator().manual_seed(block_m)
    # Every token to one expert (the first, a middle one, the last).
    for expert in (0, 37, 63):
        assert_same_blocks(torch.full((100, 1), expert), 64, block_m)
    # Every expert used, each a whole number of blocks: exactly block_m rows apiece.
    assert_same_blocks(torch.arange(8).repeat(block_m, 1), 8, block_m)
    # One row over and one under a block, and experts left empty between them.
    ids = torch.cat([torch.full((block_m + 1,), 2), torch.full((block_m - 1,), 5),
                     torch.full((block_m,), 59)])
    assert_same_blocks(ids[torch.randperm(len(ids), generator=generator)][:, None], 60, block_m)
    # Every expert of 128 used once by 16 tokens of top-8 (decode, the widest spread).
    assert_same_blocks(torch.randperm(128, generator=generator).view(16, 8), 128, block_m)


def test_no_tokens_give_no_blocks():
    assert_same_blocks(torch.empty(0, 8, dtype=torch.int64), 64, 16)


def test_the_size_limit_gives_the_torch_blocks_and_past_it_is_refused():
    from kvrecover.ops.triton.moe_align import (
        MAX_ASSIGNMENTS,
        align_by_expert_triton,
        triton_align_applies,
    )

    generator = torch.Generator().manual_seed(9)
    assert_same_blocks(routed(MAX_ASSIGNMENTS // 8, 8, 64, generator), 64, 64)
    # All of them to one expert: its blocks span most of the buffer.
    assert_same_blocks(torch.full((MAX_ASSIGNMENTS, 1), 3), 128, 16)
    too_many = torch.zeros(MAX_ASSIGNMENTS + 1, 1, dtype=torch.int64, device=TRITON_DEVICE)
    with pytest.raises(ValueError):
        align_by_expert_triton(too_many, 8, 16)
    assert not triton_align_applies(too_many, 8)
    assert triton_align_applies(too_many[:MAX_ASSIGNMENTS], 8) == (TRITON_DEVICE == "cuda")

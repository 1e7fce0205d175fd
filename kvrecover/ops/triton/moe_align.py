"""`align_by_expert` in one Triton launch, for decode-sized steps.

The torch version (`reference.grouped_moe.align_by_expert`) takes about fifteen
launches, a radix sort among them, to sort a step's few hundred assignments by
expert. Here one program per expert reads every assignment: a histogram gives all
the experts' counts, so each program knows its expert's first padded row (the
padded counts of the experts before it) and places its expert's assignments at
their rank among that expert's (a cumulative sum over token order), then its
padding rows and its blocks' expert. Together the programs also write the unused
rows and blocks after the last expert's, so every element of both outputs is
written and nothing is zeroed first. The result is the torch version's, bit for
bit; no host sync and shapes fixed by the token count, so CUDA graphs capture it.

`fused_moe` calls it where `triton_align_applies`. On an H100 (2026-12-06) it gave the
torch version's blocks on CUDA and in a captured graph (`tests/ops/test_gpu_moe.py`) in
1.9-6.4 µs a call against the torch version's 54-84 µs, graph-replayed, 1-256 tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrecover.ops.reference.grouped_moe import ExpertBlocks, max_blocks

MAX_ASSIGNMENTS = 4096  # tokens x top-k: every program holds them all in registers
MAX_EXPERTS = 1024  # the histogram's bins
_MIN_LANES = 32  # the smallest vector: one warp, each thread an element


@triton.jit
def _align_kernel(
    ids_ptr, sorted_ids_ptr, block_expert_ptr, num_assignments, num_rows, num_blocks,
    BLOCK_M: tl.constexpr, LANES: tl.constexpr, BINS: tl.constexpr,
    EXPERT_BLOCKS: tl.constexpr, ROWS_EACH: tl.constexpr, BLOCKS_EACH: tl.constexpr,
):
    """Program e: expert e's rows and blocks, and its share of the unused ones."""
    expert = tl.program_id(0)
    lanes = tl.arange(0, LANES)
    inside = lanes < num_assignments
    ids = tl.load(ids_ptr + lanes, mask=inside, other=0).to(tl.int32)
    bins = tl.arange(0, BINS)
    # The padding lanes read 0: take them out of bin 0 (no histogram mask: older Tritons).
    counts = tl.histogram(ids, BINS) - tl.where(bins == 0, LANES - num_assignments, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(bins < expert, padded, 0), axis=0)
    used_rows = tl.sum(padded, axis=0)
    count = tl.sum(tl.where(bins == expert, counts, 0), axis=0)
    mine = inside & (ids == expert)
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    tl.store(sorted_ids_ptr + start + rank, lanes, mask=mine)
    pad = count + tl.arange(0, BLOCK_M)
    end = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    sentinel = tl.zeros([BLOCK_M], tl.int32) + num_assignments
    tl.store(sorted_ids_ptr + start + pad, sentinel, mask=pad < end)
    blocks = tl.arange(0, EXPERT_BLOCKS)
    tl.store(block_expert_ptr + start // BLOCK_M + blocks,
             tl.zeros([EXPERT_BLOCKS], tl.int32) + expert, mask=blocks < end // BLOCK_M)
    # The rows and blocks past every expert's, split evenly among the programs.
    rows = expert * ROWS_EACH + tl.arange(0, ROWS_EACH)
    tl.store(sorted_ids_ptr + rows, tl.zeros([ROWS_EACH], tl.int32) + num_assignments,
             mask=(rows >= used_rows) & (rows < num_rows))
    tail = expert * BLOCKS_EACH + tl.arange(0, BLOCKS_EACH)
    tl.store(block_expert_ptr + tail, tl.full([BLOCKS_EACH], -1, tl.int32),
             mask=(tail >= used_rows // BLOCK_M) & (tail < num_blocks))


def _lanes(n: int) -> int:
    return max(_MIN_LANES, triton.next_power_of_2(n))


def triton_align_applies(topk_ids: torch.Tensor, num_experts: int) -> bool:
    """Whether `align_by_expert_triton` takes `topk_ids` [T, k]: on CUDA, at most
    `MAX_ASSIGNMENTS` assignments and `MAX_EXPERTS` experts."""
    return (topk_ids.is_cuda and topk_ids.numel() <= MAX_ASSIGNMENTS
            and num_experts <= MAX_EXPERTS)


def align_by_expert_triton(topk_ids: torch.Tensor, num_experts: int,
                           block_m: int) -> ExpertBlocks:
    """`align_by_expert`'s `ExpertBlocks`, bit for bit, in one launch (at most
    `MAX_ASSIGNMENTS` assignments, `MAX_EXPERTS` experts; any device Triton runs on)."""
    flat = topk_ids.reshape(-1)
    num_assignments = flat.shape[0]
    if num_assignments > MAX_ASSIGNMENTS or num_experts > MAX_EXPERTS:
        raise ValueError(f"{num_assignments} assignments of {num_experts} experts: "
                         f"past the Triton align's {MAX_ASSIGNMENTS} and {MAX_EXPERTS}")
    num_blocks = max_blocks(num_assignments, num_experts, block_m)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    if num_assignments:
        lanes = _lanes(num_assignments)
        _align_kernel[(num_experts,)](
            flat, sorted_ids, block_expert, num_assignments, num_blocks * block_m, num_blocks,
            BLOCK_M=block_m, LANES=lanes, BINS=_lanes(num_experts),
            EXPERT_BLOCKS=_lanes(triton.cdiv(num_assignments, block_m)),
            ROWS_EACH=_lanes(triton.cdiv(num_blocks * block_m, num_experts)),
            BLOCKS_EACH=_lanes(triton.cdiv(num_blocks, num_experts)),
            num_warps=min(4, lanes // 32),  # no thread holds a copy of another's assignment
        )
    return ExpertBlocks(sorted_ids, block_expert, block_m, num_assignments)

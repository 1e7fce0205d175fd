"""The experts' feed-forward without host syncs: assignments sorted by expert on the device.

`align_by_expert` sorts a step's token -> expert assignments by expert into row
blocks of a fixed `block_m`, each block holding one expert's rows (padded with a
sentinel), in a buffer whose size depends only on the token count: no `.item()`,
no data-dependent shape, so a CUDA graph can capture it. The Triton fused MoE
(`ops.triton.moe`) runs one program row per block; `grouped_mm_moe` is the torch
alternative over `torch._grouped_mm` (contiguous per-expert row ranges, bf16 on
sm90; `grouped_mm_available` says where it runs). Both combine a token's outputs
in top-k order in float32 (`reference.moe.combine_topk`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvrecover.ops.interface import ExpertWeights
from kvrecover.ops.reference.moe import combine_topk, expert_activation


@dataclass(frozen=True)
class ExpertBlocks:
    """A step's assignments in row blocks of `block_m` rows, one expert per block.

    `sorted_ids[r]` is the flat assignment index (`token * k + slot`) of padded row
    `r`, or `num_assignments` on padding rows; `block_expert[b]` is the expert of
    block `b`, or -1 for the unused blocks at the end. Each expert's rows are in
    token order.
    """

    sorted_ids: torch.Tensor  # [num_blocks * block_m] int32
    block_expert: torch.Tensor  # [num_blocks] int32
    block_m: int
    num_assignments: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_assignments: int, num_experts: int, block_m: int) -> int:
    """How many `block_m`-row blocks any routing of `num_assignments` can need: each
    active expert wastes at most `block_m - 1` rows of its last block."""
    active = min(num_experts, num_assignments)
    return -(-(num_assignments + active * (block_m - 1)) // block_m)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """`ExpertBlocks` of `topk_ids` [T, k], computed on its device without a host sync."""
    flat = topk_ids.reshape(-1)
    num_assignments = flat.shape[0]
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.sort(flat, stable=True).indices
    experts_sorted = flat[order]
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_assignments, device=device) - starts[experts_sorted]
    rows = (padded_ends - padded)[experts_sorted] + rank
    num_blocks = max_blocks(num_assignments, num_experts, block_m)
    sorted_ids = torch.full((num_blocks * block_m,), num_assignments, dtype=torch.int32,
                            device=device)
    sorted_ids[rows] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertBlocks(sorted_ids, block_expert, block_m, num_assignments)


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs the experts for `x`: present in this torch, and
    bf16 on a CUDA device of compute capability 9.0 or later (or the CPU fallback)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16:
        return False
    if x.device.type != "cuda":
        return x.device.type == "cpu"
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


def grouped_mm_moe(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    experts: ExpertWeights, silu_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`MoEKernels.moe` as two `torch._grouped_mm` calls over the assignments sorted by
    expert (contiguous ranges, ends in `offs`); no host sync. Not batch-invariant:
    the grouped GEMM's kernel choice may depend on the row counts."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    num_tokens, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    order = torch.sort(flat, stable=True).indices
    rows = x[order // k]
    hidden = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)
    if experts.gate_up_bias is not None:  # each sorted row's expert's bias
        hidden = hidden + experts.gate_up_bias[flat[order]]
    hidden = expert_activation(experts, silu_mul)(hidden)
    out_sorted = torch._grouped_mm(hidden, down.transpose(1, 2), offs=offs)
    if experts.down_bias is not None:
        out_sorted = out_sorted + experts.down_bias[flat[order]]
    expert_out = torch.empty_like(out_sorted)
    expert_out[order] = out_sorted
    return combine_topk(expert_out.view(num_tokens, k, -1), topk_weights)

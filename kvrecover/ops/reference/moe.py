"""The mixture-of-experts feed-forward in plain torch: the reference, and the shared steps.

The token -> expert assignments of a step (`T` tokens, `k` experts each) are
sorted by expert (`ExpertGroups`), each active expert runs one matmul pair over
its contiguous rows (never a loop over tokens), and `combine_topk` sums each
token's `k` weighted outputs in top-k order in float32. `expert_runner` is one
expert's feed-forward over any matmul: biases added after their matmuls and the
experts' activation (SwiGLU, or gpt-oss's `clamped_swiglu`). The CPU-invariant
backend (`ops.cpu.invariant_ops`) reuses the grouping, the runner and the combine
with fixed-tile matmuls; the GPU kernels (`ops.triton.moe`) follow the same rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F

from kvrecover.ops.interface import ClampedSwiGLU, ExpertWeights

WeightT = TypeVar("WeightT")
WeightT_co = TypeVar("WeightT_co", covariant=True)


class PerExpert(Protocol[WeightT_co]):
    """Expert `e`'s weight by index: a stacked tensor, or a list of packed linears."""

    def __getitem__(self, expert: int, /) -> WeightT_co: ...


@dataclass(frozen=True)
class ExpertGroups:
    """A step's assignments sorted by expert: `order[start:end]` are the flat
    assignment indices (`token * k + slot`) of expert `expert`, for each active one."""

    order: torch.Tensor  # [T * k] flat assignment indices, grouped by expert
    tokens: torch.Tensor  # [T * k] the token of each sorted assignment
    ranges: list[tuple[int, int, int]]  # (expert, start, end) of each active expert

    @classmethod
    def of(cls, topk_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
        """Group `topk_ids` [T, k]; a stable sort keeps each expert's rows in token order.
        Reads the per-expert counts on the host (one sync: the CPU and reference paths)."""
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        ranges, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                ranges.append((expert, start, start + count))
                start += count
        return cls(order, order // k, ranges)

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(expert, its flat assignment indices, their tokens) per active expert."""
        for expert, start, end in self.ranges:
            yield expert, self.order[start:end], self.tokens[start:end]


def combine_topk(expert_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """`sum_j w[t, j] * y[t, j]` for `expert_out` [T, k, H] in float32, slot by slot in
    top-k order (a fixed order, whatever else the batch holds), rounded once to
    `expert_out`'s dtype."""
    weights = topk_weights.float()
    total = expert_out[:, 0].float() * weights[:, 0:1]
    for slot in range(1, expert_out.shape[1]):
        total += expert_out[:, slot].float() * weights[:, slot : slot + 1]
    return total.to(expert_out.dtype)


def grouped_moe(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
    run_expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The MoE feed-forward with `run_expert(expert, rows)` ([n, H] -> [n, H], the model
    dtype) running one expert over its gathered rows."""
    num_tokens, k = topk_ids.shape
    expert_out = x.new_empty(num_tokens * k, x.shape[1])
    for expert, assignments, tokens in ExpertGroups.of(topk_ids, num_experts):
        # index_select / index_copy_: ~1.5x faster than x[tokens] and an indexed
        # assignment for prefill-sized steps on the CPU (bench/NOTES.md, issue 22).
        expert_out.index_copy_(0, assignments, run_expert(expert, x.index_select(0, tokens)))
    return combine_topk(expert_out.view(num_tokens, k, -1), topk_weights)


def clamped_swiglu(gate_up: torch.Tensor, activation: ClampedSwiGLU) -> torch.Tensor:
    """gpt-oss's activation (`ops.interface.ClampedSwiGLU`) for `gate_up = [gate | up]`,
    op for op as Hugging Face's `GptOssExperts._apply_gate` (after de-interleaving)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=activation.limit)
    up = up.clamp(min=-activation.limit, max=activation.limit)
    glu = gate * torch.sigmoid(gate * activation.alpha)
    return (up + 1) * glu


def expert_activation(
    experts: ExpertWeights, silu_mul: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation between `experts`' two matmuls: `silu_mul` (the backend's SwiGLU),
    or their `clamped_swiglu` where they have one."""
    activation = experts.clamped_swiglu
    if activation is None:
        return silu_mul
    return functools.partial(clamped_swiglu, activation=activation)


def expert_runner(
    experts: ExpertWeights, gate_up: PerExpert[WeightT], down: PerExpert[WeightT],
    matmul: Callable[[torch.Tensor, WeightT], torch.Tensor],
    silu_mul: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """`run_expert(expert, rows)` for `grouped_moe`: `matmul(rows, gate_up[expert])` plus
    its bias (rounded after the matmul, as Hugging Face adds it), the experts'
    activation, the down matmul plus its bias. `gate_up` / `down` are per-expert weights
    in whatever form `matmul` takes (tensors, packed linears)."""
    activation = expert_activation(experts, silu_mul)
    gate_up_bias, down_bias = experts.gate_up_bias, experts.down_bias

    def run_expert(expert: int, rows: torch.Tensor) -> torch.Tensor:
        hidden = matmul(rows, gate_up[expert])
        if gate_up_bias is not None:
            hidden = hidden + gate_up_bias[expert]
        out = matmul(activation(hidden), down[expert])
        return out if down_bias is None else out + down_bias[expert]

    return run_expert


def reference_moe(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    experts: ExpertWeights, silu_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`MoEKernels.moe` with `F.linear` over the stacked weights, one pair per active expert."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    run_expert = expert_runner(experts, gate_up, down, F.linear, silu_mul)
    return grouped_moe(x, topk_weights, topk_ids, gate_up.shape[0], run_expert)

"""The Gated DeltaNet layer of Qwen3-Next and Qwen3.5 (Hugging Face's `*GatedDeltaNet`).

Input projections (Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, grouped by key head
as Hugging Face's `fix_query_key_value_ordering` splits them; Qwen3.5: `in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a`), a short depthwise causal convolution with its
conv state, the gated delta rule (decay `g = -exp(A_log) * softplus(a + dt_bias)`,
`beta = sigmoid(b)`, q and k l2-normalised) over the recurrent state, an RMSNorm
gated by `silu(z)`, and `out_proj`. The per-request states live in the worker's
slots (`models/recurrent_state.py`); the kernels are the backend's
(`ops.interface.LinearAttentionKernels`), each called once for all the step's
requests (`*_batch`).

Under tensor parallelism each rank holds Hk / size key heads and their Hv / size value
heads (projections, conv channels, decay parameters, states); the gated RMSNorm is
per head, so it stays local, and `out_proj` is row-parallel with an all-reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from kvrecover.models.parallel_layers import (
    SINGLE_RANK,
    RowParallelLinear,
    TensorParallelGroup,
    attach_row_ranges,
)
from kvrecover.models.recurrent_state import RecurrentLayerStep, StateSpec
from kvrecover.ops.interface import DeltaRuleState

if TYPE_CHECKING:
    from kvrecover.ops.interface import ModelOps


class LinearAttentionShape(Protocol):
    """The config fields a Gated DeltaNet layer reads."""

    hidden_size: int
    rms_norm_eps: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; `split_projections` picks Qwen3.5's four input
    projections over Qwen3-Next's two grouped ones."""

    def __init__(self, config: LinearAttentionShape, ops: ModelOps, *,
                 split_projections: bool, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        # This rank's heads: Hk / size key heads and the Hv / size value heads that read them.
        self.num_k_heads = config.linear_num_key_heads // tp.size
        self.num_v_heads = config.linear_num_value_heads // tp.size
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
        self.split_projections = split_projections
        hidden = config.hidden_size
        if split_projections:
            self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(hidden, self.conv_dim + self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size,
                                groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = _GateNormWeight(self.head_v_dim)  # per head: the same on every rank
        if tp.size == 1:
            self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        else:
            self.out_proj = RowParallelLinear(self.value_dim, hidden,
                                              tp.rank * self.value_dim)
            self._read_slices(config)

    def _read_slices(self, config: LinearAttentionShape) -> None:
        """Make each projection read only this rank's heads from the checkpoint: the
        conv channels and Qwen3.5's `in_proj_qkv` as three ranges ([q all | k all |
        v all]), Qwen3-Next's grouped projections as one (they are ordered by key head)."""
        rank, heads_v = self.tp.rank, self.num_v_heads
        whole_key = config.linear_num_key_heads * self.head_k_dim
        whole_value = config.linear_num_value_heads * self.head_v_dim
        qkv = [(rank * self.key_dim, self.key_dim), (whole_key + rank * self.key_dim, self.key_dim),
               (2 * whole_key + rank * self.value_dim, self.value_dim)]
        attach_row_ranges(self.conv1d.weight, qkv, 2 * whole_key + whole_value)
        per_value_head = [(rank * heads_v, heads_v)]
        for param in (self.dt_bias, self.A_log):
            attach_row_ranges(param, per_value_head, config.linear_num_value_heads)
        if self.split_projections:
            attach_row_ranges(self.in_proj_qkv.weight, qkv, 2 * whole_key + whole_value)
            attach_row_ranges(self.in_proj_z.weight, [(rank * self.value_dim, self.value_dim)],
                              whole_value)
            for proj in (self.in_proj_b, self.in_proj_a):
                attach_row_ranges(proj.weight, per_value_head, config.linear_num_value_heads)
            return
        qkvz_rows = self.in_proj_qkvz.out_features  # this rank's key heads' groups
        attach_row_ranges(self.in_proj_qkvz.weight, [(rank * qkvz_rows, qkvz_rows)],
                          qkvz_rows * self.tp.size)
        ba_rows = self.in_proj_ba.out_features
        attach_row_ranges(self.in_proj_ba.weight, [(rank * ba_rows, ba_rows)],
                          ba_rows * self.tp.size)

    def state_specs(self, chunk_size: int) -> list[StateSpec]:
        """The per-request state: the conv inputs before the position (model dtype), the
        recurrent state at the last chunk boundary and the chunk's inputs since (float32)."""
        f32, heads = torch.float32, self.num_v_heads
        return [
            StateSpec("conv", (self.conv_dim, self.kernel_size - 1)),
            StateSpec("state", (heads, self.head_k_dim, self.head_v_dim), f32),
            StateSpec("query_tail", (chunk_size, heads, self.head_k_dim), f32, False),
            StateSpec("key_tail", (chunk_size, heads, self.head_k_dim), f32, False),
            StateSpec("value_tail", (chunk_size, heads, self.head_v_dim), f32, False),
            StateSpec("decay_tail", (chunk_size, heads), f32, False),
            StateSpec("beta_tail", (chunk_size, heads), f32, False),
        ]

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(mixed qkv [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        ops, rows = self.ops, hidden.shape[0]
        if self.split_projections:
            return (ops.linear(hidden, self.in_proj_qkv),
                    ops.linear(hidden, self.in_proj_z).view(rows, self.num_v_heads, -1),
                    ops.linear(hidden, self.in_proj_b), ops.linear(hidden, self.in_proj_a))
        ratio = self.num_v_heads // self.num_k_heads
        qkvz = ops.linear(hidden, self.in_proj_qkvz).view(rows, self.num_k_heads, -1)
        ba = ops.linear(hidden, self.in_proj_ba).view(rows, self.num_k_heads, -1)
        query, key, value, z = torch.split(
            qkvz, [self.head_k_dim, self.head_k_dim, ratio * self.head_v_dim,
                   ratio * self.head_v_dim], dim=-1)
        b, a = torch.split(ba, [ratio, ratio], dim=-1)
        mixed = torch.cat((query.reshape(rows, -1), key.reshape(rows, -1),
                           value.reshape(rows, -1)), dim=-1)
        return (mixed, z.reshape(rows, self.num_v_heads, -1), b.reshape(rows, -1),
                a.reshape(rows, -1))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                step: RecurrentLayerStep) -> torch.Tensor:
        ops = self.ops
        mixed, z, b, a = self._project(hidden)
        decay, beta = ops.delta_gates(a, b, self.A_log, self.dt_bias)
        weight = self.conv1d.weight.view(self.conv_dim, self.kernel_size)
        tensors, checkpoints, rows = step.tensors, step.checkpoints, hidden.shape[0]
        conv = ops.causal_conv1d_batch(mixed, tensors["conv"], weight, step.requests,
                                       checkpoints.get("conv"))
        query, key, value = torch.split(conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        states = DeltaRuleState(*(tensors[name] for name in (
            "state", "query_tail", "key_tail", "value_tail", "decay_tail", "beta_tail")))
        out = ops.gated_delta_rule_batch(
            query.reshape(rows, self.num_k_heads, -1), key.reshape(rows, self.num_k_heads, -1),
            value.reshape(rows, self.num_v_heads, -1), decay, beta, states, step.requests,
            step.chunk_size, checkpoints.get("state")).to(hidden.dtype)
        normed = ops.gated_rms_norm(out.view(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim),
                                    self.norm.weight, self.eps)
        out = ops.linear(normed.view(hidden.shape[0], self.value_dim), self.out_proj)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)


class _GateNormWeight(nn.Module):
    """The gated RMSNorm's weight (checkpoint name `linear_attn.norm.weight`, ones)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

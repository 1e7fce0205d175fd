"""The full-attention layer of Qwen3-Next and Qwen3.5 (Hugging Face's `Qwen3NextAttention`).

`q_proj` yields each head's query followed by its output gate ([T, H, 2 * D], split
per head); q and k go through (1 + w) RMSNorms over the head dim, then rotary over
their first `rotary_dim` dims only (partial rotary: `partial_rotary_factor`); the
attention output is multiplied by `sigmoid(gate)` before `o_proj`. The projections
keep Hugging Face's names and shapes (no fused qkv: the query rows interleave the gate).
Under tensor parallelism the heads split as in `layers.Attention` (a rank's query heads
with their gates are one range of `q_proj`'s rows; o_proj row-parallel, all-reduced).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvrecover.models.config import ModelConfig
from kvrecover.models.layers import RMSNorm
from kvrecover.models.parallel_layers import (
    SINGLE_RANK,
    RowParallelLinear,
    TensorParallelGroup,
    attach_row_ranges,
    shard_heads,
)
from kvrecover.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from kvrecover.ops.interface import ModelOps, PagedAttention


def row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`1 / (1 + exp(-x))`: each element's bits independent of the tensor's size (torch's
    vectorised sigmoid rounds a vector's remainder elements differently, which would make
    a token's bits depend on how many tokens share its step)."""
    return torch.exp(-x).add_(1).reciprocal_()


class GatedAttention(nn.Module):
    """Self-attention with an output gate, q/k (1 + w) norms and partial rotary by
    `rotary` (a table of `rotary.head_dim` = rotary_dim dims)."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, rotary_dim: int,
                 attention: PagedAttention[Any], ops: ModelOps, *, bias: bool,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.ops = ops
        self.attention = attention
        self.rotary = rotary
        self.rotary_dim = rotary_dim
        self.head_dim = config.head_dim
        self.tp = tp
        heads = shard_heads(config.num_attention_heads, config.num_key_value_heads, tp.size,
                            tp.rank)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        hidden, dim = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, 2 * self.num_heads * dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * dim, bias=bias)
        self.q_norm = RMSNorm(dim, config.rms_norm_eps, plus_one=True)
        self.k_norm = RMSNorm(dim, config.rms_norm_eps, plus_one=True)
        self.scale = dim**-0.5
        if tp.size == 1:
            self.o_proj = nn.Linear(self.num_heads * dim, hidden, bias=bias)
            return
        if bias:
            raise ValueError("attention_bias (an o_proj bias) runs on one rank only; use "
                             "tensor_parallel_size 1 for this model")
        # Each query head's rows are its query then its gate: a rank's heads are one range.
        attach_row_ranges(self.q_proj.weight, [(heads.head_start * 2 * dim,
                                                2 * self.num_heads * dim)],
                          2 * config.num_attention_heads * dim)
        for proj in (self.k_proj, self.v_proj):
            attach_row_ranges(proj.weight, [(heads.kv_head_start * dim, self.num_kv_heads * dim)],
                              config.num_key_value_heads * dim)
        self.o_proj = RowParallelLinear(self.num_heads * dim, hidden, heads.head_start * dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_meta: Any) -> torch.Tensor:
        ops, rows, dim = self.ops, hidden.shape[0], self.head_dim
        query, gate = ops.linear(hidden, self.q_proj).view(rows, self.num_heads, 2 * dim).chunk(
            2, dim=-1)
        query = self.q_norm.norm(ops, query.contiguous())
        key = self.k_norm.norm(ops, ops.linear(hidden, self.k_proj).view(rows, -1, dim))
        value = ops.linear(hidden, self.v_proj).view(rows, -1, dim)
        split = self.rotary_dim
        rotated_q, rotated_k = ops.rotary(self.rotary, positions, query[..., :split].contiguous(),
                                          key[..., :split].contiguous())
        query = torch.cat((rotated_q, query[..., split:]), dim=-1)
        key = torch.cat((rotated_k, key[..., split:]), dim=-1)
        out = self.attention.attend(query, key, value, None, positions, kv_cache, attn_meta,
                                    self.scale)
        out = out.reshape(rows, -1) * row_sigmoid(gate.reshape(rows, -1))
        out = ops.linear(out, self.o_proj)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)

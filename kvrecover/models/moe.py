"""The sparse mixture-of-experts feed-forward shared by the MoE families (Mixtral, Qwen3-MoE,
gpt-oss's experts).

A router linear scores the experts, a softmax (float32) and top-k pick `k` of
them per token, optionally renormalised to sum to one (Hugging Face's order:
softmax, then top-k, then renormalise); the backend's `ops.moe` runs the chosen
experts' SwiGLU and sums their weighted outputs in top-k order (gpt-oss routes by
`route_topk_logits` instead: top-k of the logits, then a softmax over those). Expert weights
are stacked (`[E, 2I, H]` gate_up, `[E, H, I]` down) and load from the classic
per-expert checkpoint tensors (`expert_renames`, the families' `checkpoint_renames`)
or from the fused tensors `transformers` uses in memory. Under tensor parallelism the
router is replicated and each expert's intermediate dim split (gate/up rows, down
columns, read alone); the block all-reduces the summed expert outputs once.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvrecover.models.config import FieldReader
from kvrecover.models.layers import load_shard
from kvrecover.models.loader import (
    CheckpointRename,
    CheckpointTensor,
    attach_shard_loader,
    attach_slice_loader,
)
from kvrecover.models.parallel_layers import SINGLE_RANK, TensorParallelGroup

if TYPE_CHECKING:
    from kvrecover.ops.interface import ClampedSwiGLU, ModelOps


class ExpertWeights(nn.Module):
    """The stacked SwiGLU weights of `num_experts` experts (an `ops.interface.ExpertWeights`).

    Checkpoint shards are `"gate:<e>"`, `"up:<e>"` (rows of `gate_up_proj[e]`) and
    `"down:<e>"` (`down_proj[e]`); an expert index outside the config's count is an error.
    No biases and plain SwiGLU (a subclass sets `gate_up_bias`, `down_bias` and
    `clamped_swiglu`: `models.gpt_oss.GptOssExperts`).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        # Under tensor parallelism each expert's intermediate dim is split: this rank's
        # gate/up rows and down columns [start, start + local) of every expert.
        self.intermediate_size = intermediate_size // tp.size
        self.intermediate_start = tp.rank * self.intermediate_size
        self.gate_up_bias: torch.Tensor | None = None
        self.down_bias: torch.Tensor | None = None
        self.clamped_swiglu: ClampedSwiGLU | None = None
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size,
                                                     hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size,
                                                  self.intermediate_size))
        experts = range(num_experts)
        attach_shard_loader(self.gate_up_proj, self._load_gate_up,
                            [f"{kind}:{e}" for kind in ("gate", "up") for e in experts])
        attach_shard_loader(self.down_proj, self._load_down, [f"down:{e}" for e in experts])
        if tp.size > 1:
            self.whole_intermediate_size = intermediate_size
            attach_slice_loader(self.gate_up_proj, self._read_gate_up_slice)
            attach_slice_loader(self.down_proj, self._read_down_slice)

    def _read_gate_up_slice(self, param: nn.Parameter, source: CheckpointTensor,
                            shard: str | None) -> None:
        """This rank's rows of one expert's gate or up tensor (or of the fused
        [E, 2I, H] tensor), read alone."""
        start, size = self.intermediate_start, self.intermediate_size
        whole = self.whole_intermediate_size
        if shard is None:
            self._check_fused(source, (self.num_experts, 2 * whole, self.hidden_size))
            param.data[:, :size].copy_(source.file.read_slice(source.name, 1, start, size))
            param.data[:, size:].copy_(source.file.read_slice(source.name, 1, whole + start,
                                                              size))
            return
        self._check_fused(source, (whole, self.hidden_size))
        offset = 0 if shard.startswith("gate:") else size
        param.data[self._expert_index(shard), offset : offset + size].copy_(
            source.read_rows(start, size))

    def _read_down_slice(self, param: nn.Parameter, source: CheckpointTensor,
                         shard: str | None) -> None:
        """This rank's columns of one expert's down tensor (or of the fused [E, H, I])."""
        start, size = self.intermediate_start, self.intermediate_size
        if shard is None:
            self._check_fused(source, (self.num_experts, self.hidden_size,
                                       self.whole_intermediate_size))
            param.data.copy_(source.file.read_slice(source.name, 2, start, size))
            return
        self._check_fused(source, (self.hidden_size, self.whole_intermediate_size))
        param.data[self._expert_index(shard)].copy_(source.read_columns(start, size))

    def _check_fused(self, source: CheckpointTensor, expected: tuple[int, ...]) -> None:
        if tuple(source.shape) != expected:
            raise ValueError(f"checkpoint tensor {source.name!r} of shape "
                             f"{tuple(source.shape)} is not the expected {expected}; does "
                             "config.json's expert count and intermediate size match the weights?")

    def _expert_index(self, shard: str) -> int:
        index = int(shard.partition(":")[2])
        if not 0 <= index < self.num_experts:
            raise ValueError(f"expert {index} is out of range for {self.num_experts} experts; "
                             "does config.json's expert count match the weights?")
        return index

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        size = self.intermediate_size
        offset = 0 if shard.startswith("gate:") else size
        load_shard(param.data[self._expert_index(shard)], loaded, offset, size)

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        target = param.data[self._expert_index(shard)]
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit an expert's down "
                             f"projection of shape {tuple(target.shape)}; does config.json's "
                             "intermediate size match the weights?")
        target.copy_(loaded)

    def as_linears(self) -> tuple[list[nn.Linear], list[nn.Linear]]:
        """One bias-free `nn.Linear` per expert for gate_up and for down, their weights
        views of the stacked tensors (no copy)."""
        def linear(weight: torch.Tensor) -> nn.Linear:
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            layer.weight = nn.Parameter(weight, requires_grad=False)
            return layer

        return ([linear(w) for w in self.gate_up_proj.data],
                [linear(w) for w in self.down_proj.data])


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
               weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]): softmax over the experts in float32, the `top_k`
    largest (descending), renormalised to sum to one when `renormalize`, and rounded
    to `weights_dtype` (None: kept float32). Row-local: a token's route does not
    depend on its batch."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_dtype is not None:
        weights = weights.to(weights_dtype)
    return weights, ids


def route_topk_logits(router_logits: torch.Tensor,
                      top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) in gpt-oss's order: the `top_k` largest logits
    (descending), then a softmax over those alone (in float32, rounded to the logits'
    dtype, as Hugging Face's `GptOssTopKRouter`). Row-local."""
    top_logits, ids = torch.topk(router_logits, top_k, dim=-1)
    weights = torch.softmax(top_logits.float(), dim=-1).to(router_logits.dtype)
    return weights, ids


class SparseMoeBlock(nn.Module):
    """Router (`gate`, a linear to the expert scores) plus the experts' SwiGLU.

    `round_weights` rounds the routing weights to the router's dtype before they
    weight the experts (Qwen3-MoE does; Mixtral keeps them float32).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 ops: ModelOps, *, renormalize: bool, round_weights: bool,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.round_weights = round_weights
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # replicated on every rank
        self.experts = ExpertWeights(num_experts, hidden_size, intermediate_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.partial_sum(x)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' output from this rank's slice of their intermediate dims (the
        whole output at one rank; the caller all-reduces it under tensor parallelism)."""
        logits = self.ops.linear(x, self.gate)
        weights, ids = route_topk(logits, self.top_k, self.renormalize,
                                  logits.dtype if self.round_weights else None)
        return self.ops.moe(x, weights, ids, self.experts)


def check_expert_split(config: Any, size: int, fields: tuple[str, ...]) -> None:
    """A ValueError naming both numbers unless `size` ranks divide each of `config`'s
    expert intermediate sizes `fields` (each rank holds a slice of every expert)."""
    for name in fields:
        value = getattr(config, name)
        if value % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                             f"{name} {value}; choose a divisor of {value}")


def routing_fields(fields: FieldReader, count_field: str) -> tuple[int, int]:
    """(experts, top-k) from config.json's `count_field` and `num_experts_per_tok`: a
    ValueError naming the field unless 1 <= top-k <= experts (each MoE family's
    `hf_fields`)."""
    num_experts = fields.positive_int(count_field)
    top_k = fields.positive_int("num_experts_per_tok")
    if top_k > num_experts:
        fields.fail("num_experts_per_tok", f"an integer in [1, {count_field}={num_experts}]")
    return num_experts, top_k


def expert_renames(block: str, projections: dict[str, str]) -> tuple[CheckpointRename, ...]:
    """Checkpoint renames of per-expert tensors `layers.N.<block>.experts.E.<name>.weight`
    (`projections`: checkpoint name -> "gate", "up" or "down") and of the router
    `layers.N.<block>.gate.weight` into `layers.N.mlp.experts` / `layers.N.mlp.gate`."""
    prefix = rf"(layers\.\d+)\.{re.escape(block)}\."
    renames = [CheckpointRename(
        rf"{prefix}experts\.(\d+)\.{re.escape(name)}\.weight",
        r"\1.mlp.experts." + ("down_proj" if kind == "down" else "gate_up_proj"),
        kind + r":\2",
    ) for name, kind in projections.items()]
    renames.append(CheckpointRename(rf"{prefix}gate\.weight", r"\1.mlp.gate.weight"))
    return tuple(renames)

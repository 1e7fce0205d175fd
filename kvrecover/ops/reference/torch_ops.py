"""The model's linears and small ops in plain torch: the reference (CPU, tests).

Faster backends subclass `TorchOps` (`ops.triton.fused_ops.TritonOps`,
`ops.cpu.invariant_ops.InvariantCpuOps`); every override must round where these
round. `TorchOps` is an `ops.interface.ModelOps`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvrecover.ops.cpu.onednn import pack_expert_weights, pack_linear_weights, packed_linear
from kvrecover.ops.interface import (
    DeltaRuleState,
    ExpertWeights,
    RecurrentRequestRows,
    RotaryTables,
)
from kvrecover.ops.reference import gated_delta
from kvrecover.ops.reference.moe import expert_runner, grouped_moe, reference_moe
from kvrecover.ops.reference.rotary import reference_rotary


class TorchOps:
    """Linears, RMSNorm, rotary, SwiGLU and the experts' feed-forward as plain torch ops."""

    def __init__(self) -> None:
        # Per experts module (by id, the module kept alive here): one gate_up and one
        # down linear per expert, prepared (packed) by the backend's `prepare_weights`.
        self._expert_linears: dict[
            int, tuple[ExpertWeights, list[nn.Linear], list[nn.Linear]]] = {}

    def prepare_weights(self, model: nn.Module) -> None:
        """Called once right after loading: pack the float32 CPU linears for oneDNN,
        each expert's included."""
        pack_linear_weights(model)
        for module in model.modules():
            if isinstance(module, ExpertWeights):
                packed = pack_expert_weights(module)
                if packed is not None:
                    self._expert_linears[id(module)] = (module, *packed)

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """`x @ layer.weight.T + layer.bias`; through oneDNN when the weight was
        packed after loading (`onednn.pack_linear_weights`), else `F.linear`."""
        if layer.weight.is_mkldnn:
            return packed_linear(x, layer)
        return F.linear(x, layer.weight, layer.bias)

    def embedding(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The rows of `weight` for `input_ids` (token embeddings)."""
        return F.embedding(input_ids, weight)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim in float32, rounded to `x`'s dtype before the weight."""
        input_dtype = x.dtype
        x = x.float()
        # In place on fresh tensors only: each new large temporary costs page faults.
        x = (x * x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()).to(input_dtype)
        return x.mul_(weight) if weight.dtype == input_dtype else weight * x

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(residual + x), residual + x)."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rms_norm_plus_one(self, x: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> torch.Tensor:
        """Gemma's RMSNorm: `x / rms(x) * (1 + weight)` in float32, rounded once to
        `x`'s dtype (as Hugging Face's `Gemma2RMSNorm`)."""
        normed = x.float()
        normed = normed * normed.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        return normed.mul_(1.0 + weight.float()).to(x.dtype)

    def add_rms_norm_plus_one(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (rms_norm_plus_one(residual + x), residual + x)."""
        residual = residual + x
        return self.rms_norm_plus_one(residual, weight, eps), residual

    def rotary(
        self, tables: RotaryTables, positions: torch.Tensor, query: torch.Tensor,
        key: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `query` and `key` by `positions` with the model's tables."""
        return reference_rotary(tables, positions, query, key)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: `silu(gate) * up` for `gate_up = [gate | up]` along the last dim."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU: `gelu(gate, approximate="tanh") * up` for `gate_up = [gate | up]`."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)

    def moe(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        experts: ExpertWeights,
    ) -> torch.Tensor:
        """The experts' feed-forward (`MoEKernels.moe`): one matmul pair per active expert,
        through `linear` over its per-expert linears where `prepare_weights` made them."""
        entry = self._expert_linears.get(id(experts))
        if entry is None:
            return self._stacked_moe(x, topk_weights, topk_ids, experts)
        _, gate_up, down = entry
        run_expert = expert_runner(experts, gate_up, down, self.linear, self.silu_mul)
        return grouped_moe(x, topk_weights, topk_ids, len(gate_up), run_expert)

    def _stacked_moe(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        experts: ExpertWeights,
    ) -> torch.Tensor:
        """`moe` over the stacked weights (experts `prepare_weights` did not split)."""
        return reference_moe(x, topk_weights, topk_ids, experts, self.silu_mul)

    def causal_conv1d(self, x: torch.Tensor, conv_state: torch.Tensor,
                      weight: torch.Tensor) -> torch.Tensor:
        """The short causal convolution of a linear-attention layer (`LinearAttentionKernels`)."""
        return gated_delta.causal_conv1d(x, conv_state, weight)

    def gated_delta_rule(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        decay: torch.Tensor, beta: torch.Tensor, state: DeltaRuleState,
        start: int, chunk_size: int, snapshots: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> torch.Tensor:
        """The gated delta rule in absolute-aligned chunks (`LinearAttentionKernels`)."""
        return gated_delta.gated_delta_rule(query, key, value, decay, beta, state, start,
                                            chunk_size, snapshots)

    def causal_conv1d_batch(self, x: torch.Tensor, conv_states: torch.Tensor,
                            weight: torch.Tensor, requests: Sequence[RecurrentRequestRows],
                            checkpoints: torch.Tensor | None = None) -> torch.Tensor:
        """The convolution of a step's requests, one per-request call each."""
        return gated_delta.causal_conv1d_batch(x, conv_states, weight, requests, checkpoints)

    def gated_delta_rule_batch(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        decay: torch.Tensor, beta: torch.Tensor, states: DeltaRuleState,
        requests: Sequence[RecurrentRequestRows], chunk_size: int,
        checkpoints: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The delta rule of a step's requests, one per-request call each."""
        return gated_delta.gated_delta_rule_batch(query, key, value, decay, beta, states,
                                                  requests, chunk_size, checkpoints)

    def delta_gates(self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                    dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The delta rule's decay and beta (`LinearAttentionKernels`)."""
        return gated_delta.delta_gates(a, b, a_log, dt_bias)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
        """RMSNorm times `silu(gate)` (`LinearAttentionKernels`)."""
        return gated_delta.gated_rms_norm(x, gate, weight, eps)

"""The Triton backend's linear-attention ops: the batched causal convolution and gated
delta rule of `ops.triton.causal_conv` and `ops.triton.gated_delta`, behind the
`LinearAttentionKernels` names. The per-request names stay the reference's.

`delta_gates` and `gated_rms_norm` are `ops.triton.delta_gates`' single launches.
The step's index tensors (`StepPlan`) are built by the first layer that sees the
step's request list and reused by the others (the worker hands every layer the same
list object; the plan keeps it alive, so its identity cannot be reused). A CUDA-graphed
decode step hands the layers `PlannedRequests`, whose plan lives in the graph's static
step buffer (`ops/triton/step_plan.py`).
Import only where Triton exists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrecover.ops.interface import DeltaRuleState, RecurrentRequestRows
from kvrecover.ops.triton import causal_conv, gated_delta
from kvrecover.ops.triton import delta_gates as small_ops
from kvrecover.ops.triton.step_plan import PlannedRequests, StepPlan, build_plan


class TritonLinearAttention:
    """`causal_conv1d_batch` and `gated_delta_rule_batch` as one launch (two for the
    convolution) per layer over every request of the step; `delta_gates` and
    `gated_rms_norm` one launch each (`ops.triton.delta_gates`)."""

    delta_gates = staticmethod(small_ops.delta_gates)
    gated_rms_norm = staticmethod(small_ops.gated_rms_norm)

    _plan: StepPlan | None = None

    def _plan_for(self, requests: Sequence[RecurrentRequestRows],
                  device: torch.device) -> StepPlan:
        if isinstance(requests, PlannedRequests):  # a graphed step's, prebuilt
            return requests.plan
        plan = self._plan
        if plan is None or plan.requests is not requests or plan.meta.device != device:
            plan = self._plan = build_plan(requests, device)
        return plan

    def causal_conv1d_batch(self, x: torch.Tensor, conv_states: torch.Tensor,
                            weight: torch.Tensor, requests: Sequence[RecurrentRequestRows],
                            checkpoints: torch.Tensor | None = None) -> torch.Tensor:
        """The step's convolution in one output launch and one state (and checkpoint)
        launch."""
        return causal_conv.causal_conv1d_batch(x, conv_states, weight,
                                               self._plan_for(requests, x.device), checkpoints)

    def gated_delta_rule_batch(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        decay: torch.Tensor, beta: torch.Tensor, states: DeltaRuleState,
        requests: Sequence[RecurrentRequestRows], chunk_size: int,
        checkpoints: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's delta rule in one launch."""
        return gated_delta.gated_delta_rule_batch(
            query, key, value, decay, beta, states, self._plan_for(requests, query.device),
            chunk_size, checkpoints)

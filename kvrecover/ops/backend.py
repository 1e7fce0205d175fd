"""Which kernels run: one `KernelBackend`, chosen once from the engine arguments.

The model runner calls `select_backend` once and hands the result to the model
(attention and small ops per layer) and keeps it for itself (step inputs, CUDA
graphs); nothing else decides which kernel runs.

"auto" runs the Triton kernels (paged attention and fused small ops) on CUDA
and the torch reference elsewhere; "torch" and "triton" force one (Triton off
CUDA only under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvrecover.config import ATTENTION_BACKENDS
from kvrecover.ops.torch_attention import TorchPagedAttention
from kvrecover.ops.torch_ops import TorchOps


@dataclass(frozen=True)
class KernelBackend:
    """The attention implementation and the small ops/linears one engine runs.

    `attention` has `name`, `fuses_rotary`, `forward(q, k, v, kv_cache, meta,
    scale)` and, when `fuses_rotary`, `forward_rotary(rotary, positions, q, k, v,
    kv_cache, meta, scale)`; `ops` is a `TorchOps` (or a subclass).
    """

    name: str  # "torch" or "triton"
    attention: Any
    ops: TorchOps
    batch_invariant: bool = False

    def prepare_weights(self, model: nn.Module) -> None:
        """Called once right after the weights are loaded and cast: bring them into
        the layout the linears read (oneDNN packing on the CPU reference path)."""
        self.ops.prepare_weights(model)


def select_backend(
    attention_backend: str, device: torch.device, *, batch_invariant: bool = False
) -> KernelBackend:
    """The backend for `attention_backend` on `device` (see the module docstring).

    `batch_invariant` (Triton only) routes every linear through the
    fixed-order Triton matmul and keeps decode attention on the prefill tiles;
    the torch reference ignores it.
    """
    if attention_backend not in ATTENTION_BACKENDS:  # EngineArgs checks too; direct callers
        raise ValueError(
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}"
        )
    if attention_backend == "triton" or (attention_backend == "auto" and device.type == "cuda"):
        from kvrecover.ops.triton_attention import TritonPagedAttention
        from kvrecover.ops.triton_ops import BatchInvariantOps, TritonOps

        ops = BatchInvariantOps() if batch_invariant else TritonOps()
        return KernelBackend("triton", TritonPagedAttention(batch_invariant), ops, batch_invariant)
    return KernelBackend("torch", TorchPagedAttention(), TorchOps())

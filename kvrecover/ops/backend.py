"""Which kernels run: one `KernelBackend`, chosen once from the engine arguments.

The model runner calls `select_backend` once and hands the result to the model
(attention and small ops per layer) and keeps it for itself (step inputs, CUDA
graphs); nothing else decides which kernel runs.

"auto" runs the Triton kernels (paged attention and fused small ops) on CUDA
and the torch path elsewhere; "torch" and "triton" force one (Triton off
CUDA only under `TRITON_INTERPRET=1`).

On the torch path, `batch_invariant` means what it means on Triton: a token's
bits do not depend on its batch or chunking. It selects the invariant CPU
kernels (`cpu_invariant_linear`; the C kernel of `native_attention`, or
`cpu_invariant_attention` where it cannot be built) for every dtype. bf16 and
fp16 on the CPU run them by default too (`HALF_INVARIANT_BY_DEFAULT`); float32
without `batch_invariant` runs the reference (oneDNN linears, SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvrecover.config import ATTENTION_BACKENDS
from kvrecover.ops.cpu_invariant_linear import HALF_DTYPES, InvariantCpuOps
from kvrecover.ops.native_attention import invariant_cpu_attention
from kvrecover.ops.torch_attention import TorchPagedAttention
from kvrecover.ops.torch_ops import TorchOps


@dataclass(frozen=True)
class KernelBackend:
    """The attention implementation and the small ops/linears one engine runs.

    `attention` has `name`, `fuses_rotary`, `forward(q, k, v, kv_cache, meta,
    scale)` and, when `fuses_rotary`, `forward_rotary(rotary, positions, q, k, v,
    kv_cache, meta, scale)`; `ops` is a `TorchOps` (or a subclass).
    """

    name: str  # "torch", "cpu_invariant" or "triton"
    attention: Any
    ops: TorchOps
    batch_invariant: bool = False

    def prepare_weights(self, model: nn.Module) -> None:
        """Called once right after the weights are loaded and cast: bring them into
        the layout the linears read (oneDNN packing on the CPU reference path)."""
        self.ops.prepare_weights(model)


# Whether bf16/fp16 on the CPU run the invariant kernels without `batch_invariant`.
# On: with the C attention kernel they cost no more than the reference kernels in
# bf16 (within the 15% a default may cost; bench/NOTES.md, "bf16 on the CPU").
HALF_INVARIANT_BY_DEFAULT = True


def select_backend(
    attention_backend: str, device: torch.device, *, batch_invariant: bool = False,
    dtype: torch.dtype = torch.float32,
) -> KernelBackend:
    """The backend for `attention_backend` on `device` (see the module docstring).

    `batch_invariant` on Triton routes every linear through the fixed-order
    Triton matmul and keeps decode attention on the prefill tiles; on the torch
    path it selects the invariant CPU kernels, which bf16/fp16 on the CPU run
    anyway (`HALF_INVARIANT_BY_DEFAULT`).
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
    if batch_invariant or (HALF_INVARIANT_BY_DEFAULT and dtype in HALF_DTYPES
                           and device.type == "cpu"):
        return KernelBackend("cpu_invariant", invariant_cpu_attention(device), InvariantCpuOps(),
                             True)
    return KernelBackend("torch", TorchPagedAttention(), TorchOps())

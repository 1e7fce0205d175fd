"""Which kernels run: one `KernelBackend`, chosen once from the engine arguments.

The model runner calls `select_backend` once, checks that the backend has the
features its model needs (`KernelBackend.check_supports`), hands the backend to
the model (attention and small ops per layer) and keeps it for itself (step
inputs, greedy sampling in CUDA graphs); nothing else decides which kernel runs,
and nothing outside this module names a family. Each family lives in its own
sub-package and provides the `ops.interface` Protocols:
- `ops.reference`: torch attention and ops (CPU and GPU), the reference numerics;
- `ops.cpu`: the batch-invariant CPU kernels (fixed-tile oneDNN linears, our C
  attention and row kernels, a torch fallback for the attention);
- `ops.triton`: Triton attention and fused ops, the batch-invariant matmul.

"auto" runs the Triton kernels on CUDA and the torch path elsewhere; "torch" and
"triton" force one (Triton off CUDA only under `TRITON_INTERPRET=1`).

On the torch path, `batch_invariant` means what it means on Triton: a token's
bits do not depend on its batch or chunking. It selects the invariant CPU
kernels for every dtype (the C attention kernel, or its torch fallback where it
cannot or may not be built: `native_kernels`). bf16 and fp16 on the CPU run
them by default too (`HALF_INVARIANT_BY_DEFAULT`); float32 without
`batch_invariant` runs the reference (oneDNN linears, SDPA), its attention through
the C kernel where it builds and vectorizes the heads (decodes, and prefills in query
tiles; SDPA for the rest) and its norms and rotary through the C row kernels
(bit-equal to torch's: `ops.cpu.row_kernel_ops`) where they build (`native_kernels`). On Triton, models
with experts run the invariant kernels by default (`MOE_INVARIANT_BY_DEFAULT`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvrecover.config import ATTENTION_BACKENDS
from kvrecover.ops.cpu.attention import invariant_cpu_attention, native_cpu_attention
from kvrecover.ops.cpu.invariant_ops import HALF_DTYPES, InvariantCpuOps
from kvrecover.ops.cpu.native_build import native_kernels_default
from kvrecover.ops.cpu.row_kernel_ops import RowKernelOps
from kvrecover.ops.interface import (
    BackendFeatures,
    ModelOps,
    PagedAttention,
    SamplingKernels,
    StepInputBuilder,
    StepInputSpec,
)
from kvrecover.ops.reference.sampling import TorchSampling
from kvrecover.ops.reference.step_inputs import ReferenceStepInputs
from kvrecover.ops.reference.torch_attention import TorchPagedAttention
from kvrecover.ops.reference.torch_ops import TorchOps


@dataclass(frozen=True)
class KernelBackend:
    """The kernels one engine runs: attention, the model's small ops and linears, the
    greedy-sampling kernel, and the step-input builder the attention reads."""

    name: str  # "torch", "cpu_invariant" or "triton"
    attention: PagedAttention[Any]
    ops: ModelOps
    step_inputs: Callable[[StepInputSpec], StepInputBuilder]
    sampling: SamplingKernels = field(default_factory=TorchSampling)
    features: BackendFeatures = BackendFeatures()
    batch_invariant: bool = False

    def prepare_weights(self, model: nn.Module) -> None:
        """Called once right after the weights are loaded and cast: bring them into
        the layout the linears read (oneDNN packing on the CPU reference path)."""
        self.ops.prepare_weights(model)

    def check_supports(self, needed: BackendFeatures, model_name: str) -> None:
        """A ValueError naming the model, the backend and each feature the model needs
        that this backend lacks; called at start-up, before any weight is loaded."""
        missing = self.features.missing(needed)
        if missing:
            raise ValueError(
                f"model {model_name} needs {', '.join(missing)}, which the {self.name!r} "
                f"kernel backend does not support; choose another attention_backend or model"
            )


# The features every family's attention implements (each kernel of each family); the
# linear-attention kernels are the torch reference's, which every family's ops inherit.
EVERY_BACKEND = BackendFeatures(sliding_window=True, logit_softcap=True, attention_sinks=True,
                                moe=True, linear_attention=True)

# Whether bf16/fp16 on the CPU run the invariant kernels without `batch_invariant`.
# On: with the C attention kernel they cost no more than the reference kernels in
# bf16 (within the 15% a default may cost; bench/NOTES.md, "bf16 on the CPU").
HALF_INVARIANT_BY_DEFAULT = True
# Mixture-of-experts models on Triton run the batch-invariant kernels by default: in the
# faster tiles a recomputed token's router logits can differ from the baseline's by an
# ulp and top-k turns that into another expert, so recovery would not reproduce the
# output (measured on gpt-oss; bench/NOTES.md, "GPU runs of 2026-12-01, evening"). The
# cost: 0-5% of MoE decode, ~27% of MoE prefill (bench_moe.py).
MOE_INVARIANT_BY_DEFAULT = True


def select_backend(
    attention_backend: str, device: torch.device, *, batch_invariant: bool = False,
    dtype: torch.dtype = torch.float32, native_kernels: bool | None = None,
    moe: bool = False,
) -> KernelBackend:
    """The backend for `attention_backend` on `device` (see the module docstring).

    `batch_invariant` on Triton routes every linear through the fixed-order
    Triton matmul and keeps decode attention on the prefill tiles; on the torch
    path it selects the invariant CPU kernels, which bf16/fp16 on the CPU run
    anyway (`HALF_INVARIANT_BY_DEFAULT`). `native_kernels` says whether those may
    build and run our C kernels (None: `KVRECOVER_NATIVE_KERNELS`, default on).
    `moe` (the model has experts) selects the invariant Triton kernels too
    (`MOE_INVARIANT_BY_DEFAULT`).
    """
    if attention_backend not in ATTENTION_BACKENDS:  # EngineArgs checks too; direct callers
        raise ValueError(
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}"
        )
    if attention_backend == "triton" or (attention_backend == "auto" and device.type == "cuda"):
        from kvrecover.ops.triton.attention import TritonPagedAttention, step_input_builder
        from kvrecover.ops.triton.fused_ops import BatchInvariantOps, TritonOps
        from kvrecover.ops.triton.sampling import TritonSampling

        batch_invariant = batch_invariant or (moe and MOE_INVARIANT_BY_DEFAULT)
        triton_ops = BatchInvariantOps() if batch_invariant else TritonOps()
        return KernelBackend("triton", TritonPagedAttention(batch_invariant), triton_ops,
                             step_input_builder, TritonSampling(), features=EVERY_BACKEND,
                             batch_invariant=batch_invariant)
    if batch_invariant or (HALF_INVARIANT_BY_DEFAULT and dtype in HALF_DTYPES
                           and device.type == "cpu"):
        native = native_kernels_default() if native_kernels is None else native_kernels
        invariant_ops = InvariantCpuOps(native_kernels=native)
        attention = invariant_cpu_attention(device, invariant_ops.rotary_in_place, native)
        return KernelBackend("cpu_invariant", attention, invariant_ops, ReferenceStepInputs,
                             features=EVERY_BACKEND, batch_invariant=True)
    if device.type != "cpu":
        ops = TorchOps()
        return KernelBackend("torch", TorchPagedAttention(ops.rotary), ops, ReferenceStepInputs,
                             features=EVERY_BACKEND)
    native = native_kernels_default() if native_kernels is None else native_kernels
    row_ops = RowKernelOps(native_kernels=native)  # bit-equal C norms and rotary
    # Decodes and tiled prefills read the cache in place (bench/NOTES.md); rotary writes
    # into q and k, which `attend` may overwrite.
    native_kernel = native_cpu_attention(row_ops.rotary_in_place, native)
    return KernelBackend("torch", TorchPagedAttention(row_ops.rotary_in_place, native_kernel),
                         row_ops, ReferenceStepInputs, features=EVERY_BACKEND)

"""oneDNN weight packing for float32 linears on the CPU.

Packed once, right after the weights are loaded, oneDNN's float32 matmul beats
MKL's at every batch size we run (measured on AVX2: ~1.3x at decode sizes, ~1.1x
for prefill chunks). A torch build that cannot pack keeps the dense weights and
`F.linear`.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from kvrecover.ops.interface import ExpertWeights

_BATCH_HINT = 8  # the row count oneDNN tunes the packed layout for


def pack_linear_weights(model: nn.Module) -> int:
    """Replace every float32 CPU `nn.Linear` weight of `model` by its packed form.

    A replaced dense weight is freed unless another module shares it (a tied
    embedding keeps its dense copy for lookups). Returns how many were packed;
    0 where this torch build cannot pack.
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    return sum(
        1 for module in model.modules() if isinstance(module, nn.Linear) and pack_linear(module)
    )


def pack_linear(layer: nn.Linear) -> bool:
    """Pack one layer's weight in place; False (weight untouched) where it cannot be packed."""
    weight = layer.weight
    if weight.is_mkldnn:
        return True
    if not _packable(weight):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    layer.weight = nn.Parameter(packed, requires_grad=False)
    _trim_heap()  # per layer: the freed dense copies never pile up
    return True


def pack_expert_weights(experts: ExpertWeights) -> tuple[list[nn.Linear], list[nn.Linear]] | None:
    """Per-expert packed gate_up and down linears of one float32 CPU experts module, its
    stacked weights then freed; None (untouched) where they cannot all be packed.

    A decode batch gives each expert a few rows: a packed weight runs them ~2x faster
    than `F.linear` over a slice of the stacked tensor (bench/NOTES.md, issue 22).
    """
    if not torch.backends.mkldnn.is_available() or not _packable(experts.gate_up_proj):
        return None
    gate_up, down = experts.as_linears()
    if not all(pack_linear(layer) for layer in (*gate_up, *down)):
        return None
    for param in (experts.gate_up_proj, experts.down_proj):
        param.data = param.data.new_empty(0)  # the packed copies replace them
    _trim_heap()
    return gate_up, down


def packed_linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """`x @ layer.weight.T + layer.bias` for a layer whose weight `pack_linear` packed."""
    return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def _trim_heap() -> None:
    """Return free heap pages to the OS. The dense weights just freed sit inside
    glibc's heap, which keeps them resident: without this the peak RSS grows by
    ~200 MB for SmolLM2-135M."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError, TypeError):  # not glibc
        pass

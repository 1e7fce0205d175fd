"""Gated DeltaNet's small elementwise ops as one Triton launch each (the torch reference,
`ops/reference/gated_delta.py`, takes four to ten): the delta rule's gates
(`delta_gates`) and the output's gated RMSNorm (`gated_rms_norm`).

Each element (each row, for the norm) is computed by itself in a fixed order, rounded
where the reference rounds (`ops.triton.rounding.round_to`), so its bits do not depend
on the tensor's size or the step's other rows; they are close to the reference's, not
equal (Triton's exp and rsqrt and the norm's sum order are not torch's), which the
reference's own contract allows (size-independent bits, not those of another backend).
Import only where Triton exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrecover.ops.reference.gated_delta import SOFTPLUS_THRESHOLD
from kvrecover.ops.triton.rounding import round_to

GATE_ROWS = 16  # rows per `delta_gates` program


@triton.jit
def _delta_gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, decay_ptr, beta_ptr, rows,
                        a_stride, b_stride, threshold, HV: tl.constexpr, BT: tl.constexpr,
                        BH: tl.constexpr):
    row = tl.program_id(0) * BT + tl.arange(0, BT)
    head = tl.arange(0, BH)
    mask = (row < rows)[:, None] & (head < HV)[None, :]
    a = tl.load(a_ptr + row[:, None] * a_stride + head[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + row[:, None] * b_stride + head[None, :], mask=mask, other=0.0)
    a_log = tl.load(a_log_ptr + head, mask=head < HV, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head, mask=head < HV, other=0.0).to(tl.float32)
    x = a.to(tl.float32) + dt_bias[None, :]
    softplus = tl.where(x > threshold, x, tl.log(tl.exp(tl.minimum(x, threshold)) + 1.0))
    decay = -tl.exp(a_log)[None, :] * softplus
    # sigmoid(b) = 1 / (1 + exp(-b)), each op rounded to b's dtype as the reference's are.
    dtype = beta_ptr.dtype.element_ty
    grown = round_to(round_to(tl.exp(-b.to(tl.float32)), dtype) + 1.0, dtype)
    out = row[:, None] * HV + head[None, :]
    tl.store(decay_ptr + out, decay, mask=mask)
    tl.store(beta_ptr + out, (1.0 / grown).to(dtype), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, gate_ptr, weight_ptr, out_ptr, x_stride, gate_stride, eps,
                           D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    scale = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = round_to(weight * round_to(x * scale, dtype), dtype)
    tl.store(out_ptr + row * D + cols, (normed * (gate / (tl.exp(-gate) + 1.0))).to(dtype),
             mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as 2-D rows of unit column stride (a view where it already is one)."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`LinearAttentionKernels.delta_gates` in one launch: (decay [T, Hv] float32,
    beta [T, Hv] in `b`'s dtype)."""
    a2d, b2d = _rows(a), _rows(b)
    rows, heads = b2d.shape
    decay = torch.empty((rows, heads), dtype=torch.float32, device=b.device)
    beta = torch.empty((rows, heads), dtype=b.dtype, device=b.device)
    if rows:
        _delta_gates_kernel[(triton.cdiv(rows, GATE_ROWS),)](
            a2d, b2d, a_log.contiguous(), dt_bias.contiguous(), decay, beta, rows,
            a2d.stride(0), b2d.stride(0), SOFTPLUS_THRESHOLD, HV=heads, BT=GATE_ROWS,
            BH=max(2, triton.next_power_of_2(heads)), num_warps=1)
    return decay.view(b.shape), beta.view(b.shape)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """`LinearAttentionKernels.gated_rms_norm` in one launch (one program per row)."""
    x2d, gate2d = _rows(x), _rows(gate)
    rows, width = x2d.shape
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    block = max(16, triton.next_power_of_2(width))
    if rows:
        _gated_rms_norm_kernel[(rows,)](x2d, gate2d, weight.contiguous(), out, x2d.stride(0),
                                        gate2d.stride(0), eps, D=width, BLOCK=block,
                                        num_warps=max(1, min(8, block // 256)))
    return out.view(x.shape)

"""Fused row-wise and elementwise ops for the GPU path, in Triton.

Each kernel rounds where the torch reference (`kvrecover.ops.reference.torch_ops.TorchOps`)
rounds, so bf16 results match it up to the order of a row's sum of squares.
Every op works row by row, so a row's result never depends on the other rows
of the batch (batch invariance comes for free).
Import only where Triton exists (CUDA machines, or `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn
from triton.language.extra import libdevice

from kvrecover.ops.interface import ExpertWeights, RotaryTables
from kvrecover.ops.reference.torch_ops import TorchOps
from kvrecover.ops.triton.batch_invariant_matmul import linear as batch_invariant_linear
from kvrecover.ops.triton.linear_attention import TritonLinearAttention
from kvrecover.ops.triton.moe import fused_moe
from kvrecover.ops.triton.rounding import round_to as _round


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, x_stride, residual_stride, out_stride, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PLUS_ONE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * residual_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / n_cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if PLUS_ONE:  # Gemma: times (1 + weight) in float32, rounded once
        out = xf * tl.math.rsqrt(variance + eps) * (1.0 + weight.to(tl.float32))
    else:
        normed = _round(xf * tl.math.rsqrt(variance + eps), out_ptr.dtype.element_ty)
        out = normed * weight.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    base, stride_h, out_base, out_stride_h, num_heads, cos, sin,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Rotate the heads at `base` into `out_base` (the same place for in-place)."""
    dims = tl.arange(0, HALF)
    dtype = base.dtype.element_ty
    rows = tl.arange(0, BLOCK_H)
    mask = (rows < num_heads)[:, None]
    first = base + rows[:, None] * stride_h + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # q*cos + rotate_half(q)*sin, each product rounded like the torch path.
    out1 = _round(x1 * cos, dtype) + _round(-x2 * sin, dtype)
    out2 = _round(x2 * cos, dtype) + _round(x1 * sin, dtype)
    out_first = out_base + rows[:, None] * out_stride_h + dims[None, :]
    tl.store(out_first, out1.to(dtype), mask=mask)
    tl.store(out_first + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, position, table_stride, dtype: tl.constexpr, HALF: tl.constexpr):
    # The torch path casts cos/sin to the activation dtype before multiplying.
    dims = tl.arange(0, HALF)
    cos = _round(tl.load(cos_ptr + position * table_stride + dims), dtype)[None, :]
    sin = _round(tl.load(sin_ptr + position * table_stride + dims), dtype)[None, :]
    return cos, sin


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, table_stride, num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos, sin = _cos_sin(cos_ptr, sin_ptr, position, table_stride, q_ptr.dtype.element_ty, HALF)
    q = q_ptr + token * q_stride_t
    k = k_ptr + token * k_stride_t
    _rotate_heads(q, q_stride_h, q, q_stride_h, num_q_heads, cos, sin, HALF, BLOCK_HQ)
    _rotate_heads(k, k_stride_h, k, k_stride_h, num_k_heads, cos, sin, HALF, BLOCK_HK)


@triton.jit
def _rotary_store_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, positions_ptr, slot_ptr, cos_ptr, sin_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, value_offset, table_stride,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_KV: tl.constexpr,
):
    """`_rotary_kernel` for q, then the rotated key and the value straight into the cache."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    cos, sin = _cos_sin(cos_ptr, sin_ptr, position, table_stride, q_ptr.dtype.element_ty, HALF)
    q = q_ptr + token * q_stride_t
    _rotate_heads(q, q_stride_h, q, q_stride_h, num_q_heads, cos, sin, HALF, BLOCK_HQ)
    kv_dim = num_kv_heads * 2 * HALF
    _rotate_heads(k_ptr + token * k_stride_t, k_stride_h, cache_ptr + slot * kv_dim, 2 * HALF,
                  num_kv_heads, cos, sin, HALF, BLOCK_HK)
    cols = tl.arange(0, BLOCK_KV)
    mask = cols < kv_dim
    value = tl.load(v_ptr + token * v_stride_t + cols, mask=mask)
    tl.store(cache_ptr + value_offset + slot * kv_dim + cols, value, mask=mask)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, x_stride, out_stride, BLOCK: tl.constexpr,
                     GELU_TANH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:  # GeGLU: gelu(gate, approximate="tanh")
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = _round(0.5 * gate * (1.0 + libdevice.tanh(inner)), dtype)
    else:
        act = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(dtype), mask=mask)


@triton.jit
def _embedding_kernel(ids_ptr, weight_ptr, out_ptr, n_cols, weight_stride, out_stride,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    token = tl.load(ids_ptr + row).to(tl.int64)
    values = tl.load(weight_ptr + token * weight_stride + cols, mask=mask)
    tl.store(out_ptr + row * out_stride + cols, values, mask=mask)


def embedding(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`weight[input_ids]` for 1-D `input_ids` (ids are checked before they reach here)."""
    n_cols = weight.shape[1]
    out = torch.empty((input_ids.shape[0], n_cols), dtype=weight.dtype, device=weight.device)
    block = min(1024, triton.next_power_of_2(n_cols))
    if input_ids.shape[0]:
        _embedding_kernel[(input_ids.shape[0], triton.cdiv(n_cols, block))](
            input_ids, weight, out, n_cols, weight.stride(0), out.stride(0), BLOCK=block,
            num_warps=4,
        )
    return out


def _row_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    plus_one: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dim (Gemma's `(1 + weight)` flavour with `plus_one`); with
    `residual`, first does `residual += x` in place.

    Writes the result into `x` when a residual is given (x is then a dead
    temporary), else into a new tensor.
    """
    shape = x.shape
    x2d = x.reshape(-1, shape[-1]) if x.dim() != 2 or x.stride(-1) != 1 else x
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    n_rows, n_cols = x2d.shape
    out = x2d if residual is not None else torch.empty_like(x2d)
    block = triton.next_power_of_2(n_cols)
    if n_rows:
        _rms_norm_kernel[(n_rows,)](
            x2d, residual if residual is not None else x2d, weight, out,
            x2d.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
            n_cols, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, PLUS_ONE=plus_one,
            num_warps=_row_warps(block),
        )
    return out.view(shape)


def rotary_(
    tables: RotaryTables, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `query` [T, Hq, D] and `key` [T, Hkv, D] in place (rows may be strided)."""
    num_tokens, num_q_heads, head_dim = query.shape
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            query, key, positions, tables.cos_cache, tables.sin_cache,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            tables.cos_cache.stride(0), num_q_heads, key.shape[1],
            HALF=head_dim // 2, BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(key.shape[1]), num_warps=4,
        )
    return query, key


def rotary_store_(
    rotary: RotaryTables, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
    value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """`rotary_` on `query` (in place) and on `key`, whose result goes with `value` straight
    into the cache slots (one kernel instead of rotary plus `store_kv`; `key` is unchanged)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if num_tokens:
        _rotary_store_kernel[(num_tokens,)](
            query, key, value, kv_cache, positions, slot_mapping, rotary.cos_cache,
            rotary.sin_cache, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            value.stride(0), kv_cache.stride(0), rotary.cos_cache.stride(0),
            num_q_heads, num_kv_heads, HALF=head_dim // 2,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(num_kv_heads),
            BLOCK_KV=triton.next_power_of_2(num_kv_heads * head_dim), num_warps=4,
        )


def silu_mul(gate_up: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
    """SwiGLU: `silu(gate) * up` for `gate_up = [gate | up]` along the last dim (GeGLU,
    `gelu(gate, approximate="tanh") * up`, with `gelu_tanh`)."""
    n_rows, width = gate_up.shape
    n_cols = width // 2
    out = torch.empty((n_rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    block = min(2048, triton.next_power_of_2(n_cols))
    if n_rows:
        _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](
            gate_up, out, n_cols, gate_up.stride(0), out.stride(0), BLOCK=block,
            GELU_TANH=gelu_tanh, num_warps=_row_warps(block),
        )
    return out


class TritonOps(TritonLinearAttention, TorchOps):
    """The model's small ops as the fused Triton kernels above (each op is the launcher
    of its name; `rotary` is `rotary_`, in place); linears stay on cuBLAS; the experts
    of a MoE layer run the fused Triton MoE (`ops.triton.moe`); a Gated DeltaNet layer's
    convolution and delta rule run batched over the step (`ops.triton.linear_attention`)."""

    moe_batch_invariant = False  # fixed MoE tiles whatever the step's size

    embedding = staticmethod(embedding)
    rms_norm = staticmethod(rms_norm)
    rotary = staticmethod(rotary_)
    silu_mul = staticmethod(silu_mul)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel adds `x` into `residual` in place and norms the sum."""
        return rms_norm(x, weight, eps, residual=residual), residual

    def rms_norm_plus_one(self, x: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps, plus_one=True)

    def add_rms_norm_plus_one(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_rms_norm` with Gemma's norm, in one kernel."""
        return rms_norm(x, weight, eps, residual=residual, plus_one=True), residual

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up, gelu_tanh=True)

    def moe(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        experts: ExpertWeights,
    ) -> torch.Tensor:
        """Two grouped-GEMM launches over the assignments sorted by expert; no host sync."""
        return fused_moe(x, topk_weights, topk_ids, experts,
                         batch_invariant=self.moe_batch_invariant)


class BatchInvariantOps(TritonOps):
    """TritonOps whose linears use the fixed-reduction-order Triton matmul and whose MoE
    runs one fixed tile configuration."""

    moe_batch_invariant = True

    def prepare_weights(self, model: nn.Module) -> None:
        """Nothing to pack: the Triton matmul reads the dense weights."""

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        return batch_invariant_linear(x, layer.weight, layer.bias)

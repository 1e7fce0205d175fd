"""Decode linears on the GPU: a Triton matmul for a few rows that streams the weight once.

A decode step multiplies 16-64 rows by each weight, so a linear is bound by
reading the weight. cuBLAS reaches 1.3-2 TB/s on the small attention weights of
a 1B model at these sizes (bench/NOTES.md). Here each program owns `BLOCK_N`
weight rows over the whole of K (no split K, so no second kernel and a fixed
summation order) and walks K in `BLOCK_K` steps through a deep load pipeline.
Which shapes take it, and with which tiles, is a measured table
(`SKINNY_CONFIGS`); every other linear stays on cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiles of one skinny matmul launch."""

    block_n: int  # weight rows per program
    block_k: int  # K step; divides K
    num_warps: int
    num_stages: int


# (row bucket, N, K) -> tiles; filled from `bench/profile_gpu_decode.py` on the H200.
SKINNY_CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {}
MAX_ROWS = 64


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    m_mask = rm < M
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (checked by the caller)
        x = tl.load(x_rows + k0, mask=m_mask[:, None], other=0.0)
        w = tl.load(w_rows + k0, mask=n_mask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def row_bucket(rows: int) -> int:
    """The row tile (a power of two, at least 16) that `rows` rows run in."""
    return max(16, triton.next_power_of_2(rows))


def skinny_config(x: torch.Tensor, weight: torch.Tensor) -> SkinnyConfig | None:
    """The measured tiles for `x @ weight.T`, or None where cuBLAS serves it."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if not 0 < rows <= MAX_ROWS or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    return SKINNY_CONFIGS.get((row_bucket(rows), weight.shape[0], weight.shape[1]))


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig
) -> torch.Tensor:
    """`x @ weight.T + bias` for at most `MAX_ROWS` rows of a half-precision `x`."""
    shape = x.shape
    x2d = x.reshape(-1, shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    m, k = x2d.shape
    n = weight.shape[0]
    if m > MAX_ROWS or k % config.block_k or weight.stride(-1) != 1:
        raise ValueError(
            f"skinny_linear takes at most {MAX_ROWS} rows, K divisible by block_k "
            f"{config.block_k} and a row-major weight; got {m} rows, K {k}, "
            f"weight strides {weight.stride()}"
        )
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        _skinny_kernel[(triton.cdiv(n, config.block_n),)](
            x2d, weight, bias if bias is not None else weight, out, m, n, k,
            x2d.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=row_bucket(m), BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out.view(*shape[:-1], n)

"""The fused mixture-of-experts feed-forward on the GPU, in Triton.

The assignments are sorted by expert into row blocks on the device (no host
sync, a buffer sized by the token count only, so decode steps replay in CUDA
graphs): in one Triton launch for decode-sized steps on CUDA (`moe_align.py`),
else by `reference.grouped_moe.align_by_expert`, bit for bit the same blocks.
Two grouped-GEMM launches cover every expert: the first gathers each block's
token rows, runs the block's expert's gate and up columns and applies SwiGLU
(rounding where the torch reference rounds); the second runs the down projection
and writes each row to its assignment's slot. gpt-oss's experts add a bias after
each matmul (`HAS_BIAS`) and clamp their SwiGLU (`CLAMPED`:
`reference.moe.clamped_swiglu`), rounded as that reference rounds.
`reference.moe.combine_topk` then sums a token's `k` outputs in top-k order in
float32.

Batch invariance: a row's result in a `tl.dot` tile depends only on that row and
the tile shape, so `BatchInvariantOps` runs one fixed tile configuration
(`INVARIANT_CONFIG`) whatever the number of tokens an expert received; the
default path picks a larger row block for prefill-sized steps.
Import only where Triton exists (CUDA machines, or `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvrecover.ops.interface import ExpertWeights
from kvrecover.ops.reference.grouped_moe import ExpertBlocks, align_by_expert
from kvrecover.ops.reference.moe import combine_topk
from kvrecover.ops.triton.moe_align import align_by_expert_triton, triton_align_applies
from kvrecover.ops.triton.rounding import round_to as _round


@dataclass(frozen=True)
class MoETiles:
    """One launch configuration of both grouped GEMMs."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


INVARIANT_CONFIG = MoETiles(16, 64, 64, 4, 3)  # every step, in batch-invariant mode
DECODE_CONFIG = MoETiles(16, 32, 64, 4, 4)  # narrow columns: enough programs for one token
PREFILL_CONFIG = MoETiles(64, 128, 64, 8, 3)  # bf16/fp16: 120 KiB of shared memory
PREFILL_ASSIGNMENTS = 1024  # from here on (tokens x top-k), PREFILL_CONFIG


@triton.jit
def _gate_up_silu_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
    num_assignments, top_k, N, K, stride_xm, stride_we, stride_wn, stride_om, stride_be,
    alpha, limit,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
):
    """Row block b, columns [n0, n0 + BLOCK_N) of the intermediate size N:
    silu(x @ gate.T) * (x @ up.T) for the block's token rows and expert (with the
    expert's biases, and gpt-oss's clamped SwiGLU with `CLAMPED`)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rows)
    row_mask = ids < num_assignments
    tokens = (ids // top_k).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rk = tl.arange(0, BLOCK_K)
    a_rows = x_ptr + tokens[:, None] * stride_xm
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    gate_cols = w_base + rn.to(tl.int64)[None, :] * stride_wn
    up_cols = w_base + (rn + N).to(tl.int64)[None, :] * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[None, :] & k_mask[:, None]
        w_gate = tl.load(gate_cols + k[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(up_cols + k[:, None], mask=w_mask, other=0.0)
        if IEEE:
            gate = tl.dot(a, w_gate, gate, input_precision="ieee")
            up = tl.dot(a, w_up, up, input_precision="ieee")
        else:
            gate = tl.dot(a, w_gate, gate)
            up = tl.dot(a, w_up, up)
    dtype = out_ptr.dtype.element_ty
    # The reference rounds the gate_up matmul, then silu, then the product.
    gate = _round(gate, dtype)
    up = _round(up, dtype)
    if HAS_BIAS:  # added after the rounded matmul, rounded again
        bias = bias_ptr + expert.to(tl.int64) * stride_be
        gate = _round(gate + tl.load(bias + rn, mask=n_mask, other=0.0).to(tl.float32), dtype)
        up = _round(up + tl.load(bias + N + rn, mask=n_mask, other=0.0).to(tl.float32), dtype)
    if CLAMPED:  # (up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit
        gate = _round(tl.minimum(gate, limit), dtype)
        up = _round(tl.minimum(tl.maximum(up, -limit), limit), dtype)
        sigmoid = _round(1.0 / (1.0 + tl.exp(-_round(gate * alpha, dtype))), dtype)
        product = _round(gate * sigmoid, dtype) * _round(up + 1.0, dtype)
    else:
        product = _round(gate / (1.0 + tl.exp(-gate)), dtype) * up
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, product.to(dtype), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, bias_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
    num_assignments, N, K, stride_hm, stride_we, stride_wn, stride_om, stride_be,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Row block b, hidden columns [n0, n0 + BLOCK_N): h @ down.T (plus the expert's bias
    with `HAS_BIAS`) for the block's expert, each row written to its assignment's row
    of `out`."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rows)
    row_mask = ids < num_assignments
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rk = tl.arange(0, BLOCK_K)
    a_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_hm
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if HAS_BIAS:  # added after the rounded matmul
        bias = bias_ptr + expert.to(tl.int64) * stride_be + rn
        acc = _round(acc, out_ptr.dtype.element_ty) + tl.load(bias, mask=n_mask,
                                                              other=0.0).to(tl.float32)
    out = out_ptr + ids.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def tiles_for(num_assignments: int, batch_invariant: bool, dtype: torch.dtype) -> MoETiles:
    """The launch configuration of a step with `num_assignments` (tokens x top-k) rows.
    float32 keeps the small tiles (the prefill ones would need twice the shared memory)."""
    if batch_invariant:
        return INVARIANT_CONFIG
    half = dtype in (torch.bfloat16, torch.float16)
    return PREFILL_CONFIG if half and num_assignments >= PREFILL_ASSIGNMENTS else DECODE_CONFIG


def fused_moe(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    experts: ExpertWeights, *, batch_invariant: bool = False,
) -> torch.Tensor:
    """`MoEKernels.moe` in two grouped-GEMM launches and the top-k combine; no host sync."""
    gate_up, down = experts.gate_up_proj.contiguous(), experts.down_proj.contiguous()
    num_experts, hidden = gate_up.shape[0], x.shape[1]
    intermediate = down.shape[2]
    num_tokens, top_k = topk_ids.shape
    tiles = tiles_for(num_tokens * top_k, batch_invariant, x.dtype)
    if triton_align_applies(topk_ids, num_experts):
        blocks: ExpertBlocks = align_by_expert_triton(topk_ids, num_experts, tiles.block_m)
    else:
        blocks = align_by_expert(topk_ids, num_experts, tiles.block_m)
    x = x.contiguous()
    ieee = x.dtype == torch.float32
    gate_up_bias, down_bias = experts.gate_up_bias, experts.down_bias
    gate_up_bias = x if gate_up_bias is None else gate_up_bias.contiguous()  # x: unread
    down_bias = x if down_bias is None else down_bias.contiguous()
    has_bias = experts.gate_up_bias is not None and experts.down_bias is not None
    if has_bias != (experts.gate_up_bias is not None or experts.down_bias is not None):
        raise ValueError("the fused MoE takes both expert biases or neither")
    clamp = experts.clamped_swiglu
    hidden_rows = torch.empty((blocks.num_blocks * tiles.block_m, intermediate), dtype=x.dtype,
                              device=x.device)
    expert_out = torch.empty((num_tokens * top_k, hidden), dtype=x.dtype, device=x.device)
    if num_tokens:
        _gate_up_silu_kernel[(blocks.num_blocks, triton.cdiv(intermediate, tiles.block_n))](
            x, gate_up, gate_up_bias, hidden_rows, blocks.sorted_ids, blocks.block_expert,
            blocks.num_assignments, top_k, intermediate, hidden, x.stride(0), gate_up.stride(0),
            gate_up.stride(1), hidden_rows.stride(0), gate_up_bias.stride(0),
            clamp.alpha if clamp else 0.0, clamp.limit if clamp else 0.0,
            IEEE=ieee, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            HAS_BIAS=has_bias, CLAMPED=clamp is not None, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
        _down_kernel[(blocks.num_blocks, triton.cdiv(hidden, tiles.block_n))](
            hidden_rows, down, down_bias, expert_out, blocks.sorted_ids, blocks.block_expert,
            blocks.num_assignments, hidden, intermediate, hidden_rows.stride(0), down.stride(0),
            down.stride(1), expert_out.stride(0), down_bias.stride(0), IEEE=ieee,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            HAS_BIAS=has_bias, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    return combine_topk(expert_out.view(num_tokens, top_k, hidden), topk_weights)

"""A batch-invariant matmul for `LLM(batch_invariant=True)` on the GPU.

cuBLAS picks kernels (tile shapes, split-K) by the number of rows, so a row's
result can change with the batch it is in. Here every output element is summed
in one fixed order that depends only on the weight's shape (N, K): K is cut into
`num_chunks` equal chunks, each chunk is accumulated from zero in BLOCK_K steps,
and the chunk sums are added in order in float32. Small batches compute the
chunks in parallel programs and add them in a second kernel; large batches loop
over them inside one program; both perform the same additions, so the row
count only changes the speed.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older Triton: the pointer-load kernel serves every size
    TensorDescriptor = None

BLOCK_N = 128
BLOCK_K = 64
TARGET_PROGRAMS = 128  # enough programs to stream a weight at full bandwidth for one row tile
SMALL_M_CONFIG = (64, BLOCK_N, 4, 4)  # block_m, block_n, warps, stages
SMALL_M_ROWS = 512  # up to here SMALL_M_CONFIG (and maybe split K); beyond, the large configs
# Large batches (TMA kernel), from `bench_gpu.py --matmul-configs` (8192 rows, H200):
# wider tiles for most shapes, square ones for wide weights (gate_up).
LARGE_M_CONFIG = (128, 256, 8, 3)
LARGE_M_WIDE_CONFIG = (128, 128, 8, 3)
WIDE_N = 8192


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid`. Grouped ordering keeps a band of
    weight tiles hot in L2 across row tiles."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % group_size) % size_m, (pid % group_size) // size_m


@triton.jit
def _matmul_kernel(
    a_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, M, N, K, chunk_k, num_chunks,
    stride_am, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    if SPLIT:
        first_chunk = tl.program_id(1)
        last_chunk = first_chunk + 1
    else:
        first_chunk = 0
        last_chunk = num_chunks
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for chunk in range(first_chunk, last_chunk):
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(chunk * chunk_k, (chunk + 1) * chunk_k, BLOCK_K):
            k = k0 + rk
            k_mask = k < K
            a = tl.load(a_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_cols + k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        total += acc
    if SPLIT:
        offsets = first_chunk.to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(partial_ptr + offsets, total, mask=m_mask[:, None] & n_mask[None, :])
    else:
        if HAS_BIAS:
            total += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _matmul_tma_kernel(
    a_desc, w_desc, bias_ptr, out_ptr, M, N, chunk_k, num_chunks, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """`_matmul_kernel`'s unsplit path with tiles fetched by the TMA unit (Hopper and
    later): the same additions in the same order, out-of-range elements read as zero."""
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for chunk in range(0, num_chunks):
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(chunk * chunk_k, (chunk + 1) * chunk_k, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(a, w.T, acc)
        total += acc
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    if HAS_BIAS:
        total += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=(rm < M)[:, None] & n_mask[None, :])


@triton.jit
def _sum_chunks_kernel(
    partial_ptr, bias_ptr, out_ptr, M, N, num_chunks, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < M * N
    total = tl.zeros([BLOCK], tl.float32)
    for chunk in range(0, num_chunks):  # the same additions, in the same order, as the loop above
        total += tl.load(partial_ptr + chunk * M * N + offsets, mask=mask, other=0.0)
    row = offsets // N
    col = offsets % N
    if HAS_BIAS:
        total += tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + col, total.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def num_chunks(n: int, k: int) -> int:
    """The fixed K split of an (N, K) weight: more chunks while one row tile lacks programs."""
    n_tiles = triton.cdiv(n, BLOCK_N)
    chunks = 1
    while (
        n_tiles * chunks * 2 <= TARGET_PROGRAMS
        and k % (chunks * 2 * BLOCK_K) == 0
        and k // (chunks * 2) >= 4 * BLOCK_K
    ):
        chunks *= 2
    return chunks


@functools.cache
def _compute_capability(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _tma_ready(*tensors: torch.Tensor) -> bool:
    """TMA needs a Hopper-class GPU and 16-byte aligned bases and row strides."""
    if TensorDescriptor is None or _compute_capability(tensors[0].device.index)[0] < 9:
        return False
    return all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors
    )


def _config(m: int, n: int) -> tuple[int, int, int, int]:
    if m <= SMALL_M_ROWS:
        return SMALL_M_CONFIG
    return LARGE_M_WIDE_CONFIG if n >= WIDE_N else LARGE_M_CONFIG


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None, chunks: int | None = None,
) -> torch.Tensor:
    """`x @ weight.T + bias` with a reduction order independent of the rows of `x`.

    `config` (block_m, block_n, warps, stages) overrides the tile choice and `chunks`
    the K split (benchmarks; another split is another, equally fixed, order).
    """
    shape = x.shape
    x2d = x.reshape(-1, shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, k = x2d.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*shape[:-1], n)
    chunks = chunks or num_chunks(n, k)
    chunk_k = triton.cdiv(triton.cdiv(k, chunks), BLOCK_K) * BLOCK_K
    ieee = x.dtype == torch.float32
    if ieee:  # float32 is for correctness checks: small tiles, CUDA-core dot
        block_m, block_n, warps, stages = 32, 64, 4, 2
        chunks, chunk_k = 1, triton.cdiv(k, BLOCK_K) * BLOCK_K
    else:
        block_m, block_n, warps, stages = config or _config(m, n)
    num_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = chunks > 1 and num_tiles < TARGET_PROGRAMS
    has_bias = bias is not None
    if not split and not ieee and m > SMALL_M_ROWS and _tma_ready(x2d, weight):
        a_desc = TensorDescriptor.from_tensor(x2d, [block_m, BLOCK_K])
        w_desc = TensorDescriptor.from_tensor(weight, [block_n, BLOCK_K])
        _matmul_tma_kernel[(num_tiles,)](
            a_desc, w_desc, bias if has_bias else weight, out, m, n, chunk_k, chunks,
            out.stride(0), HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=BLOCK_K, GROUP_M=8, num_warps=warps, num_stages=stages,
        )
        return out.view(*shape[:-1], n)
    partial = torch.empty((chunks, m, n), dtype=torch.float32, device=x.device) if split else out
    _matmul_kernel[(num_tiles, chunks if split else 1)](
        x2d, weight, bias if has_bias else weight, out, partial, m, n, k, chunk_k, chunks,
        x2d.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=has_bias, SPLIT=split, IEEE=ieee,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, GROUP_M=8,
        num_warps=warps, num_stages=stages,
    )
    if split:
        block = 1024
        _sum_chunks_kernel[(triton.cdiv(m * n, block),)](
            partial, bias if has_bias else weight, out, m, n, chunks, out.stride(0),
            HAS_BIAS=has_bias, BLOCK=block, num_warps=4,
        )
    return out.view(*shape[:-1], n)

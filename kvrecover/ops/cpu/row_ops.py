"""Row-local fused kernels on the CPU through C (`ops/cpu/csrc/row_ops.c`): float32,
bf16 and fp16.

Add + RMSNorm, RMSNorm (optionally times `1 + weight`) and rotary, each one call
instead of several torch ops (a C SwiGLU measured slower than torch's two
vectorized ops in bf16: bench/NOTES.md). Every output row is computed from its
own input row in a fixed order with float32 math, rounded where `TorchOps`
rounds, so a row's bits do not depend on the batch or the thread count
(`tests/ops/test_row_ops.py`). The residual sum is exact-rounded and equals
torch's, and rotary rounds step for step as `ops.reference.rotary.apply_rotary`
does (bit-equal). The norm's sum of squares runs either in a 16-lane tree
(`sum_width=0`: close to torch's) or in torch's own CPU order for a given vector
width (bit-equal to torch's in float32 with the width torch adds with:
`ops.cpu.row_kernel_ops.torch_sum_width`).
"""

from __future__ import annotations

import ctypes

import torch

from kvrecover.ops.cpu.native_build import load_library

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_HIDDEN = 8192  # ROW_CHUNK in row_ops.c
MAX_SUM_WIDTH = 64  # MAX_SUM_WIDTH in row_ops.c
MAX_ROTARY_DIM = 1024  # MAX_ROTARY_DIM in row_ops.c
# Elements worth one more thread: a parallel region costs microseconds, so a
# decode step's rows run on the calling thread.
ELEMENTS_PER_THREAD = 1 << 16

_i64, _int, _ptr, _float = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float


class NativeRowOps:
    """ctypes wrappers around the compiled `row_ops` library."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._add_rms_norm = library.kvr_add_rms_norm
        self._add_rms_norm.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _float, _int,
                                       _int, _int, _int]
        self._add_rms_norm.restype = _int
        self._rotary = library.kvr_rotary
        self._rotary.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr,
                                 _i64, _i64, _i64, _i64, _int, _int, _int]
        self._rotary.restype = _int

    def add_rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
        threads: int | None = None, *, sum_width: int = 0, plus_one: bool = False,
        in_place: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x) * weight, residual + x); with `x` None, (norm(residual) *
        weight, residual); with `plus_one` times `1 + weight` instead (Gemma's). Tensors
        [..., hidden] contiguous, one dtype. `sum_width` 0 sums the squares in the lane
        tree; > 0 in torch's CPU sum order with vectors of that many floats. `in_place`
        writes the sum into `residual` (one fresh tensor less)."""
        tensors = {"residual": residual, "weight": weight}
        if x is not None:
            tensors["x"] = x
            if x.shape != residual.shape:
                raise ValueError(f"x shape {tuple(x.shape)} must equal residual shape "
                                 f"{tuple(residual.shape)}")
        code = _dtype_code(tensors)
        hidden = residual.shape[-1]
        if weight.shape != (hidden,):
            raise ValueError(f"weight shape {tuple(weight.shape)} must be ({hidden},)")
        if not 1 <= hidden <= MAX_HIDDEN:
            raise ValueError(f"hidden size must be in 1..{MAX_HIDDEN}, got {hidden}")
        rows = residual.numel() // hidden
        out = torch.empty_like(residual)
        summed = residual if x is None or in_place else torch.empty_like(residual)
        status = self._add_rms_norm(
            None if x is None else x.data_ptr(), residual.data_ptr(),
            None if x is None else summed.data_ptr(), weight.data_ptr(), out.data_ptr(),
            rows, hidden, eps, code, sum_width, int(plus_one),
            _threads(residual.numel(), rows, threads))
        if status == 3:
            raise ValueError(f"sum_width must be in 0..{MAX_SUM_WIDTH}, got {sum_width}")
        if status:
            raise RuntimeError(f"add_rms_norm kernel failed with code {status}")
        return out, summed

    def rotary(
        self, cos_sin_cache: torch.Tensor, positions: torch.Tensor, query: torch.Tensor,
        key: torch.Tensor, threads: int | None = None, *, in_place: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`ops.reference.rotary.apply_rotary` bit for bit: query [T, Hq, D] and key [T, Hkv, D]
        (last dim contiguous, one dtype) rotated by positions [T] (int64) with the float32
        cache [P, 2 * D]; into new contiguous tensors, or with `in_place` into `query` and
        `key` themselves (returned)."""
        if query.dtype != key.dtype or query.dtype not in DTYPE_CODES:
            raise ValueError(f"query and key dtypes ({query.dtype}, {key.dtype}) must be one of "
                             f"{list(DTYPE_CODES)}")
        if query.dim() != 3 or key.dim() != 3 or query.stride(-1) != 1 or key.stride(-1) != 1:
            raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} must be "
                             "[tokens, heads, head_dim] with a contiguous last dim")
        tokens, num_heads, dim = query.shape
        if key.shape[0] != tokens or key.shape[2] != dim or dim % 2:
            raise ValueError(f"key shape {tuple(key.shape)} must match query shape "
                             f"{tuple(query.shape)} in tokens and an even head_dim")
        if (cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous()
                or cos_sin_cache.shape[1:] != (2 * dim,)):
            raise ValueError(f"cos_sin_cache must be contiguous float32 [positions, {2 * dim}], "
                             f"got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}")
        if positions.dtype != torch.int64 or positions.shape != (tokens,):
            raise ValueError(f"positions must be int64 [{tokens}], got {positions.dtype} "
                             f"{tuple(positions.shape)}")
        positions = positions.contiguous()
        query_out = query if in_place else query.new_empty(query.shape)
        key_out = key if in_place else key.new_empty(key.shape)
        status = self._rotary(
            query.data_ptr(), query.stride(0), query.stride(1), key.data_ptr(), key.stride(0),
            key.stride(1), query_out.data_ptr(), key_out.data_ptr(), cos_sin_cache.data_ptr(),
            cos_sin_cache.shape[0], positions.data_ptr(), tokens, num_heads, key.shape[1], dim,
            DTYPE_CODES[query.dtype], int(in_place),
            _threads(query.numel() + key.numel(), tokens, threads))
        if status == 2:
            raise ValueError(f"head_dim must be at most {MAX_ROTARY_DIM}, got {dim}")
        if status:
            raise ValueError(f"positions must be in 0..{cos_sin_cache.shape[0] - 1}")
        return query_out, key_out


def _dtype_code(tensors: dict[str, torch.Tensor]) -> int:
    """The kernel's dtype code for tensors that share one dtype, on the CPU, contiguous."""
    dtype = next(iter(tensors.values())).dtype
    for name, tensor in tensors.items():
        if tensor.dtype != dtype or dtype not in DTYPE_CODES:
            raise ValueError(f"{name} dtype {tensor.dtype} must be {dtype} and one of "
                             f"{list(DTYPE_CODES)}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor, got device "
                             f"{tensor.device} and strides {tensor.stride()}")
    return DTYPE_CODES[dtype]


def _threads(elements: int, rows: int, threads: int | None) -> int:
    if threads is None:
        threads = min(torch.get_num_threads(), elements // ELEMENTS_PER_THREAD)
    return max(1, min(threads, rows))


def native_row_ops(allowed: bool = True) -> NativeRowOps | None:
    """The compiled kernels, or None (after one warning) where they cannot be built or
    are not `allowed` (`EngineArgs.native_kernels`)."""
    library = load_library("row_ops", allowed)
    return None if library is None else NativeRowOps(library)

"""Greedy tokens on the GPU: a two-pass argmax that fills the device (Triton).

The `ops.interface.SamplingKernels` of the Triton backend: a CUDA-graphed decode
step ends with these, so an all-greedy step needs no sampler launch. The first
maximum wins on ties, as in `torch.argmax`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _argmax_chunks_kernel(
    logits_ptr, upcast_ptr, value_ptr, index_ptr, n_cols, stride,
    UPCAST: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride + cols, mask=cols < n_cols, other=float("-inf"))
    x = x.to(tl.float32)  # exact: the argmax of the float32 copy is the argmax of the input
    if UPCAST:
        tl.store(upcast_ptr + row * n_cols + cols, x, mask=cols < n_cols)
    value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(value_ptr + row * tl.num_programs(1) + chunk, value)
    tl.store(index_ptr + row * tl.num_programs(1) + chunk, chunk * BLOCK + index)


@triton.jit
def _argmax_rows_kernel(value_ptr, index_ptr, out_ptr, num_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK)
    mask = chunks < num_chunks
    values = tl.load(value_ptr + row * num_chunks + chunks, mask=mask, other=float("-inf"))
    indices = tl.load(index_ptr + row * num_chunks + chunks, mask=mask, other=0)
    _, best = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.sum(tl.where(chunks == best, indices, 0), axis=0))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` (first maximum on ties) in two passes that fill the GPU."""
    return _greedy(logits, None)


def upcast_greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logits.float(), greedy_tokens(logits))` with one read of `logits` (no separate cast)."""
    upcast = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    return upcast, _greedy(logits, upcast)


def _greedy(logits: torch.Tensor, upcast: torch.Tensor | None) -> torch.Tensor:
    n_rows, n_cols = logits.shape
    block = 4096
    num_chunks = triton.cdiv(n_cols, block)
    values = torch.empty((n_rows, num_chunks), dtype=torch.float32, device=logits.device)
    indices = torch.empty((n_rows, num_chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(n_rows, dtype=torch.int32, device=logits.device)
    if n_rows:
        _argmax_chunks_kernel[(n_rows, num_chunks)](
            logits, upcast if upcast is not None else logits, values, indices, n_cols,
            logits.stride(0), UPCAST=upcast is not None, BLOCK=block, num_warps=8,
        )
        _argmax_rows_kernel[(n_rows,)](
            values, indices, out, num_chunks, BLOCK=triton.next_power_of_2(num_chunks),
            num_warps=1,
        )
    return out


class TritonSampling:
    """The `ops.interface.SamplingKernels` of the GPU path: the two-pass argmax kernels."""

    def upcast_greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits, greedy tokens [B] int32); a half input is cast and argmaxed
        in one read."""
        if logits.dtype == torch.float32:
            return logits, greedy_tokens(logits)
        return upcast_greedy_tokens(logits)

"""Rounding inside Triton kernels where the torch reference rounds between ops."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Round float32 `x` to `dtype` and widen it again, where torch rounds between ops.

    bf16 is rounded (to nearest even) with integer ops, which the compiler
    cannot fold away the way it may fold a cast pair.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)

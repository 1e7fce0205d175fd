"""Batch-invariant paged attention on the CPU: one promise, two implementations.

A query's bits do not depend on its batch, its chunking or prefix-cache hits.
`c_kernel.NativeInvariantAttention` keeps it through our C kernel
(`ops/cpu/csrc/paged_attention.c`, built at first use by `ops.cpu.native_build`);
`torch_tiles.CpuInvariantAttention` keeps it in torch ops at several times the
cost, where the kernel cannot or may not be built, and off the CPU.
`invariant_cpu_attention` picks one.
"""

from __future__ import annotations

import torch

from kvrecover.ops.cpu.attention.c_kernel import NativeInvariantAttention
from kvrecover.ops.cpu.attention.torch_tiles import CpuInvariantAttention
from kvrecover.ops.cpu.native_build import load_library
from kvrecover.ops.interface import RotaryKernel
from kvrecover.ops.reference.rotary import reference_rotary

CPU = torch.device("cpu")

__all__ = ["CpuInvariantAttention", "NativeInvariantAttention", "invariant_cpu_attention",
           "native_cpu_attention"]


def invariant_cpu_attention(
    device: torch.device = CPU, rotate: RotaryKernel = reference_rotary,
    native_kernels: bool = True,
) -> NativeInvariantAttention | CpuInvariantAttention:
    """The fused C kernel where it builds (on the CPU, with `native_kernels`), else the
    torch implementation (after one warning where the build failed; always off the CPU:
    `attention_backend="torch"` on CUDA). `rotate` is the backend's rotary op."""
    if device.type != "cpu":
        return CpuInvariantAttention(rotate=rotate)
    native = native_cpu_attention(rotate, native_kernels)
    return CpuInvariantAttention(rotate=rotate) if native is None else native


def native_cpu_attention(rotate: RotaryKernel = reference_rotary,
                         native_kernels: bool = True) -> NativeInvariantAttention | None:
    """The C kernel, or None where it is not `native_kernels` or does not build (after
    one warning)."""
    library = load_library("paged_attention", allowed=native_kernels)
    return None if library is None else NativeInvariantAttention(library, rotate=rotate)

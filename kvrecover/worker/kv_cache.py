"""Allocation of the per-layer paged KV cache tensors."""

from __future__ import annotations

import os

import torch

from kvrecover.device_defaults import DEVICE_DEFAULTS, GIB
from kvrecover.kv_layout import KVCacheLayout

DEFAULT_CPU_KV_CACHE_BYTES = int(DEVICE_DEFAULTS["kv_cache_memory_gb"].cpu * GIB)


def available_kv_cache_bytes(device: torch.device, gpu_memory_utilization: float) -> int:
    """A memory budget for the KV cache when the user gave none."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(0, int(total * gpu_memory_utilization) - used)
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 8 << 30
    return min(DEFAULT_CPU_KV_CACHE_BYTES, physical // 4)


def allocate_kv_caches(layout: KVCacheLayout, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """One `[2, num_blocks, block_size, kv_heads, head_dim]` tensor per layer of a KV
    cache group (`layout.num_cache_tensors`: every layer without sliding windows).

    Left uninitialised (zeroing gigabytes costs seconds at start-up) except the
    null block 0, which padded attention reads: slots past a request's length
    are never attended to (the torch backend zeroes those it gathers with a
    request's last block), and written slots always hold finite values.
    """
    shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    caches = [torch.empty(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_cache_tensors)]
    for cache in caches:
        cache[:, 0].zero_()
    return caches

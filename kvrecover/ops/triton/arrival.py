"""Arrival counters for kernels whose last program to finish does the final reduction.

A split kernel (split-context attention, split-K matmul) stores each program's
partial result, then counts its arrival on one counter per output tile; the
program that arrives last reads every partial back in a fixed order and writes
the result. That replaces a second, reducing kernel launch with the same
additions in the same order. Each launch leaves its counters at zero (the last
arrival re-arms them), so a buffer serves every later launch on its stream,
CUDA graph replays included.
"""

from __future__ import annotations

import torch

# (user, device) -> counter buffers; replaced ones stay alive because captured
# graphs keep their addresses.
_COUNTERS: dict[tuple[str, torch.device], list[torch.Tensor]] = {}


def arrival_counters(user: str, size: int, device: torch.device) -> torch.Tensor:
    """At least `size` zeroed int32 counters for `user`'s kernels on `device`."""
    kept = _COUNTERS.setdefault((user, device), [])
    if not kept or kept[-1].numel() < size:
        kept.append(torch.zeros(max(size, 8192), dtype=torch.int32, device=device))
    return kept[-1]


def all_counters_zero(device: torch.device) -> bool:
    """Whether every counter on `device` is re-armed (tests)."""
    return all(
        int(buf.count_nonzero()) == 0
        for (_, dev), bufs in _COUNTERS.items() if dev == device for buf in bufs
    )

"""How many threads torch's CPU kernels get: the cores this process may use.

The count is fixed by the machine, never by its momentary load: a kernel may split
its reductions by thread, and exact recovery compares outputs computed in separate
processes (prefill, decode, decode after a failure), so every process of one
deployment must run the same thread count. On a machine shared with other busy
processes, set `OMP_NUM_THREADS` (it wins) to the cores that are really free:
there a multi-threaded op waits at its barrier for a descheduled thread, and a
decode step can take 5-15x longer with 2 threads than with 1 (bench/NOTES.md).
"""

from __future__ import annotations

import os

import torch


def available_cpu_cores() -> int:
    """Cores in this process's affinity mask (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def set_cpu_threads(num_ranks: int = 1) -> int:
    """Give torch `available_cpu_cores()` threads (shared out among `num_ranks`
    tensor-parallel ranks on one machine) unless `OMP_NUM_THREADS` is set; returns the
    thread count in force. Called once when a CPU engine (or rank) starts."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    threads = max(1, available_cpu_cores() // num_ranks)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads

"""How many threads torch's CPU kernels get: the cores this process may use that
other processes leave idle.

torch's default is every physical core. When other processes keep some of them
busy, each multi-threaded op ends at a barrier that waits for a thread the OS
has descheduled: on a 2-core machine at load 9, a decode step took 5-15x longer
with 2 threads than with 1 (bench/NOTES.md). So the engine counts the cores in
its affinity mask, subtracts the ones the 1-minute load average says are busy,
and keeps at least one. `OMP_NUM_THREADS`, when set, wins.
"""

from __future__ import annotations

import os

import torch


def available_cpu_cores(load_average: float | None = None) -> int:
    """Cores in this process's affinity mask minus those busy with other work (>= 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if load_average is None:
        try:
            load_average = os.getloadavg()[0]
        except (AttributeError, OSError):
            load_average = 0.0
    return max(1, min(cores, cores - round(load_average)))


def set_cpu_threads() -> int:
    """Give torch `available_cpu_cores()` threads unless `OMP_NUM_THREADS` is set;
    returns the thread count in force. Called once when a CPU engine starts."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    threads = available_cpu_cores()
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads

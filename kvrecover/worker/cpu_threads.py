"""How many threads torch's CPU kernels get: the cores this process may use that
other processes leave idle.

torch's default is every physical core. When other processes keep some of them
busy, each multi-threaded op ends at a barrier that waits for a thread the OS
has descheduled: on a 2-core machine at load 9, a decode step took 5-15x longer
with 2 threads than with 1 (bench/NOTES.md). So the engine counts the cores in
its affinity mask, subtracts the ones the 1-minute load average says other
processes keep busy, and keeps at least one. `OMP_NUM_THREADS`, when set, wins.
"""

from __future__ import annotations

import math
import os

import torch


def available_cpu_cores(load_average: float | None = None, own_load: float | None = None) -> int:
    """Cores in this process's affinity mask minus those busy with other work (>= 1).

    Other work is the 1-minute load average less this process's own share of it
    (`own_load`, default: its CPU time over its age, since a long-lived caller such
    as a test runner counts in the load average too).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if load_average is None:
        try:
            load_average = os.getloadavg()[0]
        except (AttributeError, OSError):
            load_average = 0.0
    if own_load is None:
        own_load = _own_load()
    busy = max(0.0, load_average - own_load)
    return max(1, min(cores, cores - round(busy)))


def _own_load() -> float:
    """This process's share of the 1-minute load average, from its CPU time and age
    (0 where unknown)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            fields = stat.read().rsplit(")", 1)[1].split()
            seconds_up = float(uptime.read().split()[0])
        age = seconds_up - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time
    except (OSError, ValueError, IndexError):
        return 0.0
    if age <= 1:
        return 0.0
    times = os.times()
    # Its average busy share, weighted as the 1-minute exponential load average
    # has seen it so far.
    return (times.user + times.system) / age * (1 - math.exp(-age / 60))


def set_cpu_threads() -> int:
    """Give torch `available_cpu_cores()` threads unless `OMP_NUM_THREADS` is set;
    returns the thread count in force. Called once when a CPU engine starts."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    threads = available_cpu_cores()
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads

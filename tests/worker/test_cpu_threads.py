"""The CPU thread policy: the cores in the affinity mask, whatever the machine's load."""

from __future__ import annotations

import os

import torch

from kvrecover.worker import cpu_threads


def _machine(monkeypatch, cores: int, load: float) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))


def test_the_thread_count_follows_the_affinity_mask_not_the_load(monkeypatch):
    # Processes that must compute identical bits get identical thread counts.
    _machine(monkeypatch, cores=4, load=0.2)
    assert cpu_threads.available_cpu_cores() == 4
    _machine(monkeypatch, cores=4, load=9.0)
    assert cpu_threads.available_cpu_cores() == 4
    _machine(monkeypatch, cores=1, load=0.0)
    assert cpu_threads.available_cpu_cores() == 1


def test_set_cpu_threads_follows_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        _machine(monkeypatch, cores=1, load=0.0)
        assert cpu_threads.set_cpu_threads() == 1
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        assert cpu_threads.set_cpu_threads() == 2  # the user's setting is kept
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

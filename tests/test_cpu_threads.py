"""The CPU thread policy: cores in the affinity mask minus those other work keeps busy."""

from __future__ import annotations

import os

import torch

from kvrecover.worker import cpu_threads


def _machine(monkeypatch, cores: int, load: float, own: float = 0.0) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(cpu_threads, "_own_load", lambda: own)


def test_idle_machine_gets_every_core_and_a_busy_one_keeps_one(monkeypatch):
    _machine(monkeypatch, cores=4, load=0.2)
    assert cpu_threads.available_cpu_cores() == 4
    _machine(monkeypatch, cores=4, load=1.7)
    assert cpu_threads.available_cpu_cores() == 2
    _machine(monkeypatch, cores=2, load=9.0)
    assert cpu_threads.available_cpu_cores() == 1


def test_the_callers_own_load_does_not_count_as_other_work(monkeypatch):
    _machine(monkeypatch, cores=2, load=1.1, own=0.9)  # a busy test runner, nothing else
    assert cpu_threads.available_cpu_cores() == 2
    _machine(monkeypatch, cores=2, load=2.0, own=0.9)
    assert cpu_threads.available_cpu_cores() == 1


def test_own_load_is_a_plausible_share_of_one_process():
    assert 0.0 <= cpu_threads._own_load() <= os.cpu_count()


def test_set_cpu_threads_follows_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        _machine(monkeypatch, cores=2, load=9.0)
        assert cpu_threads.set_cpu_threads() == 1
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        assert cpu_threads.set_cpu_threads() == 2  # the user's setting is kept
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

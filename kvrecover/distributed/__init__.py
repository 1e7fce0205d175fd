"""Tensor parallelism's machinery, beside the worker: the loopback rendezvous and the
process groups (`rendezvous.py`, `group.py`), the rank processes and the one message a
step sends them (`rank_process.py`, `messages.py`), and how the ranks' KV-transfer
reports become one (`rank_reports.py`). It imports neither the engine nor the worker:
the worker's rank loop (`worker/rank_worker.py`) and rank 0's runner
(`worker/parallel_runner.py`) build on it.
"""

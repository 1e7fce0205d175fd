"""RankWatch calls back as soon as a watched process exits, and never after `stop`."""

from __future__ import annotations

import subprocess
import sys
import threading

from kvrecover.distributed.rank_watch import RankWatch

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_process_exit_calls_back_at_once():
    processes = [subprocess.Popen(SLEEPER) for _ in range(2)]
    called = threading.Event()
    watch = RankWatch([p.pid for p in processes], called.set)
    try:
        assert not called.wait(0.2)
        processes[1].kill()
        assert called.wait(5.0)
    finally:
        watch.stop()
        for process in processes:
            process.kill()
            process.wait()


def test_a_stopped_watch_never_calls_back():
    process = subprocess.Popen(SLEEPER)
    called = threading.Event()
    watch = RankWatch([process.pid], called.set)
    watch.stop()
    watch.stop()  # idempotent
    process.kill()
    process.wait()
    assert not called.wait(0.3)

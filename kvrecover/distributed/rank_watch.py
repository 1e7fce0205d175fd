"""Watches the rank processes from a thread of its own while the engine steps.

On the CPU a dead rank breaks gloo's sockets and the step raises at once; on CUDA a
collective whose peer died would keep rank 0's GPU waiting (NCCL notices only at its
watchdog's timeout). So as soon as any rank process exits, `RankWatch` calls its
callback (the runner aborts the group: pending collectives end, the step fails and
the engine stops cleanly). It waits on Linux pidfds, so it costs nothing while the
ranks live; where pidfds are unavailable it watches nothing (gloo still notices).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait


class RankWatch:
    """Calls `on_exit` once, from its thread, when any process of `pids` exits."""

    def __init__(self, pids: Sequence[int], on_exit: Callable[[], None]) -> None:
        self._on_exit = on_exit
        self._process_fds: list[int] = []
        try:
            self._process_fds = [os.pidfd_open(pid) for pid in pids]
        except (AttributeError, OSError):  # no pidfds here: nothing to watch with
            for fd in self._process_fds:
                os.close(fd)
            self._process_fds = []
        self._stop_read, self._stop_write = os.pipe()
        self._thread = threading.Thread(target=self._run, name="kvrecover-rank-watch",
                                        daemon=True)
        if self._process_fds:
            self._thread.start()

    def _run(self) -> None:
        ready = wait([*self._process_fds, self._stop_read])
        if self._stop_read not in ready:
            self._on_exit()

    def stop(self) -> None:
        """Stop watching (before the ranks are asked to exit); idempotent."""
        if self._stop_write < 0:
            return
        os.write(self._stop_write, b"x")
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        for fd in (*self._process_fds, self._stop_read, self._stop_write):
            os.close(fd)
        self._process_fds, self._stop_write = [], -1

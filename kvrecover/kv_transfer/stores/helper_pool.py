"""Persistent helper threads for staged reads, shared by every load of one connector.

`staged_io.read_rows` spreads a load's rows over several threads: the calling one
and up to `threads - 1` helpers. Starting those helpers per load cost 0.5-7 ms each
on a busy host (`Thread.start` waits for the GIL), and 16 concurrent async loads of
8 threads each ran 128 threads at once. A `HelperPool` keeps its threads: a load
queues its helpers (`run`), idle threads take them in order, so loads in flight
together share at most the pool's threads (plus their own calling threads) and
none starts a thread.

Safety is the caller's own: `read_rows` waits, before it returns, for every helper
of its load that started, and a helper that starts after that does nothing, so no
helper ever writes a load's rows once its caller has moved on (as a joined thread).
A helper stuck in a read (a hung mount) keeps its pool thread; the load's calling
thread reads on by itself meanwhile, so a stuck pool slows loads, never blocks them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

MAX_POOL_THREADS = 64  # as `io_threads` at most
CLOSE_JOIN_S = 5.0  # how long `close` waits for the threads, in all


class HelperPool:
    """Daemon threads (named `kv-io-N`) that run queued helper calls; grows on demand up
    to MAX_POOL_THREADS. Any thread may call it."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def run(self, helpers: int, work: Callable[[], None]) -> Callable[[], None]:
        """Queue `helpers` calls of `work` on pool threads (starting threads until the
        pool has `helpers`); returns `finish`: call it once the caller's own share of
        the work is done. It waits for the calls that started and voids the rest."""
        state = {"closed": False, "running": 0}
        changed = threading.Condition()

        def helper() -> None:
            with changed:
                if state["closed"]:
                    return
                state["running"] += 1
            try:
                work()
            finally:
                with changed:
                    state["running"] -= 1
                    changed.notify_all()

        def finish() -> None:
            with changed:
                state["closed"] = True
                while state["running"]:
                    changed.wait()

        self._grow(min(helpers, MAX_POOL_THREADS))
        for _ in range(helpers):
            self._tasks.put(helper)
        return finish

    def _grow(self, size: int) -> None:
        with self._lock:
            while len(self._threads) < size:
                thread = threading.Thread(target=self._serve, name=f"kv-io-{len(self._threads)}",
                                          daemon=True)
                thread.start()
                self._threads.append(thread)

    def _serve(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except Exception:  # read_rows' work catches its own; never kill a pool thread
                pass

    def close(self, join_s: float = CLOSE_JOIN_S) -> None:
        """End the threads once the queued calls are done and wait up to `join_s` in all
        for them (idempotent): none may still be inside torch when the interpreter tears
        down (that aborts the process). A thread stuck in a read is left behind."""
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._tasks.put(None)
        give_up = time.monotonic() + join_s
        for thread in threads:
            thread.join(max(0.0, give_up - time.monotonic()))

"""Store reads on threads that a load can stop waiting for: the whole-load deadline.

A read from a stuck NFS mount, or any blocking call into a store, cannot be
interrupted from Python. So every load (sync or async) reads on a daemon thread of
its own, and the load waits for it only until its deadline (`load_timeout_s`). Past
it the read is abandoned: its `cancelled` event is set (reads check it between
entries, an injected hang waits on it) and whatever it returns later is dropped.
An abandoned read only ever writes memory of its own (staging rows, host buffers),
never the KV cache, so giving up on it is safe. A read that copies into the cache
itself (a folder's sync load on the CPU) does so only through its `cancelled`
event's `write_unless_set`: once `set()` has returned, no such copy is running and
none will start (the copy is a memory copy, never I/O, so `set()` waits for at most
one block's).

A store that hangs for good would otherwise leave one stuck thread per load: while
`MAX_ABANDONED_READS` abandoned reads of one connector are still running, a new load
fails at once (`StoreStuck`: its blocks are invalid and recomputed) instead of starting
another thread. Reads already running when the cap is reached may still be abandoned
after it, so the stuck reads stay below the cap plus the loads in flight at once (a
read of many blocks may itself run on up to `io_threads` threads: `staged_io`).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

MAX_ABANDONED_READS = 4  # stuck reads one connector keeps waiting on before it refuses loads


class StoreStuck(Exception):
    """Too many abandoned reads of this store are still running: it hangs."""


class ReadTimedOut(Exception):
    """A read was still running at its load's deadline (it was abandoned)."""


ResultT = TypeVar("ResultT")


class ReadCancel(threading.Event):
    """A read's `cancelled` flag, which also fences the read's writes into the KV cache
    (see module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._writes = threading.Lock()
        # What the read has finished so far, for a load that stops waiting for it to
        # keep (set by the read; `StoreConnectorBase._salvage`).
        self.progress: Any = None

    def set(self) -> None:
        with self._writes:  # waits for a copy in progress to end
            super().set()

    def write_unless_set(self, write: Callable[[], ResultT]) -> ResultT:
        """`write()`'s result, or ReadTimedOut (and nothing written) if the read is
        cancelled; `set()` waits while `write` runs."""
        with self._writes:
            if self.is_set():
                raise ReadTimedOut("the load was given up: nothing more goes into the cache")
            return write()


@dataclass
class StoreRead:
    """A read running on its own thread: the result to come and how to cancel it."""

    future: concurrent.futures.Future
    cancelled: ReadCancel
    thread: threading.Thread


class ReaderThreads:
    """Starts a connector's store reads on daemon threads and keeps count of the ones
    it gave up on (see module docstring). The worker thread calls it; thread-safe."""

    def __init__(self, max_abandoned: int = MAX_ABANDONED_READS) -> None:
        self.max_abandoned = max_abandoned
        self._abandoned: list[StoreRead] = []
        self._lock = threading.Lock()

    def start(self, name: str, read: Callable[[ReadCancel], Any]) -> StoreRead:
        """Run `read(cancelled)` on a new daemon thread called `name`. Raises StoreStuck
        (starting nothing) while `max_abandoned` abandoned reads are still running."""
        if self.num_stuck() >= self.max_abandoned:
            raise StoreStuck(f"{self.max_abandoned} earlier reads of this store are still "
                             "stuck past their deadline")
        cancelled = ReadCancel()
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(read(cancelled))
            except BaseException as error:  # reads catch their own errors; be safe
                future.set_exception(error)

        # A daemon thread: a read stuck in the kernel must not keep the process alive at exit.
        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return StoreRead(future, cancelled, thread)

    def wait(self, task: StoreRead, timeout_s: float) -> Any:
        """`task`'s result, waited for at most `timeout_s`; past that the read is abandoned
        and ReadTimedOut raised. Raises what the read raised."""
        try:
            return task.future.result(timeout=max(0.0, timeout_s))
        except TimeoutError:  # (concurrent.futures' is the built-in one)
            if task.future.done():  # the read's own TimeoutError
                raise
            self.abandon(task)
            raise ReadTimedOut("the read was still running after its deadline") from None

    def abandon(self, task: StoreRead) -> None:
        """Stop waiting for `task`: cancel it and count it while its thread runs on."""
        task.cancelled.set()
        if task.thread.is_alive():
            with self._lock:
                self._abandoned.append(task)

    def num_stuck(self) -> int:
        """How many abandoned reads are still running."""
        with self._lock:
            self._abandoned = [task for task in self._abandoned if task.thread.is_alive()]
            return len(self._abandoned)

    def join_abandoned(self, give_up: float) -> None:
        """Wait until the monotonic time `give_up` at most for the abandoned reads to end."""
        with self._lock:
            tasks, self._abandoned = self._abandoned, []
        for task in tasks:
            task.thread.join(max(0.0, give_up - time.monotonic()))

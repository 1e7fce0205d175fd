"""Moving a transfer's stored entries between staging rows and files with several threads.

A staged load (async loads, and every load into a GPU cache) reads each entry into
its own row of one host buffer. One Python thread reading 0.5 MB entries is bound
by the kernel's page-cache copy into user memory (about one core's memory
bandwidth), so the rows are split into chunks and several threads claim chunks in
order: `os.readv` releases the GIL, so their copies overlap, and only the
checksum and the per-entry Python work take turns. After each chunk
`after_chunk(start, end)` runs on the thread that read it (the GPU path uploads
the chunk there, so host-to-device copies overlap the remaining reads).

Only the leading run of good rows is ever used, so once a row fails no thread
claims a chunk after it; rows that were not read are reported as None. Saves
(`write_rows`) spread the same way; there every row counts on its own.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

CHUNK_BYTES = 16 << 20  # rows per chunk: enough to amortise an upload, small enough to spread
RowResult = int | Exception | None  # a row's checksum, why it failed, or None (not read)


def chunk_rows(row_nbytes: int) -> int:
    """How many rows make one chunk (at least one)."""
    return max(1, CHUNK_BYTES // row_nbytes)


def read_rows(count: int, read_row: Callable[[int], int], cancelled: threading.Event,
              threads: int, rows_per_chunk: int,
              after_chunk: Callable[[int, int], None] | None = None,
              every_row: bool = False) -> list[RowResult]:
    """Run `read_row(position)` for positions 0..count-1 (it returns the row's checksum
    or raises) on up to `threads` threads, the calling one included; stops early
    when `cancelled` is set, and after a row fails unless `every_row` (rows that do not
    depend on each other: KV cache groups). One result per row (see `RowResult`)."""
    results: list[RowResult] = [None] * count
    num_chunks = -(-count // rows_per_chunk)
    claims = itertools.count()  # next() on it is atomic under the GIL
    first_failure = [count]  # lowest failed position so far (a list: written by workers)
    lock = threading.Lock()

    def work() -> None:
        while not cancelled.is_set():
            chunk = next(claims)
            start = chunk * rows_per_chunk
            if chunk >= num_chunks or start > first_failure[0]:
                return
            end = min(count, start + rows_per_chunk)
            done = start
            while done < end and not cancelled.is_set() and done < first_failure[0]:
                try:
                    results[done] = read_row(done)
                except Exception as error:  # a bad entry is an invalid block, never a crash
                    fail(done, error)
                    if not every_row:
                        break
                done += 1
            if after_chunk is not None and done > start:
                try:  # the rows read so far, even of a chunk cut short: they may be used
                    after_chunk(start, done)
                except Exception as error:
                    fail(start, error)
            if done < end:
                return

    def fail(position: int, error: Exception) -> None:
        results[position] = error
        if every_row:
            return
        with lock:
            first_failure[0] = min(first_failure[0], position)

    helpers = [threading.Thread(target=work, name=f"kv-read-{index}", daemon=True)
               for index in range(min(threads, num_chunks) - 1)]
    for helper in helpers:
        helper.start()
    try:
        work()
    finally:
        for helper in helpers:
            helper.join()
    return results


def write_rows(count: int, write_row: Callable[[int], None], threads: int) -> int:
    """Run `write_row(position)` for positions 0..count-1 on up to `threads` threads, the
    calling one included; returns how many raised (every row is attempted)."""
    failures = [0]
    lock = threading.Lock()

    def work(first: int) -> None:
        for position in range(first, count, workers):
            try:
                write_row(position)
            except Exception:  # the caller counts save failures; it never raises
                with lock:
                    failures[0] += 1

    workers = max(1, min(threads, count))
    helpers = [threading.Thread(target=work, args=(first,), name=f"kv-write-{first}", daemon=True)
               for first in range(1, workers)]
    for helper in helpers:
        helper.start()
    try:
        work(0)
    finally:
        for helper in helpers:
            helper.join()
    return failures[0]

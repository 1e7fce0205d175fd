"""Moving a transfer's stored entries between staging rows and files with several threads.

A staged load (async loads, and every load into a GPU cache) reads each entry into
its own row of one host buffer. One Python thread reading 0.5 MB entries is bound
by the kernel's page-cache copy into user memory (about one core's memory
bandwidth), so the rows are split into chunks and several threads claim chunks in
order: `os.readv` releases the GIL, so their copies overlap, and only the
checksum and the per-entry Python work take turns. After each chunk
`after_chunk(start, end)` runs on the thread that read it (the GPU path uploads
the chunk there, so host-to-device copies overlap the remaining reads).

Only the leading run of good rows of a request is ever used, so once a row fails
no thread claims a chunk after it in its run (a batched step reads every request's
rows as one load, each request a run of its own: a failure cuts its own run only);
rows that were not read are reported as None. Saves (`write_rows`) spread the same
way; there every row counts on its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvrecover.kv_transfer.stores.helper_pool import HelperPool

CHUNK_BYTES = 16 << 20  # rows per chunk: enough to amortise an upload, small enough to spread
RowResult = int | Exception | None  # a row's checksum, why it failed, or None (not read)


def chunk_rows(row_nbytes: int) -> int:
    """How many rows make one chunk (at least one)."""
    return max(1, CHUNK_BYTES // row_nbytes)


def read_rows(count: int, read_row: Callable[[int], int], cancelled: threading.Event,
              threads: int, rows_per_chunk: int,
              after_chunk: Callable[[int, int], None] | None = None,
              every_row: bool = False, segments: Sequence[int] | None = None,
              results: list[RowResult] | None = None,
              pool: HelperPool | None = None,
              after_run: Callable[[int], None] | None = None,
              read_chunk: Callable[[int, int], Sequence[RowResult] | None] | None = None,
              ) -> list[RowResult]:
    """Run `read_row(position)` for positions 0..count-1 (it returns the row's checksum
    or raises) on up to `threads` threads, the calling one included; stops early
    when `cancelled` is set, and after a row fails unless `every_row` (rows that do not
    depend on each other: KV cache groups). `segments` (the end positions of
    consecutive runs of rows, e.g. one per request of a batched step; default one run)
    bounds what a failure stops: the rest of its own run only. One result per row (see
    `RowResult`), written into `results` as rows end when it is given (a list of
    `count` Nones: what a caller that gave up waiting may still use). The helpers run
    on `pool`'s threads when it is given, else on threads started for this call.
    `after_run(run)` runs once per run whose rows all ended (read, failed or cut by a
    failure; its `after_chunk` calls returned), on the thread that ended it, so a
    caller can use one run (one request's rows) while the others are still read; a
    run that `cancelled` cut short gets no call. `read_chunk(start, end)`, when given,
    reads a whole chunk at once (results of rows start..end-1, None for a row not read
    after a failure), or returns None to leave it to `read_row` row by row."""
    results = [None] * count if results is None else results
    ends = [count] if segments is None else list(segments)
    if (ends and ends[-1] != count) or any(b < a for a, b in zip([0, *ends], ends)):
        raise ValueError(f"segments must be ascending run ends up to {count}, got {ends}")
    # Chunks never span two runs, so a failure's cut is a chunk boundary of its run.
    chunks = [(start, min(end, start + rows_per_chunk), run)
              for run, (first, end) in enumerate(zip([0, *ends], ends))
              for start in range(first, end, rows_per_chunk)]
    claims = iter(chunks)  # next() on it is atomic under the GIL
    first_failure = list(ends)  # per run, its lowest failed position so far
    lock = threading.Lock()
    chunks_left = [0] * len(ends)  # per run, its chunks not ended yet
    for _, _, run in chunks:
        chunks_left[run] += 1

    def chunk_ended(run: int) -> None:
        with lock:
            chunks_left[run] -= 1
            ended = chunks_left[run] == 0
        if ended and after_run is not None:
            try:
                after_run(run)
            except Exception:  # the run's rows stay in `results`: the caller uses them at the end
                pass

    def work() -> None:
        while not cancelled.is_set():
            start, end, run = next(claims, (count, count, -1))
            if run < 0:
                return
            if start > first_failure[run]:
                chunk_ended(run)
                continue
            done = start
            try:
                chunk = None if read_chunk is None else read_chunk(start, end)
            except Exception:  # (unexpected: then row by row, which reports each failure)
                chunk = None
            for result in chunk or ():
                if result is None:
                    break
                if isinstance(result, Exception):
                    fail(done, run, result)
                    if not every_row:
                        break
                else:
                    results[done] = result
                done += 1
            while chunk is None and done < end and not cancelled.is_set() \
                    and done < first_failure[run]:
                try:
                    results[done] = read_row(done)
                except Exception as error:  # a bad entry is an invalid block, never a crash
                    fail(done, run, error)
                    if not every_row:
                        break
                done += 1
            if after_chunk is not None and done > start:
                try:  # the rows read so far, even of a chunk cut short: they may be used
                    after_chunk(start, done)
                except Exception as error:
                    fail(start, run, error)
            if cancelled.is_set():
                return
            chunk_ended(run)

    def fail(position: int, run: int, error: Exception) -> None:
        results[position] = error
        if every_row:
            return
        with lock:
            first_failure[run] = min(first_failure[run], position)

    num_helpers = min(threads, len(chunks)) - 1
    if pool is not None:
        finish = pool.run(num_helpers, work) if num_helpers > 0 else (lambda: None)
        try:
            work()
        finally:
            finish()  # no helper of this call runs past here
        return results
    helpers = [threading.Thread(target=work, name=f"kv-read-{index}", daemon=True)
               for index in range(num_helpers)]
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

"""The async side of a block-store connector (`StoreConnectorBase` mixes it in): each
async load reads on a reader thread while its request waits, alone (`_start_async`) or
with the step's other async loads as one batch (`_start_async_batch`), and
`get_finished` lands the ones that ended (one `_install_step` for them all), gives up
those past their deadline, and lets go of aborted ones (`_abandon`: a read shared with
others of its batch goes on for them; its own writes into the cache are fenced off).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvrecover.kv_transfer.stores.reader_threads import (
    ReadCancel,
    ReaderThreads,
    StoreRead,
    StoreStuck,
)
from kvrecover.kv_transfer.stores.transfers import BlockTransfer

logger = logging.getLogger(__name__)

# How much of its deadline window a finished async load waits for the rest of its batch.
BATCH_HOLD_FRACTION = 0.25


@dataclass
class AsyncLoad:
    """An async load in flight: its thread (None if it was refused at once), the result
    to come, its deadline, and the fence of its own writes into the cache (`writes`:
    set once nobody waits for it, even while its batch's read goes on for others)."""

    transfer: BlockTransfer
    future: concurrent.futures.Future
    deadline: float
    cancelled: ReadCancel
    thread: threading.Thread | None
    writes: ReadCancel | None = None


class AsyncStoreLoads:
    """Async loads of a block-store connector: started by `start_load_kv`, reported and
    landed by `get_finished`. The host class holds the state (`_async_loads`,
    `_readers`, `load_timeout_s`, `_invalid_block_ids`) and installs what lands."""

    _async_loads: dict[str, AsyncLoad]
    _readers: ReaderThreads
    load_timeout_s: float
    _invalid_block_ids: set[int]

    if TYPE_CHECKING:  # provided by `StoreConnectorBase`
        def _install_step(self, transfers: list[BlockTransfer], results: list[Any]) -> None: ...
        def _install_state(self, transfer: BlockTransfer, payload: bytes | None) -> None: ...
        def _keep_resume_states(self, transfers: list[BlockTransfer]) -> None: ...
        def _read_states(self, transfers: list[BlockTransfer], cancelled: ReadCancel,
                         ) -> list[bytes | None]: ...

    def _read_async(self, transfer: BlockTransfer, cancelled: ReadCancel) -> Any:
        """Read and verify one async load's blocks on its thread, off the cache; the
        result goes to `_install` once the worker reports the load finished."""
        raise NotImplementedError(f"{type(self).__name__} does not load asynchronously")

    def _read_async_batch(self, transfers: list[BlockTransfer], cancelled: ReadCancel,
                          ready: Callable[[int, Any], None],
                          writes: list[ReadCancel]) -> list[Any]:
        """Read and verify a step's async loads as one batch on one reader thread
        (`batched_async_reads`): `ready(i, result)` as soon as transfer i's blocks are
        read (any thread may call it; what `_read_async` returns), and one result per
        transfer returned at the end (those already handed to `ready` are ignored). A
        read that writes into the cache itself does so only through both `cancelled`'s
        and transfer i's `writes[i]` fence (`ReadCancel.write_unless_set`): `writes[i]`
        is set when nobody waits for load i any more, before its blocks are freed."""
        raise NotImplementedError(f"{type(self).__name__} does not batch async loads")

    def _drop_async_result(self, result: Any) -> None:
        """An async load's `_read_async` result that will never be installed (its
        request was aborted or gave up): let go of what it holds. The default holds
        nothing."""

    def _start_async(self, transfer: BlockTransfer) -> None:
        deadline = time.monotonic() + self.load_timeout_s
        try:
            task = self._readers.start(f"kv-load-{transfer.request_id}",
                                       lambda cancelled: self._read_async_load(transfer, cancelled))
        except StoreStuck as error:  # fails at once: reported finished, its blocks invalid
            refused: concurrent.futures.Future = concurrent.futures.Future()
            refused.set_exception(error)
            self._async_loads[transfer.request_id] = AsyncLoad(
                transfer, refused, deadline, ReadCancel(), None)
            return
        self._async_loads[transfer.request_id] = AsyncLoad(
            transfer, task.future, deadline, task.cancelled, task.thread)

    def _start_async_batch(self, transfers: list[BlockTransfer]) -> None:
        """Start a step's async loads as one batch on one reader thread: each load's
        future resolves as soon as its own blocks (and state) are read."""
        deadline = time.monotonic() + self.load_timeout_s
        futures: list[concurrent.futures.Future] = [concurrent.futures.Future()
                                                    for _ in transfers]
        # Made here, on the worker thread: an abort may come before the read starts.
        writes = [ReadCancel() for _ in transfers]

        def read(cancelled: ReadCancel) -> None:
            ended = [False] * len(transfers)

            def ready(index: int, blocks: Any) -> None:
                if ended[index]:
                    return
                ended[index] = True
                try:
                    result = self._with_state(transfers[index], blocks, cancelled)
                except BaseException as error:  # reads catch their own errors; be safe
                    futures[index].set_exception(error)
                    return
                futures[index].set_result(result)

            try:
                for index, blocks in enumerate(self._read_async_batch(transfers, cancelled,
                                                                      ready, writes)):
                    ready(index, blocks)
            except BaseException as error:
                for index, future in enumerate(futures):
                    if not ended[index]:
                        ended[index] = True
                        future.set_exception(error)
                raise

        try:
            task = self._readers.start(f"kv-load-{transfers[0].request_id}", read)
        except StoreStuck as error:  # fails at once: reported finished, blocks invalid
            for transfer, future in zip(transfers, futures):
                future.set_exception(error)
                self._async_loads[transfer.request_id] = AsyncLoad(
                    transfer, future, deadline, ReadCancel(), None)
            return
        for transfer, future, fence in zip(transfers, futures, writes):
            self._async_loads[transfer.request_id] = AsyncLoad(
                transfer, future, deadline, task.cancelled, task.thread, fence)

    def _abandon(self, load: AsyncLoad) -> None:
        """Nobody waits for this async load any more; its thread may run on (counted).
        A load that shares its read with others of its batch still in flight leaves
        the read running for them; its result is dropped when it comes."""
        if load.writes is not None:  # nothing more of this load reaches the cache
            load.writes.set()
        if load.thread is None:
            return
        load.future.add_done_callback(self._drop_abandoned)
        if any(other.cancelled is load.cancelled and not other.future.done()
               for other in self._async_loads.values() if other is not load):
            return
        self._readers.abandon(StoreRead(load.future, load.cancelled, load.thread))

    def _drop_abandoned(self, future: concurrent.futures.Future) -> None:
        if future.exception() is None:
            result = future.result()
            self._drop_async_result(result[0] if isinstance(result, tuple) else result)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report the async loads that ended; every one that finished is installed by ONE
        `_install_step` (one batched install) per round."""
        done: set[str] = set()
        now = time.monotonic()
        for request_id, load in list(self._async_loads.items()):
            if request_id in finished_req_ids:  # aborted: nothing will read these blocks
                self._abandon(load)
            elif load.future.done():
                continue  # lands below, with the rest of its batch
            elif now >= load.deadline:
                logger.warning("request %s: KV load exceeded %.1fs; its blocks are invalid",
                               request_id, self.load_timeout_s)
                self._abandon(load)  # a late result is dropped with the future
                self._invalid_block_ids.update(load.transfer.block_ids)
            else:
                continue
            del self._async_loads[request_id]
            done.add(request_id)
        # Installing takes time (a copy; on a GPU an upload): a load that finished
        # meanwhile is reported now, not a whole step later.
        while landed := self._landable(time.monotonic()):
            self._land(landed)
            done.update(load.transfer.request_id for load in landed)
        return None, done or None

    def _landable(self, now: float) -> list[AsyncLoad]:
        """The finished async loads, taken out of the in-flight ones, except those whose
        batch (loads sharing one read) still reads for another member: a step's loads
        land together, as a sync step's would (one install, and one forward for them
        all rather than a first one for the earliest that the others then wait for).
        A member that is slow or hangs holds the others for the first
        BATCH_HOLD_FRACTION of their deadline window at most (the engine's own deadline
        on them ends later)."""
        reading = {id(load.cancelled) for load in self._async_loads.values()
                   if not load.future.done()}
        hold_until = (1.0 - BATCH_HOLD_FRACTION) * self.load_timeout_s
        ready = [request_id for request_id, load in self._async_loads.items()
                 if load.future.done() and (id(load.cancelled) not in reading
                                            or now >= load.deadline - hold_until)]
        return [self._async_loads.pop(request_id) for request_id in ready]

    def _read_async_load(self, transfer: BlockTransfer, cancelled: ReadCancel) -> Any:
        """An async load's blocks (`_read_async`), with its state (blocks, state) when it
        carries one."""
        return self._with_state(transfer, self._read_async(transfer, cancelled), cancelled)

    def _with_state(self, transfer: BlockTransfer, blocks: Any, cancelled: ReadCancel) -> Any:
        """`blocks`, or (blocks, state) with its state read when the load carries one."""
        if transfer.state_hash is None:
            return blocks
        return blocks, self._read_states([transfer], cancelled)[0]

    def _land(self, loads: list[AsyncLoad]) -> None:
        """Install finished loads' blocks (one `_install_step` for them all) and states,
        or mark a load's blocks invalid if its read crashed."""
        transfers: list[BlockTransfer] = []
        results: list[Any] = []
        for load in loads:
            error = load.future.exception()
            if error is not None:
                logger.warning("request %s: KV load crashed (%r); its blocks are invalid",
                               load.transfer.request_id, error)
                self._invalid_block_ids.update(load.transfer.block_ids)
                continue
            transfers.append(load.transfer)
            results.append(load.future.result())
        if not transfers:
            return
        self._install_step(transfers, [result if transfer.state_hash is None else result[0]
                                       for transfer, result in zip(transfers, results)])
        for transfer, result in zip(transfers, results):
            if transfer.state_hash is not None:
                self._install_state(transfer, result[1])
        self._keep_resume_states([t for t in transfers if t.state_hash is not None])

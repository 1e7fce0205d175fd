"""A consumer rank's NIXL READs of checked pulls, and the install of what they verify.

`PullReader.read` moves every block of a step's checked pulls from one producer agent
with one READ into a registered staging buffer on the cache's device, never into the
cache (`staging.py`): a row per distinct producer block in ascending id (short gaps
between runs read too), laid out (side, cache, block), one descriptor per side, cache
tensor and run of consecutive remote ids, a hybrid's state rows after the blocks
(`states.py`). `install` checks the staged blocks against the producer's checksums (by
the algorithm its handshake names: `checksums.py`) and copies only the verified ones
into the cache, an indexed copy per cache tensor and run of consecutive staged rows,
under a load's fence when given; `verify_states` checks the staged states. The reader
counts the bytes and time READ, the time checking and the blocks installed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kvrecover.kv_transfer.p2p.checksums import checksum_blocks
from kvrecover.kv_transfer.p2p.metadata import Pull
from kvrecover.kv_transfer.p2p.peers import Peer
from kvrecover.kv_transfer.p2p.staging import (
    StagingBuffer,
    StagingExhausted,
    StagingLayout,
    StagingPool,
    block_descriptors,
    half_nbytes,
    max_gap_blocks,
    memory_of,
    staged_blocks,
)
from kvrecover.kv_transfer.p2p.states import chunks, num_rows, verify
from kvrecover.kv_transfer.stores.reader_threads import ReadCancel, ReadTimedOut

logger = logging.getLogger(__name__)

Checked = tuple[Pull, Peer, list[int]]
"""A pull its producer confirmed: the producer's peer and the checksums of its blocks."""


def staging_layout(items: list[Checked], caches: list[torch.Tensor]) -> StagingLayout:
    """Where `PullReader.read` stages the blocks of `items` (in their order) for a cache
    of the tensors `caches`."""
    max_gap = max_gap_blocks(half_nbytes(caches), caches[0].device.type)
    return StagingLayout.of([b for pull, _, _ in items for b in pull.remote_block_ids],
                            max_gap)


@dataclass(frozen=True)
class InstallPlan:
    """Verified staged rows into cache blocks: each segment (first row, number of rows)
    of consecutive staged rows goes into the next blocks of `targets` (the segments'
    blocks, in turn); `repeats` are the (row, block) pairs of a row that goes into more
    than one block (a producer block two pulls share)."""

    segments: list[tuple[int, int]]
    targets: list[int]
    repeats: list[tuple[int, int]]

    @classmethod
    def of(cls, pairs: Iterable[tuple[int, int]]) -> InstallPlan:
        """The plan of (staged row, cache block) `pairs`."""
        segments: list[tuple[int, int]] = []
        targets: list[int] = []
        repeats: list[tuple[int, int]] = []
        for row, block in sorted(pairs):
            if segments and row < segments[-1][0] + segments[-1][1]:
                repeats.append((row, block))
            elif segments and row == segments[-1][0] + segments[-1][1]:
                segments[-1] = (segments[-1][0], segments[-1][1] + 1)
                targets.append(block)
            else:
                segments.append((row, 1))
                targets.append(block)
        return cls(segments, targets, repeats)

    def copies(self, gather: bool) -> list[tuple[slice | list[int], list[int]]]:
        """(staged rows, their blocks) of each indexed copy: a slice per segment and a
        gather of the repeats, or with `gather`, one of every row (a slice if they are
        all the rows, in order)."""
        at = 0
        copies: list[tuple[slice | list[int], list[int]]] = []
        for first, length in self.segments:
            copies.append((slice(first, first + length), self.targets[at:at + length]))
            at += length
        if self.repeats:
            copies.append(([row for row, _ in self.repeats], [b for _, b in self.repeats]))
        if not gather or len(copies) == 1:
            return copies
        rows = [r for source, _ in copies for r in (
            range(source.start, source.stop) if isinstance(source, slice) else source)]
        return [(rows, [b for _, blocks in copies for b in blocks])]


class PullReader:
    """Reads checked pulls into staging buffers and installs their verified blocks into
    the cache; its counts are taken by `take_transfer_counts` and
    `take_installed_blocks`."""

    def __init__(self) -> None:
        self.caches: list[torch.Tensor] = []
        self.agent: Any = None
        self.staging: StagingPool | None = None  # made with the first read
        self._lock = threading.Lock()
        self._installed_blocks = 0
        # Bytes READ, and microseconds spent in READs and in checking staged blocks, since
        # the last `take_transfer_counts` (async pulls add from their own threads).
        self._transfer_counts = {"read_bytes": 0, "read_microseconds": 0,
                                 "check_microseconds": 0}

    def register(self, caches: list[torch.Tensor], agent: Any) -> None:
        """The cache verified blocks are copied into, and the agent that reads them."""
        self.caches, self.agent = caches, agent

    def read(self, agent: str, items: list[Checked], deadline: float) -> StagingBuffer | None:
        """One NIXL READ of every block of `items` from `agent` into a staging buffer
        (never into the cache: `staging.py`): the blocks of `items` as `staging_layout`
        places them, one descriptor per run of consecutive remote ids, a hybrid's state
        rows after them. The buffer if the READ completed (the caller gives it back),
        else None (a READ given up in flight leaves its buffer quarantined)."""
        half = half_nbytes(self.caches)
        pool = self._staging_pool()
        row_nbytes = pool.row_nbytes  # a block's K and V in every cache tensor
        states = [p.remote_state for p, _, _ in items if p.remote_state is not None]
        layout = staging_layout(items, self.caches)
        num_blocks = len(layout.remote_ids)
        try:
            buffer = pool.acquire(num_blocks + sum(num_rows(s, row_nbytes) for s in states))
        except StagingExhausted as error:
            logger.warning("NIXL read from %s refused: %s", agent, error)
            return None
        base = buffer.rows.data_ptr()
        device = memory_of(buffer.rows)[1]
        peer = items[0][1]  # one producer agent: one peer
        # The step's pulls are described together, so a run of ids goes on from one
        # prompt into another.
        local, remote = block_descriptors(layout.remote_ids, peer.regions, half, base, 0,
                                          num_blocks, device, peer.device_id)
        state_row = num_blocks
        for remote_state in states:
            state_local, state_remote = chunks(remote_state, base, state_row, row_nbytes,
                                               device, peer.device_id)
            local += state_local
            remote += state_remote
            state_row += num_rows(remote_state, row_nbytes)
        started = time.perf_counter()
        if not pool.read(buffer, local, remote, peer.memory, agent, deadline):
            return None
        self._count("read_bytes", sum(length for _, length, _ in local))
        self._count("read_microseconds", int((time.perf_counter() - started) * 1e6))
        return buffer

    def verify_states(self, items: list[Checked], buffer: StagingBuffer) -> None:
        """Each pull's staged state, verified against its checksum (`state_payload`;
        None if it fails), from the rows after the blocks' (as `read` laid them out)."""
        row = len(staging_layout(items, self.caches).remote_ids)
        for pull, _, _ in items:
            state = pull.remote_state
            if state is None:
                continue
            rows = num_rows(state, buffer.rows.shape[1])
            pull.state_payload = verify(state, buffer.rows[row:row + rows])
            row += rows
            if pull.state_payload is None:
                logger.warning("request %s: its pulled recurrent state fails its checksum",
                               pull.request_id)

    def install(self, items: list[Checked], buffer: StagingBuffer,
                fence: ReadCancel | None) -> set[int]:
        """Verify the staged rows of `items` against the producer's checksums and copy
        the verified ones into the cache (`InstallPlan`), under
        `fence` when given: nothing is written once it is set. The blocks not installed."""
        local_ids = [b for pull, _, _ in items for b in pull.block_ids]
        expected = [x for _, _, checksums in items for x in checksums]
        layout = staging_layout(items, self.caches)
        rows, num_rows = layout.rows, len(layout.remote_ids)  # rows: each pulled block's
        count = len(self.caches)
        staged = staged_blocks(buffer.rows, num_rows, count)  # (side, cache, block)
        pulled_rows = sorted(set(rows))  # not the gaps' rows
        started = time.perf_counter()
        checksums = checksum_blocks(items[0][1].checksum,
                                    [staged[:, c] for c in range(count)], pulled_rows)
        self._count("check_microseconds", int((time.perf_counter() - started) * 1e6))
        actual = dict(zip(pulled_rows, checksums))
        good = [i for i, x in enumerate(expected) if actual[rows[i]] == x]
        bad = set(local_ids) - {local_ids[i] for i in good}
        for pull, _, _ in items:
            failed = sum(b in bad for b in pull.block_ids)
            if failed:
                logger.warning("request %s: %d pulled KV block(s) fail their checksum",
                               pull.request_id, failed)
        if not good:
            return bad
        half = half_nbytes(self.caches)
        # Moved in 8-byte words where the halves allow: an indexed copy of bytes moves one
        # byte per element (a 16 x 1024-token CPU pull spent 3 s here).
        word = torch.int64 if half % 8 == 0 else torch.uint8
        words = staged.view(word)
        # On a CPU, a copy per segment of consecutive rows: a gather of the rows used
        # (with a gap read or a block failed) would move every byte twice. On a GPU, one
        # gather: a launch per segment costs more than the second pass.
        plan = InstallPlan.of((rows[i], local_ids[i]) for i in good)
        device = staged.device
        copies = [(source if isinstance(source, slice) else torch.tensor(source, device=device),
                   torch.tensor(blocks, dtype=torch.long, device=device))
                  for source, blocks in plan.copies(gather=staged.is_cuda)]

        def copy() -> None:
            for c, cache in enumerate(self.caches):
                cache_words = cache.view(torch.uint8).view(2, cache.shape[1], half).view(word)
                for source, blocks in copies:
                    source_words = (words[:, c, source] if isinstance(source, slice)
                                    else words[:, c].index_select(1, source))
                    cache_words.index_copy_(1, blocks, source_words)
            if staged.is_cuda:
                # The buffer goes back to the pool next, and the next READ into it runs on
                # UCX's stream, not this one: the copies out of it must be done first.
                torch.cuda.current_stream(staged.device).synchronize()

        if fence is None:
            copy()
        else:
            try:
                fence.write_unless_set(copy)
            except ReadTimedOut:
                return set(local_ids)
        with self._lock:  # async pulls install from their own threads
            self._installed_blocks += len(good)
        return bad

    def give_back(self, buffer: StagingBuffer) -> None:
        """Return a buffer `read` gave to its pool once its rows are installed."""
        self._staging_pool().give_back(buffer)

    def take_installed_blocks(self) -> int:
        """Blocks installed into the cache, since the last call."""
        with self._lock:
            installed, self._installed_blocks = self._installed_blocks, 0
        return installed

    def take_transfer_counts(self) -> dict[str, int]:
        """READ bytes and microseconds, and microseconds checking staged blocks, since the
        last call."""
        with self._lock:
            counts = dict(self._transfer_counts)
            self._transfer_counts = dict.fromkeys(counts, 0)
        return counts

    def close(self) -> None:
        """Free the staging buffers (shutdown)."""
        if self.staging is not None:
            self.staging.close()

    def _count(self, name: str, amount: int) -> None:
        with self._lock:
            self._transfer_counts[name] += amount

    def _staging_pool(self) -> StagingPool:
        with self._lock:
            if self.staging is None:
                row_nbytes = 2 * len(self.caches) * half_nbytes(self.caches)  # a block's K and V
                self.staging = StagingPool(self.agent, row_nbytes,
                                           device=self.caches[0].device)
            return self.staging

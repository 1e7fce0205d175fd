"""The consumer's worker role: it runs the pulls the scheduler role planned (`claims.py`).

A block id spans every cache tensor whatever its group, so pulls move and verify pairs
of ids. For each pull the worker checks the reference with the producer (its answer
has the blocks' checksums), handshakes once per producer agent (again when the producer
restarted: a new agent), reads every block of the step with NIXL READ in one transfer
per producer (a descriptor per side, cache tensor and run of consecutive block ids:
`staging.py`), verifies each block's checksum (by the algorithm the producer's
handshake names: `checksums.py`) and releases the reference. The READ lands in a
registered staging buffer on the cache's device, never in the cache: only verified
blocks are copied into the cache (one indexed copy per cache tensor, under the load's
fence when a TieredConnector pulls), so a READ given up at its deadline that completes
later writes nothing the engine uses; its buffer stays quarantined until NIXL reports
that READ ended (past `MAX_QUARANTINED_READS` such buffers, pulls fail at once and are
recomputed). Anything that fails (unreachable producer, unknown or reused reference,
out-of-range ids, another layout, a read that errors or outlives `load_timeout_s`, a
checksum mismatch) makes those blocks invalid: the engine recomputes them (rule 10).

A hybrid's state is read in the same READ as the blocks, verified alike and installed
on the engine's thread (`states.py`): at once for a sync pull, with `finished` for an
async one; a state that fails makes the claim's last block invalid.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.p2p.checksums import ALGORITHMS, checksum_blocks
from kvrecover.kv_transfer.p2p.metadata import Pull
from kvrecover.kv_transfer.p2p.params import RemoteReference
from kvrecover.kv_transfer.p2p.side_channel import CALL_TIMEOUT_S, SideChannelError, call
from kvrecover.kv_transfer.p2p.staging import (
    StagingBuffer,
    StagingExhausted,
    StagingPool,
    block_descriptors,
    half_nbytes,
    memory_of,
    staged_blocks,
)
from kvrecover.kv_transfer.p2p.states import chunks, num_rows, parse_remote_state, verify
from kvrecover.kv_transfer.stores.reader_threads import ReadCancel, ReadTimedOut

if TYPE_CHECKING:
    from kvrecover.kv_transfer.stores.state_entries import RecurrentStateAccess

logger = logging.getLogger(__name__)
# Bounds a release's side-channel call (a pull's, and an unread reference's after its
# check, which is bounded as a pull's check is: CALL_TIMEOUT_S).
RELEASE_TIMEOUT_S = 1.0


def _call_timeout(deadline: float) -> float:
    """A pull's side-channel call's bound: at most CALL_TIMEOUT_S, and never past the
    pull's `deadline` (each call of a step's pulls shares it: a producer that never
    answers costs them load_timeout_s in all, not CALL_TIMEOUT_S each)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the pull's deadline passed before its producer answered")
    return min(CALL_TIMEOUT_S, left)


@dataclass
class _Peer:
    agent: str
    num_blocks: int
    block_half_nbytes: int
    regions: list[tuple[int, int]]  # each cache tensor's (K base, V base) address
    memory: str  # NIXL's memory type of the producer's cache: "DRAM" or "VRAM"
    device_id: int
    checksum: str  # the producer's algorithm (`checksums.py`)


class NixlConsumer:
    """A consumer rank's pulls (worker role): sync ones in `start`, async ones on their
    own threads (reported by `finished`), a TieredConnector's through `pull_blocks`."""

    def __init__(self, layout: KVCacheLayout, load_timeout_s: float) -> None:
        self.layout = layout
        self.rank = layout.tensor_parallel_rank  # pulls from the producer's rank `rank`
        self.load_timeout_s = load_timeout_s
        self.caches: list[torch.Tensor] = []
        self.agent: Any = None
        self.staging: StagingPool | None = None  # made with the first read
        self._recurrent: RecurrentStateAccess | None = None
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._invalid: set[int] = set()
        self._async: dict[str, threading.Thread] = {}
        self._async_invalid: dict[str, set[int]] = {}
        self._async_pulls: dict[str, Pull] = {}  # async pulls of a state, by request
        self._releasing: list[threading.Thread] = []  # `release_unread`'s, not yet joined
        self._pulled_blocks = 0
        # Bytes READ, and microseconds spent in READs and in checking staged blocks, since
        # the last `take_transfer_counts` (async pulls add from their own threads).
        self._transfer_counts = {"read_bytes": 0, "read_microseconds": 0,
                                 "check_microseconds": 0}

    def register(self, caches: list[torch.Tensor], agent: Any) -> None:
        """The cache verified blocks are copied into, and the agent that reads them (the
        cache itself is not registered: READs land in staging buffers only)."""
        self.caches, self.agent = caches, agent

    def register_states(self, states: RecurrentStateAccess) -> None:
        """Where a hybrid's pulled states are installed."""
        self._recurrent = states

    def start(self, pulls: list[Pull]) -> None:
        """The step's pulls (`start_load_kv`): the sync ones now, the async ones on
        their own threads."""
        sync = [p for p in pulls if not p.is_async]
        if sync:
            self._invalid |= self._pull(sync)
            self._install_states(sync)
        for pull in (p for p in pulls if p.is_async):
            if pull.state_position is not None:
                self._async_pulls[pull.request_id] = pull
            thread = threading.Thread(target=self._pull_async, args=(pull,), daemon=True,
                                      name=f"kvrecover-nixl-pull-{pull.request_id}")
            self._async[pull.request_id] = thread
            thread.start()

    def release_unread(self, releases: list[Pull]) -> None:
        """Release references the step reads nothing from (a full local hit), each once
        the producer confirms it is of this prompt (a foreign one is left to its lease),
        on a thread of their own: the step never waits on the side channel for them."""
        if releases:
            self._in_background(self._release_checked, releases)

    def _in_background(self, releasing: Callable[[list[Pull]], None],
                       pulls: list[Pull]) -> None:
        """Run `releasing(pulls)` on a thread `close` waits for (bounded); async pulls'
        threads call this too."""
        thread = threading.Thread(target=releasing, args=(pulls,), daemon=True,
                                  name="kvrecover-nixl-release")
        with self._lock:
            self._releasing = [t for t in self._releasing if t.is_alive()]
            self._releasing.append(thread)
        thread.start()

    def _release_checked(self, releases: list[Pull]) -> None:
        for pull in releases:
            try:
                if self._ask_check(pull).get("ok") is True:
                    self._release(pull.reference)
            except SideChannelError:
                pass  # a producer that is gone or slow frees it at its lease's end

    def _release_all(self, pulls: list[Pull]) -> None:
        for pull in pulls:
            self._release(pull.reference)

    def _release(self, reference: RemoteReference) -> None:
        """Tell the producer this rank is done with `reference` (bounded; a producer that
        is gone or slow frees it at its lease's end)."""
        try:
            call(reference.host, reference.side_channel_port(self.rank),
                 {"op": "release", "handle": reference.request_id},
                 timeout_s=RELEASE_TIMEOUT_S)
        except SideChannelError:
            pass

    def _pull_async(self, pull: Pull) -> None:
        try:
            invalid = self._pull([pull])
        except Exception:  # noqa: BLE001 - a pull that broke leaves nothing it vouches for
            logger.exception("request %s: KV pull failed", pull.request_id)
            invalid = set(pull.block_ids) | set(pull.missing)
        self._async_invalid[pull.request_id] = invalid

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """The requests whose async pulls ended since the last call (their invalid
        blocks join `take_invalid`'s, their states are installed); the pulls of
        `finished_req_ids` (aborted while pulling) install no state."""
        for request_id in finished_req_ids:
            self._async_pulls.pop(request_id, None)
        receiving = {request_id for request_id, thread in self._async.items()
                     if not thread.is_alive()}
        for request_id in receiving:
            del self._async[request_id]
            self._invalid |= self._async_invalid.pop(request_id, set())
            pull = self._async_pulls.pop(request_id, None)
            if pull is not None:
                self._install_states([pull])
        return receiving

    def take_invalid(self) -> set[int]:
        """The local blocks whose pulls failed, since the last call."""
        invalid, self._invalid = self._invalid, set()
        return invalid

    def take_pulled_blocks(self) -> int:
        """Blocks pulled and installed, since the last call."""
        pulled, self._pulled_blocks = self._pulled_blocks, 0
        return pulled

    def take_transfer_counts(self) -> dict[str, int]:
        """READ bytes and microseconds, and microseconds checking staged blocks, since the
        last call."""
        with self._lock:
            counts = dict(self._transfer_counts)
            self._transfer_counts = dict.fromkeys(counts, 0)
        return counts

    def _count(self, name: str, amount: int) -> None:
        with self._lock:
            self._transfer_counts[name] += amount

    def pull_blocks(self, pulls: list[Pull], timeout_s: float,
                    fence: ReadCancel | None = None) -> set[int]:
        """Pull and verify `pulls` now, within `timeout_s` at most (a TieredConnector's
        reader thread calls it for its P2P tier, `fence` its load's: once the load is
        given up nothing more is copied into the cache); the local blocks that are not
        valid (verified ones are in the cache)."""
        return self._pull(pulls, min(timeout_s, self.load_timeout_s), fence)

    def _pull(self, pulls: list[Pull], timeout_s: float | None = None,
              fence: ReadCancel | None = None) -> set[int]:
        """Pull and verify `pulls`; returns the local blocks that are not valid. Only
        verified staged blocks are copied into the cache, before this returns."""
        deadline = time.monotonic() + (self.load_timeout_s if timeout_s is None
                                       else timeout_s)
        invalid: set[int] = set()
        checked: list[tuple[Pull, _Peer, list[int]]] = []
        for pull in pulls:
            invalid.update(pull.missing)
            if not pull.block_ids:
                continue
            try:
                peer, checksums = self._check(pull, deadline)
                checked.append((pull, peer, checksums))
            except Exception as error:  # noqa: BLE001 - a producer's answers are untrusted
                # input: a missing field or a wrong type refuses the pull as a bad value does.
                logger.warning("request %s: KV pull from %s refused: %r", pull.request_id,
                               pull.reference.engine_id, error)
                invalid.update(pull.block_ids)
        by_agent: dict[str, list[tuple[Pull, _Peer, list[int]]]] = {}
        for item in checked:
            by_agent.setdefault(item[1].agent, []).append(item)
        for agent, items in by_agent.items():
            buffer = self._read(agent, items, deadline)
            if buffer is None:
                for pull, _, _ in items:
                    invalid.update(pull.block_ids)
                continue
            try:
                invalid |= self._install_staged(items, buffer, fence)
                self._verify_states(items, buffer)
            finally:
                self._staging_pool().give_back(buffer)
        # Done with each reference that checked out, read or not: the producer frees it,
        # told from a thread (a slow producer must not hold up the step). A refused one is
        # left to its lease (it may be someone else's, or not be at all).
        if checked:
            self._in_background(self._release_all, [pull for pull, _, _ in checked])
        return invalid

    def _check(self, pull: Pull, deadline: float) -> tuple[_Peer, list[int]]:
        """Ask the producer whether the reference still holds these blocks; its answer's
        checksums, and the peer (handshaking when its agent is new), by `deadline`."""
        reference = pull.reference
        remote_ids = pull.remote_block_ids
        answer = self._ask_check(pull, _call_timeout(deadline))
        if answer.get("ok") is not True:
            raise ValueError(str(answer.get("reason", "refused")))
        if pull.state_position is not None and self._recurrent is not None:
            pull.remote_state = parse_remote_state(answer.get("state"), pull.state_position,
                                                   self._recurrent.bytes_per_checkpoint)
            if pull.remote_state is None:
                logger.warning("request %s: the producer keeps no recurrent state at %d",
                               pull.request_id, pull.state_position)
        checksums = answer.get("checksums")
        if not isinstance(checksums, list) or len(checksums) != len(remote_ids):
            raise ValueError("the producer's checksums do not match the blocks")
        peer = self._peers.get(reference.engine_id)
        if peer is None or peer.agent != answer.get("agent"):
            peer = self._handshake(reference, _call_timeout(deadline))
            self._peers[reference.engine_id] = peer
        if any(b >= peer.num_blocks for b in remote_ids):
            raise ValueError("block ids outside the producer's cache")
        return peer, checksums

    def _ask_check(self, pull: Pull, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        """The producer's answer to whether `pull`'s reference still holds its blocks, at
        its last position, for this prompt, within `timeout_s` (raises SideChannelError)."""
        reference = pull.reference
        return call(reference.host, reference.side_channel_port(self.rank),
                    {"op": "check", "handle": reference.request_id,
                     "position": pull.last_position,
                     "blocks": [[g, p, b] for (g, p), b in zip(pull.remote_slots,
                                                               pull.remote_block_ids)],
                     "last_block_hash": pull.last_block_hash,
                     **({} if pull.state_position is None
                        else {"state_position": pull.state_position})},
                    timeout_s=timeout_s)

    def _handshake(self, reference: RemoteReference, timeout_s: float) -> _Peer:
        answer = call(reference.host, reference.side_channel_port(self.rank),
                      {"op": "handshake"}, timeout_s=timeout_s)
        if answer.get("ok") is not True:
            raise ValueError(f"handshake refused: {answer.get('reason')}")
        if answer.get("fingerprint") != self.layout.fingerprint or \
                answer.get("block_size") != self.layout.block_size:
            raise ValueError("the producer's KV layout is not this engine's")
        regions = answer.get("regions")
        if (not isinstance(regions, list) or len(regions) != len(self.caches)
                or answer.get("block_half_nbytes") != half_nbytes(self.caches)):
            raise ValueError("the producer's cache regions do not match this engine's")
        memory, device_id, checksum = (answer.get(k) for k in ("memory", "device_id",
                                                              "checksum"))
        if memory not in ("DRAM", "VRAM") or not isinstance(device_id, int) \
                or isinstance(device_id, bool) or device_id < 0:
            raise ValueError(f"the producer's cache memory is unknown: {memory!r} "
                             f"device {device_id!r}")
        if checksum not in ALGORITHMS:
            raise ValueError(f"the producer's checksum algorithm is unknown: {checksum!r}")
        agent = self.agent.add_remote_agent(bytes.fromhex(str(answer["metadata"])))
        name = agent.decode() if isinstance(agent, bytes) else str(agent)
        if name != answer.get("agent"):
            raise ValueError("the producer's agent metadata names another agent")
        return _Peer(name, int(answer["num_blocks"]), int(answer["block_half_nbytes"]),
                     [(int(k), int(v)) for k, v in regions], str(memory), device_id,
                     str(checksum))

    def _read(self, agent: str, items: list[tuple[Pull, _Peer, list[int]]],
              deadline: float) -> StagingBuffer | None:
        """One NIXL READ of every block of `items` from `agent` into a staging buffer
        (never into the cache: `staging.py`): the blocks of `items` in order, laid out
        (side, cache, block), one descriptor per run of consecutive remote ids, a
        hybrid's state rows after them. The buffer if the READ completed (the caller
        gives it back), else None (a READ given up in flight leaves its buffer
        quarantined)."""
        half = half_nbytes(self.caches)
        pool = self._staging_pool()
        row_nbytes = pool.row_nbytes  # a block's K and V in every cache tensor
        states = [p.remote_state for p, _, _ in items if p.remote_state is not None]
        num_blocks = sum(len(p.block_ids) for p, _, _ in items)
        try:
            buffer = pool.acquire(num_blocks + sum(num_rows(s, row_nbytes) for s in states))
        except StagingExhausted as error:
            logger.warning("NIXL read from %s refused: %s", agent, error)
            return None
        base = buffer.rows.data_ptr()
        device = memory_of(buffer.rows)[1]
        peer = items[0][1]  # one producer agent: one peer
        # Block rows laid out (side, cache, block): `staging.py`. The step's pulls are
        # described together, so a run of ids goes on from one prompt into the next.
        remote_ids = [b for pull, _, _ in items for b in pull.remote_block_ids]
        local, remote = block_descriptors(remote_ids, peer.regions, half, base, 0, num_blocks,
                                          device, peer.device_id)
        state_row = num_blocks
        for remote_state in states:  # a hybrid's, in rows after the blocks' (`states.py`)
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

    def _verify_states(self, items: list[tuple[Pull, _Peer, list[int]]],
                       buffer: StagingBuffer) -> None:
        """Each pull's staged state, verified against its checksum (`state_payload`;
        None if it fails), from the rows after the blocks' (as `_read` laid them out)."""
        row = sum(len(pull.block_ids) for pull, _, _ in items)
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

    def _staging_pool(self) -> StagingPool:
        with self._lock:
            if self.staging is None:
                row_nbytes = 2 * len(self.caches) * half_nbytes(self.caches)  # a block's K and V
                self.staging = StagingPool(self.agent, row_nbytes,
                                           device=self.caches[0].device)
            return self.staging

    def _install_staged(self, items: list[tuple[Pull, _Peer, list[int]]],
                        buffer: StagingBuffer, fence: ReadCancel | None) -> set[int]:
        """Verify the staged rows of `items` against the producer's checksums and copy
        the verified ones into the cache (one indexed copy per cache tensor), under
        `fence` when given: nothing is written once it is set. The blocks not installed."""
        local_ids = [b for pull, _, _ in items for b in pull.block_ids]
        expected = [x for _, _, checksums in items for x in checksums]
        count = len(self.caches)
        staged = staged_blocks(buffer.rows, len(local_ids), count)  # (side, cache, block)
        started = time.perf_counter()
        actual = checksum_blocks(items[0][1].checksum, [staged[:, c] for c in range(count)],
                                 range(len(local_ids)))
        self._count("check_microseconds", int((time.perf_counter() - started) * 1e6))
        good = [i for i, x in enumerate(expected) if actual[i] == x]
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
        chosen = None  # every staged block, in order
        if len(good) < len(local_ids):
            chosen = torch.tensor(good, device=staged.device)
        targets = torch.tensor([local_ids[i] for i in good], dtype=torch.long,
                               device=staged.device)

        def copy() -> None:
            for c, cache in enumerate(self.caches):
                cache_words = cache.view(torch.uint8).view(2, cache.shape[1], half).view(word)
                source = words[:, c] if chosen is None else words[:, c].index_select(1, chosen)
                cache_words.index_copy_(1, targets, source)
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
        self._pulled_blocks += len(good)
        return bad

    def _install_states(self, pulls: list[Pull]) -> None:
        """Give each pull's request its pulled state on the engine's thread; a missing or
        failed one is zeros and the claim's last block is invalid (`states.py`)."""
        if self._recurrent is None:
            return
        for pull in pulls:
            if pull.state_position is None:
                continue
            self._recurrent.install(pull.request_id, pull.state_position, pull.state_payload)
            if pull.state_payload is None:
                ids = pull.block_ids or pull.missing
                self._invalid.add(ids[-1])

    def close(self) -> None:
        """Wait for the async pulls (bounded) and free the staging buffers (shutdown)."""
        for thread in list(self._async.values()):
            thread.join(timeout=self.load_timeout_s)
        releases_end = time.monotonic() + CALL_TIMEOUT_S + RELEASE_TIMEOUT_S + 1.0
        with self._lock:
            releasing = list(self._releasing)
        for thread in releasing:  # each call is bounded; so is the wait for them all
            thread.join(timeout=max(0.0, releases_end - time.monotonic()))
        if self.staging is not None:
            self.staging.close()

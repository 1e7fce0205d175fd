"""The consumer's worker role: it runs the pulls the scheduler role planned (`claims.py`).

A block id spans every cache tensor whatever its group, so pulls move and verify pairs
of ids. For each pull the worker checks the reference with the producer (its answer
has the blocks' checksums), handshakes once per producer agent (again when the producer
restarted: a new agent; `peers.py`), reads every block of the step with one NIXL READ
per producer into a registered staging buffer, verifies each block's checksum and
copies only verified blocks into the cache, under the load's fence when a
TieredConnector pulls (`pull_reads.py`), then releases the reference from a thread of
its own. A READ given up at its deadline that completes later writes nothing the engine
uses; its buffer stays quarantined until NIXL reports that READ ended (past
`MAX_QUARANTINED_READS` such buffers, pulls fail at once and are recomputed:
`staging.py`). Anything that fails (unreachable producer, unknown or reused reference,
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
from typing import TYPE_CHECKING, Any

import torch

from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.p2p.metadata import Pull
from kvrecover.kv_transfer.p2p.params import RemoteReference
from kvrecover.kv_transfer.p2p.peers import Peer, Peers, parse_handshake
from kvrecover.kv_transfer.p2p.pull_reads import Checked, PullReader
from kvrecover.kv_transfer.p2p.side_channel import CALL_TIMEOUT_S, SideChannelError, call
from kvrecover.kv_transfer.p2p.states import parse_remote_state
from kvrecover.kv_transfer.stores.reader_threads import ReadCancel

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


class NixlConsumer:
    """A consumer rank's pulls (worker role): sync ones in `start`, async ones on their
    own threads (reported by `finished`), a TieredConnector's through `pull_blocks`."""

    def __init__(self, layout: KVCacheLayout, load_timeout_s: float) -> None:
        self.layout = layout
        self.rank = layout.tensor_parallel_rank  # pulls from the producer's rank `rank`
        self.load_timeout_s = load_timeout_s
        self.caches: list[torch.Tensor] = []
        self.agent: Any = None
        self.reader = PullReader()
        self._recurrent: RecurrentStateAccess | None = None
        self._lock = threading.Lock()
        self._peers = Peers()
        self._invalid: set[int] = set()
        self._async: dict[str, threading.Thread] = {}
        self._async_invalid: dict[str, set[int]] = {}
        self._async_pulls: dict[str, Pull] = {}  # async pulls of a state, by request
        self._releasing: list[threading.Thread] = []  # release threads, not yet joined

    def register(self, caches: list[torch.Tensor], agent: Any) -> None:
        """The cache verified blocks are copied into, and the agent that reads them (the
        cache itself is not registered: READs land in staging buffers only)."""
        self.caches, self.agent = caches, agent
        self.reader.register(caches, agent)

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
        return self.reader.take_installed_blocks()

    def take_transfer_counts(self) -> dict[str, int]:
        """READ bytes and microseconds, and microseconds checking staged blocks, since the
        last call."""
        return self.reader.take_transfer_counts()

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
        checked: list[Checked] = []
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
        by_agent: dict[str, list[Checked]] = {}
        for item in checked:
            by_agent.setdefault(item[1].agent, []).append(item)
        for agent, items in by_agent.items():
            buffer = self.reader.read(agent, items, deadline)
            if buffer is None:
                for pull, _, _ in items:
                    invalid.update(pull.block_ids)
                continue
            try:
                invalid |= self.reader.install(items, buffer, fence)
                self.reader.verify_states(items, buffer)
            finally:
                self.reader.give_back(buffer)
        # Done with each reference that checked out, read or not: the producer frees it,
        # told from a thread (a slow producer must not hold up the step). A refused one is
        # left to its lease (it may be someone else's, or not be at all).
        if checked:
            self._in_background(self._release_all, [pull for pull, _, _ in checked])
        return invalid

    def _check(self, pull: Pull, deadline: float) -> tuple[Peer, list[int]]:
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
        peer = self._peers.of(reference.engine_id, answer.get("agent"),
                              lambda: self._handshake(reference, _call_timeout(deadline)))
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

    def _handshake(self, reference: RemoteReference, timeout_s: float) -> Peer:
        answer = call(reference.host, reference.side_channel_port(self.rank),
                      {"op": "handshake"}, timeout_s=timeout_s)
        return parse_handshake(answer, self.layout, self.caches, self.agent)

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
        self.reader.close()

"""The producer's worker role: it holds the kept prompts and serves their pulls.

The scheduler role decides what is kept (`kept_prompts.py`); here each kept prompt is
held from the step whose metadata names it (`bind`), checksummed once in that step (a
kept block is never written while held: `engine/held_blocks.py`), and a hybrid's state
moved into the registered state pool (`states.HeldStates`). A prompt whose state finds
no slot there (`max_held_states`) or was not captured is not held at all: a consumer's
claim ends at the state boundary, so its blocks are of no use without the state; they
are freed at once and a check of its reference is refused.

The side channel (`side_channel.py`) answers the handshake (agent metadata, where each
cache tensor's blocks live, block size, layout fingerprint), the check of each pull
(the reference must still be held, its blocks and prompt must match) with the blocks'
checksums, and the release. A check may come before the step that holds the blocks (the
reference is answered as the request finishes; vllm-router forwards it at once): it
waits for that step (`UNBOUND_HOLD_WAIT_S`) unless its reference ended already. A held
prompt ends on release or when its lease (`lease_s`) ends, reported in
`finished_sending` (`expire`); the blocks a lease freed are counted
(`kv_nixl_lease_freed_blocks`). While a checked pull may be reading, a progress loop
drives the agent (NIXL's own progress thread is off: it spins a core even when idle).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvrecover.kv_layout import NULL_BLOCK_ID, KVCacheLayout
from kvrecover.kv_transfer.p2p.checksums import checksum_blocks, default_algorithm
from kvrecover.kv_transfer.p2p.metadata import NixlMetadata
from kvrecover.kv_transfer.p2p.side_channel import SideChannelServer
from kvrecover.kv_transfer.p2p.staging import half_nbytes, memory_of
from kvrecover.kv_transfer.p2p.states import HeldStates

if TYPE_CHECKING:
    from kvrecover.kv_transfer.stores.state_entries import RecurrentStateAccess

logger = logging.getLogger(__name__)

# The producer progresses its agent only while a checked pull may be reading it, this often.
SERVE_POLL_S = 0.0002
# A producer answers a prompt's reference as the prompt finishes; its worker holds the
# blocks from the next step on. A check arriving in between (a router forwards the answer
# at once) waits this long for that step instead of being refused; under a second, so
# that a reference the producer never held (it restarted) still falls back within one.
UNBOUND_HOLD_WAIT_S = 0.9
ENDED_HANDLES_KEPT = 4096  # recently released or expired handles: refused without a wait


@dataclass
class _Hold:
    group_block_ids: tuple[tuple[int, ...], ...]
    block_hashes: list[str]
    deadline: float
    # Block id -> checksum, computed once in the step that binds the hold (a kept block
    # is never written while held: `engine/held_blocks.py`); None until then.
    checksums: dict[int, int] | None = None


class NixlProducer:
    """A producer rank's held prompts, side channel and progress loop (worker role).
    `serve` runs on the side channel's threads, `_progress_pulls` on its own; the rest
    on the engine's thread. `register` starts the threads, `close` ends them."""

    def __init__(self, layout: KVCacheLayout, engine_id: str, lease_s: float,
                 load_timeout_s: float, max_held_states: int, checksum: str = "auto") -> None:
        self.layout = layout
        self.engine_id = engine_id
        self.lease_s = lease_s
        self.load_timeout_s = load_timeout_s  # how long a checked pull may read
        self.max_held_states = max_held_states
        self.checksum = checksum  # "auto": the cache's device decides (`_algorithm`)
        self._hybrid = layout.has_recurrent_layers
        self.caches: list[torch.Tensor] = []
        self.agent: Any = None
        self.agent_name = ""
        self.held_states: HeldStates | None = None  # a hybrid's
        self._server: SideChannelServer | None = None
        # Handle -> until when a checked pull may still read it (progressed by
        # `_progress_pulls`); set when the first one starts.
        self._reading: dict[str, float] = {}
        self._reading_now = threading.Event()
        self._closing = threading.Event()
        self._progress: threading.Thread | None = None
        self._lock = threading.Lock()
        self._bound = threading.Condition(self._lock)  # notified as a step binds new holds
        self._held: dict[str, _Hold] = {}
        self._ended: collections.deque[str] = collections.deque(maxlen=ENDED_HANDLES_KEPT)
        self._released: set[str] = set()
        self._lease_freed_blocks = 0  # kept blocks freed because a lease ended

    def register(self, caches: list[torch.Tensor], agent: Any, agent_name: str,
                 host: str, port: int) -> None:
        """Register the KV cache with `agent`, serve the side channel on host:port and
        start the progress loop (`register_kv_caches`)."""
        self.caches, self.agent, self.agent_name = caches, agent, agent_name
        agent.register_memory(list(caches))  # VRAM for a GPU's cache, DRAM for the CPU's
        self._server = SideChannelServer(host, port, self.serve)
        self._progress = threading.Thread(target=self._progress_pulls, daemon=True,
                                          name="kvrecover-nixl-progress")
        self._progress.start()

    def register_states(self, states: RecurrentStateAccess) -> None:
        """A hybrid's state pool, registered with the agent (`register_recurrent_states`,
        after `register`)."""
        if self.agent is not None:
            self.held_states = HeldStates(self.agent, states, self.max_held_states,
                                          self.caches[0].device)

    def capture_states(self, captures: list[tuple[str, int, int]]) -> None:
        """Copy out the states the step wrote at kept prompts' boundaries (`wait_for_save`)."""
        if self.held_states is not None:
            self.held_states.capture(captures)

    def bind(self, metadata: NixlMetadata) -> None:
        """Hold the prompts the step's metadata keeps (`bind_connector_metadata`)."""
        if self.held_states is not None:
            self.held_states.drop(metadata.state_drops)
        if not metadata.holds:
            return
        deadline = time.monotonic() + self.lease_s
        bound = []
        with self._bound:
            for handle, (group_block_ids, hashes) in metadata.holds.items():
                state = metadata.state_holds.get(handle)
                if state is not None and (self.held_states is None
                                          or not self.held_states.hold(handle, *state)):
                    # A hybrid's blocks are of no use without their state (a claim ends
                    # at it): freed now, and a check of the reference refused.
                    self._end(handle)
                    continue
                bound.append(_Hold(group_block_ids, hashes, deadline))
                self._held[handle] = bound[-1]
            self._bound.notify_all()
        # Checksummed once, here, not at each check: the step that wrote the kept blocks
        # has ended and none is written while held (the engine holds them for the request
        # id, never given to another request nor freed, until reported in
        # `finished_sending`; a prefix-cache hit never covers a request's last token, so it
        # never writes a cached block). Outside the lock: a check that comes first
        # computes its blocks' own (`serve`).
        for hold in bound:
            ids = sorted({b for ids in hold.group_block_ids for b in ids
                          if b != NULL_BLOCK_ID})
            hold.checksums = dict(zip(ids, self._checksums(ids)))

    def _algorithm(self) -> str:
        """The checksum algorithm this producer answers (and names in its handshake)."""
        return default_algorithm(self.caches[0]) if self.checksum == "auto" else self.checksum

    def _checksums(self, block_ids: list[int]) -> list[int]:
        """Each block's checksum (`checksums.py`: the consumer hashes its staged rows so)."""
        sides = [c.view(torch.uint8).view(2, c.shape[1], -1) for c in self.caches]
        return checksum_blocks(self._algorithm(), sides, block_ids)

    def serve(self, message: dict[str, Any]) -> dict[str, Any]:
        """The side channel's answers (a thread of the server)."""
        op = message.get("op")
        if op == "handshake" and self._hybrid and self.held_states is None:
            return {"ok": False, "reason": "the producer's state pool is not registered yet"}
        if op == "handshake":
            half = half_nbytes(self.caches)
            num_blocks = self.caches[0].shape[1]
            memory, device_id = memory_of(self.caches[0])
            return {"ok": True, "engine_id": self.engine_id, "agent": self.agent_name,
                    "metadata": self.agent.get_agent_metadata().hex(),
                    "block_size": self.layout.block_size,
                    "fingerprint": self.layout.fingerprint,
                    "memory": memory, "device_id": device_id, "checksum": self._algorithm(),
                    "num_blocks": num_blocks, "block_half_nbytes": half,
                    "regions": [[c.data_ptr(), c.data_ptr() + num_blocks * half]
                                for c in self.caches]}
        handle = message.get("handle")
        if not isinstance(handle, str):
            return {"ok": False, "reason": "no reference handle"}
        with self._lock:
            hold = self._held.get(handle)
            if hold is None and op == "check" and handle not in self._ended:
                self._bound.wait_for(lambda: handle in self._held or handle in self._ended,
                                     UNBOUND_HOLD_WAIT_S)
                hold = self._held.get(handle)
            if op == "release":
                if hold is not None:
                    del self._held[handle]
                    self._end(handle)
                self._reading.pop(handle, None)
                return {"ok": True}
            if op != "check":
                return {"ok": False, "reason": f"unknown op {op!r}"}
            if hold is None:
                return {"ok": False, "reason": "unknown, released or expired reference"}
            return self._answer_check(handle, hold, message)

    def _answer_check(self, handle: str, hold: _Hold, message: dict[str, Any]
                      ) -> dict[str, Any]:
        """A held reference's check: the blocks and prompt must be the reference's; the
        answer has their checksums (and a hybrid's state). Under `_lock`."""
        position, blocks = message.get("position"), message.get("blocks")
        if not isinstance(blocks, list) or not blocks or not all(
                _holds_slot(hold.group_block_ids, item) for item in blocks):
            return {"ok": False, "reason": "the blocks are not those of the reference"}
        if (not isinstance(position, int) or not 0 <= position < len(hold.block_hashes)
                or hold.block_hashes[position] != message.get("last_block_hash")):
            return {"ok": False, "reason": "the reference is of another prompt"}
        self._reading[handle] = time.monotonic() + self.load_timeout_s
        self._reading_now.set()
        block_ids = [item[2] for item in blocks]
        kept = hold.checksums
        answer: dict[str, Any] = {
            "ok": True, "agent": self.agent_name,
            "checksums": self._checksums(block_ids) if kept is None
            else [kept[b] for b in block_ids]}
        if self.held_states is not None and "state_position" in message:
            answer["state"] = self.held_states.describe(handle, message["state_position"])
        return answer

    def expire(self) -> set[str]:
        """End the holds past their lease; the requests whose holds ended since the last
        call (released, expired or never held), for `finished_sending`."""
        now = time.monotonic()
        with self._lock:
            for handle in [h for h, hold in self._held.items() if hold.deadline <= now]:
                logger.info("KV reference %s was not pulled within its lease", handle)
                self._lease_freed_blocks += sum(
                    b != NULL_BLOCK_ID for ids in self._held[handle].group_block_ids
                    for b in ids)
                del self._held[handle]
                self._end(handle)
            sending, self._released = self._released, set()
        return sending

    def _end(self, handle: str) -> None:
        """The reference `handle` ended (released, expired, or never held): checks of it
        are refused at once, its request is reported in `finished_sending` (its blocks
        freed) and its state's slot is free (under `_lock`)."""
        self._ended.append(handle)
        self._released.add(handle.rsplit("@", 1)[0])
        if self.held_states is not None:
            self.held_states.release(handle)

    def take_lease_freed_blocks(self) -> int:
        """Kept blocks freed because their lease ended, since the last call."""
        with self._lock:
            freed, self._lease_freed_blocks = self._lease_freed_blocks, 0
        return freed

    def _progress_pulls(self) -> None:
        """Drive the producer's UCX worker while a consumer may be reading from it (a
        read's target must progress on some transports), idle otherwise."""
        while not self._closing.is_set():
            if not self._reading_now.wait(timeout=0.1):
                continue
            with self._lock:
                now = time.monotonic()
                for handle in [h for h, until in self._reading.items() if until <= now]:
                    del self._reading[handle]
                if not self._reading:
                    self._reading_now.clear()
                    continue
            try:
                self.agent.get_new_notifs()  # progresses the agent's backends
            except Exception:  # noqa: BLE001 - a closing agent; the loop ends with it
                pass
            time.sleep(SERVE_POLL_S)

    def close(self) -> None:
        """Stop the progress loop and the side channel, deregister the state pool."""
        self._closing.set()
        if self._progress is not None:
            self._progress.join(timeout=5)
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.held_states is not None:
            self.held_states.close(self.agent)
            self.held_states = None


def _holds_slot(group_block_ids: tuple[tuple[int, ...], ...], item: Any) -> bool:
    """Whether `item`, a consumer's [group, position, block id], names a block the hold
    keeps at that slot."""
    if not isinstance(item, list) or len(item) != 3 or \
            not all(isinstance(x, int) and not isinstance(x, bool) for x in item):
        return False
    group, position, block_id = item
    return (0 <= group < len(group_block_ids) and 0 <= position < len(group_block_ids[group])
            and block_id != NULL_BLOCK_ID and group_block_ids[group][position] == block_id)

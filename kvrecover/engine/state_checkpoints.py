"""Which prefixes have a recurrent-state checkpoint, and where the worker keeps it.

A hybrid model's linear-attention layers (rule 8) can resume at a prefix P only
from their state at P. The worker keeps `num_state_checkpoints` checkpoint slots
(the conv and recurrent states of every linear layer at one block boundary); this
module, on the scheduler's side, decides which boundary goes into which slot:
every block boundary a step crosses is saved, keyed by the chain hash of the
block that ends there (the prefix's identity, as for KV blocks), the least
recently used checkpoint giving way. A prefix-cache hit is cut back to the
longest prefix whose boundary has a checkpoint (`usable_prefix`), and the
request's first slice starts from it (`ScheduledRequest.restore_checkpoint`).
Within one step (`begin_step` starts each) no slot that the step writes or reads
gives way, so two requests of a step never write one slot, and a checkpoint the
step writes is no restore point in that step (the worker restores before the
layers run). A slice reaching a boundary whose checkpoint is held already, or starting
from one, lists it (`held_checkpoints`), so a producer's connector stores it from there.

With a store connector (`KVTransferConfig.state_interval_blocks` K) two more things:
a producer gives the boundaries its connector stores (every K-th block boundary and the
prompt's last loadable one) their slots first; and a consumer's load that fails at
block b has the worker keep the stored state at the latest multiple of K blocks inside
the load at or before b (`loaded_resume_point`, by `kv_layout.resume_points` and
`latest_resume_point`: the functions the connector's worker role calls, so the two
agree), which a rollback there resumes from (a *resume state*: the worker's, used by
the request's next slice that starts there).
"""

from __future__ import annotations

from collections import OrderedDict

from kvrecover.engine.kv_cache_manager import PrefixHit
from kvrecover.engine.request import Request
from kvrecover.kv_layout import (
    blocks_needed,
    latest_resume_point,
    resume_points,
    stores_state_at,
    update_block_hashes,
)
from kvrecover.step_messages import ScheduledRequest


class StateCheckpoints:
    """The scheduler's map of checkpointed block boundaries (block hash -> slot, LRU)."""

    def __init__(self, num_slots: int, block_size: int, store_interval: int | None = None,
                 load_interval: int | None = None) -> None:
        self.block_size = block_size
        self.num_slots = num_slots
        # K of the boundaries a producer's connector stores (they get slots first), and
        # of those a consumer's failed load resumes from; None: not a producer / consumer.
        self.store_interval = store_interval
        self.load_interval = load_interval
        # request id -> position of the resume state the worker keeps for it.
        self._resume_states: dict[str, int] = {}
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self._free = list(range(num_slots - 1, -1, -1))
        # request id -> (slot, position) its next slice starts from, if it starts there.
        self._restores: dict[str, tuple[int, int]] = {}
        # The step being scheduled: slots it writes or reads (no other boundary may take
        # them before it ran) and the prefixes whose checkpoints it writes (their state is
        # not there yet, so no request may start from them in this step).
        self._step_slots: set[int] = set()
        self._step_written: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._slots)

    def begin_step(self) -> None:
        """A new step is being scheduled: the last one's slots may give way again."""
        self._step_slots.clear()
        self._step_written.clear()

    def usable_prefix(self, request: Request, hits: PrefixHit) -> PrefixHit:
        """`hits` cut to its longest prefix whose last boundary has a checkpoint written
        before this step (the empty hit when none has); remembers that checkpoint for the
        request's next slice."""
        self._restores.pop(request.request_id, None)
        for num_blocks in range(len(hits), 0, -1):
            block_hash = request.block_hashes[num_blocks - 1]
            slot = None if block_hash in self._step_written else self._slots.get(block_hash)
            if slot is not None:
                self._slots.move_to_end(block_hash)
                self._restores[request.request_id] = (slot, num_blocks * self.block_size)
                return PrefixHit(num_blocks * self.block_size,
                                 [blocks[:num_blocks] for blocks in hits.blocks])
        return PrefixHit(0, [[] for _ in hits.blocks])

    def holds(self, request: Request, position: int) -> bool:
        """Whether a checkpoint of the request's prefix at block boundary `position` is
        kept (recovery's rule 8 for a hybrid: a rollback point needs one)."""
        num_blocks = position // self.block_size
        return (position % self.block_size == 0 and 0 < num_blocks <= len(request.block_hashes)
                and request.block_hashes[num_blocks - 1] in self._slots)

    def can_resume(self, request: Request, position: int, first_invalid: int) -> bool:
        """Whether the request's state at block boundary `position` is to be had after a
        failure whose first invalid block starts at `first_invalid` (recovery's rule 8):
        a kept checkpoint, the worker's resume state, or the one the failed load keeps."""
        return (self.holds(request, position)
                or self._resume_states.get(request.request_id) == position
                or self.loaded_resume_point(request, first_invalid) == position)

    def loaded_resume_point(self, request: Request, first_invalid: int) -> int | None:
        """Where the worker keeps a resume state when the request's pending load fails
        from `first_invalid` on: the latest multiple of K blocks strictly inside the
        load, at or before it (the connector read it; had that read failed, it would
        have reported the block ending there invalid, so `first_invalid` is before it)."""
        interval, pending = self.load_interval, request.pending_external
        if interval is None or pending is None:
            return None
        start, end = pending
        points = resume_points(start // self.block_size, blocks_needed(end, self.block_size),
                               interval)
        latest = latest_resume_point(points, first_invalid // self.block_size)
        return None if latest is None else latest * self.block_size

    def restore_at(self, request: Request, position: int) -> None:
        """The request was rolled back to `position` (`can_resume` said its state is to
        be had there): its next slice starts from the checkpoint there, if one is kept,
        else from the worker's resume state (position 0 starts from zeros)."""
        self._restores.pop(request.request_id, None)
        if self.holds(request, position):
            block_hash = request.block_hashes[position // self.block_size - 1]
            self._slots.move_to_end(block_hash)
            self._restores[request.request_id] = (self._slots[block_hash], position)
        elif position > 0:
            self._resume_states[request.request_id] = position

    def plan(self, request: Request, item: ScheduledRequest) -> None:
        """Fill `item`'s checkpoint fields: the restore remembered by `usable_prefix` (if
        the slice starts there: a connector's load may have carried it further) and a slot
        for each block boundary the slice reaches, the latest first (a connector stores
        the state of the prompt's last loadable boundary from its slot)."""
        remembered = self._restores.pop(request.request_id, None)
        start = item.num_computed_tokens
        if start in (0, self._resume_states.get(request.request_id)):
            self._resume_states.pop(request.request_id, None)  # the worker's is used up
        if remembered is not None and start > 0 and remembered[1] == start:
            item.restore_checkpoint = remembered[0]
            self._step_slots.add(remembered[0])
            # A hit up to a boundary a producer stores (the prompt's last loadable one):
            # its connector stores the state from the slot the slice starts from.
            item.held_checkpoints.append((start, remembered[0]))
        end = start + len(item.token_ids)
        first, last = start // self.block_size + 1, end // self.block_size
        if last < first or self.num_slots == 0:
            return
        update_block_hashes(request.block_hashes, request.token_ids[:end], self.block_size)
        out_of_slots = False
        for boundary in self._by_priority(request, first, last):
            block_hash = request.block_hashes[boundary - 1]
            slot = self._slots.get(block_hash)
            if slot is not None:  # the same prefix's state, bit for bit (point 2)
                self._slots.move_to_end(block_hash)
                self._step_slots.add(slot)  # a connector may store it from there
                item.held_checkpoints.append((boundary * self.block_size, slot))
                continue
            slot = None if out_of_slots else self._take_slot()
            if slot is None:
                out_of_slots = True
                continue
            self._slots[block_hash] = slot
            self._step_slots.add(slot)
            self._step_written.add(block_hash)
            item.save_checkpoints.append((boundary * self.block_size, slot))
        item.save_checkpoints.sort()  # the layers write them in position order
        item.held_checkpoints.sort()
        for position, _ in item.save_checkpoints:  # the latest boundary most recently used
            self._slots.move_to_end(request.block_hashes[position // self.block_size - 1])

    def _by_priority(self, request: Request, first: int, last: int) -> list[int]:
        """Block boundaries first..last in the order they get slots: the latest first,
        except that a producer's stored ones (the prompt's last loadable boundary, then
        every `store_interval`-th) come before the others."""
        boundaries = list(range(last, first - 1, -1))
        if self.store_interval is None:
            return boundaries
        last_loadable = (request.num_prompt_tokens - 1) // self.block_size
        stored = [b for b in boundaries if stores_state_at(
            b, request.num_prompt_tokens, self.block_size, self.store_interval)]
        stored.sort(key=lambda b: b != last_loadable)
        taken = set(stored)
        return stored + [b for b in boundaries if b not in taken]

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used one that this step neither reads
        nor writes and no restore still to come starts from (a rollback's or an
        admission's)."""
        if self._free:
            return self._free.pop()
        pinned = self._step_slots | {slot for slot, _ in self._restores.values()}
        for block_hash, slot in self._slots.items():
            if slot not in pinned:
                del self._slots[block_hash]
                return slot
        return None

    def discard(self, saves: list[tuple[int, int]]) -> None:
        """Forget the checkpoints a failed step was to write (their slots may hold garbage):
        called by the scheduler for each request whose part of a step failed."""
        lost = {slot for _, slot in saves}
        for block_hash, slot in list(self._slots.items()):
            if slot in lost:
                del self._slots[block_hash]
                self._free.append(slot)

    def forget(self, request_id: str) -> None:
        """Drop a restore planned for a request that ended before its slice ran (and its
        resume state: the worker frees it with the request's slot)."""
        self._restores.pop(request_id, None)
        self._resume_states.pop(request_id, None)

"""The consumer's scheduler role: how much of a prompt a reference supplies, and the
pull that moves it.

A request whose `kv_transfer_params` has `do_remote_prefill` claims the referenced
prompt blocks after those it holds locally, up to the last position where every
full-attention group's block and every windowed group's window are held by the producer
(a hybrid's claim ends at the reference's state boundary, `states.claim_end`). Each
group's blocks of the claim (a windowed group's from `KVCacheGroup.first_loaded_block`
on) pair a local block with the producer's; a local block the producer does not hold (a
window's margin it released) is `missing`: invalid without a read (rule 8 decides what
that costs). A reference of another model, layout or tensor-parallel size claims
nothing: the prompt is computed here, with a warning.

A request pulls its reference once: asked again after a failed load
(`kv_load_retry_limit`) it claims nothing from it (the worker released it after its
check, or the producer refused it already), so the retry goes to the next tier of a
TieredConnector or is recomputed without another round trip.

A request that claims nothing from a reference it was given because it holds every
offered block locally (a full prefix-cache hit) still releases it, as vLLM notifies the
producer on such a hit: a `release` names the last claimable block, which the worker
checks with the producer (the reference is this prompt's) before releasing it, so the
kept prompt is freed now instead of when its lease ends.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING

from kvrecover.kv_layout import NULL_BLOCK_ID, KVCacheLayout
from kvrecover.kv_transfer.p2p.metadata import Pull
from kvrecover.kv_transfer.p2p.params import RemoteReference, parse_reference
from kvrecover.kv_transfer.p2p.states import claim_end

if TYPE_CHECKING:
    from kvrecover.kv_transfer.request_view import KVRequestView

logger = logging.getLogger(__name__)

# Requests whose reference a pull used (request id -> the reference), kept so that one
# asking again after a failed load claims nothing from it; forgotten as a request ends.
CONSUMED_REFERENCES_KEPT = 4096


class PullClaims:
    """The consumer's claims and the pulls they plan (the connector's scheduler role)."""

    def __init__(self, layout: KVCacheLayout, grouped: bool, async_load: bool) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.kv_groups = layout.kv_groups
        self._grouped = grouped  # the references carry a block list per group
        self._hybrid = layout.has_recurrent_layers
        self._async_load = async_load
        self._references: dict[str, RemoteReference] = {}
        # Request id -> (engine id, handle) of the reference its pull used.
        self._consumed: collections.OrderedDict[str, tuple[str, str]] = \
            collections.OrderedDict()
        self._pulls: list[Pull] = []
        self._releases: list[Pull] = []  # references to release unread (a full local hit)

    def claim(self, request: KVRequestView, num_computed_tokens: int) -> tuple[int, bool]:
        """`get_num_new_matched_tokens` of a request with `do_remote_prefill`: the tokens
        after `num_computed_tokens` the reference supplies, and whether they load
        asynchronously; ValueError for a malformed reference."""
        reference = parse_reference(request.sampling_params.kv_transfer_params)
        if reference.tp_size != self.layout.tensor_parallel_size:
            logger.warning("request %s: its KV reference is of a producer at "
                           "tensor_parallel_size %d, this engine runs %d (a rank pulls its "
                           "own rank's shard only); the prompt is computed here",
                           request.request_id, reference.tp_size,
                           self.layout.tensor_parallel_size)
            return 0, False
        # This role holds rank 0's layout and the reference names the producer's rank 0's;
        # each worker rank's handshake then checks its own rank's.
        if reference.fingerprint != self.layout.fingerprint:
            logger.warning("request %s: its KV reference is of another model or layout; "
                           "the prompt is computed here", request.request_id)
            return 0, False
        if reference.grouped != self._grouped or \
                len(reference.group_block_ids) != len(self.kv_groups):
            logger.warning("request %s: its KV reference names %d block list(s), this model "
                           "has %d KV cache group(s); the prompt is computed here",
                           request.request_id, len(reference.group_block_ids),
                           len(self.kv_groups))
            return 0, False
        if self._consumed.get(request.request_id) == (reference.engine_id,
                                                       reference.request_id):
            logger.info("request %s: its KV reference was pulled already (the producer "
                        "released it); not pulled again", request.request_id)
            return 0, False
        self._references[request.request_id] = reference
        first = num_computed_tokens // self.block_size
        limit = min(reference.num_blocks, (request.num_prompt_tokens - 1) // self.block_size)
        end = self._loadable_end(reference, first, limit)
        if self._hybrid:
            end = claim_end(reference.state_block, first, end)
        return max(0, end * self.block_size - num_computed_tokens), self._async_load

    def _loadable_end(self, reference: RemoteReference, first: int, limit: int) -> int:
        """The last block position (exclusive, at most `limit`) up to which the producer
        holds every full-attention group's blocks from `first` on and every windowed
        group's window; `first` if none."""
        end = limit
        for group, ids in zip(self.kv_groups, reference.group_block_ids):
            if group.window is None:
                end = next((p for p in range(first, end) if ids[p] == NULL_BLOCK_ID), end)
        windowed = [(g, ids) for g, ids in zip(self.kv_groups, reference.group_block_ids)
                    if g.window is not None]
        while end > first and not all(
                NULL_BLOCK_ID not in ids[max(first, g.first_needed_block(
                    end * self.block_size, self.block_size)):end] for g, ids in windowed):
            end -= 1
        return max(end, first)

    def plan(self, request: KVRequestView, block_ids: list[int],
             num_external_tokens: int) -> None:
        """`update_state_after_alloc`: the pull of the claim's blocks, for the next
        metadata (none for a request that claimed nothing)."""
        reference = self._references.pop(request.request_id, None)
        if reference is None:
            return
        if num_external_tokens <= 0:
            self._plan_release(request, reference)
            return
        first = request.num_computed_tokens // self.block_size
        end = first + num_external_tokens // self.block_size
        tables = request.block_tables or (tuple(block_ids),)
        starts = [max(first, g.first_loaded_block(end * self.block_size, self.block_size))
                  for g in self.kv_groups]
        local: list[int] = []
        remote: list[int] = []
        slots: list[tuple[int, int]] = []
        missing: list[int] = []
        for position in range(first, end):
            for g, table in enumerate(tables):
                if position < starts[g] or table[position] == NULL_BLOCK_ID:
                    continue
                source = reference.group_block_ids[g][position]
                if source == NULL_BLOCK_ID:
                    missing.append(table[position])
                    continue
                local.append(table[position])
                remote.append(source)
                slots.append((g, position))
        self._consumed[request.request_id] = (reference.engine_id, reference.request_id)
        if len(self._consumed) > CONSUMED_REFERENCES_KEPT:
            self._consumed.popitem(last=False)
        self._pulls.append(Pull(
            request.request_id, local, remote, slots, missing, reference, end - 1,
            request.block_hashes[end - 1].hex(), self._async_load,
            end * self.block_size if self._hybrid else None))

    def _plan_release(self, request: KVRequestView, reference: RemoteReference) -> None:
        """A reference the request reads nothing from: its release, checked against the
        prompt's last block that the reference offers (none if it offers no block)."""
        last_loadable = (request.num_prompt_tokens - 1) // self.block_size
        position = min(reference.num_blocks, last_loadable) - 1
        if position < 0:
            return
        slots = [(g, position) for g, ids in enumerate(reference.group_block_ids)
                 if ids[position] != NULL_BLOCK_ID]
        if not slots:
            return
        self._consumed[request.request_id] = (reference.engine_id, reference.request_id)
        self._releases.append(Pull(
            request.request_id, [], [reference.group_block_ids[g][p] for g, p in slots],
            slots, [], reference, position, request.block_hashes[position].hex(), False))

    def take_releases(self) -> list[Pull]:
        """The unread references to release since the last call (`build_connector_meta`)."""
        releases, self._releases = self._releases, []
        return releases

    def take_pulls(self) -> list[Pull]:
        """The pulls planned since the last call (`build_connector_meta`)."""
        pulls, self._pulls = self._pulls, []
        return pulls

    def forget(self, request_id: str) -> None:
        """The request ended: no claim or retry of it is left."""
        self._references.pop(request_id, None)
        self._consumed.pop(request_id, None)

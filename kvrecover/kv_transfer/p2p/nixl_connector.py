"""NixlConnector: the decode instance pulls the prefill instance's KV blocks over NIXL.

Producer (`kv_producer`, or `kv_both` for a request with `do_remote_decode`): when a
request ends, its full prompt blocks are kept in every KV cache group (`request_finished`
returns True; a windowed group's are those it still holds) and a reference is handed
out (`kv_transfer_params`: vLLM's field names, a block list per group for a model with
windows, `params.py`). The
worker role registers the KV cache with a NIXL agent and serves the side channel
(`side_channel.py`): the handshake, a check of each pull (the reference must still be
held, its blocks and prompt must match) answered with the blocks' checksums (computed
once, in the step that binds the hold: a kept block is never written while held), and
the release. A check may come before the step that holds the blocks (the reference is
answered as the request finishes; vllm-router forwards it at once): it waits for that
step (`UNBOUND_HOLD_WAIT_S`) unless its reference was released or expired already. A
kept prompt is freed on release or when its lease (`lease_s`) ends, reported in
`finished_sending`; the blocks a lease freed are counted (`kv_nixl_lease_freed_blocks`).

Consumer (`kv_consumer`): a request whose `kv_transfer_params` has `do_remote_prefill`
claims the referenced prompt blocks after those it holds locally, up to the last
position where every full-attention group's block and every windowed group's window
are held by the producer; each group's blocks of the claim (a windowed group's from
`KVCacheGroup.first_loaded_block` on) pair a local block with the producer's, and a
local block the producer does not hold (a window's margin it released) is reported
invalid without a read (rule 8 decides what that costs). A block id spans every cache
tensor whatever its group, so the worker role moves and verifies pairs of ids: it
checks the reference with the producer, handshakes once per producer agent (again
when the producer restarted: a new agent), reads every block of the step with NIXL
READ in one transfer per producer (a descriptor per side, cache tensor and run of
consecutive block ids: `staging.py`), verifies each block's checksum and releases the
reference. The READ lands in a registered staging buffer (`staging.py`), never in the
cache: only verified blocks are copied into the cache (one indexed copy per cache tensor,
under the load's fence when a TieredConnector pulls), so a READ given up at its deadline
that completes later writes nothing the engine uses; its buffer stays quarantined until
NIXL reports that READ ended (past `MAX_QUARANTINED_READS` such buffers, pulls fail at
once and are recomputed). Only a producer registers its cache with NIXL. Anything that
fails (unreachable producer, unknown or reused reference, out-of-range ids, another
layout, a read that errors or outlives `load_timeout_s`, a checksum mismatch) makes
those blocks invalid: the engine recomputes them (rule 10). A request pulls its reference
once: asked again after a failed load (`kv_load_retry_limit`) it claims nothing from it
(the producer released it, or refused it already), so the retry goes to the next tier of
a TieredConnector or is recomputed without another round trip.

It serves full-attention, sliding-window and hybrid (recurrent-state: Qwen3-Next,
Qwen3.5) models. A hybrid's kept prompt keeps its state at the last loadable boundary
too, read in the same READ as the blocks and verified alike; a claim ends at that
boundary, and a state that fails rolls the request back to a checkpoint it holds, or 0
(`states.py`). A prompt whose state finds no slot (`max_held_states`) keeps no blocks
either: they are freed at once and its reference is refused.

Tensor parallelism (vLLM's scheme; producer and consumer of the SAME size N): every rank
has its own worker-role connector, NIXL agent and layout (whose fingerprint names N and
the rank). Producer rank r registers its own KV shard (and a hybrid's own heads' states)
and serves its side channel on `side_channel_port + r`; the reference, built by the
scheduler role from rank 0's layout, hands out the base port, `tp_size` N and rank 0's
fingerprint. Consumer rank r handshakes with, checks, reads from and releases on
producer rank r only (the handshake checks rank r's fingerprint, the check answers rank
r's checksums). A rank's failure is its invalid blocks, which the engine unions over
the ranks; a kept prompt is freed once every rank reported it in `finished_sending`
(released or past its lease on each: `distributed/rank_reports.py`). A reference of
another size (`tp_size`) claims nothing: the prompt is computed here, with a warning.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvrecover.config import KVTransferConfig
from kvrecover.kv_groups import single_group
from kvrecover.kv_layout import NULL_BLOCK_ID, KVCacheLayout
from kvrecover.kv_transfer.base import (
    SETTING_LABEL,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvrecover.kv_transfer.p2p.params import (
    RemoteReference,
    parse_reference,
    rank_side_channel_port,
    wants_remote_prefill,
)
from kvrecover.kv_transfer.p2p.side_channel import SideChannelError, SideChannelServer, call
from kvrecover.kv_transfer.p2p.staging import (
    StagingBuffer,
    StagingExhausted,
    StagingPool,
    block_checksums,
    block_descriptors,
    staged_blocks,
)
from kvrecover.kv_transfer.p2p.states import (
    HeldStates,
    RemoteState,
    StateCaptures,
    chunks,
    claim_end,
    num_rows,
    parse_remote_state,
    verify,
)
from kvrecover.kv_transfer.stores.reader_threads import ReadCancel, ReadTimedOut
from kvrecover.options import option, validate

if TYPE_CHECKING:
    from kvrecover.kv_transfer.request_view import KVRequestView
    from kvrecover.kv_transfer.stores.state_entries import RecurrentStateAccess
    from kvrecover.step_messages import SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_SIDE_CHANNEL_PORT = 5600  # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default
POLL_INTERVAL_S = 0.001
# A producer progresses its agent (NIXL's own progress thread is off: it spins a core
# even when idle) only while a checked pull may be reading it, this often.
SERVE_POLL_S = 0.0002
# A producer answers a prompt's reference as the prompt finishes; its worker holds the
# blocks from the next step on. A check arriving in between (a router forwards the answer
# at once) waits this long for that step instead of being refused; under a second, so
# that a reference the producer never held (it restarted) still falls back within one.
UNBOUND_HOLD_WAIT_S = 0.9
ENDED_HANDLES_KEPT = 4096  # recently released or expired handles: refused without a wait
# A consumer's requests whose reference a pull used (request id -> the reference), so that
# one asking again after a failed load (`kv_load_retry_limit`) claims nothing from it.
CONSUMED_REFERENCES_KEPT = 4096


@dataclass(frozen=True)
class NixlSettings:
    """`kv_connector_extra_config` keys of the NixlConnector."""

    side_channel_host: str = option(
        "127.0.0.1", "the address a producer's side channel listens on and hands out", str)
    side_channel_port: int = option(
        DEFAULT_SIDE_CHANNEL_PORT, "the port of a producer's side channel (its rank r's: "
        "port + r)", int,
        minimum=1, maximum=65535)
    engine_id: str | None = option(
        None, "the producer's engine id in its references (default host:port)", str,
        nullable=True)
    async_load: bool = option(
        False, "pull in a background thread while the request waits", bool)
    load_timeout_s: float = option(
        30.0, "bound on each pull: blocks not verified by then are invalid", float,
        above=0, maximum=1e6)
    lease_s: float = option(
        120.0, "a producer frees a kept prompt no consumer released after this long",
        float, above=0, maximum=1e6)
    max_held_states: int = option(
        16, "a hybrid model's producer keeps at most this many prompts' recurrent states "
        "(CPU memory, allocated at start-up); a prompt past them is not kept", int,
        minimum=1, maximum=1 << 16)

    def __post_init__(self) -> None:
        validate(self, SETTING_LABEL)


@dataclass
class Pull:
    """One request's pull in a step: its local `block_ids` <- the producer's
    `remote_block_ids` (pairwise, every group's; `remote_slots` the (group, position)
    the reference gives each), `missing`: local blocks of the claim the producer does
    not hold (invalid without a read); the producer checks each slot and the chain hash
    of prompt block `last_position`."""

    request_id: str
    block_ids: list[int]
    remote_block_ids: list[int]
    remote_slots: list[tuple[int, int]]
    missing: list[int]
    reference: RemoteReference
    last_position: int
    last_block_hash: str
    is_async: bool
    # A hybrid's: the state to pull with the blocks, at this position (`states.py`);
    # the worker's check sets `remote_state`, its read and verification `state_payload`.
    state_position: int | None = None
    remote_state: RemoteState | None = None
    state_payload: bytes | None = None


@dataclass
class NixlMetadata(KVConnectorMetadata):
    """A step's pulls (consumer) and newly kept prompts (producer: handle -> (each
    group's kept block ids by position, hex chain hash of each position)); a hybrid
    producer's states to copy out after the step (request id, checkpoint slot, position),
    to keep (handle -> (request id, position)) and to forget (request ids)."""

    pulls: list[Pull] = field(default_factory=list)
    holds: dict[str, tuple[tuple[tuple[int, ...], ...], list[str]]] = field(
        default_factory=dict)
    state_captures: list[tuple[str, int, int]] = field(default_factory=list)
    state_holds: dict[str, tuple[str, int]] = field(default_factory=dict)
    state_drops: list[str] = field(default_factory=list)

    def loads_by_request(self) -> dict[str, tuple[list[int], bool]]:
        return {p.request_id: (p.block_ids + p.missing, p.is_async) for p in self.pulls}


@dataclass
class _Hold:
    group_block_ids: tuple[tuple[int, ...], ...]
    block_hashes: list[str]
    deadline: float
    # Block id -> checksum, computed once in the step that binds the hold (a kept block
    # is never written while held: `engine/held_blocks.py`); None until then.
    checksums: dict[int, int] | None = None


@dataclass
class _Peer:
    agent: str
    num_blocks: int
    block_half_nbytes: int
    regions: list[tuple[int, int]]  # each cache tensor's (K base, V base) address


def _nixl_agent(name: str):
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError as error:  # pragma: no cover - the pinned wheel is installed
        raise ValueError("NixlConnector needs the nixl package (pip install nixl-cu12)") \
            from error
    logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout
    # STRICT: the agent is called from several threads (async pulls, the side channel's
    # server, the producer's progress loop); NIXL's default without a listener is
    # unsynchronised, and concurrent calls corrupted UCX's state (crashes, hung reads).
    config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                               sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    return nixl_agent(name, config)


class NixlConnector(KVConnectorBase):
    """P2P KV transfer over NIXL (see the module docstring)."""

    settings_class = NixlSettings
    # A block id spans every cache tensor whatever its group: the scheduler role pairs
    # each group's blocks, the worker role moves ids.
    supports_kv_groups = True
    # A hybrid's kept prompt keeps its state at the claim's end too (`states.py`).
    supports_recurrent_states = True

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout):
        super().__init__(config, role, layout)
        settings: NixlSettings = self.settings
        # Under tensor parallelism each rank has its own connector: rank r serves (a
        # producer) or pulls from (a consumer) side channel port + r, its own shard only.
        self.rank = layout.tensor_parallel_rank
        if rank_side_channel_port(settings.side_channel_port,
                                  layout.tensor_parallel_size - 1) > 65535:
            raise ValueError(f"side_channel_port {settings.side_channel_port} + rank passes "
                             f"65535 at tensor_parallel_size {layout.tensor_parallel_size}: "
                             "choose a lower side_channel_port")
        self.load_timeout_s = settings.load_timeout_s
        if config.is_producer:  # the engine keeps stepping for a release until the lease ends
            self.load_timeout_s = max(settings.load_timeout_s, settings.lease_s + 1.0)
        self.host = settings.side_channel_host
        self.port = settings.side_channel_port
        self.engine_id = settings.engine_id or f"{self.host}:{self.port}"
        self.block_size = layout.block_size
        self.kv_groups = layout.kv_groups
        # A model with windows hands out (and reads) a block list per group.
        self._grouped = layout.kv_groups != single_group(layout.num_layers)
        self._hybrid = layout.has_recurrent_layers  # a state travels with the blocks
        # Scheduler role.
        self._captures = StateCaptures(self.block_size)
        self._state_holds: dict[str, tuple[str, int]] = {}
        self._state_drops: list[str] = []
        self._references: dict[str, RemoteReference] = {}
        # Consumer: request id -> (engine id, handle) of the reference its pull used; the
        # worker releases a reference it checked (the producer refuses it from then on)
        # and one it could not check is refused again, so a retry goes past it at once.
        self._consumed: collections.OrderedDict[str, tuple[str, str]] = \
            collections.OrderedDict()
        self._pulls: list[Pull] = []
        self._holds: dict[str, tuple[tuple[tuple[int, ...], ...], list[str]]] = {}
        self._params: dict[str, dict[str, Any]] = {}
        # Worker role.
        self._caches: list[torch.Tensor] = []
        self._cache_sides: list[np.ndarray] = []  # each cache's bytes, (2, blocks, half)
        self._agent: Any = None
        self._agent_name = ""
        self._server: SideChannelServer | None = None
        # Producer: handle -> until when a checked pull may still read it (progressed by
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
        self._peers: dict[str, _Peer] = {}
        self._invalid: set[int] = set()
        self._async: dict[str, threading.Thread] = {}
        self._async_invalid: dict[str, set[int]] = {}
        self._staging: StagingPool | None = None  # consumer: made with the first read
        self._recurrent: RecurrentStateAccess | None = None
        self._held_states: HeldStates | None = None  # a hybrid producer's
        self._async_pulls: dict[str, Pull] = {}  # async pulls of a state, by request
        self._discarded: set[str] = set()  # requests whose states this step must not keep
        self._pulled_blocks = 0
        self._lease_freed_blocks = 0  # producer: kept blocks freed because a lease ended

    # ----- scheduler role -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: KVRequestView,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = request.sampling_params.kv_transfer_params
        if not self.config.is_consumer or not wants_remote_prefill(params):
            return 0, False
        reference = parse_reference(params)
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
        return max(0, end * self.block_size - num_computed_tokens), self.settings.async_load

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

    def update_state_after_alloc(self, request: KVRequestView, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        if self._hybrid and self.config.is_producer:
            self._captures.track(request)
        reference = self._references.pop(request.request_id, None)
        if reference is None or num_external_tokens <= 0:
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
            request.block_hashes[end - 1].hex(), self.settings.async_load,
            end * self.block_size if self._hybrid else None))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlMetadata:
        metadata = NixlMetadata(self._pulls, self._holds, [], self._state_holds,
                                self._state_drops)
        self._pulls, self._holds, self._state_holds, self._state_drops = [], {}, {}, []
        if self._hybrid and self.config.is_producer:
            metadata.state_captures = self._captures.plan(scheduler_output)
        return metadata

    def request_finished(self, request: KVRequestView, block_ids: list[int]) -> bool:
        self._references.pop(request.request_id, None)
        self._consumed.pop(request.request_id, None)
        captured = self._captures.finished(request.request_id)
        if captured is not None:  # forgotten by the worker unless kept below
            self._state_drops.append(request.request_id)
        params = request.sampling_params.kv_transfer_params
        asked = params.get("do_remote_decode") if isinstance(params, dict) else None
        # A producer keeps every prompt unless told not to; kv_both only those asked for.
        keeps = asked is True or (self.config.kv_role == "kv_producer" and asked is not False)
        if not self.config.is_producer or not keeps:
            return False
        tables = request.block_tables or (tuple(block_ids),)
        num_blocks = min((request.num_prompt_tokens - 1) // self.block_size,
                         request.num_computed_tokens // self.block_size, len(tables[0]))
        for group, table in zip(self.kv_groups, tables):
            if group.window is None:  # a full group's blocks are a prefix
                num_blocks = next((p for p in range(num_blocks) if table[p] == NULL_BLOCK_ID),
                                  num_blocks)
        state_block = None
        if self._hybrid:  # blocks without their state are of no use: keep both or neither
            if captured is None or captured % self.block_size or \
                    not 0 < captured // self.block_size <= num_blocks:
                return False
            num_blocks = state_block = captured // self.block_size
        if num_blocks <= 0:
            return False
        handle = f"{request.request_id}@{secrets.token_hex(8)}"  # never reused
        if state_block is not None:
            self._state_drops.remove(request.request_id)
            self._state_holds[handle] = (request.request_id, state_block * self.block_size)
        kept = tuple(_held_suffix(table[:num_blocks]) for table in tables)
        self._holds[handle] = (kept, [h.hex() for h in request.block_hashes[:num_blocks]])
        self._params[request.request_id] = RemoteReference(
            self.engine_id, handle, kept, self.host, self.port,
            self.layout.tensor_parallel_size,
            self.layout.fingerprint, self._grouped, state_block).as_params()
        return True

    def kv_transfer_params(self, request: KVRequestView) -> dict[str, Any] | None:
        return self._params.pop(request.request_id, None)

    # ----- worker role: both sides ------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._caches = kv_caches
        if any(not c.is_contiguous() or c.shape[0] != 2 for c in kv_caches):
            raise ValueError("NixlConnector needs contiguous [2, blocks, ...] cache tensors")
        self._agent_name = f"kvrecover-{self.engine_id}-rank{self.rank}-{secrets.token_hex(6)}"
        self._agent = _nixl_agent(self._agent_name)
        if self.config.is_producer:  # a consumer's reads land in staging buffers only
            self._agent.register_memory(list(kv_caches))
            self._cache_sides = [c.view(torch.uint8).view(2, c.shape[1], -1).numpy()
                                 for c in kv_caches]
            self._server = SideChannelServer(
                self.host, rank_side_channel_port(self.port, self.rank), self._serve)
            self._progress = threading.Thread(target=self._progress_pulls, daemon=True,
                                              name="kvrecover-nixl-progress")
            self._progress.start()

    def register_recurrent_states(self, states: RecurrentStateAccess) -> None:
        self._recurrent = states
        if self.config.is_producer and self._agent is not None:
            self._held_states = HeldStates(self._agent, states, self.settings.max_held_states)

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        if isinstance(metadata, NixlMetadata) and self._held_states is not None:
            self._held_states.capture([c for c in metadata.state_captures
                                       if c[0] not in self._discarded])

    def discard_saves_for(self, request_ids: set[str]) -> None:
        """A hybrid producer copies out no state of these requests this step (their
        loads were bad: so may be the checkpoints the step wrote)."""
        self._discarded |= request_ids

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._discarded = set()

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
                self._agent.get_new_notifs()  # progresses the agent's backends
            except Exception:  # noqa: BLE001 - a closing agent; the loop ends with it
                pass
            time.sleep(SERVE_POLL_S)

    def _half_nbytes(self) -> int:
        cache = self._caches[0]
        return cache[0, 0].numel() * cache.element_size()

    def _checksums(self, block_ids: list[int]) -> list[int]:
        """xxh3 of each block's K and V in every cache tensor, laid out block-major
        (`staging.block_checksums`: the consumer hashes its staged rows so)."""
        return block_checksums(self._cache_sides, block_ids)

    # ----- worker role: producer ----------------------------------------------------------
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        metadata = self._get_metadata_of(NixlMetadata)
        holds = metadata.holds
        if self._held_states is not None:
            self._held_states.drop(metadata.state_drops)
        if holds:
            deadline = time.monotonic() + self.settings.lease_s
            bound = []
            with self._bound:
                for handle, (group_block_ids, hashes) in holds.items():
                    state = metadata.state_holds.get(handle)
                    if state is not None and (self._held_states is None
                                              or not self._held_states.hold(handle, *state)):
                        # A hybrid's blocks are of no use without their state (a claim
                        # ends at it): freed now, and a check of the reference refused.
                        self._end(handle)
                        continue
                    bound.append(_Hold(group_block_ids, hashes, deadline))
                    self._held[handle] = bound[-1]
                self._bound.notify_all()
            # Checksummed once, here, not at each check: the step that wrote the kept
            # blocks has ended and none is written while held (the engine holds them for
            # the request id, never given to another request nor freed, until reported
            # in `finished_sending`; a prefix-cache hit never covers a request's last
            # token, so it never writes a cached block). Outside the lock: a check that
            # comes first computes its blocks' own (`_serve`).
            for hold in bound:
                ids = sorted({b for ids in hold.group_block_ids for b in ids
                              if b != NULL_BLOCK_ID})
                hold.checksums = dict(zip(ids, self._checksums(ids)))

    def _serve(self, message: dict[str, Any]) -> dict[str, Any]:
        """The side channel's answers (a thread of the server)."""
        op = message.get("op")
        if op == "handshake" and self._hybrid and self._held_states is None:
            return {"ok": False, "reason": "the producer's state pool is not registered yet"}
        if op == "handshake":
            cache = self._caches[0]
            half = self._half_nbytes()
            num_blocks = cache.shape[1]
            return {"ok": True, "engine_id": self.engine_id, "agent": self._agent_name,
                    "metadata": self._agent.get_agent_metadata().hex(),
                    "block_size": self.block_size, "fingerprint": self.layout.fingerprint,
                    "num_blocks": num_blocks, "block_half_nbytes": half,
                    "regions": [[c.data_ptr(), c.data_ptr() + num_blocks * half]
                                for c in self._caches]}
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
            position, blocks = message.get("position"), message.get("blocks")
            if not isinstance(blocks, list) or not blocks or not all(
                    _holds_slot(hold.group_block_ids, item) for item in blocks):
                return {"ok": False, "reason": "the blocks are not those of the reference"}
            if (not isinstance(position, int) or not 0 <= position < len(hold.block_hashes)
                    or hold.block_hashes[position] != message.get("last_block_hash")):
                return {"ok": False, "reason": "the reference is of another prompt"}
            self._reading[handle] = time.monotonic() + self.settings.load_timeout_s
            self._reading_now.set()
            block_ids = [item[2] for item in blocks]
            kept = hold.checksums
            answer: dict[str, Any] = {
                "ok": True, "agent": self._agent_name,
                "checksums": self._checksums(block_ids) if kept is None
                else [kept[b] for b in block_ids]}
            if self._held_states is not None and "state_position" in message:
                answer["state"] = self._held_states.describe(handle,
                                                             message["state_position"])
            return answer

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        if self.config.is_producer:
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
        for request_id in finished_req_ids:  # aborted while pulling: no state to install
            self._async_pulls.pop(request_id, None)
        receiving = {request_id for request_id, thread in self._async.items()
                     if not thread.is_alive()}
        for request_id in receiving:
            del self._async[request_id]
            self._invalid |= self._async_invalid.pop(request_id, set())
            pull = self._async_pulls.pop(request_id, None)
            if pull is not None:
                self._install_states([pull])
        return sending or None, receiving or None

    def _end(self, handle: str) -> None:
        """The reference `handle` ended (released, expired, or never kept): checks of it
        are refused at once, its request is reported in `finished_sending` (its blocks
        freed) and its state's slot is free (under `_lock`)."""
        self._ended.append(handle)
        self._released.add(handle.rsplit("@", 1)[0])
        if self._held_states is not None:
            self._held_states.release(handle)

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

    # ----- worker role: consumer ----------------------------------------------------------
    def start_load_kv(self, kv_caches: list[torch.Tensor]) -> None:
        pulls = self._get_metadata_of(NixlMetadata).pulls
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

    def _pull_async(self, pull: Pull) -> None:
        self._async_invalid[pull.request_id] = self._pull([pull])

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def get_connector_stats(self) -> dict[str, int]:
        pulled, self._pulled_blocks = self._pulled_blocks, 0
        with self._lock:
            freed, self._lease_freed_blocks = self._lease_freed_blocks, 0
        counts = {"kv_nixl_pulled_blocks": pulled, "kv_nixl_lease_freed_blocks": freed}
        return {name: count for name, count in counts.items() if count}

    def pull_blocks(self, pulls: list[Pull], timeout_s: float,
                    fence: ReadCancel | None = None) -> set[int]:
        """Pull and verify `pulls` now, within `timeout_s` at most (a TieredConnector's
        reader thread calls it for its P2P tier, `fence` its load's: once the load is
        given up nothing more is copied into the cache); the local blocks that are not
        valid (verified ones are in the cache)."""
        return self._pull(pulls, min(timeout_s, self.settings.load_timeout_s), fence)

    def _pull(self, pulls: list[Pull], timeout_s: float | None = None,
              fence: ReadCancel | None = None) -> set[int]:
        """Pull and verify `pulls`; returns the local blocks that are not valid. Only
        verified staged blocks are copied into the cache, before this returns."""
        deadline = time.monotonic() + (self.settings.load_timeout_s if timeout_s is None
                                       else timeout_s)
        invalid: set[int] = set()
        checked: list[tuple[Pull, _Peer, list[int]]] = []
        for pull in pulls:
            invalid.update(pull.missing)
            if not pull.block_ids:
                continue
            try:
                peer, checksums = self._check(pull)
                checked.append((pull, peer, checksums))
            except (SideChannelError, ValueError) as error:
                logger.warning("request %s: KV pull from %s refused: %s", pull.request_id,
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
        # Done with each reference that checked out, read or not: the producer frees it. A
        # refused one is left to its lease (it may be someone else's, or not be at all).
        for pull, _, _ in checked:
            try:
                call(pull.reference.host, pull.reference.side_channel_port(self.rank),
                     {"op": "release", "handle": pull.reference.request_id}, timeout_s=1.0)
            except SideChannelError:
                pass
        return invalid

    def _check(self, pull: Pull) -> tuple[_Peer, list[int]]:
        """Ask the producer whether the reference still holds these blocks; its answer's
        checksums, and the peer (handshaking when its agent is new)."""
        reference = pull.reference
        remote_ids = pull.remote_block_ids
        answer = call(reference.host, reference.side_channel_port(self.rank),
                      {"op": "check", "handle": reference.request_id,
                       "position": pull.last_position,
                       "blocks": [[g, p, b] for (g, p), b in zip(pull.remote_slots, remote_ids)],
                       "last_block_hash": pull.last_block_hash,
                       **({} if pull.state_position is None
                          else {"state_position": pull.state_position})})
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
            peer = self._handshake(reference)
            self._peers[reference.engine_id] = peer
        if any(b >= peer.num_blocks for b in remote_ids):
            raise ValueError("block ids outside the producer's cache")
        return peer, checksums

    def _handshake(self, reference: RemoteReference) -> _Peer:
        answer = call(reference.host, reference.side_channel_port(self.rank),
                      {"op": "handshake"})
        if answer.get("ok") is not True:
            raise ValueError(f"handshake refused: {answer.get('reason')}")
        if answer.get("fingerprint") != self.layout.fingerprint or \
                answer.get("block_size") != self.block_size:
            raise ValueError("the producer's KV layout is not this engine's")
        regions = answer.get("regions")
        if (not isinstance(regions, list) or len(regions) != len(self._caches)
                or answer.get("block_half_nbytes") != self._half_nbytes()):
            raise ValueError("the producer's cache regions do not match this engine's")
        agent = self._agent.add_remote_agent(bytes.fromhex(str(answer["metadata"])))
        name = agent.decode() if isinstance(agent, bytes) else str(agent)
        if name != answer.get("agent"):
            raise ValueError("the producer's agent metadata names another agent")
        return _Peer(name, int(answer["num_blocks"]), int(answer["block_half_nbytes"]),
                     [(int(k), int(v)) for k, v in regions])

    def _read(self, agent: str, items: list[tuple[Pull, _Peer, list[int]]],
              deadline: float) -> StagingBuffer | None:
        """One NIXL READ of every block of `items` from `agent` into a staging buffer
        (never into the cache: `staging.py`): the blocks of `items` in order, laid out
        (side, cache, block), one descriptor per run of consecutive remote ids, a
        hybrid's state rows after them. The buffer if the READ completed (the caller
        gives it back), else None (a READ given up in flight leaves its buffer
        quarantined)."""
        half = self._half_nbytes()
        count = len(self._caches)
        row_nbytes = 2 * count * half
        states = [p.remote_state for p, _, _ in items if p.remote_state is not None]
        try:
            buffer = self._staging_pool().acquire(
                sum(len(p.block_ids) for p, _, _ in items)
                + sum(num_rows(s, row_nbytes) for s in states))
        except StagingExhausted as error:
            logger.warning("NIXL read from %s refused: %s", agent, error)
            return None
        base = buffer.rows.data_ptr()
        num_blocks = sum(len(p.block_ids) for p, _, _ in items)
        local, remote = [], []
        row = 0
        for pull, peer, _ in items:  # block rows laid out (side, cache, block): `staging.py`
            pull_local, pull_remote = block_descriptors(
                pull.remote_block_ids, peer.regions, half, base, row, num_blocks)
            local += pull_local
            remote += pull_remote
            row += len(pull.remote_block_ids)
        state_row = row
        for remote_state in states:  # a hybrid's, in rows after the blocks' (`states.py`)
            state_local, state_remote = chunks(remote_state, base, state_row, row_nbytes)
            local += state_local
            remote += state_remote
            state_row += num_rows(remote_state, row_nbytes)
        handle = None
        state = "ERR"
        try:
            local_descs = self._agent.get_xfer_descs(local, "DRAM")
            remote_descs = self._agent.get_xfer_descs(remote, "DRAM")
            handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, agent, b"")
            state = self._agent.transfer(handle)
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                time.sleep(POLL_INTERVAL_S)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                logger.warning("NIXL read of %d blocks from %s: %s", row, agent,
                               "failed" if state == "ERR" else "past its deadline")
        except Exception as error:  # a transfer that cannot be posted is a failed pull
            logger.warning("NIXL read from %s could not run: %r", agent, error)
            state = "ERR" if handle is None else "PROC"  # posted: it may still write
        if handle is not None and state not in ("DONE", "ERR"):
            self._staging_pool().quarantine(buffer, handle)  # never released in flight
            return None
        if handle is not None:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - ended: nothing more is written
                pass
        if state != "DONE":
            self._staging_pool().give_back(buffer)
            return None
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
            if self._staging is None:
                row_nbytes = 2 * len(self._caches) * self._half_nbytes()  # a block's K and V
                self._staging = StagingPool(self._agent, row_nbytes)
            return self._staging

    def _install_staged(self, items: list[tuple[Pull, _Peer, list[int]]],
                        buffer: StagingBuffer, fence: ReadCancel | None) -> set[int]:
        """Verify the staged rows of `items` against the producer's checksums and copy
        the verified ones into the cache (one indexed copy per cache tensor), under
        `fence` when given: nothing is written once it is set. The blocks not installed."""
        local_ids = [b for pull, _, _ in items for b in pull.block_ids]
        expected = [x for _, _, checksums in items for x in checksums]
        count = len(self._caches)
        staged = staged_blocks(buffer.rows, len(local_ids), count)  # (side, cache, block)
        raw = staged.numpy()
        actual = block_checksums([raw[:, c] for c in range(count)], range(len(local_ids)))
        good = [i for i, x in enumerate(expected) if actual[i] == x]
        bad = set(local_ids) - {local_ids[i] for i in good}
        for pull, _, _ in items:
            failed = sum(b in bad for b in pull.block_ids)
            if failed:
                logger.warning("request %s: %d pulled KV block(s) fail their checksum",
                               pull.request_id, failed)
        if not good:
            return bad
        half = self._half_nbytes()
        # Moved in 8-byte words where the halves allow: an indexed copy of bytes moves one
        # byte per element (a 16 x 1024-token CPU pull spent 3 s here).
        word = torch.int64 if half % 8 == 0 else torch.uint8
        words = staged.view(word)
        chosen = None if len(good) == len(local_ids) else torch.tensor(good)
        targets = torch.tensor([local_ids[i] for i in good], dtype=torch.long)

        def copy() -> None:
            for c, cache in enumerate(self._caches):
                cache_words = cache.view(torch.uint8).view(2, cache.shape[1], half).view(word)
                source = words[:, c] if chosen is None else words[:, c].index_select(1, chosen)
                cache_words.index_copy_(1, targets.to(cache.device), source.to(cache.device))

        if fence is None:
            copy()
        else:
            try:
                fence.write_unless_set(copy)
            except ReadTimedOut:
                return set(local_ids)
        self._pulled_blocks += len(good)
        return bad

    def shutdown(self) -> None:
        self._closing.set()
        if self._progress is not None:
            self._progress.join(timeout=5)
        for thread in list(self._async.values()):
            thread.join(timeout=self.settings.load_timeout_s)
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._staging is not None:
            self._staging.close()
        if self._held_states is not None:
            self._held_states.close(self._agent)
            self._held_states = None
        self._agent = None
        self._caches = []


def _held_suffix(table: tuple[int, ...]) -> tuple[int, ...]:
    """`table` with the null block before its last null entry too: what a group holds
    from one position to the end (a window's blocks; a full group's are all held)."""
    last_null = max((p for p, b in enumerate(table) if b == NULL_BLOCK_ID), default=-1)
    return (NULL_BLOCK_ID,) * (last_null + 1) + tuple(table[last_null + 1:])


def _holds_slot(group_block_ids: tuple[tuple[int, ...], ...], item: Any) -> bool:
    """Whether `item`, a consumer's [group, position, block id], names a block the hold
    keeps at that slot."""
    if not isinstance(item, list) or len(item) != 3 or \
            not all(isinstance(x, int) and not isinstance(x, bool) for x in item):
        return False
    group, position, block_id = item
    return (0 <= group < len(group_block_ids) and 0 <= position < len(group_block_ids[group])
            and block_id != NULL_BLOCK_ID and group_block_ids[group][position] == block_id)

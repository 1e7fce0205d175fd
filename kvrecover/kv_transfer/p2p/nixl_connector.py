"""NixlConnector: the decode instance pulls the prefill instance's KV blocks over NIXL.

vLLM's P/D protocol, NIXL over UCX: CPU memory, or GPU memory (a GPU engine registers
its KV cache as VRAM, stages its reads on the GPU and checksums there: `checksums.py`;
UCX moves it by cuda_ipc between processes on one node). This module is the
connector's face: its registered name, its settings and the dispatch of each contract
method to the part that does the work, one job per module:

- `kept_prompts.py` (producer, scheduler role: `kv_producer`, or `kv_both` for a request
  with `do_remote_decode`): which finished prompts are kept (`request_finished` returns
  True; every KV cache group's full prompt blocks, a windowed group's those it still
  holds) and the reference handed out (`kv_transfer_params`: vLLM's field names, a block
  list per group for a model with windows, `params.py`).
- `producer.py` (producer, worker role): registers the KV cache with a NIXL agent, holds
  the kept prompts (checksummed once, in the step that binds them), serves the side
  channel (`side_channel.py`: the handshake, the check of each pull answered with the
  blocks' checksums, the release) and frees a kept prompt on release or when its lease
  (`lease_s`) ends, reported in `finished_sending`.
- `claims.py` (consumer, scheduler role: `kv_consumer`): how much of a prompt a
  reference supplies (`get_num_new_matched_tokens`: up to the last position where the
  producer holds every group's blocks and windows) and the pull that moves it
  (`update_state_after_alloc`); a request pulls its reference once, so a retry after a
  failed load (`kv_load_retry_limit`) claims nothing from it.
- `consumer.py` (consumer, worker role): checks each reference with the producer,
  handshakes once per producer agent (`peers.py`), reads the step's blocks with one
  NIXL READ per producer into a registered staging buffer (`staging.py`), verifies each
  block's checksum, copies only verified blocks into the cache (`pull_reads.py`) and
  releases the reference. Anything that fails makes those blocks invalid: the engine
  recomputes them (rule 10).
- `metadata.py`: what the scheduler role hands the worker role each step (`Pull`,
  `NixlMetadata`).

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

import importlib
import logging
import os
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvrecover.config import KVTransferConfig
from kvrecover.kv_groups import single_group
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import (
    SETTING_LABEL,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvrecover.kv_transfer.p2p.checksums import ALGORITHMS
from kvrecover.kv_transfer.p2p.claims import PullClaims
from kvrecover.kv_transfer.p2p.consumer import NixlConsumer
from kvrecover.kv_transfer.p2p.kept_prompts import KeptPrompts
from kvrecover.kv_transfer.p2p.metadata import NixlMetadata, Pull
from kvrecover.kv_transfer.p2p.params import rank_side_channel_port, wants_remote_prefill
from kvrecover.kv_transfer.p2p.producer import NixlProducer
from kvrecover.kv_transfer.stores.reader_threads import ReadCancel
from kvrecover.options import option, validate

if TYPE_CHECKING:
    from kvrecover.kv_transfer.request_view import KVRequestView
    from kvrecover.kv_transfer.stores.state_entries import RecurrentStateAccess
    from kvrecover.step_messages import SchedulerOutput

DEFAULT_SIDE_CHANNEL_PORT = 5600  # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default


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
    checksum: str = option(
        "auto", "how a producer checksums the blocks it serves: xxh3, fold64 (hashed "
        "where the cache is), or auto (fold64 for a GPU's cache, xxh3 for the CPU's); a "
        "consumer checks with the producer's", str, choices=("auto", *ALGORITHMS),
        describe=f"one of {('auto', *ALGORITHMS)}")
    max_held_states: int = option(
        16, "a hybrid model's producer keeps at most this many prompts' recurrent states "
        "(on the cache's device, allocated at start-up); a prompt past them is not kept", int,
        minimum=1, maximum=1 << 16)

    def __post_init__(self) -> None:
        validate(self, SETTING_LABEL)


def _nixl_api() -> Any:
    """NIXL's Python API: nixl-cu12's (pinned) or, where only it is installed (a CUDA 13
    machine), nixl-cu13's."""
    for package in ("nixl_cu12", "nixl_cu13"):
        try:
            return importlib.import_module(f"{package}._api")
        except ImportError:
            continue
    raise ValueError("NixlConnector needs the nixl package (pip install nixl-cu12, or "
                     "nixl-cu13 with CUDA 13)")


# UCX's default ("auto") turns cuda_ipc's GET off on a GPU with no NVLink peer (a lone
# card, PCIe pairs): a READ of GPU memory then goes through UCX's software emulation
# over TCP. vLLM/llm-d and Dynamo deployments turn it on; a user's own setting wins.
GPU_UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


def _nixl_agent(name: str, gpu: bool = False):
    """A NIXL agent of this process (`gpu`: it moves GPU memory, see GPU_UCX_DEFAULTS;
    UCX reads its environment when the agent's backend starts)."""
    if gpu:
        for variable, value in GPU_UCX_DEFAULTS.items():
            os.environ.setdefault(variable, value)
    api = _nixl_api()
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
    nixl_thread_sync_t = api.nixl_thread_sync_t
    logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout
    # STRICT: the agent is called from several threads (async pulls, the side channel's
    # server, the producer's progress loop); NIXL's default without a listener is
    # unsynchronised, and concurrent calls corrupted UCX's state (crashes, hung reads).
    config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                               sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    return nixl_agent(name, config)


class NixlConnector(KVConnectorBase):
    """P2P KV transfer over NIXL (see the module docstring): each contract method goes
    to the claims or kept prompts (scheduler role), or to the producer or consumer
    (worker role)."""

    settings_class = NixlSettings
    # A block id spans every cache tensor whatever its group: the scheduler role pairs
    # each group's blocks, the worker role moves ids.
    supports_kv_groups = True
    # A hybrid's kept prompt keeps its state at the claim's end too (`states.py`).
    supports_recurrent_states = True
    # The worker role's pulls (a subclass may put its own, e.g. to inject faults).
    consumer_class: type[NixlConsumer] = NixlConsumer

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
        # A model with windows hands out (and reads) a block list per group.
        grouped = layout.kv_groups != single_group(layout.num_layers)
        # Scheduler role.
        self.claims = PullClaims(layout, grouped, settings.async_load)
        self.kept = KeptPrompts(config, layout, self.engine_id, self.host, self.port, grouped)
        # Worker role: a producer only if this instance keeps prompts.
        self.producer = NixlProducer(layout, self.engine_id, settings.lease_s,
                                     settings.load_timeout_s, settings.max_held_states,
                                     settings.checksum) if config.is_producer else None
        self.consumer = self.consumer_class(layout, settings.load_timeout_s)
        self._discarded: set[str] = set()  # requests whose states this step must not keep

    # ----- scheduler role -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: KVRequestView,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = request.sampling_params.kv_transfer_params
        if not self.config.is_consumer or not wants_remote_prefill(params):
            return 0, False
        return self.claims.claim(request, num_computed_tokens)

    def update_state_after_alloc(self, request: KVRequestView, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self.kept.track(request)
        self.claims.plan(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlMetadata:
        metadata = NixlMetadata(self.claims.take_pulls(), self.claims.take_releases())
        self.kept.fill(metadata, scheduler_output)
        return metadata

    def request_finished(self, request: KVRequestView, block_ids: list[int]) -> bool:
        self.claims.forget(request.request_id)
        return self.kept.finished(request, block_ids)

    def kv_transfer_params(self, request: KVRequestView) -> dict[str, Any] | None:
        return self.kept.reference(request.request_id)

    # ----- worker role ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        if any(not c.is_contiguous() or c.shape[0] != 2 for c in kv_caches):
            raise ValueError("NixlConnector needs contiguous [2, blocks, ...] cache tensors")
        agent_name = f"kvrecover-{self.engine_id}-rank{self.rank}-{secrets.token_hex(6)}"
        agent = _nixl_agent(agent_name, gpu=any(c.is_cuda for c in kv_caches))
        self.consumer.register(kv_caches, agent)
        if self.producer is not None:  # a consumer's reads land in staging buffers only
            self.producer.register(kv_caches, agent, agent_name, self.host,
                                   rank_side_channel_port(self.port, self.rank))

    def register_recurrent_states(self, states: RecurrentStateAccess) -> None:
        self.consumer.register_states(states)
        if self.producer is not None:
            self.producer.register_states(states)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        bound = self._get_metadata_of(NixlMetadata)
        self.consumer.release_unread(bound.releases)  # here: a TieredConnector binds too
        if self.producer is not None:
            self.producer.bind(bound)

    def start_load_kv(self, kv_caches: list[torch.Tensor]) -> None:
        self.consumer.start(self._get_metadata_of(NixlMetadata).pulls)

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        if isinstance(metadata, NixlMetadata) and self.producer is not None:
            self.producer.capture_states([c for c in metadata.state_captures
                                          if c[0] not in self._discarded])

    def discard_saves_for(self, request_ids: set[str]) -> None:
        """A hybrid producer copies out no state of these requests this step (their
        loads were bad: so may be the checkpoints the step wrote)."""
        self._discarded |= request_ids

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._discarded = set()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending = set() if self.producer is None else self.producer.expire()
        receiving = self.consumer.finished(finished_req_ids)
        return sending or None, receiving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.consumer.take_invalid()

    def get_connector_stats(self) -> dict[str, int]:
        counts = {"kv_nixl_pulled_blocks": self.consumer.take_pulled_blocks(),
                  "kv_nixl_lease_freed_blocks": 0 if self.producer is None
                  else self.producer.take_lease_freed_blocks(),
                  **{f"kv_nixl_{name}": count
                     for name, count in self.consumer.take_transfer_counts().items()}}
        return {name: count for name, count in counts.items() if count}

    def pull_blocks(self, pulls: list[Pull], timeout_s: float,
                    fence: ReadCancel | None = None) -> set[int]:
        """Pull and verify `pulls` now, within `timeout_s` at most (a TieredConnector's
        reader thread calls it for its P2P tier, `fence` its load's: once the load is
        given up nothing more is copied into the cache); the local blocks that are not
        valid (verified ones are in the cache)."""
        return self.consumer.pull_blocks(pulls, timeout_s, fence)

    def shutdown(self) -> None:
        self.consumer.close()
        if self.producer is not None:
            self.producer.close()

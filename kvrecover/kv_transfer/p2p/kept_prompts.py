"""The producer's scheduler role: which finished prompts it keeps, and their references.

A producer (`kv_producer`, or `kv_both` for a request with `do_remote_decode`) keeps a
request's full prompt blocks in every KV cache group when it ends (`request_finished`
returns True; a windowed group's are those it still holds) and hands out a reference
(`kv_transfer_params`: vLLM's field names, a block list per group for a model with
windows, `params.py`) under a handle never reused. The worker role holds them from the
next step on (`producer.py`). A hybrid's prompt is kept only with its recurrent state at
the last loadable boundary (`states.StateCaptures` notes where the engine put it): its
blocks are of no use without it.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import NULL_BLOCK_ID, KVCacheLayout
from kvrecover.kv_transfer.p2p.metadata import NixlMetadata
from kvrecover.kv_transfer.p2p.params import RemoteReference
from kvrecover.kv_transfer.p2p.states import StateCaptures

if TYPE_CHECKING:
    from kvrecover.kv_transfer.request_view import KVRequestView
    from kvrecover.step_messages import SchedulerOutput


class KeptPrompts:
    """The prompts a producer keeps, each step's new ones for its worker, and the
    references it hands out (the connector's scheduler role)."""

    def __init__(self, config: KVTransferConfig, layout: KVCacheLayout, engine_id: str,
                 host: str, port: int, grouped: bool) -> None:
        self.config = config
        self.layout = layout
        self.block_size = layout.block_size
        self.kv_groups = layout.kv_groups
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self._grouped = grouped
        self._hybrid = layout.has_recurrent_layers
        self._captures = StateCaptures(self.block_size)
        self._holds: dict[str, tuple[tuple[tuple[int, ...], ...], list[str]]] = {}
        self._state_holds: dict[str, tuple[str, int]] = {}
        self._state_drops: list[str] = []
        self._params: dict[str, dict[str, Any]] = {}

    def track(self, request: KVRequestView) -> None:
        """A new request (`update_state_after_alloc`): a hybrid producer notes where its
        prompt's state is captured."""
        if self._hybrid and self.config.is_producer:
            self._captures.track(request)

    def fill(self, metadata: NixlMetadata, scheduler_output: SchedulerOutput) -> None:
        """Put the prompts kept and the states to capture, keep and forget since the last
        step into `metadata` (`build_connector_meta`)."""
        metadata.holds, metadata.state_holds = self._holds, self._state_holds
        metadata.state_drops = self._state_drops
        self._holds, self._state_holds, self._state_drops = {}, {}, []
        if self._hybrid and self.config.is_producer:
            metadata.state_captures = self._captures.plan(scheduler_output)

    def finished(self, request: KVRequestView, block_ids: list[int]) -> bool:
        """`request_finished`: whether the request's prompt blocks are kept (its
        reference is then `reference`'s)."""
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

    def reference(self, request_id: str) -> dict[str, Any] | None:
        """`kv_transfer_params`: the reference of a prompt `finished` kept (once)."""
        return self._params.pop(request_id, None)


def _held_suffix(table: tuple[int, ...]) -> tuple[int, ...]:
    """`table` with the null block before its last null entry too: what a group holds
    from one position to the end (a window's blocks; a full group's are all held)."""
    last_null = max((p for p, b in enumerate(table) if b == NULL_BLOCK_ID), default=-1)
    return (NULL_BLOCK_ID,) * (last_null + 1) + tuple(table[last_null + 1:])

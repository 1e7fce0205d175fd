"""The Triton path's step inputs: one step's integer inputs, packed into one buffer
and copied once (`StepInputBuilder`, an `ops.interface.StepInputBuilder` whose
padded-decode interface serves the CUDA graphs).

Token ids, positions, cache slots, the attention tiles, the rows to sample and
the block table all go into one pinned int32 host buffer, reach the device in
one copy, and are handed to the model as views. With `pad_to` the batch is
padded with dummy one-token requests (token 0 at position 0, cache slot 0 of
the null block 0) so that a CUDA graph captured for that size can replay it;
the offsets of every segment then depend on `pad_to` alone.

A model with several KV cache groups (`kv_groups.py`) has one block table and one
cache-slot segment per group (group 0's are `table` and `slots`, as for one group);
padded steps then give every table the model's full width, so that the offsets still
depend on `pad_to` alone (only the last segment, group 0's table, may grow).

A hybrid model's builder (`recurrent`) also packs, into padded steps, the recurrent
layers' plan (`ops/triton/step_plan.py`: each request's row, position, state slot and
checkpoint; padding requests of 0 rows), so a graphed step reads it from the same
static buffer; eager steps' layers build their own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvrecover.ops.interface import (
    GraphStepInputs,
    RecurrentRequestRows,
    ScheduledTokens,
    StepInputs,
)
from kvrecover.ops.triton.metadata import PagedAttentionMetadata
from kvrecover.ops.triton.step_plan import (
    decode_plan_lengths,
    decode_plan_views,
    pack_decode_plan,
)

_ALIGN = 32  # int32 elements (128 bytes) between segments, for aligned kernel loads
_SEGMENTS = ("ids", "positions", "slots", "seq_lens", "query_start", "tile_request",
             "tile_query_start", "sample_rows", "table_stride", "table")


def _segments(num_groups: int, recurrent: bool = False) -> tuple[str, ...]:
    """The segment names of a step with `num_groups` block tables (and with `recurrent`
    the recurrent layers' plan, before the tables), in buffer order."""
    plan = tuple(decode_plan_lengths(0)) if recurrent else ()
    if num_groups == 1:
        return _SEGMENTS[:-2] + plan + _SEGMENTS[-2:]
    extra = range(1, num_groups)
    return ("ids", "positions", "slots", *(f"slots{g}" for g in extra), "seq_lens",
            "query_start", "tile_request", "tile_query_start", "sample_rows", *plan,
            "table_stride", *(f"table{g}" for g in extra), "table")


def _group_names(num_groups: int) -> list[tuple[str, str]]:
    """(slots segment, table segment) of each group."""
    return [("slots", "table")] + [(f"slots{g}", f"table{g}") for g in range(1, num_groups)]


@dataclass
class StepLayout:
    """Where each segment of a packed step lives in the buffer, and its length."""

    offsets: dict[str, int]
    lengths: dict[str, int]
    size: int  # elements in use
    num_tiles: int
    decode_only: bool
    max_seq_len: int


def _round_up(value: int) -> int:
    return -(-value // _ALIGN) * _ALIGN


def _offsets(lengths: dict[str, int], num_groups: int = 1,
             recurrent: bool = False) -> tuple[dict[str, int], int]:
    offsets, size = {}, 0
    for name in _segments(num_groups, recurrent):
        offsets[name] = size
        size = _round_up(size + lengths[name])
    return offsets, size


class StepInputBuilder:
    """Packs scheduled requests into the host buffer and uploads it (one per model runner).

    `tile_tokens` is the attention kernel's query tokens per tile
    (`ops.triton.attention.tile_tokens`; `ops.triton.attention.step_input_builder`
    makes the builder from an `ops.interface.StepInputSpec`).
    """

    def __init__(
        self, block_size: int, tile_tokens: int, device: torch.device, max_model_len: int = 0,
        num_kv_groups: int = 1, recurrent: bool = False,
    ) -> None:
        self.block_size = block_size
        self.num_kv_groups = num_kv_groups
        self.recurrent = recurrent  # padded steps carry the recurrent layers' plan
        self._groups = _group_names(num_kv_groups)
        # Padded steps of several groups give every table this width (see the module doc).
        self._graph_width = max(1, -(-max_model_len // block_size))
        self.max_model_len = max_model_len
        self.tile_tokens = tile_tokens
        self.device = device
        self._pin = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int32)
        self._host_np = self._host.numpy()
        self._device = torch.empty(0, dtype=torch.int32, device=device)
        self._uploaded: torch.cuda.Event | None = None
        # Block-table rows left in the host buffer by the last decode pack, by group and row.
        self._table_rows: list[list[tuple[str, int, int, int] | None]] = []
        self._table_shape: tuple[int, int, int] | None = None

    def build(self, scheduled: Sequence[ScheduledTokens]) -> StepInputs:
        """The step's inputs on the device: packed, uploaded, as views (an eager step)."""
        layout = self.pack(scheduled)
        return self.views(layout, self.upload(layout))

    def for_graphs(self) -> GraphStepInputs | None:
        """This builder itself: `pack(pad_to=...)`, `upload` and `views` serve the graphs."""
        return self

    def pack(
        self,
        scheduled: Sequence[ScheduledTokens],
        pad_to: int | None = None,
        input_ids: list[int] | None = None,
        recurrent: Sequence[RecurrentRequestRows] | None = None,
    ) -> StepLayout:
        """Write the step into the host buffer; returns its layout.

        With `pad_to` every request must have exactly one new token (a decode step),
        and `input_ids` may replace those tokens in the buffer; a builder made with
        `recurrent` then also packs the recurrent layers' plan of `recurrent` (the
        requests' rows and slots, `RecurrentStates.step`; None: padding only).
        """
        if pad_to:
            return self._pack_decode(scheduled, pad_to, input_ids, recurrent or ())
        self._table_shape = None
        num_real = len(scheduled)
        num_reqs = pad_to or num_real
        num_pad = num_reqs - num_real
        query_lens = np.fromiter((len(s.token_ids) for s in scheduled), np.int64, num_real)
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, num_real)
        num_real_tokens = int(query_lens.sum())
        num_tokens = num_real_tokens + num_pad
        tiles_per_req = -(-query_lens // self.tile_tokens)
        num_tiles = int(tiles_per_req.sum()) + num_pad
        samples = [] if pad_to else [i for i, s in enumerate(scheduled) if s.sample]
        groups = self._groups
        width = max([len(t) for s in scheduled for t in s.tables] + [1])
        lengths = {
            "ids": num_tokens, "positions": num_tokens, "seq_lens": num_reqs,
            "query_start": num_reqs + 1, "tile_request": num_tiles,
            "tile_query_start": num_tiles, "sample_rows": len(samples), "table_stride": 1,
        }
        lengths.update(dict.fromkeys(decode_plan_lengths(0), 0))  # eager: the layers' own plan
        for slots_name, table_name in groups:
            lengths[slots_name] = num_tokens
            lengths[table_name] = num_reqs * width
        offsets, size = _offsets(lengths, len(groups), self.recurrent)
        host = self._host_buffer(size)
        seg = {name: host[offsets[name] : offsets[name] + lengths[name]]
               for name in _segments(len(groups), self.recurrent)}

        query_start = seg["query_start"]
        query_start[0] = 0
        np.cumsum(query_lens, out=query_start[1 : num_real + 1])
        query_start[num_real + 1 :] = num_real_tokens + np.arange(1, num_pad + 1)
        seg["seq_lens"][:num_real] = starts + query_lens
        seg["seq_lens"][num_real:] = 1
        tables = []
        for g, (_, table_name) in enumerate(groups):
            table = seg[table_name].reshape(num_reqs, width)
            table[:] = 0
            for row, item in zip(table, scheduled):
                ids = item.tables[g]
                row[: len(ids)] = ids
            tables.append(table)
        seg["table_stride"][0] = width

        request_of_row = np.repeat(np.arange(num_real), query_lens)
        positions = np.arange(num_real_tokens) + np.repeat(starts - query_start[:num_real], query_lens)
        seg["ids"][:num_real_tokens] = np.fromiter(
            itertools.chain.from_iterable(s.token_ids for s in scheduled), np.int32, num_real_tokens
        )
        seg["ids"][num_real_tokens:] = 0
        seg["positions"][:num_real_tokens] = positions
        seg["positions"][num_real_tokens:] = 0
        for (slots_name, _), table in zip(groups, tables):
            blocks = table[request_of_row, positions // self.block_size]
            seg[slots_name][:num_real_tokens] = (
                blocks * self.block_size + positions % self.block_size)
            seg[slots_name][num_real_tokens:] = 0

        tile_start = np.cumsum(tiles_per_req) - tiles_per_req
        real_tiles = num_tiles - num_pad
        seg["tile_request"][:real_tiles] = np.repeat(np.arange(num_real), tiles_per_req)
        seg["tile_request"][real_tiles:] = np.arange(num_real, num_reqs)
        seg["tile_query_start"][:real_tiles] = (
            np.arange(real_tiles) - np.repeat(tile_start, tiles_per_req)
        ) * self.tile_tokens
        seg["tile_query_start"][real_tiles:] = 0
        seg["sample_rows"][:] = query_start[1:][samples] - 1
        decode_only = num_tokens == num_reqs
        # A graph replays with any context length: bound it by the model's.
        max_seq_len = self.max_model_len if pad_to else int(seg["seq_lens"].max(initial=1))
        return StepLayout(offsets, lengths, size, num_tiles, decode_only, max_seq_len)

    def _pack_decode(
        self, scheduled: Sequence[ScheduledTokens], num_reqs: int, input_ids: list[int] | None,
        recurrent: Sequence[RecurrentRequestRows],
    ) -> StepLayout:
        """`pack` for padded decode steps (the CUDA-graph path), lean on per-call overhead.

        Consecutive decode steps of one shape rewrite only what changes: the constant
        segments and padding rows stay in the host buffer, and a block-table row is
        rewritten only when its request or block count changes (converting block-id
        lists is the slow part; a request's list only grows while it decodes).
        """
        num_real, block_size = len(scheduled), self.block_size
        groups = self._groups
        if len(groups) == 1:
            width = max([len(s.block_ids) for s in scheduled] + [1])
        else:  # every table at full width: the offsets depend on num_reqs alone
            width = self._graph_width
        shape = (id(self._host), num_reqs, width)
        if shape != self._table_shape:
            lengths = {
                "ids": num_reqs, "positions": num_reqs,
                "seq_lens": num_reqs, "query_start": num_reqs + 1, "tile_request": num_reqs,
                "tile_query_start": num_reqs, "sample_rows": 0, "table_stride": 1,
            }
            lengths.update(decode_plan_lengths(num_reqs) if self.recurrent
                           else dict.fromkeys(decode_plan_lengths(0), 0))
            for slots_name, table_name in groups:
                lengths[slots_name] = num_reqs
                lengths[table_name] = num_reqs * width
            offsets, size = _offsets(lengths, len(groups), self.recurrent)
            host = self._host_buffer(size)
            if id(self._host) != shape[0]:  # the buffer grew: the shape changed after all
                shape = (id(self._host), num_reqs, width)
            o = offsets
            host[:size] = 0
            host[o["seq_lens"] : o["seq_lens"] + num_reqs] = 1  # padding: position 0, length 1
            host[o["query_start"] : o["query_start"] + num_reqs + 1] = np.arange(num_reqs + 1)
            host[o["tile_request"] : o["tile_request"] + num_reqs] = np.arange(num_reqs)
            host[o["table_stride"]] = width
            self._decode_layout = StepLayout(
                offsets, lengths, size, num_reqs, True, self.max_model_len
            )
            self._table_rows = [[None] * num_reqs for _ in groups]
            self._table_shape = shape
        else:
            host = self._host_buffer(self._decode_layout.size)
        layout = self._decode_layout
        o = layout.offsets
        if self.recurrent:
            pack_decode_plan({name: host[o[name] : o[name] + layout.lengths[name]]
                              for name in decode_plan_lengths(0)}, recurrent, num_reqs)
        elif recurrent:
            raise ValueError("recurrent rows for a step-input builder made without `recurrent`")
        positions = [s.num_computed_tokens for s in scheduled]
        if input_ids is None:
            input_ids = [s.token_ids[0] for s in scheduled]
        host[o["ids"] : o["ids"] + num_real] = input_ids
        host[o["positions"] : o["positions"] + num_real] = positions
        host[o["seq_lens"] : o["seq_lens"] + num_real] = positions
        host[o["seq_lens"] : o["seq_lens"] + num_real] += 1
        for g, (slots_name, table_name) in enumerate(groups):
            host[o[slots_name] : o[slots_name] + num_real] = [
                s.tables[g][p // block_size] * block_size + p % block_size
                for s, p in zip(scheduled, positions)
            ]
            table = host[o[table_name] : o[table_name] + num_reqs * width].reshape(num_reqs, width)
            rows = self._table_rows[g]
            for index, item in enumerate(scheduled):
                ids = item.tables[g]
                # A windowed group's table also changes where it releases blocks (they
                # become the null block) without changing this key: the kernels never
                # read a block below the window, so such a stale entry is never used.
                key = (item.request_id, len(ids), ids[0], ids[-1])
                if rows[index] != key:
                    table[index, : len(ids)] = ids
                    table[index, len(ids) :] = 0
                    rows[index] = key
            for index in range(num_real, num_reqs):
                if rows[index] is not None:  # a row that held a request last step: padding
                    table[index] = 0
                    rows[index] = None
                    host[o[slots_name] + index] = 0
                    if g == 0:
                        for name in ("ids", "positions"):
                            host[o[name] + index] = 0
                        host[o["seq_lens"] + index] = 1
        return layout

    def upload(self, layout: StepLayout, target: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the packed step to `target` (default: a growing device buffer); returns it."""
        if target is None:
            if self._device.numel() < layout.size:
                self._device = torch.empty(
                    max(layout.size, 2 * self._device.numel()), dtype=torch.int32,
                    device=self.device,
                )
            target = self._device
        target[: layout.size].copy_(self._host[: layout.size], non_blocking=self._pin)
        if self._pin:
            # The next pack must not overwrite the host buffer before this copy ran.
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        return target

    def views(self, layout: StepLayout, buffer: torch.Tensor) -> StepInputs:
        """The model's inputs as views of an uploaded buffer."""
        seg = {
            name: buffer[layout.offsets[name] : layout.offsets[name] + layout.lengths[name]]
            for name in _segments(self.num_kv_groups, self.recurrent)
        }
        planned = (decode_plan_views(seg, layout.lengths["rec_snap_slot"])
                   if self.recurrent and layout.lengths["rec_meta"] else None)
        attn = PagedAttentionMetadata(
            slot_mapping=seg["slots"],
            seq_lens=seg["seq_lens"],
            query_start_loc=seg["query_start"],
            tile_request=seg["tile_request"],
            tile_query_start=seg["tile_query_start"],
            block_tables=seg["table"],
            block_table_stride=seg["table_stride"],
            num_tiles=layout.num_tiles,
            decode_only=layout.decode_only,
            max_seq_len=layout.max_seq_len,
        )
        group_attn = [] if self.num_kv_groups == 1 else [attn] + [
            replace(attn, slot_mapping=seg[slots_name], block_tables=seg[table_name])
            for slots_name, table_name in self._groups[1:]
        ]
        return StepInputs(seg["ids"], seg["positions"], seg["sample_rows"], attn, group_attn,
                          planned)

    def _host_buffer(self, size: int) -> np.ndarray:
        if self._uploaded is not None:
            self._uploaded.synchronize()
            self._uploaded = None
        if self._host.numel() < size:
            capacity = max(size, 2 * self._host.numel(), 1 << 16)
            self._host = torch.empty(capacity, dtype=torch.int32, pin_memory=self._pin)
            self._host_np = self._host.numpy()
        return self._host_np

"""Batch-invariant paged attention in torch ops: fixed query tiles, fixed key chunks.

The fallback of the C kernel (`c_kernel`) where that cannot be built, and
the CPU-invariant attention off the CPU (`attention_backend="torch"` on CUDA); it
keeps the same promise at several times the cost.

A query's output must not depend on whether it comes from a full prefill, a
chunk of one or a decode step, nor on the other requests in the step. So every
matmul here has one shape whatever the step: queries go in tiles of
`query_tile` consecutive tokens of one request (padded with a zero row), all
query heads of a KV head stacked, `[tile * group, head_dim]`; keys go in chunks
of `key_chunk` absolute positions (chunk c holds positions [c * key_chunk,
(c + 1) * key_chunk) of the request, whatever the block size).

A sliding window masks the keys before each query's window and starts at the
first chunk any tile's window reaches (keys no query of a tile sees read the
null block); soft-capping maps each score elementwise. Softmax is exact and
two-pass in float32: the row maximum over all chunks and the head's sink logit, if
any (a max does not depend on order), then `exp(s - max)` per chunk, the chunk sums
(then the sink's `exp(sink - max)`)
and `p @ v` added chunk by chunk in increasing order. A chunk beyond a query's
position is fully masked: it adds exact zeros, so a tile that reads more chunks
(a later query shares it) leaves the earlier query's bits alone. A tile reads
only the chunks its last query needs; tiles are sorted by that count, so the
tiles reading chunk c are a prefix and every per-chunk tensor is a view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrecover.ops.interface import RotaryKernel
from kvrecover.ops.reference.attention_metadata import (
    AttentionMetadata,
    PerStepPlan,
    write_step_kv,
)
from kvrecover.ops.reference.rotary import RotateThenAttend, reference_rotary

QUERY_TILE = 4  # tokens per query tile: decode pads 1 to this
KEY_CHUNK = 64  # keys per chunk; a multiple of 32 keeps exp on the vector path


@dataclass
class TilePlan:
    """Where one step's query tiles read and write; built once per step, used by every layer."""

    row_index: torch.Tensor  # [N * tile] row of q for each tile row (T = the zero row)
    active_tiles: list[int]  # active_tiles[c]: the first so many tiles read key chunk c
    chunk_slots: list[torch.Tensor]  # [active * key_chunk] cache slots of chunk c, per tile
    chunk_masks: list[torch.Tensor]  # [active, 1, tile * group, key_chunk] True = masked
    output_rows: torch.Tensor  # [T] tile row holding each query row's output


class CpuInvariantAttention(RotateThenAttend):
    """Paged attention whose per-query bits do not depend on batch or chunking (see module);
    `attend` rotates with `rotate` (the backend's rotary op) first."""

    name = "cpu_invariant"

    def __init__(
        self, query_tile: int = QUERY_TILE, key_chunk: int = KEY_CHUNK,
        rotate: RotaryKernel = reference_rotary,
    ) -> None:
        super().__init__(rotate)
        for field, value in (("query_tile", query_tile), ("key_chunk", key_chunk)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")
        self.query_tile = query_tile
        self.key_chunk = key_chunk
        self._plans: PerStepPlan[dict[int | None, TilePlan]] = PerStepPlan()

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int | None = None, softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend (over the last `window`
        positions only, unless None; scores soft-capped at `softcap`, unless None; each
        head's softmax with its `sinks` logit, unless None); returns [T, Hq, D]."""
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        group = num_heads // num_kv_heads
        key_cache, value_cache = write_step_kv(kv_cache, meta.slot_mapping, key, value)
        plans = self._plans.get(meta, dict)  # one tile plan per window in this step
        plan = plans.get(window)
        if plan is None:
            plan = plans[window] = build_tile_plan(meta, group, kv_cache.shape[2],
                                                   self.query_tile, self.key_chunk, window)
        tile, chunk = self.query_tile, self.key_chunk
        rows = tile * group
        num_tiles = plan.row_index.shape[0] // tile

        padded = query.new_zeros(num_tokens + 1, num_heads, head_dim, dtype=torch.float32)
        padded[:num_tokens] = query
        padded.mul_(scale)
        # [N, tile, Hkv, group, D] -> [N, Hkv, tile * group, D]: one KV head's query rows.
        queries = (
            padded.index_select(0, plan.row_index)
            .view(num_tiles, tile, num_kv_heads, group, head_dim)
            .transpose(1, 2)
            .reshape(num_tiles, num_kv_heads, rows, head_dim)
        )
        scores = []
        row_max: torch.Tensor | None = None
        for active, slots, mask in zip(plan.active_tiles, plan.chunk_slots, plan.chunk_masks):
            keys = _as_float_heads(key_cache.index_select(0, slots), active, chunk)
            chunk_scores = torch.matmul(queries[:active], keys.transpose(-1, -2))
            if softcap is not None:  # elementwise: the row's bits stay its own
                chunk_scores = chunk_scores.div_(softcap).tanh_().mul_(softcap)
            chunk_scores.masked_fill_(mask, float("-inf"))
            chunk_max = chunk_scores.amax(-1)
            if row_max is None:
                row_max = chunk_max
            else:
                row_max[:active] = torch.maximum(row_max[:active], chunk_max)
            scores.append(chunk_scores)
        if row_max is None:
            raise ValueError("a tile plan with no key chunks: every query attends to itself")
        sink_rows = None
        if sinks is not None:  # row r of a KV head's tile is query head r % group
            sink_rows = sinks.float().view(num_kv_heads, 1, group).expand(-1, tile, -1)
            sink_rows = sink_rows.reshape(1, num_kv_heads, rows)
            row_max = torch.maximum(row_max, sink_rows)

        out = queries.new_zeros(num_tiles, num_kv_heads, rows, head_dim)
        denominator = queries.new_zeros(num_tiles, num_kv_heads, rows)
        for active, slots, chunk_scores in zip(plan.active_tiles, plan.chunk_slots, scores):
            probs = chunk_scores.sub_(row_max[:active].unsqueeze(-1)).exp_()
            denominator[:active] += probs.sum(-1)
            values = _as_float_heads(value_cache.index_select(0, slots), active, chunk)
            out[:active] += torch.matmul(probs, values)
        if sink_rows is not None:
            denominator += (sink_rows - row_max).exp_()
        out.div_(denominator.unsqueeze(-1))
        out = out.view(num_tiles, num_kv_heads, tile, group, head_dim).transpose(1, 2)
        out = out.reshape(num_tiles * tile, num_heads, head_dim)
        return out.index_select(0, plan.output_rows).to(query.dtype)


def _as_float_heads(gathered: torch.Tensor, tiles: int, chunk: int) -> torch.Tensor:
    """[tiles * chunk, Hkv, D] cache rows -> contiguous float32 [tiles, Hkv, chunk, D]
    in one copy that moves whole D-rows (a transposing copy would be several times slower)."""
    heads = gathered.view(tiles, chunk, *gathered.shape[1:]).transpose(1, 2)
    return heads.to(torch.float32, memory_format=torch.contiguous_format)


def build_tile_plan(
    meta: AttentionMetadata, group: int, block_size: int, query_tile: int, key_chunk: int,
    window: int | None = None,
) -> TilePlan:
    """Cut each request's new tokens into query tiles and list the key chunks they read
    (seen through a sliding `window`: from the first chunk any tile's window reaches,
    the keys before a tile's earliest window start read from the null block)."""
    device = meta.slot_mapping.device
    query_lens = torch.tensor(meta.query_lens)
    seq_lens = torch.tensor(meta.seq_lens)
    num_tokens = int(query_lens.sum())
    tiles_per_request = (query_lens + query_tile - 1) // query_tile
    tile_request = torch.repeat_interleave(torch.arange(len(meta.query_lens)), tiles_per_request)
    first_tile = torch.cumsum(tiles_per_request, 0) - tiles_per_request
    tile_in_request = torch.arange(tile_request.shape[0]) - first_tile[tile_request]
    row_in_request = tile_in_request[:, None] * query_tile + torch.arange(query_tile)[None, :]
    valid = row_in_request < query_lens[tile_request][:, None]
    first_row = (torch.cumsum(query_lens, 0) - query_lens)[tile_request]
    row_index = torch.where(valid, first_row[:, None] + row_in_request, num_tokens)
    start = (seq_lens - query_lens)[tile_request]
    # Padding rows sit at position 0: they attend to key 0 only and are dropped.
    positions = torch.where(valid, start[:, None] + row_in_request, 0)
    chunks_needed = positions.amax(1) // key_chunk + 1
    order = torch.sort(chunks_needed, descending=True, stable=True).indices
    tile_request, row_index, positions = tile_request[order], row_index[order], positions[order]
    chunks_needed = chunks_needed[order]

    max_chunks = int(chunks_needed[0])
    width = max_chunks * key_chunk
    tables = meta.block_tables.to(device="cpu", dtype=torch.int64)
    key_positions = torch.arange(width)
    block_of_key = (key_positions // block_size).clamp(max=tables.shape[1] - 1)
    slots = tables[:, block_of_key] * block_size + key_positions % block_size
    # Keys past a request's context read the null block: masked, and never stale memory.
    slots = torch.where(key_positions[None, :] < seq_lens[:, None], slots, 0)
    tile_slots = slots[tile_request]
    first_chunk = 0
    if window is not None:
        # Padding rows take the tile's last position instead: position 0 may lie before
        # the tile's window. The first row then has the tile's earliest window start.
        positions = torch.where(valid[order], positions, positions.amax(1, keepdim=True))
        window_start = (positions[:, 0] - window + 1).clamp(min=0)
        # Keys no query of the tile sees read the null block: masked, never stale memory.
        tile_slots = torch.where(key_positions[None, :] < window_start[:, None], 0, tile_slots)
        first_chunk = int(window_start.min()) // key_chunk
    head_positions = positions.repeat_interleave(group, dim=1)  # [N, tile * group]
    active_tiles, chunk_slots, chunk_masks = [], [], []
    for c in range(first_chunk, max_chunks):
        active = int((chunks_needed > c).sum())
        key_positions = torch.arange(c * key_chunk, (c + 1) * key_chunk)
        active_tiles.append(active)
        chunk_slots.append(
            tile_slots[:active, c * key_chunk : (c + 1) * key_chunk].reshape(-1).to(device)
        )
        masked = key_positions[None, None, :] > head_positions[:active, :, None]
        if window is not None:
            masked |= key_positions[None, None, :] <= head_positions[:active, :, None] - window
        chunk_masks.append(masked.unsqueeze(1).to(device))
    flat_rows = row_index.reshape(-1)
    output_rows = torch.empty(num_tokens, dtype=torch.int64)
    is_query = flat_rows < num_tokens
    output_rows[flat_rows[is_query]] = torch.arange(flat_rows.shape[0])[is_query]
    return TilePlan(
        row_index=flat_rows.to(device),
        active_tiles=active_tiles,
        chunk_slots=chunk_slots,
        chunk_masks=chunk_masks,
        output_rows=output_rows.to(device),
    )

"""Per-step attention metadata: what each attention backend reads besides q, k, v.

KV cache layout per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 keys, 1 values). A token at position `p` of a request lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

`AttentionMetadata` serves the torch reference backend and the CPU-invariant
kernels (`ops.cpu.attention`); it is a plain record, built by the step inputs
(`ops.reference.step_inputs`). The torch backend reads the cache block by block: each
step gathers whole blocks (one row copy per block, not per token) only for
requests that have a cached context; fresh prompts attend to their own new keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, ParamSpec, TypeVar

import torch

PlanT = TypeVar("PlanT")
BuildArgs = ParamSpec("BuildArgs")


@dataclass
class ContextGather:
    """Which cache blocks a group of requests reads, gathered block by block.

    `blocks` holds `num_blocks` block ids per request, from the first block its
    queries can see (0 without a sliding window; the one holding the earliest
    query's window start with one) on (0, the null block, past each request's
    context); the gathered keys are [requests, num_blocks * block_size, Hkv, D],
    cut to `common_len` keys when set. `stale_rows` are the flat rows of that
    tensor that no query reads inside a gathered block: past a request's context
    in its last block (another request's leftovers, or a failed load's NaNs) and
    before the earliest window start in its first block, zeroed before attending
    so that masking them is exact. `mask` is [requests, 1, queries, num_blocks *
    block_size], True where a query may attend.
    """

    blocks: torch.Tensor  # [requests * num_blocks] int64
    stale_rows: torch.Tensor  # [S] int64
    mask: torch.Tensor | None  # None: every kept key is visible to every query
    num_blocks: int
    # All requests keep this many gathered keys (equal context lengths and first
    # blocks): the gathered keys are cut to it (nothing past a context is kept), and
    # decodes whose window starts at the first gathered key need no mask at all.
    common_len: int | None = None


@dataclass
class PrefillGroup:
    """Requests of one step with more than one new token, attended together.

    Rows `[row_start, row_start + num_requests * query_len)` of the step. A
    `fresh` group (nothing cached before the new tokens) attends causally to its
    own new keys and needs no cache read (causally, or through `fresh_mask`
    [1, 1, query_len, query_len] where a sliding window is shorter than the
    prompt); otherwise it is one request whose new tokens follow a cached
    prefix, read through `context`.
    """

    row_start: int
    num_requests: int
    query_len: int
    context: ContextGather | None = None
    fresh_mask: torch.Tensor | None = None

    @property
    def row_end(self) -> int:
        return self.row_start + self.num_requests * self.query_len


def write_step_kv(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the step's new `key` and `value` [T, Hkv, D] into their cache slots
    (`slot_mapping` [T]); returns the key and value caches seen as [slots, Hkv, D]."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    key_cache.index_copy_(0, slot_mapping, key)
    value_cache.index_copy_(0, slot_mapping, value)
    return key_cache, value_cache


class PerStepPlan(Generic[PlanT]):
    """What an attention kernel derives from a step's metadata, built once per step:
    every layer of a step receives the same metadata object, so `get` builds anew
    only when it is handed another one."""

    def __init__(self) -> None:
        self._meta: object | None = None
        self._plan: PlanT | None = None

    def get(self, meta: object, build: Callable[BuildArgs, PlanT],
            *args: BuildArgs.args, **kwargs: BuildArgs.kwargs) -> PlanT:
        """The plan of `meta`'s step: `build(*args, **kwargs)` unless `meta` built the last one."""
        if self._plan is None or self._meta is not meta:
            self._plan = build(*args, **kwargs)
            self._meta = meta
        return self._plan


@dataclass
class AttentionMetadata:
    """Per-step indexing for the torch reference attention (built once per step).

    The batch holds B requests; request b contributes `query_lens[b]` new tokens
    (flattened into T rows) attending to its first `seq_lens[b]` cached tokens.
    Requests with one new token form the decode group (`decode_rows`, read through
    `decode_context`); the others form `prefills`. A layer with a sliding window
    reads `with_window(window)`: the same step with contexts that start at the
    first block the window reaches.
    """

    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V goes to
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor  # [B, max_blocks] (int32), padded with 0
    decode_rows: slice | torch.Tensor | None  # rows of the decode group, a slice when contiguous
    decode_context: ContextGather | None
    prefills: list[PrefillGroup]
    window: int | None = None  # the sliding window these contexts are cut to
    # What `build` was called with, and the windowed views built from it.
    build_args: tuple[list[int], list[list[int]], int, torch.device] | None = field(
        default=None, repr=False)
    windowed: dict[int, AttentionMetadata] = field(default_factory=dict, repr=False)

    def with_window(self, window: int | None) -> AttentionMetadata:
        """This step for a layer that sees the last `window` positions only (itself for
        None); built once per step and window, then shared by the layers of that window."""
        if window is None or window == self.window:
            return self
        view = self.windowed.get(window)
        if view is None:
            if self.build_args is None:
                raise ValueError("with_window needs metadata made by AttentionMetadata.build")
            num_computed, block_tables, block_size, device = self.build_args
            view = AttentionMetadata.build(num_computed, self.query_lens, block_tables,
                                           block_size, device, window=window)
            self.windowed[window] = view
        return view

    @classmethod
    def build(
        cls,
        num_computed: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        window: int | None = None,
    ) -> AttentionMetadata:
        """Index tensors for requests whose new tokens start at `num_computed[b]`, for
        layers that see the last `window` positions (None: every position)."""
        seq_lens = [c + q for c, q in zip(num_computed, query_lens)]
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.zeros(len(query_lens), max_blocks, dtype=torch.int64)
        for b, table in enumerate(block_tables):
            tables[b, : len(table)] = torch.tensor(table, dtype=torch.int64)
        query_lens_t = torch.tensor(query_lens)
        starts = torch.tensor(num_computed)
        row_starts = (torch.cumsum(query_lens_t, 0) - query_lens_t).tolist()
        # Slot of every new token: its block's id times block_size plus its offset.
        positions = torch.repeat_interleave(starts, query_lens_t) + torch.arange(
            int(query_lens_t.sum())
        ) - torch.repeat_interleave(torch.tensor(row_starts), query_lens_t)
        request_of_row = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens_t)
        slot_mapping = tables[request_of_row, positions // block_size] * block_size
        slot_mapping += positions % block_size

        decode = [b for b, q in enumerate(query_lens) if q == 1]
        decode_rows: slice | torch.Tensor | None = None
        decode_context = None
        if decode:
            rows = [row_starts[b] for b in decode]
            contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
            decode_rows = (slice(rows[0], rows[0] + len(rows)) if contiguous
                           else torch.tensor(rows, device=device))
            decode_context = _context(
                tables[decode], [seq_lens[b] for b in decode],
                torch.tensor([[seq_lens[b] - 1] for b in decode]),
                block_size, device, window,
            )
        prefills: list[PrefillGroup] = []
        for b, query_len in enumerate(query_lens):
            if query_len == 1:
                continue
            if num_computed[b] == 0:
                last = prefills[-1] if prefills else None
                if (last is not None and last.context is None and last.query_len == query_len
                        and last.row_end == row_starts[b]):
                    last.num_requests += 1  # equal fresh prompts side by side: one batch
                else:
                    prefills.append(PrefillGroup(row_starts[b], 1, query_len,
                                                 fresh_mask=_fresh_mask(query_len, window,
                                                                        device)))
                continue
            query_positions = torch.arange(num_computed[b], seq_lens[b])[None, :]
            context = _context(tables[b : b + 1], [seq_lens[b]], query_positions, block_size,
                               device, window)
            prefills.append(PrefillGroup(row_starts[b], 1, query_len, context))
        return cls(
            slot_mapping=slot_mapping.to(device),
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=tables.to(device=device, dtype=torch.int32),
            decode_rows=decode_rows,
            decode_context=decode_context,
            prefills=prefills,
            window=window,
            build_args=(num_computed, block_tables, block_size, device),
        )


def _fresh_mask(query_len: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """A fresh prompt's mask under a sliding window, None where causal is the same."""
    if window is None or query_len <= window:
        return None
    positions = torch.arange(query_len)
    distance = positions[:, None] - positions[None, :]  # query minus key
    return ((distance >= 0) & (distance < window))[None, None].to(device)


def _context(
    tables: torch.Tensor, seq_lens: list[int], query_positions: torch.Tensor,
    block_size: int, device: torch.device, window: int | None = None,
) -> ContextGather:
    """The `ContextGather` of requests with these block tables, context lengths and
    query positions ([requests, queries]), seen through a sliding `window` (None:
    from position 0)."""
    lengths = torch.tensor(seq_lens)
    end_block = -(-lengths // block_size)
    if window is None:
        first_key = torch.zeros_like(lengths)
    else:  # the earliest query's window start: no query reads a key before it
        first_key = (query_positions.amin(1) - window + 1).clamp(min=0)
    first_block = first_key // block_size
    num_blocks = int((end_block - first_block).max())
    padded_len = num_blocks * block_size
    block_index = first_block[:, None] + torch.arange(num_blocks)[None, :]
    used = block_index < end_block[:, None]
    # Blocks past a request's context read the zeroed null block, never stale memory.
    blocks = torch.where(used, tables.gather(1, block_index.clamp(max=tables.shape[1] - 1)), 0)
    key_pos = first_block[:, None] * block_size + torch.arange(padded_len)[None, :]  # absolute
    before_window = key_pos < first_key[:, None]
    past_context = (key_pos >= lengths[:, None]) & (key_pos < (end_block * block_size)[:, None])
    flat = torch.arange(len(seq_lens))[:, None] * padded_len + torch.arange(padded_len)[None, :]
    if min(seq_lens) == max(seq_lens) and bool((first_block == first_block[0]).all()):
        common_len = seq_lens[0] - int(first_block[0]) * block_size
        key_pos = key_pos[:, :common_len]
        stale_rows = flat[before_window].to(device)  # past the context: cut off
    else:
        stale_rows, common_len = flat[before_window | past_context].to(device), None
    visible = key_pos[:, None, :] <= query_positions[:, :, None]
    if window is not None:
        visible &= key_pos[:, None, :] > query_positions[:, :, None] - window
    mask: torch.Tensor | None = visible
    if common_len is not None and query_positions.shape[1] == 1 and not bool(before_window.any()):
        mask = None  # decodes of equal length: each sees exactly the kept keys
    return ContextGather(
        blocks=blocks.reshape(-1).to(device),
        stale_rows=stale_rows,
        mask=None if mask is None else mask.unsqueeze(1).to(device),
        num_blocks=num_blocks,
        common_len=common_len,
    )

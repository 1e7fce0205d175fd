"""Reference paged attention in plain torch (CPU and GPU), read block by block.

Reads the cache through `AttentionMetadata` (see `attention_metadata.py` for the
cache layout and the groups a step is split into):
- fresh prompts attend causally to their own new keys: no cache read at all;
- decodes and chunks after a cached prefix gather their context's whole blocks
  (one contiguous row per block: a per-token gather costs ~10x more) and attend
  with a mask;
- a layer with a sliding window reads its step's `with_window` view: the
  gather starts at the first block the window reaches, the blocks before it
  are never read, and fresh prompts longer than the window get a band mask;
- GQA never expands K/V: SDPA's `enable_gqa`, and for decodes the query heads of
  one KV head become that head's query rows;
- soft-capping and attention sinks (which SDPA cannot do) run as explicit ops,
  rounded as Hugging Face's eager attention rounds;
- a step goes to `native_kernel` where one is given (on the CPU the C kernel, which
  reads the cache in place: `ops.backend` passes it) if it vectorizes the head shape
  and, for a step with prefills, runs them in query tiles (float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvrecover.ops.interface import RotaryKernel
from kvrecover.ops.reference.attention_metadata import (
    AttentionMetadata,
    ContextGather,
    PrefillGroup,
    write_step_kv,
)
from kvrecover.ops.reference.rotary import RotateThenAttend, reference_rotary

if TYPE_CHECKING:
    from kvrecover.ops.cpu.attention.c_kernel import NativeInvariantAttention


class TorchPagedAttention(RotateThenAttend):
    """Reference paged attention in plain torch (CPU and GPU); `attend` rotates with
    `rotate` (the backend's rotary op) first. `native_kernel` (optional) takes every
    step for head shapes it vectorizes, a step with prefills only where it tiles them
    (`tiled`): its `forward` writes the step's K/V and attends (`ops.backend` gives the
    CPU's C kernel: a decode read in place runs 1.6-1.7x faster than the block gather
    plus SDPA in a 30-layer float32 step, a prefill in query tiles 2-3x faster than
    SDPA; bench/NOTES.md, issue 28 goal 6)."""

    name = "torch"

    def __init__(self, rotate: RotaryKernel = reference_rotary,
                 native_kernel: NativeInvariantAttention | None = None) -> None:
        super().__init__(rotate)
        self._workspace = _GatherWorkspace()
        self._native_kernel = native_kernel

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int | None = None, softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend (over the last `window`
        positions only, unless None; scores soft-capped at `softcap`, unless None; with
        each head's `sinks` logit in its softmax, unless None); returns [T, Hq, D]."""
        native = self._native_kernel
        if (native is not None
                and native.vectorized(query.shape[1], key.shape[1], query.shape[2])
                and (not meta.prefills or native.tiled(query.dtype, query.shape[2]))):
            return native.forward(query, key, value, kv_cache, meta, scale, window, softcap,
                                  sinks)
        meta = meta.with_window(window)
        scoring = _Scoring(scale, softcap, sinks)
        write_step_kv(kv_cache, meta.slot_mapping, key, value)
        num_rows = query.shape[0]
        rows, context = meta.decode_rows, meta.decode_context  # both None without decodes
        if (context is not None and not meta.prefills and isinstance(rows, slice)
                and rows.stop - rows.start == num_rows):
            return _decode(query, kv_cache, context, scoring, self._workspace)
        if len(meta.prefills) == 1 and rows is None:
            group = meta.prefills[0]
            if group.row_end - group.row_start == num_rows:
                return _prefill(query, key, value, kv_cache, group, scoring, self._workspace)
        out = query.new_empty(query.shape)
        if rows is not None and context is not None:
            if isinstance(rows, slice):
                out[rows] = _decode(query[rows], kv_cache, context, scoring, self._workspace)
            else:
                decoded = _decode(
                    query.index_select(0, rows), kv_cache, context, scoring, self._workspace,
                )
                out.index_copy_(0, rows, decoded)
        for group in meta.prefills:
            span = slice(group.row_start, group.row_end)
            out[span] = _prefill(
                query[span], key[span], value[span], kv_cache, group, scoring, self._workspace,
            )
        return out


@dataclass(frozen=True)
class _Scoring:
    """How one layer scores keys: the scale, the soft-cap and the sinks (None: none)."""

    scale: float
    softcap: float | None
    sinks: torch.Tensor | None


_GATHER_BYTES = 8 << 20  # K + V gathered per decode slice on the CPU: stays in the cache


class _GatherWorkspace:
    """Two growing buffers that every layer's context gather writes into.

    A fresh tensor per layer would be worse than the copy itself: glibc maps
    allocations above 32 MB afresh each time, and faulting in those pages made a
    decode step at batch 32 x 1100 tokens take 1.2 s instead of ~0.1 s. The views
    handed out live only until the next gather (the same layer's SDPA reads them).
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def take(self, which: int, rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers[which]
        if (buffer is None or buffer.numel() < rows * width or buffer.dtype != like.dtype
                or buffer.device != like.device):
            buffer = torch.empty(rows * width, dtype=like.dtype, device=like.device)
            self._buffers[which] = buffer
        return buffer[: rows * width].view(rows, width)


def _gather(
    kv_cache: torch.Tensor, context: ContextGather, num_kv_heads: int, head_dim: int,
    workspace: _GatherWorkspace, first: int = 0, stop: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the group's requests `[first, stop)`: [requests, num_blocks *
    block_size, Hkv, D] (cut to `context.common_len` when set), views of `workspace`."""
    num_cache_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    padded_len = context.num_blocks * block_size
    stop = context.blocks.numel() // context.num_blocks if stop is None else stop
    blocks = context.blocks[first * context.num_blocks : stop * context.num_blocks]
    stale = context.stale_rows
    if stale.numel() and (first or stop * padded_len <= int(stale[-1])):
        # The stale rows are sorted: keep those of these requests, relative to `first`.
        lo, hi = torch.searchsorted(stale, stale.new_tensor([first, stop]) * padded_len).tolist()
        stale = stale[lo:hi] - first * padded_len
    shape = (-1, padded_len, num_kv_heads, head_dim)
    gathered = []
    for which, cache in enumerate((kv_cache[0], kv_cache[1])):
        flat_cache = cache.view(num_cache_blocks, -1)
        rows = workspace.take(which, blocks.numel(), flat_cache.shape[1], cache)
        torch.index_select(flat_cache, 0, blocks, out=rows)
        if stale.numel():
            rows.view(-1, num_kv_heads * head_dim).index_fill_(0, stale, 0.0)
        gathered.append(rows.view(shape)[:, : context.common_len])
    return gathered[0], gathered[1]


def _decode(
    query: torch.Tensor, kv_cache: torch.Tensor, context: ContextGather, scoring: _Scoring,
    workspace: _GatherWorkspace,
) -> torch.Tensor:
    """Attention for one new token per request.

    The query heads that share a KV head go to SDPA as that head's query rows,
    so each key is read once per KV head (no GQA expansion, no query padding).
    On the CPU the requests go in slices whose gathered K/V fit `_GATHER_BYTES`:
    SDPA then reads them from the cache the gather just wrote (a whole batch
    32 x 1040 tokens took 3x longer, read back from memory).
    """
    batch = query.shape[0]
    per_request = 2 * context.num_blocks * kv_cache[0, 0].numel() * kv_cache.element_size()
    step = batch if kv_cache.device.type != "cpu" else max(1, _GATHER_BYTES // per_request)
    if step >= batch:
        return _decode_slice(query, kv_cache, context, scoring, workspace, 0, batch)
    out = query.new_empty(query.shape)
    for first in range(0, batch, step):
        stop = min(batch, first + step)
        out[first:stop] = _decode_slice(
            query[first:stop], kv_cache, context, scoring, workspace, first, stop
        )
    return out


def _decode_slice(
    query: torch.Tensor, kv_cache: torch.Tensor, context: ContextGather, scoring: _Scoring,
    workspace: _GatherWorkspace, first: int, stop: int,
) -> torch.Tensor:
    """`_decode` for the group's requests `[first, stop)` (the rows of `query`)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    keys, values = _gather(kv_cache, context, num_kv_heads, head_dim, workspace, first, stop)
    mask = None if context.mask is None else context.mask[first:stop]
    group = num_heads // num_kv_heads
    sinks = None if scoring.sinks is None else scoring.sinks.view(num_kv_heads, group, 1)
    out = _attention(
        query.reshape(batch, num_kv_heads, group, head_dim),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        mask,  # [B, 1, 1, L] or None: broadcast over the grouped query rows
        scoring, sinks,
    )
    return out.reshape(batch, num_heads, head_dim)


def _prefill(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
    group: PrefillGroup, scoring: _Scoring, workspace: _GatherWorkspace,
) -> torch.Tensor:
    """Attention for a `PrefillGroup`'s rows of q, k and v; returns [rows, Hq, D]."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key.shape[1]
    shape = (group.num_requests, group.query_len)
    if group.context is None:
        # Nothing cached before the new tokens: the mask is plain causal (SDPA
        # skips the blocks above the diagonal) unless a sliding window cuts it.
        keys = key.reshape(*shape, num_kv_heads, head_dim)
        values = value.reshape(*shape, num_kv_heads, head_dim)
        mask = group.fresh_mask
    else:
        keys, values = _gather(kv_cache, group.context, num_kv_heads, head_dim, workspace)
        mask = group.context.mask
    out = _attention(
        query.reshape(*shape, num_heads, head_dim).transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        mask, scoring, None if scoring.sinks is None else scoring.sinks.view(num_heads, 1, 1),
        is_causal=mask is None,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.transpose(1, 2).reshape(-1, num_heads, head_dim)


def _attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
    scoring: _Scoring, sinks: torch.Tensor | None, is_causal: bool = False,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA over [..., heads, rows, D]; with a soft-cap or `sinks` (the layer's, shaped to
    broadcast over [..., heads, rows, 1]), the same in explicit ops (SDPA can do neither),
    rounded as Hugging Face's eager attention rounds: the sink joins each row as one more
    logit whose probability is dropped after the softmax."""
    scale, softcap = scoring.scale, scoring.softcap
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                              is_causal=is_causal, enable_gqa=enable_gqa)
    if enable_gqa:
        group = query.shape[-3] // keys.shape[-3]
        keys = keys.repeat_interleave(group, dim=-3)
        values = values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        rows, cols = scores.shape[-2:]
        mask = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        sink_column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        combined = torch.cat((scores, sink_column), dim=-1)
        probs = torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1].to(query.dtype)
    return torch.matmul(probs, values)

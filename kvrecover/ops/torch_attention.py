"""Reference paged attention in plain torch (CPU and GPU), read block by block.

Reads the cache through `AttentionMetadata` (see `attention_metadata.py` for the
cache layout and the groups a step is split into):
- fresh prompts attend causally to their own new keys: no cache read at all;
- decodes and chunks after a cached prefix gather their context's whole blocks
  (one contiguous row per block: a per-token gather costs ~10x more) and attend
  with a mask;
- GQA never expands K/V: SDPA's `enable_gqa`, and for decodes the query heads of
  one KV head become that head's query rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrecover.ops.attention_metadata import AttentionMetadata, ContextGather, PrefillGroup


class TorchPagedAttention:
    """Reference paged attention in plain torch (CPU and GPU)."""

    name = "torch"
    fuses_rotary = False  # the model rotates q and k (ops.rotary) before `forward`

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend; returns [T, Hq, D]."""
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)
        num_rows = query.shape[0]
        rows = meta.decode_rows
        if not meta.prefills and isinstance(rows, slice) and rows.stop - rows.start == num_rows:
            return _decode(query, kv_cache, meta.decode_context, scale)
        if len(meta.prefills) == 1 and rows is None:
            group = meta.prefills[0]
            if group.row_end - group.row_start == num_rows:
                return _prefill(query, key, value, kv_cache, group, scale)
        out = query.new_empty(query.shape)
        if rows is not None:
            if isinstance(rows, slice):
                out[rows] = _decode(query[rows], kv_cache, meta.decode_context, scale)
            else:
                decoded = _decode(query.index_select(0, rows), kv_cache, meta.decode_context, scale)
                out.index_copy_(0, rows, decoded)
        for group in meta.prefills:
            span = slice(group.row_start, group.row_end)
            out[span] = _prefill(query[span], key[span], value[span], kv_cache, group, scale)
        return out


def _gather(
    kv_cache: torch.Tensor, context: ContextGather, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of a group's context: [requests, num_blocks * block_size, Hkv, D]."""
    num_cache_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    shape = (-1, context.num_blocks * block_size, num_kv_heads, head_dim)
    gathered = []
    for cache in (kv_cache[0], kv_cache[1]):
        rows = cache.view(num_cache_blocks, -1).index_select(0, context.blocks)
        if context.stale_rows.numel():
            rows.view(-1, num_kv_heads * head_dim).index_fill_(0, context.stale_rows, 0.0)
        gathered.append(rows.view(shape)[:, : context.common_len])
    return gathered[0], gathered[1]


def _decode(
    query: torch.Tensor, kv_cache: torch.Tensor, context: ContextGather, scale: float
) -> torch.Tensor:
    """Attention for one new token per request.

    The query heads that share a KV head go to SDPA as that head's query rows,
    so each key is read once per KV head (no GQA expansion, no query padding).
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    keys, values = _gather(kv_cache, context, num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        query.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=context.mask,  # [B, 1, 1, L] or None: broadcast over the grouped query rows
        scale=scale,
    )
    return out.reshape(batch, num_heads, head_dim)


def _prefill(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
    group: PrefillGroup, scale: float,
) -> torch.Tensor:
    """Attention for a `PrefillGroup`'s rows of q, k and v; returns [rows, Hq, D]."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key.shape[1]
    shape = (group.num_requests, group.query_len)
    if group.context is None:
        # Nothing cached before the new tokens: the mask is plain causal, and SDPA
        # skips the blocks above the diagonal.
        keys = key.reshape(*shape, num_kv_heads, head_dim)
        values = value.reshape(*shape, num_kv_heads, head_dim)
        mask = None
    else:
        keys, values = _gather(kv_cache, group.context, num_kv_heads, head_dim)
        mask = group.context.mask
    out = F.scaled_dot_product_attention(
        query.reshape(*shape, num_heads, head_dim).transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        is_causal=mask is None,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.transpose(1, 2).reshape(-1, num_heads, head_dim)

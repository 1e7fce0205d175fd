"""Reference paged attention in plain torch (CPU and GPU): gather, mask, SDPA.

Reads the cache through `AttentionMetadata` (see `attention_metadata.py` for the
cache layout and the slot arithmetic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrecover.ops.attention_metadata import AttentionMetadata


class TorchPagedAttention:
    """Reference paged attention in plain torch (CPU and GPU): gather, mask, SDPA."""

    name = "torch"
    fuses_rotary = False  # the model rotates q and k (ops.rotary) before `forward`

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend; returns [T, Hq, D]."""
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
        value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
        key_cache.index_copy_(0, meta.slot_mapping, key)
        value_cache.index_copy_(0, meta.slot_mapping, value)
        # index_select on the flat slots is several times faster than advanced indexing.
        slots = meta.key_slots.reshape(-1)
        context_shape = (*meta.key_slots.shape, num_kv_heads, head_dim)
        keys = key_cache.index_select(0, slots).view(context_shape)  # [B, Lmax, Hkv, D]
        values = value_cache.index_select(0, slots).view(context_shape)
        batch, max_query = meta.query_index.shape
        if max_query == 1:
            return self._decode(query, keys, values, meta.mask, scale)
        padded = query.shape[0] != batch * max_query  # else the rows are already [B, Qmax]
        if padded:
            padded_query = F.pad(query, (0, 0, 0, 0, 0, 1))[meta.query_index]  # [B, Qmax, Hq, D]
        else:
            padded_query = query.reshape(batch, max_query, *query.shape[1:])
        # Nothing cached before the new tokens: the mask is plain causal (padding rows
        # aside, whose output is dropped), and SDPA skips the blocks above the diagonal.
        causal = meta.seq_lens == meta.query_lens
        out = F.scaled_dot_product_attention(
            padded_query.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=None if causal else meta.mask,
            scale=scale,
            is_causal=causal,
            enable_gqa=query.shape[1] != num_kv_heads,
        )
        out = out.transpose(1, 2).reshape(batch * max_query, out.shape[1], head_dim)
        return out[meta.output_index] if padded else out

    @staticmethod
    def _decode(
        query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention for one new token per request (T == B, no padding rows).

        The query heads that share a KV head go to SDPA as that head's query rows,
        so each key is read once per KV head (no GQA expansion) and no query
        padding or output gather is needed.
        """
        batch, num_heads, head_dim = query.shape
        num_kv_heads = keys.shape[2]
        out = F.scaled_dot_product_attention(
            query.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,  # [B, 1, 1, Lmax]: broadcast over the grouped query rows
            scale=scale,
        )
        return out.reshape(batch, num_heads, head_dim)

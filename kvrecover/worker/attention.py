"""Paged attention: the reference torch backend and the per-step metadata it reads.

KV cache layout per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 keys, 1 values). A token at position `p` of a request lives in slot
`block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step indexing shared by all layers (built once by the model runner).

    The batch holds B requests; request b contributes `query_lens[b]` new tokens
    (flattened into T rows) attending to its first `seq_lens[b]` cached tokens.
    """

    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V goes to
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor  # [B, max_blocks] (int32), padded with 0
    # Reference-backend indexing, all [B, ...] padded:
    query_index: torch.Tensor  # [B, Qmax] rows of q (T = padding row)
    key_slots: torch.Tensor  # [B, Lmax] cache slots of each request's context
    mask: torch.Tensor  # [B, 1, Qmax, Lmax] True where a query may attend
    output_index: torch.Tensor  # [T] flat row of each token in the padded output

    @classmethod
    def build(
        cls,
        num_computed: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Index tensors for requests whose new tokens start at `num_computed[b]`."""
        batch = len(query_lens)
        seq_lens = [c + q for c, q in zip(num_computed, query_lens)]
        max_query, max_seq = max(query_lens), max(seq_lens)
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.zeros(batch, max_blocks, dtype=torch.int64)
        for b, table in enumerate(block_tables):
            tables[b, : len(table)] = torch.tensor(table, dtype=torch.int64)
        query_lens_t = torch.tensor(query_lens)
        starts = torch.tensor(num_computed)
        # Flat token layout: request b's tokens are rows [offset_b, offset_b + query_len_b).
        offsets = torch.cumsum(query_lens_t, 0) - query_lens_t
        q_pos = torch.arange(max_query)
        valid_q = q_pos[None, :] < query_lens_t[:, None]
        total = int(query_lens_t.sum())
        query_index = torch.where(valid_q, offsets[:, None] + q_pos[None, :], total)
        token_positions = starts[:, None] + q_pos[None, :]  # [B, Qmax]
        # Padding rows attend to key 0 only so no row of the softmax is empty.
        token_positions = torch.where(valid_q, token_positions, 0)
        key_pos = torch.arange(max_seq)
        mask = key_pos[None, None, :] <= token_positions[:, :, None]
        block_of_key = (key_pos // block_size).clamp(max=max_blocks - 1)
        key_slots = tables[:, block_of_key] * block_size + key_pos % block_size
        # Keys past a request's length read the (zeroed) null block, never stale memory.
        key_slots = torch.where(key_pos[None, :] < torch.tensor(seq_lens)[:, None], key_slots, 0)
        flat_rows = (torch.arange(batch)[:, None] * max_query + q_pos[None, :])[valid_q]
        slot_mapping = key_slots.gather(1, token_positions.clamp(max=max_seq - 1))[valid_q]
        return cls(
            slot_mapping=slot_mapping.to(device),
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=tables.to(device=device, dtype=torch.int32),
            query_index=query_index.to(device),
            key_slots=key_slots.to(device),
            mask=mask.unsqueeze(1).to(device),
            output_index=flat_rows.to(device),
        )


class TorchPagedAttention:
    """Reference paged attention in plain torch (CPU and GPU): gather, mask, SDPA."""

    name = "torch"
    fuses_rotary = False  # the model rotates q and k (ops.rotary) before `forward`

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
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

"""Per-step attention metadata: what each attention backend reads besides q, k, v.

KV cache layout per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 keys, 1 values). A token at position `p` of a request lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

`AttentionMetadata` serves the torch reference backend, `PagedAttentionMetadata`
the Triton kernels; both are plain records (no Triton import), built by the
worker's step inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


@dataclass
class PagedAttentionMetadata:
    """Per-step device indexing for `TritonPagedAttention` (views of one int32 buffer).

    `block_table_stride` is a one-element tensor holding the row stride of
    `block_tables`, read by the kernel so that a CUDA graph can replay with a
    different table width. `decode_only` steps (one new token per request) use
    the split-context kernel; `max_seq_len` bounds its segment count.
    """

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    seq_lens: torch.Tensor  # [B] context length after this step
    query_start_loc: torch.Tensor  # [B + 1] first row of each request in the flat batch
    tile_request: torch.Tensor  # [num_tiles] request of each query tile
    tile_query_start: torch.Tensor  # [num_tiles] first query (within the request) of each tile
    block_tables: torch.Tensor  # flat [B * stride] block ids
    block_table_stride: torch.Tensor  # [1]
    num_tiles: int
    decode_only: bool = False
    max_seq_len: int = 0

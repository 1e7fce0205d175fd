"""Per-step attention metadata of the Triton kernels (a plain record: no Triton import).

The KV cache layout is the reference one (`ops.reference.attention_metadata`);
the packed step inputs (`ops.triton.step_inputs`) build this record as views of
one uploaded int32 buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

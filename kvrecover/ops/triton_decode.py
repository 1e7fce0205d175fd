"""Decode attention with one program per (token, segment) over all of its KV heads.

A cache slot holds every KV head of one token side by side (1 KB for 8 heads of 64
bf16 values); the per-head decode kernel (`triton_attention`) reads 128 bytes of each
slot per program. Here a program reads whole slots: its key tile has one row per
(key, KV head), and one 2-D dot scores every query head against every row, with the
rows of other KV heads masked to -inf (the extra products cost nothing on a
memory-bound step). States are stored in the per-head kernel's layout, so its
combine kernel merges them. Default mode only (`DecodeKernelConfig.all_heads`): the
arithmetic differs from the prefill kernel's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrecover.ops.attention_metadata import PagedAttentionMetadata


@triton.jit
def _all_heads_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    seq_lens_ptr, query_start_ptr, tile_request_ptr, block_tables_ptr, block_table_stride_ptr,
    scale_log2, q_stride_t, q_stride_h, slot_stride, max_segments, num_splits,
    NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, ROWS: tl.constexpr, KV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SEGMENT: tl.constexpr, PAGE: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    request = tl.load(tile_request_ptr + tile)
    token = tl.load(query_start_ptr + request).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + request)
    rows = tl.arange(0, ROWS)  # query heads
    row_valid = rows < NUM_HEADS
    row_kv = rows // GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token * q_stride_t + rows[:, None] * q_stride_h + dims[None, :],
                mask=row_valid[:, None], other=0.0)
    COLS: tl.constexpr = BLOCK_N * KV_PAD
    cols = tl.arange(0, COLS)  # (key, KV head): a key's heads are neighbours in the slot
    col_kv = cols % KV_PAD
    col_key = cols // KV_PAD
    same_head = row_kv[:, None] == col_kv[None, :]
    table = block_tables_ptr + request.to(tl.int64) * tl.load(block_table_stride_ptr)
    num_segments = tl.cdiv(seq_len, SEGMENT)
    states = (tile * KV_HEADS + row_kv).to(tl.int64) * max_segments * GROUP_PAD + rows % GROUP
    for segment in range(tl.program_id(1), num_segments, num_splits):
        seg_start = segment * SEGMENT
        seg_end = tl.minimum(seg_start + SEGMENT, seq_len)  # decode: every key is visible
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        for start in range(seg_start, seg_end, BLOCK_N):
            keys = start + col_key
            key_valid = (keys < seg_end) & (col_kv < KV_HEADS)
            block = tl.load(table + keys // PAGE, mask=key_valid, other=0)
            slots = block.to(tl.int64) * PAGE + keys % PAGE
            kv = (slots * slot_stride + col_kv * HEAD_DIM)[:, None] + dims[None, :]
            k = tl.load(k_cache_ptr + kv, mask=key_valid[:, None], other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(same_head & key_valid[None, :], scores * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(scores - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv, mask=key_valid[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        base = states + segment * GROUP_PAD
        tl.store(part_m_ptr + base, m_i, mask=row_valid)
        tl.store(part_l_ptr + base, l_i, mask=row_valid)
        tl.store(part_acc_ptr + base[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_valid[:, None])


def all_heads_states(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: PagedAttentionMetadata, scale: float,
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], max_segments: int, num_splits: int,
    block_n: int, segment: int, num_warps: int, num_stages: int,
) -> None:
    """Write every decode token's segment states into `parts` (max, sum, output), in the
    per-head decode kernel's layout."""
    _, num_heads, head_dim = query.shape
    kv_heads = kv_cache.shape[3]
    group = num_heads // kv_heads
    part_m, part_l, part_acc = parts
    _all_heads_kernel[(meta.num_tiles, num_splits)](
        query, kv_cache[0], kv_cache[1], part_m, part_l, part_acc,
        meta.seq_lens, meta.query_start_loc, meta.tile_request, meta.block_tables,
        meta.block_table_stride, scale * 1.4426950408889634, query.stride(0), query.stride(1),
        kv_cache.stride(2), max_segments, num_splits,
        NUM_HEADS=num_heads, KV_HEADS=kv_heads, GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group), ROWS=max(16, triton.next_power_of_2(num_heads)),
        KV_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim, BLOCK_N=block_n,
        SEGMENT=segment, PAGE=kv_cache.shape[2], IEEE=query.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )

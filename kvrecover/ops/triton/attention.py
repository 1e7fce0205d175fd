"""Paged attention on the GPU (Triton): prefill, chunked prefill and decode.

The work is cut into query tiles: a tile is up to `BLOCK_Q` consecutive new
tokens of one request times all query heads of one KV head (GQA packing, so a
KV tile is loaded once for its whole head group). A request's context is read
through its block table in `SEGMENT`-key segments aligned to position 0; each
segment's online-softmax state is computed from scratch in `BLOCK_N`-key steps,
and the states are merged in segment order. Prefill programs do the merging
themselves; decode steps spread the segments over many programs (split context,
for bandwidth) and merge them with the same arithmetic, either in a second kernel
or, outside the batch-invariant mode, in the last of a token's programs to finish
(`ops.arrival`: one launch fewer per layer).

Sliding windows (`WINDOW`, a compile-time constant per layer; 0 = full): a query
at position q sees keys q - WINDOW < k <= q. A program starts at the segment and
the `BLOCK_N` step holding its earliest query's window start and never loads a
key, value or block-table entry before it (those blocks may be freed, reused or
hold NaNs); inside the boundary step the band is masked. Soft-capping
(`SOFTCAP`, a compile-time constant; 0 = none) maps each score s = scale * q.k
to SOFTCAP * tanh(s / SOFTCAP) before the mask. Attention sinks (`SINKS`, a
compile-time flag; the logits in `sinks_ptr`, one per query head): once a row's
segments are merged, its sink is merged in as one more state (max = the sink, sum
1, no value: `_merge_sink`), just before the division.

Batch invariance: a query row's arithmetic depends only on its own query, its
context and the fixed constants (BLOCK_N, SEGMENT). Key steps or segments past
the row's causal limit are fully masked, and a fully masked step or segment
changes nothing bit for bit (the max stays, the rescale factor is exactly 1, the
added terms are exactly 0), so a token gives the same result whatever tile,
chunk or batch it is computed in, decode included. The same holds for steps and
segments before a row's window (a leading fully masked step leaves the state at
its start values, so a tile whose earlier queries read more of them changes no
bit of a later query), and steps and segments stay aligned to position 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvrecover.ops.interface import RotaryTables, StepInputSpec
from kvrecover.ops.triton.arrival import arrival_counters
from kvrecover.ops.triton.fused_ops import rotary_store_
from kvrecover.ops.triton.metadata import PagedAttentionMetadata
from kvrecover.ops.triton.step_inputs import StepInputBuilder

PREFILL_BLOCK_M = 64  # query rows per program (BLOCK_Q tokens x the padded head group)
DECODE_BLOCK_M = 64
BLOCK_N = 64  # keys per inner step
SEGMENT = 256  # keys per softmax segment: the fixed unit of the reduction order
PREFILL_WARPS, DECODE_WARPS = 4, 4
NUM_STAGES = 2
TARGET_PROGRAMS = 1056  # decode programs to keep 132 SMs busy (about 8 each)


@dataclass(frozen=True)
class DecodeKernelConfig:
    """Tiles of the split-context decode kernel.

    The batch-invariant mode keeps `INVARIANT_DECODE` (the prefill kernel's
    tiles, so a token's bits do not depend on being decoded or prefilled);
    the default mode may use smaller, faster ones.
    """

    block_m: int  # query rows per program (one token x the padded head group, padded)
    block_n: int  # keys per inner step; divides `segment`
    num_warps: int
    num_stages: int
    # Keys per softmax segment. Only SEGMENT keeps decode bit-identical to prefill.
    segment: int = SEGMENT
    # Programs to aim for when spreading segments (split-context decode); at least
    # one per (token, KV head), at most one per segment.
    target_programs: int = TARGET_PROGRAMS
    # The last program of a (token, KV head) to finish merges the segments itself
    # (an arrival counter) instead of a second kernel: the same merges, in order.
    fused_combine: bool = False
    # Each program merges its own segments as it goes and leaves one state, so the last
    # program merges one state per program, not per segment (a long context has hundreds
    # of segments: merged one by one, they were a serial tail of every decode step).
    # Other merges than the combine kernel's: default mode only, with `fused_combine`.
    merge_in_program: bool = False


INVARIANT_DECODE = DecodeKernelConfig(DECODE_BLOCK_M, BLOCK_N, DECODE_WARPS, NUM_STAGES)
# The smallest tile tl.dot takes: a decode tile holds one token, the rest is padding.
FAST_DECODE = DecodeKernelConfig(16, 64, 4, 2, fused_combine=True, merge_in_program=True)


def tile_tokens(group_size: int, block_m: int = PREFILL_BLOCK_M) -> int:
    """Query tokens per prefill tile for `group_size` query heads per KV head."""
    return max(1, block_m // triton.next_power_of_2(group_size))


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr, key_stride, value_stride, value_offset,
    KV_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < KV_DIM
    key = tl.load(key_ptr + token * key_stride + cols, mask=mask)
    value = tl.load(value_ptr + token * value_stride + cols, mask=mask)
    tl.store(cache_ptr + slot * KV_DIM + cols, key, mask=mask)
    tl.store(cache_ptr + value_offset + slot * KV_DIM + cols, value, mask=mask)


@triton.jit
def _segment(
    q, query_pos, k_cache_ptr, v_cache_ptr, table, kv_base, slot_stride,
    seg_start, seg_end, key_lo, scale_log2, PAGE: tl.constexpr,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Online-softmax state (max, sum, unnormalised output) of keys [seg_start, seg_end);
    with a `WINDOW`, of those from `key_lo` (the earliest row's window start) on."""
    dims = tl.arange(0, HEAD_DIM)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    first = seg_start
    if WINDOW > 0:
        # The steps wholly before the window are skipped (computed, they would be
        # fully masked leading steps: no bit of the state would change).
        first = tl.maximum(seg_start, key_lo - key_lo % BLOCK_N)
    for start in range(first, seg_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_valid = keys < seg_end
        if WINDOW > 0:
            key_valid = key_valid & (keys >= key_lo)  # never loaded: may be NaN or freed
        block = tl.load(table + keys // PAGE, mask=key_valid, other=0)
        slots = block.to(tl.int64) * PAGE + keys % PAGE
        kv_offsets = slots[:, None] * slot_stride + kv_base + dims[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=key_valid[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        visible = keys[None, :] <= query_pos[:, None]
        if WINDOW > 0:
            visible = visible & (keys[None, :] > query_pos[:, None] - WINDOW)
        if SOFTCAP > 0:  # scale_log2 / log2(e) = scale: cap scale * q.k, then to base 2
            scores = libdevice.tanh(scores * (scale_log2 / (SOFTCAP * 1.4426950408889634)))
            scores = scores * (SOFTCAP * 1.4426950408889634)
        else:
            scores = scores * scale_log2
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=key_valid[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _merge(m_a, l_a, acc_a, m_b, l_b, acc_b):
    """Combine two online-softmax states; both kernels merge segments with this, in order."""
    m = tl.maximum(m_a, m_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    scale_a = tl.math.exp2(m_a - m_safe)
    scale_b = tl.math.exp2(m_b - m_safe)
    return m, l_a * scale_a + l_b * scale_b, acc_a * scale_a[:, None] + acc_b * scale_b[:, None]


@triton.jit
def _merge_sink(m_i, l_i, acc, sinks_ptr, head, mask):
    """A merged state with each row's sink logit (base e, at `sinks_ptr + head`) merged in:
    a key whose probability joins the sum and whose value is zero."""
    sink = tl.load(sinks_ptr + head, mask=mask, other=float("-inf")).to(tl.float32)
    sink = sink * 1.4426950408889634  # to base 2, as the scores
    return _merge(m_i, l_i, acc, sink, tl.where(mask, 1.0, 0.0), tl.zeros_like(acc))


@triton.jit
def _store_state(part_m_ptr, part_l_ptr, part_acc_ptr, base, rows, dims, first,
                 HEAD_DIM: tl.constexpr, m_s, l_s, acc_s):
    """Store a decode token's online-softmax state (rows `first`) at state row `base`."""
    tl.store(part_m_ptr + base + rows, m_s, mask=first)
    tl.store(part_l_ptr + base + rows, l_s, mask=first)
    tl.store(part_acc_ptr + (base + rows)[:, None] * HEAD_DIM + dims[None, :], acc_s,
             mask=first[:, None])


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    seq_lens_ptr, query_start_ptr, tile_request_ptr, tile_query_start_ptr,
    block_tables_ptr, block_table_stride_ptr, counter_ptr, sinks_ptr,
    scale_log2, q_stride_t, q_stride_h, out_stride_t, out_stride_h, slot_stride,
    max_segments, num_splits, PAGE: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SEGMENT: tl.constexpr,
    SPLIT: tl.constexpr, FUSED_COMBINE: tl.constexpr, PROGRAM_STATES: tl.constexpr,
    IEEE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = tl.load(tile_request_ptr + tile)
    query_begin = tl.load(tile_query_start_ptr + tile)
    row_begin = tl.load(query_start_ptr + request)
    query_len = tl.load(query_start_ptr + request + 1) - row_begin
    seq_len = tl.load(seq_lens_ptr + request)
    context = seq_len - query_len

    ROWS: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, ROWS)
    query_index = query_begin + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (query_index < query_len) & (rows % GROUP_PAD < GROUP)
    query_pos = context + query_index
    dims = tl.arange(0, HEAD_DIM)
    q_rows = (row_begin + query_index).to(tl.int64) * q_stride_t + head * q_stride_h
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_valid[:, None], other=0.0)

    kv_end = tl.minimum(context + query_begin + BLOCK_Q, seq_len)
    if WINDOW > 0:  # the tile's first query has its earliest window start
        key_lo = tl.maximum(context + query_begin - WINDOW + 1, 0)
        first_segment = key_lo // SEGMENT
    else:
        key_lo = 0
        first_segment = 0
    table = block_tables_ptr + request.to(tl.int64) * tl.load(block_table_stride_ptr)
    kv_base = kv_head * HEAD_DIM
    if SPLIT:
        # Decode: this program computes segments split, split + num_splits, ... and stores
        # each one's state (with PROGRAM_STATES, their merge: one state per program); the
        # combine kernel (or, with FUSED_COMBINE, the last of the token's programs to
        # finish) merges the states in order.
        num_segments = tl.cdiv(kv_end, SEGMENT)
        state_rows = (tile * tl.num_programs(1) + kv_head).to(tl.int64) * max_segments
        first = rows < GROUP_PAD  # a decode tile has one token: rows [0, GROUP_PAD)
        m_p = tl.full([ROWS], float("-inf"), tl.float32)
        l_p = tl.zeros([ROWS], tl.float32)
        acc_p = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        for segment in range(first_segment + tl.program_id(2), num_segments, num_splits):
            seg_start = segment * SEGMENT
            m_s, l_s, acc_s = _segment(
                q, query_pos, k_cache_ptr, v_cache_ptr, table, kv_base, slot_stride,
                seg_start, tl.minimum(seg_start + SEGMENT, kv_end), key_lo, scale_log2, PAGE,
                ROWS, HEAD_DIM, BLOCK_N, IEEE, WINDOW, SOFTCAP,
            )
            if PROGRAM_STATES:
                m_p, l_p, acc_p = _merge(m_p, l_p, acc_p, m_s, l_s, acc_s)
            else:
                _store_state(part_m_ptr, part_l_ptr, part_acc_ptr,
                             (state_rows + segment) * GROUP_PAD, rows, dims, first, HEAD_DIM,
                             m_s, l_s, acc_s)
        if PROGRAM_STATES:  # a program without segments leaves an empty state
            _store_state(part_m_ptr, part_l_ptr, part_acc_ptr,
                         (state_rows + tl.program_id(2)) * GROUP_PAD, rows, dims, first,
                         HEAD_DIM, m_p, l_p, acc_p)
        if FUSED_COMBINE:
            # Publish this program's states (barrier, then a release at GPU scope); the
            # num_splits-th arrival merges every state in order and re-arms the counter.
            tl.debug_barrier()
            counter = counter_ptr + tile * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                m_i = tl.full([ROWS], float("-inf"), tl.float32)
                l_i = tl.zeros([ROWS], tl.float32)
                acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
                if PROGRAM_STATES:
                    state_lo = 0
                    state_hi = num_splits
                else:
                    state_lo = first_segment
                    state_hi = num_segments
                for state in range(state_lo, state_hi):
                    base = (state_rows + state) * GROUP_PAD
                    m_s = tl.load(part_m_ptr + base + rows, mask=first, other=float("-inf"),
                                  cache_modifier=".cg")
                    l_s = tl.load(part_l_ptr + base + rows, mask=first, other=0.0,
                                  cache_modifier=".cg")
                    acc_s = tl.load(
                        part_acc_ptr + (base + rows)[:, None] * HEAD_DIM + dims[None, :],
                        mask=first[:, None], other=0.0, cache_modifier=".cg",
                    )
                    m_i, l_i, acc = _merge(m_i, l_i, acc, m_s, l_s, acc_s)
                if SINKS:
                    m_i, l_i, acc = _merge_sink(m_i, l_i, acc, sinks_ptr, head,
                                                rows % GROUP_PAD < GROUP)
                out = acc / l_i[:, None]
                out_rows = (row_begin + query_index).to(tl.int64) * out_stride_t + head * out_stride_h
                tl.store(out_ptr + out_rows[:, None] + dims[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=(row_valid & first)[:, None])
                tl.atomic_xchg(counter, 0)
    else:
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        for seg_start in range(first_segment * SEGMENT, kv_end, SEGMENT):
            m_s, l_s, acc_s = _segment(
                q, query_pos, k_cache_ptr, v_cache_ptr, table, kv_base, slot_stride,
                seg_start, tl.minimum(seg_start + SEGMENT, kv_end), key_lo, scale_log2, PAGE,
                ROWS, HEAD_DIM, BLOCK_N, IEEE, WINDOW, SOFTCAP,
            )
            m_i, l_i, acc = _merge(m_i, l_i, acc, m_s, l_s, acc_s)
        if SINKS:
            m_i, l_i, acc = _merge_sink(m_i, l_i, acc, sinks_ptr, head, rows % GROUP_PAD < GROUP)
        out = acc / l_i[:, None]
        out_rows = (row_begin + query_index).to(tl.int64) * out_stride_t + head * out_stride_h
        tl.store(
            out_ptr + out_rows[:, None] + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )


@triton.jit
def _combine_segments_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, seq_lens_ptr, query_start_ptr,
    tile_request_ptr, sinks_ptr, out_stride_t, out_stride_h, max_segments,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, SEGMENT: tl.constexpr,
    WINDOW: tl.constexpr, SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = tl.load(tile_request_ptr + tile)
    row = tl.load(query_start_ptr + request)
    seq_len = tl.load(seq_lens_ptr + request)
    num_segments = tl.cdiv(seq_len, SEGMENT)
    if WINDOW > 0:  # the decoded token (position seq_len - 1) sees keys from seq_len - WINDOW
        first_segment = tl.maximum(seq_len - WINDOW, 0) // SEGMENT
    else:
        first_segment = 0
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    state_rows = (tile * tl.num_programs(1) + kv_head).to(tl.int64) * max_segments
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for segment in range(first_segment, num_segments):
        base = (state_rows + segment) * GROUP_PAD
        m_s = tl.load(part_m_ptr + base + rows)
        l_s = tl.load(part_l_ptr + base + rows)
        acc_s = tl.load(part_acc_ptr + (base + rows)[:, None] * HEAD_DIM + dims[None, :])
        m_i, l_i, acc = _merge(m_i, l_i, acc, m_s, l_s, acc_s)
    head = kv_head * GROUP + rows
    if SINKS:
        m_i, l_i, acc = _merge_sink(m_i, l_i, acc, sinks_ptr, head, rows < GROUP)
    out = acc / l_i[:, None]
    out_rows = row.to(tl.int64) * out_stride_t + head * out_stride_h
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows < GROUP)[:, None])


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write `key`/`value` [T, Hkv, D] (token rows may be strided) into their cache slots."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kv_dim = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, key.stride(0), value.stride(0), kv_cache.stride(0),
        KV_DIM=kv_dim, BLOCK=triton.next_power_of_2(kv_dim), num_warps=4,
    )


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: PagedAttentionMetadata, scale: float,
    num_stages: int = NUM_STAGES, prefill_block_m: int = PREFILL_BLOCK_M,
    prefill_warps: int = PREFILL_WARPS, decode: DecodeKernelConfig = INVARIANT_DECODE,
    window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of `query` [T, Hq, D] over the paged cache (over the last `window`
    positions only, unless None; scores soft-capped at `softcap`, unless None; with each
    head's `sinks` [Hq] logit in its softmax, unless None); returns [T, Hq, D].

    `prefill_block_m` must match the tiles of `meta` (see `tile_tokens`).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if meta.num_tiles == 0:
        return out
    split = meta.decode_only
    block_m = decode.block_m if split else prefill_block_m
    segment = decode.segment if split else SEGMENT
    max_segments = triton.cdiv(max(meta.max_seq_len, 1), segment) if split else 1
    fused = split and decode.fused_combine
    counters = out
    if fused:
        counters = arrival_counters("attention", meta.num_tiles * num_kv_heads, query.device)
    num_splits = 1
    if split:
        num_splits = min(
            max_segments, triton.cdiv(decode.target_programs, meta.num_tiles * num_kv_heads)
        )
        if window is not None:  # a window spans at most this many segments
            num_splits = min(num_splits, triton.cdiv(window, segment) + 1)
        states = meta.num_tiles * num_kv_heads * max_segments * group_pad
        part_m = torch.empty(states, dtype=torch.float32, device=query.device)
        part_l = torch.empty(states, dtype=torch.float32, device=query.device)
        part_acc = torch.empty((states, head_dim), dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_acc = out
    # Fused multiply-adds are off so that the decode combine kernel and the prefill
    # kernel round every merge step identically (batch invariance).
    _paged_attention_kernel[(meta.num_tiles, num_kv_heads, num_splits)](
        query, kv_cache[0], kv_cache[1], out, part_m, part_l, part_acc,
        meta.seq_lens, meta.query_start_loc, meta.tile_request, meta.tile_query_start,
        meta.block_tables, meta.block_table_stride, counters,
        out if sinks is None else sinks,  # `out`: a pointer SINKS=False never reads
        scale * 1.4426950408889634, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(2), max_segments, num_splits, PAGE=kv_cache.shape[2],
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=max(1, block_m // group_pad), HEAD_DIM=head_dim,
        BLOCK_N=decode.block_n if split else BLOCK_N, SEGMENT=segment, SPLIT=split,
        FUSED_COMBINE=fused, PROGRAM_STATES=fused and decode.merge_in_program,
        IEEE=query.dtype == torch.float32, WINDOW=window or 0,
        SOFTCAP=float(softcap or 0.0), SINKS=sinks is not None,
        num_warps=decode.num_warps if split else prefill_warps,
        num_stages=decode.num_stages if split else num_stages,
        enable_fp_fusion=False,
    )
    if split and not fused:
        _combine_segments_kernel[(meta.num_tiles, num_kv_heads)](
            out, part_m, part_l, part_acc, meta.seq_lens, meta.query_start_loc, meta.tile_request,
            out if sinks is None else sinks, out.stride(0), out.stride(1), max_segments,
            GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, SEGMENT=segment,
            WINDOW=window or 0, SINKS=sinks is not None, num_warps=1, enable_fp_fusion=False,
        )
    return out


class TritonPagedAttention:
    """The GPU attention backend: Triton KV store plus the paged attention kernel; `attend`
    rotates q and k and stores the key in one kernel.

    `batch_invariant` keeps decode on the prefill tiles.
    """

    name = "triton"

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant
        self.decode_config = INVARIANT_DECODE if batch_invariant else FAST_DECODE

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        rotary: RotaryTables | None, positions: torch.Tensor, kv_cache: torch.Tensor,
        meta: PagedAttentionMetadata, scale: float, *, window: int | None = None,
        softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The `ops.interface.PagedAttention` entry point: with `rotary`, one kernel
        rotates `query` (in place) and the key into the cache (`key` itself stays as it
        was); without, `forward`. `window`: the layer's sliding window, `softcap` its
        score soft-cap, `sinks` its per-head sink logits (None: none)."""
        if rotary is None:
            return self.forward(query, key, value, kv_cache, meta, scale, window, softcap, sinks)
        rotary_store_(rotary, positions, query, key, value, kv_cache, meta.slot_mapping)
        return self._attend(query, kv_cache, meta, scale, window, softcap, sinks)

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: PagedAttentionMetadata, scale: float,
        window: int | None = None, softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's (rotated) K/V into the cache, then attend (over the last
        `window` positions only, unless None; scores soft-capped at `softcap`, unless
        None; with the heads' `sinks` logits, unless None); returns [T, Hq, D]."""
        store_kv(key, value, kv_cache, meta.slot_mapping)
        return self._attend(query, kv_cache, meta, scale, window, softcap, sinks)

    def _attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: PagedAttentionMetadata,
        scale: float, window: int | None, softcap: float | None, sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        return paged_attention(query, kv_cache, meta, scale, decode=self.decode_config,
                               window=window, softcap=softcap, sinks=sinks)


def step_input_builder(spec: StepInputSpec) -> StepInputBuilder:
    """The packed step inputs whose query tiles match this kernel's prefill tiles."""
    group = spec.num_attention_heads // spec.num_kv_heads
    return StepInputBuilder(spec.block_size, tile_tokens(group), spec.device, spec.max_model_len,
                            spec.num_kv_groups, spec.recurrent)

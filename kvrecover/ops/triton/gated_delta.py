"""The gated delta rule and the short causal convolution of Gated DeltaNet, in Triton,
batched over every request of a step (one launch per layer and kernel).

Same contract as the torch reference (`ops/reference/gated_delta.py`): chunks of C
rows aligned to absolute positions, each computed by one fixed-shape tile program
whatever part of it the step brings (rows not yet seen are zero padding, rows seen
by an earlier step come from the request's tail buffers), the recurrent state
advanced only at complete chunks. One program owns one (request, value head,
block of value dims) and walks the request's chunks in order; its tile shapes
depend on C and the head dims only, never on the grid or on how many rows are
real, so a row's output bits and the state at a chunk boundary do not depend on
the chunking, the batch's other requests, or decode vs prefill. Within a chunk
the UT transform runs as in the reference: the unit lower-triangular system
`I + (beta k k^T) * decay` is inverted by forward substitution on the tile (the
flash-linear-attention approach), every matmul in IEEE float32.

The step's requests reach the kernels as index tensors (`StepPlan`: rows, positions,
slots, checkpoint table; `ops/triton/step_plan.py`), built once per step and shared by
every layer, or prebuilt in a CUDA graph's static buffer.

A head's value blocks share its query, key, decay and beta tails: each program reads
the tail rows before the step's position in its first chunk, and the step's last,
partial chunk leaves new rows there. When that chunk is the first one, its new rows lie
after the rows read, so the first value block writes them; when the step spans more
chunks, the last program of the head to arrive writes them (an arrival counter,
`ops/triton/arrival.py`), after every other one has read the old rows. (The programs
of a head need not run at once: a value block that started late read rows an earlier
one had overwritten, 5e-3 off on the GPU under 8 warps, and in the interpreter.)
Import only where Triton exists (CUDA machines, or `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrecover.ops.interface import DeltaRuleState
from kvrecover.ops.reference.gated_delta import L2_NORM_EPS
from kvrecover.ops.triton.arrival import arrival_counters
from kvrecover.ops.triton.step_plan import StepPlan, build_plan

__all__ = ["StepPlan", "build_plan", "gated_delta_rule_batch"]

MAX_VALUE_BLOCK = 32  # value dims per program (bounds the state tile in registers)
NUM_WARPS = 8  # 1.9-6.7x faster than 4 on the H200, same error (bench/bench_gated_delta.py, NOTES)


@triton.jit
def _load_rows(new_ptr, tail_ptr, new_rows, tail_rows, new_stride, tail_stride, cols, from_new,
               from_tail, col_mask):
    """A [rows, cols] tile whose rows come from the step's inputs or the tail buffer."""
    new = tl.load(new_ptr + new_rows[:, None] * new_stride + cols[None, :],
                  mask=from_new[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    tail = tl.load(tail_ptr + tail_rows[:, None] * tail_stride + cols[None, :],
                   mask=from_tail[:, None] & col_mask[None, :], other=0.0)
    return new, tail


# Not specialised on the batch size: one compiled kernel (one set of bits) for every batch.
@triton.jit(do_not_specialize=["num_requests"])
def _gated_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, out_ptr,
    state_ptr, q_tail_ptr, k_tail_ptr, v_tail_ptr, g_tail_ptr, b_tail_ptr, checkpoint_ptr,
    meta_ptr, snap_begin_ptr, snap_pos_ptr, snap_slot_ptr, counter_ptr, num_requests,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    g_stride_t, b_stride_t, scale, eps,
    C: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr,
    DV: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    key_head = head // GROUP
    first_row = tl.load(meta_ptr + request).to(tl.int64)
    count = tl.load(meta_ptr + num_requests + request)
    position = tl.load(meta_ptr + 2 * num_requests + request)
    slot = tl.load(meta_ptr + 3 * num_requests + request).to(tl.int64)
    snap = tl.load(snap_begin_ptr + request)
    snap_end = tl.load(snap_begin_ptr + request + 1)

    rows = tl.arange(0, BC)
    dk = tl.arange(0, BK)
    dv = v_block * BV + tl.arange(0, BV)
    dk_mask, dv_mask = dk < DK, dv < DV
    causal = rows[:, None] >= rows[None, :]
    strictly_lower = rows[:, None] > rows[None, :]
    identity = (rows[:, None] == rows[None, :]).to(tl.float32)

    state_base = state_ptr + (slot * HV + head) * DK * DV
    state_offsets = dk[:, None] * DV + dv[None, :]
    state_mask = dk_mask[:, None] & dv_mask[None, :]
    state = tl.load(state_base + state_offsets, mask=state_mask, other=0.0)

    tail_row = slot * C + rows  # row of the tail buffers [slots, C, HV, ...]
    offset = position % C
    total = offset + count
    for chunk in range(0, tl.cdiv(total, C)):
        local = chunk * C + rows  # index in (tail rows, then the step's rows)
        valid = (rows < C) & (local < total)
        from_tail = valid & (local < offset)
        from_new = valid & (local >= offset)
        new_row = first_row + (local - offset)
        q_new, q_old = _load_rows(q_ptr + key_head * q_stride_h, q_tail_ptr + head * DK,
                                  new_row, tail_row, q_stride_t, HV * DK, dk, from_new,
                                  from_tail, dk_mask)
        k_new, k_old = _load_rows(k_ptr + key_head * k_stride_h, k_tail_ptr + head * DK,
                                  new_row, tail_row, k_stride_t, HV * DK, dk, from_new,
                                  from_tail, dk_mask)
        v_new_in, v_old = _load_rows(v_ptr + head * v_stride_h, v_tail_ptr + head * DV,
                                     new_row, tail_row, v_stride_t, HV * DV, dv, from_new,
                                     from_tail, dv_mask)
        # l2-normalised (q also scaled) as the reference; tail rows were stored so.
        q_new = q_new * tl.math.rsqrt(tl.sum(q_new * q_new, axis=1) + eps)[:, None] * scale
        k_new = k_new * tl.math.rsqrt(tl.sum(k_new * k_new, axis=1) + eps)[:, None]
        q = tl.where(from_tail[:, None], q_old, q_new)
        k = tl.where(from_tail[:, None], k_old, k_new)
        v = tl.where(from_tail[:, None], v_old, v_new_in)
        g = tl.where(from_tail, tl.load(g_tail_ptr + tail_row * HV + head, mask=from_tail,
                                        other=0.0),
                     tl.load(g_ptr + new_row * g_stride_t + head, mask=from_new,
                             other=0.0).to(tl.float32))
        beta = tl.where(from_tail, tl.load(b_tail_ptr + tail_row * HV + head, mask=from_tail,
                                           other=0.0),
                        tl.load(b_ptr + new_row * b_stride_t + head, mask=from_new,
                                other=0.0).to(tl.float32))

        cum = tl.cumsum(g, axis=0)
        # exp only of the causal differences (<= 0): the others would overflow to inf.
        pairwise = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)),
                            0.0)
        k_beta = k * beta[:, None]
        system = tl.where(strictly_lower,
                          tl.dot(k_beta, tl.trans(k), input_precision="ieee") * pairwise, 0.0)
        # (I + system)^-1 by forward substitution: row i = e_i - sum_{j<i} L[i,j] row_j.
        # Rows past the chunk's real ones are zero in `system` and stay e_i, so the loop
        # stops at them (a decode step's chunk has offset + 1): the same bits, fewer steps.
        inverse = identity
        for i in range(1, tl.minimum(total - chunk * C, C)):
            pick = (rows == i)[:, None]
            coefficients = tl.sum(tl.where(pick, system, 0.0), axis=0)
            inverse = tl.where(pick, inverse - tl.sum(coefficients[:, None] * inverse, axis=0)[
                None, :], inverse)
        growth = tl.exp(cum)
        new_values = tl.dot(inverse, v * beta[:, None], input_precision="ieee")
        k_cumdecay = tl.dot(inverse, k_beta * growth[:, None], input_precision="ieee")
        v_new = new_values - tl.dot(k_cumdecay, state, input_precision="ieee")
        intra = tl.where(causal, tl.dot(q, tl.trans(k), input_precision="ieee") * pairwise, 0.0)
        out = (tl.dot(q * growth[:, None], state, input_precision="ieee")
               + tl.dot(intra, v_new, input_precision="ieee"))
        tl.store(out_ptr + (new_row[:, None] * HV + head) * DV + dv[None, :], out,
                 mask=from_new[:, None] & dv_mask[None, :])

        if chunk * C + C <= total:  # complete: advance the state past it
            last = tl.sum(tl.where(rows == C - 1, cum, 0.0), axis=0)
            decayed_key = k * tl.exp(last - cum)[:, None]
            state = state * tl.exp(last) + tl.dot(tl.trans(decayed_key), v_new,
                                                  input_precision="ieee")
            reached = position - offset + chunk * C + C
            wanted = tl.load(snap_pos_ptr + snap, mask=snap < snap_end, other=-1)
            if wanted == reached:
                target = tl.load(snap_slot_ptr + snap).to(tl.int64)
                tl.store(checkpoint_ptr + (target * HV + head) * DK * DV + state_offsets, state,
                         mask=state_mask)
                snap += 1
        else:  # the request's last, partial chunk: its new rows wait in the tails
            keep = from_new[:, None]
            tl.store(v_tail_ptr + (tail_row[:, None] * HV + head) * DV + dv[None, :], v,
                     mask=keep & dv_mask[None, :])
            writes_tails = v_block == 0
            if chunk > 0:  # the rows it leaves are rows the head's first chunks read
                tl.debug_barrier()
                counter = counter_ptr + request * HV + head
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                writes_tails = arrived == tl.num_programs(2) - 1
            if writes_tails:
                tail_qk = (tail_row[:, None] * HV + head) * DK + dk[None, :]
                tl.store(q_tail_ptr + tail_qk, q, mask=keep & dk_mask[None, :])
                tl.store(k_tail_ptr + tail_qk, k, mask=keep & dk_mask[None, :])
                tl.store(g_tail_ptr + tail_row * HV + head, g, mask=from_new)
                tl.store(b_tail_ptr + tail_row * HV + head, beta, mask=from_new)
                if chunk > 0:
                    tl.atomic_xchg(counter_ptr + request * HV + head, 0)  # re-armed
    # A padding request (0 rows) of a graphed step writes nothing: its slot may be real.
    tl.store(state_base + state_offsets, state, mask=state_mask & (count > 0))


def _pools_contiguous(states: DeltaRuleState, checkpoints: torch.Tensor | None) -> None:
    pools = [states.state, states.query_tail, states.key_tail, states.value_tail,
             states.decay_tail, states.beta_tail]
    if checkpoints is not None:
        pools.append(checkpoints)
    if not all(p.is_contiguous() and p.dtype == torch.float32 for p in pools):
        raise ValueError("the delta-rule state pools and checkpoints must be contiguous "
                         "float32 tensors (as `RecurrentStates` allocates them)")


def gated_delta_rule_batch(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
    beta: torch.Tensor, states: DeltaRuleState, plan: StepPlan, chunk_size: int,
    checkpoints: torch.Tensor | None = None,
) -> torch.Tensor:
    """`LinearAttentionKernels.gated_delta_rule_batch` for the requests of `plan`: one
    launch over (request, value head, value block)."""
    rows, num_k_heads, key_dim = query.shape
    num_v_heads, value_dim = value.shape[1], value.shape[2]
    _pools_contiguous(states, checkpoints)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    decay, beta = decay.contiguous(), beta.contiguous()
    out = torch.empty((rows, num_v_heads, value_dim), dtype=torch.float32, device=value.device)
    num_requests = plan.num_requests
    if num_requests == 0 or rows == 0:
        return out
    if plan.num_snapshots and (checkpoints is None or not checkpoints.numel()):
        raise ValueError("the step's requests ask for state checkpoints, but no checkpoint "
                         "pool was given (num_state_checkpoints > 0 allocates one)")
    block_v = min(MAX_VALUE_BLOCK, max(16, triton.next_power_of_2(value_dim)))
    checkpoint_pool = checkpoints if checkpoints is not None and checkpoints.numel() else out
    grid = (num_requests, num_v_heads, triton.cdiv(value_dim, block_v))
    counters = arrival_counters("gated_delta", num_requests * num_v_heads, value.device)
    _gated_delta_kernel[grid](
        query, key, value, decay, beta, out, states.state, states.query_tail, states.key_tail,
        states.value_tail, states.decay_tail, states.beta_tail, checkpoint_pool, plan.meta,
        plan.snapshot_begin, plan.snapshot_position, plan.snapshot_slot, counters, num_requests,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), decay.stride(0), beta.stride(0), key_dim**-0.5, L2_NORM_EPS,
        C=chunk_size, HV=num_v_heads, GROUP=num_v_heads // num_k_heads, DK=key_dim,
        DV=value_dim, BC=max(16, triton.next_power_of_2(chunk_size)),
        BK=max(16, triton.next_power_of_2(key_dim)), BV=block_v, num_warps=NUM_WARPS,
    )
    return out

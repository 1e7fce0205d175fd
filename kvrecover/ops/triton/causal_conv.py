"""The short depthwise causal convolution of Gated DeltaNet (then SiLU), in Triton, batched
over every request of a step: one launch for the outputs, one that advances the conv
states (separate so that no program reads a state another has already advanced) and
copies the conv state at each checkpoint position into its checkpoint slot.

Each output row is the same float32 sum over the same K inputs (the step's rows, or
for a request's first K - 1 rows its conv state, which holds the inputs before it in
the model dtype) in tap order, rounded once: its bits do not depend on the step's
split or batch. Import only where Triton exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrecover.ops.triton.step_plan import StepPlan

CONV_ROWS = 16  # rows per output program
CONV_CHANNELS = 128  # channels per program


@triton.jit
def _tap_inputs(x_ptr, state_ptr, first_row, slot, relative, rows_mask, channels,
                channel_mask, x_stride, D: tl.constexpr, K: tl.constexpr):
    """Inputs at `relative` rows of the request (< 0: from its conv state), float32."""
    from_x = rows_mask & (relative >= 0)
    from_state = rows_mask & (relative < 0)
    x = tl.load(x_ptr + (first_row + relative)[:, None] * x_stride + channels[None, :],
                mask=from_x[:, None] & channel_mask[None, :], other=0.0)
    old = tl.load(state_ptr + slot * D * (K - 1) + channels[None, :] * (K - 1)
                  + (relative + K - 1)[:, None],
                  mask=from_state[:, None] & channel_mask[None, :], other=0.0)
    return tl.where(from_state[:, None], old, x)


# Not specialised on the batch size: one compiled kernel (one set of bits) for every batch.
@triton.jit(do_not_specialize=["num_requests"])
def _conv_kernel(x_ptr, state_ptr, weight_ptr, out_ptr, meta_ptr, num_requests, x_stride,
                 D: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    request = tl.program_id(0)
    channels = tl.program_id(1) * BD + tl.arange(0, BD)
    rows = tl.program_id(2) * BT + tl.arange(0, BT)
    first_row = tl.load(meta_ptr + request).to(tl.int64)
    count = tl.load(meta_ptr + num_requests + request)
    slot = tl.load(meta_ptr + 3 * num_requests + request).to(tl.int64)
    channel_mask = channels < D
    rows_mask = rows < count
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for tap in tl.static_range(K):
        inputs = _tap_inputs(x_ptr, state_ptr, first_row, slot, rows + tap - (K - 1), rows_mask,
                             channels, channel_mask, x_stride, D, K).to(tl.float32)
        weight = tl.load(weight_ptr + channels * K + tap, mask=channel_mask, other=0.0)
        acc += inputs * weight.to(tl.float32)[None, :]
    out = acc / (tl.exp(-acc) + 1.0)
    tl.store(out_ptr + (first_row + rows)[:, None] * D + channels[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rows_mask[:, None] & channel_mask[None, :])


# Not specialised on the batch size: one compiled kernel (one set of bits) for every batch.
@triton.jit(do_not_specialize=["num_requests"])
def _conv_state_kernel(x_ptr, state_ptr, checkpoint_ptr, meta_ptr, snap_begin_ptr, snap_pos_ptr,
                       snap_slot_ptr, num_requests, x_stride, D: tl.constexpr, K: tl.constexpr,
                       BW: tl.constexpr, BD: tl.constexpr, SAVE: tl.constexpr):
    request = tl.program_id(0)
    channels = tl.program_id(1) * BD + tl.arange(0, BD)
    first_row = tl.load(meta_ptr + request).to(tl.int64)
    count = tl.load(meta_ptr + num_requests + request)
    slot = tl.load(meta_ptr + 3 * num_requests + request).to(tl.int64)
    channel_mask = channels < D
    width = tl.arange(0, BW)
    width_mask = width < K - 1
    state_offsets = channels[None, :] * (K - 1) + width[:, None]
    if SAVE:  # the conv state at each checkpoint position: the K - 1 inputs before it
        position = tl.load(meta_ptr + 2 * num_requests + request)
        for entry in range(tl.load(snap_begin_ptr + request),
                           tl.load(snap_begin_ptr + request + 1)):
            reached = tl.load(snap_pos_ptr + entry) - position
            saved = _tap_inputs(x_ptr, state_ptr, first_row, slot, reached - (K - 1) + width,
                                width_mask, channels, channel_mask, x_stride, D, K)
            target = tl.load(snap_slot_ptr + entry).to(tl.int64)
            tl.store(checkpoint_ptr + target * D * (K - 1) + state_offsets, saved,
                     mask=width_mask[:, None] & channel_mask[None, :])
    # The K - 1 inputs before the request's next position: relative rows count - K + 1 ...
    kept = _tap_inputs(x_ptr, state_ptr, first_row, slot, count - (K - 1) + width, width_mask,
                       channels, channel_mask, x_stride, D, K)
    tl.debug_barrier()  # every thread has read the old state before any writes it
    # A padding request (0 rows) of a graphed step writes nothing: its slot may be real.
    tl.store(state_ptr + slot * D * (K - 1) + state_offsets, kept,
             mask=width_mask[:, None] & channel_mask[None, :] & (count > 0))


def causal_conv1d_batch(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                        plan: StepPlan, checkpoints: torch.Tensor | None = None) -> torch.Tensor:
    """`LinearAttentionKernels.causal_conv1d_batch` for the requests of `plan` (the conv
    state at each of their checkpoints into that slot of `checkpoints`, unless None)."""
    rows, channels = x.shape
    width = weight.shape[-1]
    if x.stride(-1) != 1 or not conv_states.is_contiguous() or not weight.is_contiguous():
        raise ValueError("the convolution needs row-major x, a contiguous conv-state pool "
                         "and a contiguous weight")
    if conv_states.dtype != x.dtype:
        raise ValueError(f"conv states are {conv_states.dtype}, inputs {x.dtype}: the pool "
                         "must hold the model dtype")
    out = torch.empty((rows, channels), dtype=x.dtype, device=x.device)
    num_requests = plan.num_requests
    if num_requests == 0 or rows == 0:
        return out
    save = checkpoints is not None and checkpoints.numel() > 0
    if checkpoints is not None and save and (not checkpoints.is_contiguous()
                                             or checkpoints.dtype != conv_states.dtype):
        raise ValueError("conv checkpoints must be a contiguous pool of the conv states' dtype")
    channel_blocks = triton.cdiv(channels, CONV_CHANNELS)
    _conv_kernel[(num_requests, channel_blocks, triton.cdiv(plan.max_rows, CONV_ROWS))](
        x, conv_states, weight, out, plan.meta, num_requests, x.stride(0), D=channels, K=width,
        BT=CONV_ROWS, BD=CONV_CHANNELS, num_warps=4)
    _conv_state_kernel[(num_requests, channel_blocks)](
        x, conv_states, checkpoints if save else conv_states, plan.meta, plan.snapshot_begin,
        plan.snapshot_position, plan.snapshot_slot, num_requests, x.stride(0), D=channels,
        K=width, BW=max(2, triton.next_power_of_2(width - 1)), BD=CONV_CHANNELS, SAVE=save,
        num_warps=4)
    return out

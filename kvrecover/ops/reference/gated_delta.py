"""The gated delta rule (Gated DeltaNet's linear attention) in plain torch: the reference.

Hugging Face's `torch_chunk_gated_delta_rule` computes a prompt in chunks of 64
tokens counted from the prompt's first token and decodes token by token, so a
state's bits depend on how the sequence was split. Here every chunk is aligned to
*absolute* positions (chunk k holds positions [kC, (k+1)C)), and each chunk is
computed by one fixed-shape computation whatever part of it a step brings: the
rows of a chunk not yet seen are zero padding, which no earlier row reads (the
intra-chunk system is lower triangular), so a row's output has the same bits
whether its chunk arrived whole, in pieces or one token per decode step. The
recurrent state advances only when a chunk is complete; until then the chunk's
inputs so far wait in the request's tail buffers (`DeltaRuleState`). The state at
an absolute chunk boundary therefore has the same bits for every split of the
sequence (what lets a recomputed request reproduce its output byte for byte).

All of it runs in float32, as Hugging Face's does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrecover.ops.interface import DeltaRuleState, RecurrentRequestRows

L2_NORM_EPS = 1e-6  # Hugging Face's (and the FLA kernels') `l2norm` epsilon
SOFTPLUS_THRESHOLD = 20.0  # torch's: above it softplus(x) is x


# torch's vectorised sigmoid, silu, softplus and log1p round the elements of a vector's
# remainder differently from the others, so an element's bits would depend on how many
# tokens the step holds; exp, log and the four operations do not.
def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`1 / (1 + exp(-x))`, each element's bits independent of the tensor's size."""
    return torch.exp(-x).add_(1).reciprocal_()


def silu(x: torch.Tensor) -> torch.Tensor:
    """`x * sigmoid(x)`, each element's bits independent of the tensor's size."""
    return x / torch.exp(-x).add_(1)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """`log(1 + exp(x))` (x itself above `SOFTPLUS_THRESHOLD`), each element's bits
    independent of the tensor's size."""
    return torch.where(x > SOFTPLUS_THRESHOLD, x, torch.exp(x).add_(1).log_())


def l2norm(x: torch.Tensor, eps: float = L2_NORM_EPS) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last dim (Hugging Face's `l2norm`)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
    beta: torch.Tensor, state: DeltaRuleState, start: int, chunk_size: int,
    snapshots: Sequence[tuple[int, torch.Tensor]] = (),
) -> torch.Tensor:
    """The outputs [T, Hv, Dv] (float32) of one request's tokens at positions
    [start, start + T), advancing `state` in place.

    `query`, `key` [T, Hk, Dk] (raw: l2-normalised here, as Hugging Face's
    `use_qk_l2norm_in_kernel`), `value` [T, Hv, Dv], `decay` (log space, <= 0) and
    `beta` [T, Hv]; Hv a multiple of Hk (each key head serves Hv / Hk value heads).
    `state` must be the request's state at position `start`. For each (position,
    tensor) of `snapshots` (chunk boundaries inside (start, start + T]), the recurrent
    state at that position is copied into the tensor.
    """
    num_v_heads, key_dim = value.shape[1], query.shape[-1]
    repeat = num_v_heads // query.shape[1]
    query = l2norm(query.float()).repeat_interleave(repeat, dim=1) * key_dim**-0.5
    key = l2norm(key.float()).repeat_interleave(repeat, dim=1)
    value, decay, beta = value.float(), decay.float(), beta.float()
    offset = start % chunk_size
    if offset:
        query = torch.cat((state.query_tail[:offset], query))
        key = torch.cat((state.key_tail[:offset], key))
        value = torch.cat((state.value_tail[:offset], value))
        decay = torch.cat((state.decay_tail[:offset], decay))
        beta = torch.cat((state.beta_tail[:offset], beta))
    total = query.shape[0]
    outputs = []
    for chunk_start in range(0, total, chunk_size):
        rows = min(chunk_size, total - chunk_start)
        part = slice(chunk_start, chunk_start + rows)
        chunk = [_padded(x[part], chunk_size) for x in (query, key, value, decay, beta)]
        q, k, v, g, b = chunk
        out = _chunk(q, k, v, g, b, state.state, complete=rows == chunk_size)
        outputs.append(out[max(offset - chunk_start, 0) : rows])
        reached = start - offset + chunk_start + rows
        for position, target in snapshots:
            if position == reached and rows == chunk_size:
                target.copy_(state.state)
        if rows < chunk_size:
            for tail, x in zip((state.query_tail, state.key_tail, state.value_tail,
                                state.decay_tail, state.beta_tail), chunk):
                tail[:rows].copy_(x[:rows])
    return torch.cat(outputs)


def gated_delta_rule_batch(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
    beta: torch.Tensor, states: DeltaRuleState, requests: Sequence[RecurrentRequestRows],
    chunk_size: int, checkpoints: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gated_delta_rule` over a step's requests (`LinearAttentionKernels.
    gated_delta_rule_batch`): one call per request on its rows and its slot of the
    pools `states`, so every bit is the per-request call's."""
    out = torch.empty(value.shape, dtype=torch.float32, device=value.device)
    for request in requests:
        rows, slot = slice(request.start_row, request.end_row), request.slot
        state = DeltaRuleState(*(pool[slot] for pool in (
            states.state, states.query_tail, states.key_tail, states.value_tail,
            states.decay_tail, states.beta_tail)))
        snapshots = ([(position, checkpoints[c]) for position, c in request.checkpoints]
                     if checkpoints is not None else [])
        out[rows] = gated_delta_rule(query[rows], key[rows], value[rows], decay[rows],
                                     beta[rows], state, request.position, chunk_size, snapshots)
    return out


def _padded(x: torch.Tensor, size: int) -> torch.Tensor:
    """`x` [rows, ...] with zero rows appended up to `size` (a fresh tensor)."""
    padded = x.new_zeros((size, *x.shape[1:]))
    padded[: x.shape[0]] = x
    return padded


def _chunk(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
           beta: torch.Tensor, state: torch.Tensor, *, complete: bool) -> torch.Tensor:
    """One aligned chunk of C rows ([C, H, D]; rows past the real ones are zeros): its
    outputs [C, Hv, Dv]; when `complete`, `state` [Hv, Dk, Dv] advances past it in place.

    Hugging Face's chunk step (the UT transform), on one chunk of a fixed shape."""
    query, key, value = (x.transpose(0, 1) for x in (query, key, value))  # [H, C, D]
    decay, beta = decay.transpose(0, 1), beta.transpose(0, 1)  # [H, C]
    size = query.shape[1]
    upper = torch.ones(size, size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=-1)
    pairwise = (cum_decay.unsqueeze(-1) - cum_decay.unsqueeze(-2)).masked_fill(upper, float("-inf"))
    pairwise = pairwise.exp()
    k_beta = key * beta.unsqueeze(-1)
    system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, value * beta.unsqueeze(-1), upper=False,
                                               unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum_decay.exp().unsqueeze(-1),
                                               upper=False, unitriangular=True)
    v_new = new_values - k_cumdecay @ state
    out = (query * cum_decay.exp().unsqueeze(-1)) @ state + intra @ v_new
    if complete:
        last = cum_decay[:, -1:]
        decayed_key = key * (last - cum_decay).exp().unsqueeze(-1)
        state.mul_(last.exp().unsqueeze(-1)).add_(decayed_key.transpose(-1, -2) @ v_new)
    return out.transpose(0, 1)


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of the depthwise causal convolution of `x` [T, D] (one request's tokens)
    with `weight` [D, K], continuing from `conv_state` [D, K - 1] (the K - 1 inputs
    before `x`, zeros at the start), which is advanced in place. Summed in float32 in
    a fixed order, rounded once to `x`'s dtype: a row's bits do not depend on T."""
    width = weight.shape[-1]
    extended = torch.cat((conv_state.transpose(0, 1).to(x.dtype), x))  # [K - 1 + T, D]
    rows = x.shape[0]
    weight32 = weight.float()
    acc = extended[0:rows].float() * weight32[:, 0]
    for tap in range(1, width):
        acc.add_(extended[tap : tap + rows].float() * weight32[:, tap])
    conv_state.copy_(extended[rows:].transpose(0, 1))
    return silu(acc).to(x.dtype)


def causal_conv1d_batch(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                        requests: Sequence[RecurrentRequestRows],
                        checkpoints: torch.Tensor | None = None) -> torch.Tensor:
    """`causal_conv1d` over a step's requests: one call per request on its rows and its
    slot of `conv_states` [slots, D, K - 1], so every bit is the per-request call's. The
    conv state at each of a request's checkpoints (the K - 1 inputs before that position)
    is copied into that slot of `checkpoints` [checkpoint slots, D, K - 1] (None: not
    copied)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for request in requests:
        rows = slice(request.start_row, request.end_row)
        if request.checkpoints and checkpoints is not None:
            _checkpoint_conv(request, conv_states[request.slot], x[rows], checkpoints)
        out[rows] = causal_conv1d(x[rows], conv_states[request.slot], weight)
    return out


def _checkpoint_conv(request: RecurrentRequestRows, conv_state: torch.Tensor, x: torch.Tensor,
                     checkpoints: torch.Tensor) -> None:
    """Copy the conv state at each of the request's checkpoint positions into its
    checkpoint slot; `conv_state` is the state at its first row, `x` its rows."""
    width = conv_state.shape[-1]
    extended = torch.cat((conv_state.transpose(0, 1).to(x.dtype), x))  # from position - K + 1
    for position, slot in request.checkpoints:
        offset = position - request.position
        checkpoints[slot].copy_(extended[offset : offset + width].transpose(0, 1))


def delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(decay `-exp(A_log) * softplus(a + dt_bias)` in float32, `beta = sigmoid(b)` in
    `b`'s dtype), as Hugging Face computes them."""
    return -torch.exp(a_log.float()) * softplus(a.float() + dt_bias), sigmoid(b)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """Hugging Face's `Qwen3NextRMSNormGated`: RMSNorm of `x` (float32, rounded to
    `x`'s dtype before the weight), times `silu(gate)` in float32, rounded once."""
    dtype = x.dtype
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return ((weight * normed).float() * silu(gate.float())).to(dtype)

"""The kernel seam: what every backend family provides, as typed `Protocol`s.

A backend (`ops.backend.KernelBackend`) bundles one implementation of each:
- `PagedAttention`: writes a step's K/V into the paged cache and attends, with
  rotary applied by the kernel (a backend that fuses it) or just before it;
- `ModelOps`: the linears, norms, rotary, embedding, SwiGLU and mixture-of-experts
  feed-forward (`MoEKernels`) a model calls;
- `SamplingKernels`: the device-side greedy pick of a graphed decode step;
- `StepInputBuilder`: turns the scheduled requests into the step's inputs in the
  form that backend's attention reads (`StepInputs.attn`), and, where decode
  steps can replay CUDA graphs, the padded-decode interface (`GraphStepInputs`);
- `BackendFeatures`: which model features the kernels implement; a model states
  what it needs in the same record and `KernelBackend.check_supports` refuses
  a model that needs more.

The worker and the models program against these names only; which family runs
is decided once, in `ops.backend.select_backend`. Nothing here imports a family,
the models, the worker or the engine: the model's rotary tables and the
scheduler's requests are seen through the structural types `RotaryTables` and
`ScheduledTokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

MetadataT = TypeVar("MetadataT", contravariant=True)


# ----- features ------------------------------------------------------------------------
@dataclass(frozen=True)
class BackendFeatures:
    """Model features beyond a dense full-attention decoder with rotary.

    A backend declares the ones its kernels implement; a model declares the ones
    it needs (from its config) in the same record. Every field is False for the
    families that exist today.
    """

    sliding_window: bool = False  # attention over the last W positions only (`attend`'s window)
    logit_softcap: bool = False  # tanh soft-capping of attention scores
    attention_sinks: bool = False  # a learned per-head sink logit in the softmax
    moe: bool = False  # mixture-of-experts feed-forward layers
    linear_attention: bool = False  # recurrent-state layers (gated delta rule)
    tensor_parallel: bool = False  # weights and KV heads sharded over ranks

    def missing(self, needed: BackendFeatures) -> list[str]:
        """The features `needed` asks for that these do not provide, in field order."""
        return [f.name for f in fields(self)
                if getattr(needed, f.name) and not getattr(self, f.name)]


# ----- rotary --------------------------------------------------------------------------
class RotaryTables(Protocol):
    """Rotary cos/sin tables by position, float32, rotate-half layout (the model's
    `models.rope.RotaryEmbedding` is one)."""

    @property
    def cos_cache(self) -> torch.Tensor:  # [max_positions, head_dim]
        ...

    @property
    def sin_cache(self) -> torch.Tensor:  # [max_positions, head_dim]
        ...

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        """[max_positions, 2 * head_dim]: cos, then sin with rotate_half's sign folded in."""
        ...


class RotaryKernel(Protocol):
    """Rotates `query` [T, Hq, D] and `key` [T, Hkv, D] by their positions [T]; returns
    the rotated pair (which may be the inputs, rotated in place)."""

    def __call__(
        self, tables: RotaryTables, positions: torch.Tensor, query: torch.Tensor,
        key: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


# ----- linears, norms, small ops ------------------------------------------------------------
class LinearKernels(Protocol):
    """A backend's matmuls over the model's `nn.Linear` weights."""

    def prepare_weights(self, model: nn.Module) -> None:
        """Called once, right after the weights are loaded and cast: bring them into
        the layout `linear` reads (packing, proving tile shapes)."""
        ...

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """`x @ layer.weight.T + layer.bias` for `x` [rows, in]."""
        ...


class NormKernels(Protocol):
    """RMSNorm over the last dim in two flavours: Llama's (float32 inside, rounded to
    `x`'s dtype before the weight) and Gemma's `_plus_one` (times `1 + weight`, all in
    float32, rounded once at the end)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); `residual` may be updated in place."""
        ...

    def rms_norm_plus_one(self, x: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> torch.Tensor: ...

    def add_rms_norm_plus_one(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x) with the `_plus_one` norm; `residual` may be
        updated in place."""
        ...


# ----- mixture of experts ------------------------------------------------------------------
@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation for `gate_up = [gate | up]`: `gate` clamped to at most
    `limit`, `up` to [-limit, limit], then `(up + 1) * gate * sigmoid(alpha * gate)`,
    each op rounded to the model dtype (as Hugging Face's `GptOssExperts`)."""

    alpha: float
    limit: float


@runtime_checkable
class ExpertWeights(Protocol):
    """The stacked SwiGLU weights of one layer's experts (the model's
    `models.moe.ExpertWeights` is one); a backend finds them in `prepare_weights`.
    Biases and the clamped activation are gpt-oss's; None for the other families."""

    @property
    def gate_up_proj(self) -> torch.Tensor:  # [num_experts, 2 * intermediate, hidden]
        ...

    @property
    def down_proj(self) -> torch.Tensor:  # [num_experts, hidden, intermediate]
        ...

    @property
    def gate_up_bias(self) -> torch.Tensor | None:  # [num_experts, 2 * intermediate]
        ...

    @property
    def down_bias(self) -> torch.Tensor | None:  # [num_experts, hidden]
        ...

    @property
    def clamped_swiglu(self) -> ClampedSwiGLU | None:  # None: plain SwiGLU
        ...

    def as_linears(self) -> tuple[list[nn.Linear], list[nn.Linear]]:
        """One bias-free `nn.Linear` per expert for gate_up and for down, their weights
        views of the stacked tensors (no copy)."""
        ...


class MoEKernels(Protocol):
    """The experts' feed-forward of a sparse mixture-of-experts layer (routing, the
    softmax top-k over the router logits, is the model's)."""

    def moe(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        experts: ExpertWeights,
    ) -> torch.Tensor:
        """`sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))` with
        `e = topk_ids[t, j]`, for `x` [T, H], `topk_weights` [T, k] (float32 or the model
        dtype) and `topk_ids` [T, k] (int64). Each product is summed in float32 in j order
        (the order of the top-k, fixed) and rounded once to `x`'s dtype; each expert's
        output is rounded to `x`'s dtype before it is weighted. Where `experts` has
        biases, each is added (rounded) right after its matmul; with `clamped_swiglu`,
        that activation replaces SwiGLU."""
        ...


# ----- linear attention (gated delta rule) ----------------------------------------------
@dataclass
class DeltaRuleState:
    """One request's state of one linear-attention layer (views into the worker's pool).

    `state` [Hv, Dk, Dv] is the recurrent state at the last chunk boundary at or before
    the request's position p; the tails [C, ...] hold the (normalised) inputs of the
    positions from that boundary to p, in their first `p % C` rows.
    """

    state: torch.Tensor  # [Hv, Dk, Dv] float32
    query_tail: torch.Tensor  # [C, Hv, Dk] float32, l2-normalised and scaled
    key_tail: torch.Tensor  # [C, Hv, Dk] float32, l2-normalised
    value_tail: torch.Tensor  # [C, Hv, Dv] float32
    decay_tail: torch.Tensor  # [C, Hv] float32, log decay g
    beta_tail: torch.Tensor  # [C, Hv] float32


class RecurrentRequestRows(Protocol):
    """What a batched linear-attention kernel reads of one request of the step (the
    model's `models.recurrent_state.RequestRows` is one)."""

    @property
    def start_row(self) -> int:  # its first row of the step's flat batch
        ...

    @property
    def end_row(self) -> int:  # one past its last row
        ...

    @property
    def position(self) -> int:  # the absolute position of its first row
        ...

    @property
    def slot(self) -> int:  # its slot in the state pools
        ...

    @property
    def checkpoints(self) -> Sequence[tuple[int, int]]:
        """(chunk-boundary position, checkpoint slot) inside its rows, by position."""
        ...


class LinearAttentionKernels(Protocol):
    """The kernels of a Gated DeltaNet layer (`models/gated_deltanet.py` calls the `*_batch`
    ones, once per layer for the whole step); each
    row's bits do not depend on how many tokens the step holds or where it was split
    (`ops/reference/gated_delta.py` says how)."""

    def causal_conv1d(self, x: torch.Tensor, conv_state: torch.Tensor,
                      weight: torch.Tensor) -> torch.Tensor:
        """SiLU of the depthwise causal convolution of one request's `x` [T, D] with
        `weight` [D, K], continuing from and advancing `conv_state` [D, K - 1]."""
        ...

    def gated_delta_rule(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        decay: torch.Tensor, beta: torch.Tensor, state: DeltaRuleState, start: int,
        chunk_size: int, snapshots: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> torch.Tensor:
        """One request's outputs [T, Hv, Dv] (float32) for positions [start, start + T),
        advancing its `DeltaRuleState` in place, in chunks aligned to absolute positions;
        the recurrent state at each chunk boundary of `snapshots` is copied into its tensor."""
        ...

    def causal_conv1d_batch(self, x: torch.Tensor, conv_states: torch.Tensor,
                            weight: torch.Tensor, requests: Sequence[RecurrentRequestRows],
                            checkpoints: torch.Tensor | None = None) -> torch.Tensor:
        """`causal_conv1d` for every request of a step at once: `x` [T, D] the step's rows,
        `conv_states` [slots, D, K - 1] the pool (each request's slot advanced in place);
        each row's bits are those of the per-request call. The conv state at each of a
        request's `checkpoints` (the K - 1 inputs before it) goes into that slot of
        `checkpoints` [checkpoint slots, D, K - 1] (None: nowhere)."""
        ...

    def gated_delta_rule_batch(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        decay: torch.Tensor, beta: torch.Tensor, states: DeltaRuleState,
        requests: Sequence[RecurrentRequestRows], chunk_size: int,
        checkpoints: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`gated_delta_rule` for every request of a step at once: the inputs hold the
        step's rows ([T, H, D], [T, Hv]), `states` the pools (each tensor with a leading
        slot dim; each request's slot advanced in place), and the recurrent state at each
        of a request's `checkpoints` goes into that slot of `checkpoints` [slots, Hv, Dk,
        Dv]. Returns [T, Hv, Dv] float32. Each (request, value head, aligned chunk) is one
        fixed-shape computation, so a row's bits and the state at a chunk boundary do not
        depend on the batch's other requests, the chunking or decode vs prefill."""
        ...

    def delta_gates(self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                    dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log decay `-exp(A_log) * softplus(a + dt_bias)` [T, Hv] float32, `sigmoid(b)`)."""
        ...

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
        """RMSNorm of `x` times `silu(gate)` (Hugging Face's `RMSNormGated`)."""
        ...


class ModelOps(LinearKernels, NormKernels, MoEKernels, LinearAttentionKernels, Protocol):
    """Every per-token op a model calls besides attention (`ops.reference.TorchOps` is the
    reference; each override rounds where it rounds)."""

    def embedding(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def rotary(
        self, tables: RotaryTables, positions: torch.Tensor, query: torch.Tensor,
        key: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: `silu(gate) * up` for `gate_up = [gate | up]` along the last dim."""
        ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU: `gelu(gate, approximate="tanh") * up` for `gate_up = [gate | up]`."""
        ...


# ----- attention -----------------------------------------------------------------------
class PagedAttention(Protocol[MetadataT]):
    """Attention over the paged KV cache `[2, num_blocks, block_size, Hkv, D]` of one layer.

    `MetadataT` is the per-step record the same backend's `StepInputBuilder` makes;
    every layer of a step receives the same object.
    """

    @property
    def name(self) -> str: ...

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        rotary: RotaryTables | None, positions: torch.Tensor, kv_cache: torch.Tensor,
        meta: MetadataT, scale: float, *, window: int | None = None,
        softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotate `query` [T, Hq, D] and `key` [T, Hkv, D] by `positions` with `rotary`
        (None: no rotary), write key and `value` into the cache slots of `meta`, and
        attend causally; returns [T, Hq, D]. May overwrite `query` and `key`.

        `window` (the layer's sliding window, None: full attention): a query at
        position q sees the keys at positions q - window < k <= q only (Hugging
        Face's `sliding_window_causal`). A backend that takes it declares
        `BackendFeatures.sliding_window`; it never reads the values of keys outside
        every query's window (those blocks may be freed, reused or hold NaNs).
        `softcap` (None: none): scores `s = scale * q.k` become `softcap * tanh(s /
        softcap)` before the mask and softmax (Gemma 2's `attn_logit_softcapping`;
        `BackendFeatures.logit_softcap`)."""
        ...


# ----- sampling ------------------------------------------------------------------------
class SamplingKernels(Protocol):
    """Device-side helpers of the sampling step."""

    def upcast_greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`logits` as float32, each row's argmax with the first maximum on ties), with
        no host sync (a CUDA graph captures it)."""
        ...


# ----- step inputs ---------------------------------------------------------------------
class ScheduledTokens(Protocol):
    """What a step-input builder reads of one scheduled request (the engine's
    `ScheduledRequest` is one)."""

    @property
    def request_id(self) -> str: ...

    @property
    def token_ids(self) -> list[int]:  # tokens computed in this step
        ...

    @property
    def num_computed_tokens(self) -> int:  # position of token_ids[0]
        ...

    @property
    def block_ids(self) -> list[int]:  # the request's whole block table (of group 0)
        ...

    @property
    def tables(self) -> list[list[int]]:  # one block table per KV cache group
        ...

    @property
    def sample(self) -> bool:  # whether this step samples the request's next token
        ...


@dataclass
class StepInputs:
    """One step's inputs on the device."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    sample_rows: torch.Tensor  # [S] rows of the flat batch whose logits are sampled
    attn: Any  # the metadata record of the backend's attention (`PagedAttention[...]`)
    # One record per KV cache group (`kv_groups.py`: its own block table and cache
    # slots), group 0's being `attn`; empty for a model of one group.
    group_attn: list[Any] = field(default_factory=list)
    # A padded (graphed) step's recurrent request list with its prebuilt plan (the
    # backend's: Triton's `PlannedRequests`), handed to every recurrent layer; else None.
    recurrent: Any = None


@dataclass(frozen=True)
class StepInputSpec:
    """What a step-input builder needs to know about the model and the cache."""

    block_size: int
    num_attention_heads: int
    num_kv_heads: int
    max_model_len: int
    device: torch.device
    num_kv_groups: int = 1  # block tables per request (`kv_groups.py`)
    recurrent: bool = False  # the model has recurrent layers (their plan in padded steps)


class GraphStepInputs(Protocol):
    """The padded-decode interface of a builder whose steps can replay CUDA graphs.

    `pack(scheduled, pad_to=size)` writes a one-token-per-request step padded to
    `size` dummy-request rows into a host buffer (`input_ids` replaces the tokens,
    e.g. by rows of a device tensor gathered later; `recurrent` the recurrent layers'
    request rows, for a builder of a `StepInputSpec.recurrent` model); `upload` copies
    it into a static device buffer and `views` hands the model views of that buffer
    (`StepInputs.recurrent` then the layers' prebuilt plan).
    """

    def pack(
        self, scheduled: Sequence[ScheduledTokens], pad_to: int | None = None,
        input_ids: list[int] | None = None,
        recurrent: Sequence[RecurrentRequestRows] | None = None,
    ) -> Any: ...

    def upload(self, layout: Any, target: torch.Tensor | None = None) -> torch.Tensor: ...

    def views(self, layout: Any, buffer: torch.Tensor) -> StepInputs: ...


class StepInputBuilder(Protocol):
    """Builds each step's inputs for one backend (one builder per model runner)."""

    def build(self, scheduled: Sequence[ScheduledTokens]) -> StepInputs:
        """The step's inputs on the device (the scheduled requests in order)."""
        ...

    def for_graphs(self) -> GraphStepInputs | None:
        """The padded-decode interface, or None where decode steps cannot replay graphs."""
        ...

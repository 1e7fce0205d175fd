"""Layers the decoder families share: norms, the attention block, the gated MLP, the
pre-norm decoder layer, and the decoder stack with its embedding and LM head.

The Gemma families use the same blocks with named options: `RMSNorm(plus_one=True)`
(times `1 + weight`, rounded once), `GatedMLP(activation="gelu_pytorch_tanh")`
(GeGLU), `DecoderLayer(sandwich_norms=True)` (norms after attention and the MLP as
well), an attention `scale` and `softcap`, and the `CausalLM.embed` / `soft_cap`
hooks for scaled embeddings and capped logits.

Only the model definition: every kernel (linears, norms, rotary, attention) comes
from the `KernelBackend` the model runner passes in (`kvrecover.ops`). Module and
parameter names follow Hugging Face Llama, so checkpoints load by name
(`loader.load_weights`, with `CausalLM.packed_modules` for the fused weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch
from torch import nn

from kvrecover.models.config import ModelConfig
from kvrecover.models.loader import CheckpointRename, attach_shard_loader
from kvrecover.models.parallel_layers import (
    SINGLE_RANK,
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TensorParallelGroup,
    VocabParallelEmbedding,
    check_tensor_parallel,
    shard_heads,
)
from kvrecover.models.recurrent_state import StateSpec
from kvrecover.models.rope import RotaryEmbedding
from kvrecover.ops.interface import BackendFeatures

if TYPE_CHECKING:
    from kvrecover.ops.backend import KernelBackend
    from kvrecover.ops.interface import ModelOps, PagedAttention


class RMSNorm(nn.Module):
    """Root-mean-square layer norm parameters; the math is `ops.rms_norm`, or with
    `plus_one` Gemma's `ops.rms_norm_plus_one` (times `1 + weight`, in float32)."""

    def __init__(self, size: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if plus_one else torch.ones(size))
        self.eps = eps
        self.plus_one = plus_one

    def norm(self, ops: ModelOps, x: torch.Tensor) -> torch.Tensor:
        """`x` normalised by this norm's flavour of the backend's kernel."""
        if self.plus_one:
            return ops.rms_norm_plus_one(x, self.weight, self.eps)
        return ops.rms_norm(x, self.weight, self.eps)

    def add_norm(self, ops: ModelOps, x: torch.Tensor,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); `residual` may be updated in place."""
        if self.plus_one:
            return ops.add_rms_norm_plus_one(x, residual, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """`cap * tanh(x / cap)` (Gemma's logit soft-capping), in `x`'s dtype."""
    return torch.tanh(x / cap) * cap


def load_shard(param: torch.Tensor, loaded: torch.Tensor, offset: int, size: int) -> None:
    """Copy one checkpoint tensor (q, k, v, gate or up) into its rows of a fused weight
    (or of one expert's slice of a stacked weight)."""
    if loaded.shape[0] != size or tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit rows "
            f"[{offset}, {offset + size}) of a fused weight of shape {tuple(param.shape)}; "
            "does config.json match the weights?"
        )
    param.data[offset : offset + size].copy_(loaded)


class Attention(nn.Module):
    """Self-attention with fused QKV projection, GQA, an optional per-head q/k norm (of
    the `plus_one` flavour with `norm_plus_one`), an optional sliding `window` (the last
    so many positions only), score `scale` (default head_dim**-0.5) and `softcap`;
    `o_bias` gives the output projection a bias and `sinks` each head a learned sink
    logit in its softmax (gpt-oss, single rank only)."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        attention: PagedAttention[Any],
        ops: ModelOps,
        *,
        bias: bool = False,
        qk_norm: bool = False,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        norm_plus_one: bool = False,
        o_bias: bool = False,
        sinks: bool = False,
        tp: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        if tp.size > 1 and (o_bias or sinks):
            raise ValueError("an output-projection bias and attention sinks run on one rank "
                             "only; use tensor_parallel_size 1 for this model")
        self.ops = ops
        self.window = window
        self.softcap = softcap
        self.tp = tp
        self.head_dim = config.head_dim
        heads = shard_heads(config.num_attention_heads, config.num_key_value_heads, tp.size,
                            tp.rank)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, norm_plus_one) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, norm_plus_one) if qk_norm else None
        self.rotary = rotary
        self.attention = attention
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if sinks else None
        if tp.size > 1:
            dim = self.head_dim
            self.qkv_proj: nn.Linear = ColumnParallelLinear(config.hidden_size, {
                "q": (0, heads.head_start * dim, self.q_size),
                "k": (self.q_size, heads.kv_head_start * dim, self.kv_size),
                "v": (self.q_size + self.kv_size, heads.kv_head_start * dim, self.kv_size),
            }, bias=bias)
            self.o_proj: nn.Linear = RowParallelLinear(self.q_size, config.hidden_size,
                                                       heads.head_start * dim)
            return
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        shards = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                  "v": (self.q_size + self.kv_size, self.kv_size)}
        for param in self.qkv_proj.parameters():
            attach_shard_loader(param, lambda p, w, shard: load_shard(p, w, *shards[shard]))

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, attn_meta: Any
    ) -> torch.Tensor:
        ops = self.ops
        qkv = ops.linear(hidden, self.qkv_proj)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither
            q = self.q_norm.norm(ops, q)
            k = self.k_norm.norm(ops, k)
        out = self.attention.attend(q, k, v, self.rotary, positions, kv_cache, attn_meta,
                                    self.scale, window=self.window, softcap=self.softcap,
                                    sinks=self.sinks)
        out = ops.linear(out.reshape(-1, self.q_size), self.o_proj)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)


GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # Hugging Face names: SwiGLU, GeGLU


class GatedMLP(nn.Module):
    """Gated feed-forward (SwiGLU, or GeGLU with `activation="gelu_pytorch_tanh"`) with
    fused gate and up projections (split over `tp`'s ranks by the intermediate size)."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: ModelOps,
                 tp: TensorParallelGroup = SINGLE_RANK, activation: str = "silu") -> None:
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r} in config.json "
                             f"(hidden_activation / hidden_act); supported: {GATED_ACTIVATIONS}")
        self.ops = ops
        self.activation = activation
        self.tp = tp
        if tp.size > 1:
            local = intermediate_size // tp.size
            self.intermediate_size = local
            start = tp.rank * local
            self.gate_up_proj: nn.Linear = ColumnParallelLinear(hidden_size, {
                "gate": (0, start, local), "up": (local, start, local)})
            self.down_proj: nn.Linear = RowParallelLinear(local, hidden_size, start)
            return
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        shards = {"gate": (0, intermediate_size), "up": (intermediate_size, intermediate_size)}
        attach_shard_loader(self.gate_up_proj.weight,
                            lambda p, w, shard: load_shard(p, w, *shards[shard]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.partial_sum(x)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The output from this rank's slice of the intermediate dim (the whole output
        at one rank; the caller all-reduces it under tensor parallelism)."""
        ops = self.ops
        gate_up = ops.linear(x, self.gate_up_proj)
        if self.activation == "silu":
            return ops.linear(ops.silu_mul(gate_up), self.down_proj)
        return ops.linear(ops.gelu_tanh_mul(gate_up), self.down_proj)


class DecoderLayer(nn.Module):
    """One pre-norm transformer block around a given attention and feed-forward module.

    Carries the residual stream separately (`residual`, None before the first
    layer) so that each residual add fuses with the next norm. `sandwich_norms`
    (Gemma): the attention and MLP outputs are normed too before their residual
    add (`post_attention_layernorm`, `post_feedforward_layernorm`), and the MLP's
    input norm is `pre_feedforward_layernorm`; `norm_plus_one` picks the norms'
    flavour.
    """

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module,
                 ops: ModelOps, *, sandwich_norms: bool = False,
                 norm_plus_one: bool = False) -> None:
        super().__init__()
        self.ops = ops
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, norm_plus_one)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(size, eps, norm_plus_one)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, norm_plus_one) if sandwich_norms else None
        self.post_feedforward_layernorm = (RMSNorm(size, eps, norm_plus_one) if sandwich_norms
                                           else None)
        self.mlp = mlp

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_meta: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops, norm = self.ops, self.input_layernorm
        if residual is None:
            residual, hidden = hidden, norm.norm(ops, hidden)
        else:
            hidden, residual = norm.add_norm(ops, hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_meta)
        pre_mlp, post_mlp = self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        if pre_mlp is None or post_mlp is None:  # both or neither
            hidden, residual = self.post_attention_layernorm.add_norm(ops, hidden, residual)
            return self.mlp(hidden), residual
        hidden = self.post_attention_layernorm.norm(ops, hidden)
        hidden, residual = pre_mlp.add_norm(ops, hidden, residual)
        return post_mlp.norm(ops, self.mlp(hidden)), residual


ConfigT = TypeVar("ConfigT", bound=ModelConfig)


class CausalLM(nn.Module, Generic[ConfigT]):
    """The decoder stack plus LM head; `forward` returns hidden states, `logits` projects them.

    A family subclasses it as `CausalLM[ItsConfig]`: `config_class` (that `ModelConfig`
    subclass) and `make_layer` (its decoder layer at a given index). `before_layer(layer_index)` (optional) runs
    before each layer's attention reads the KV cache and `after_layer(layer_index)`
    after the layer wrote it: that is where a KV connector waits for a layer's load
    and saves a layer's KV.
    """

    config_class: type[ConfigT]  # set by each family
    norm_plus_one = False  # Gemma: every norm of the model is `RMSNorm(plus_one=True)`
    # Whether the family's layers shard over tensor-parallel ranks (`make_layer` passes
    # `self.tp` to them); a family that does not is refused at tensor_parallel_size > 1.
    tensor_parallel: ClassVar[bool] = False

    @classmethod
    def check_tensor_parallel(cls, config: ModelConfig, size: int) -> None:
        """A ValueError naming both numbers when `size` ranks cannot split `config`
        (a family with more to split extends this); only called for a family that shards."""
        check_tensor_parallel(config, size)

    @classmethod
    def required_features(cls, config: ModelConfig) -> BackendFeatures:
        """The kernel features this model needs beyond dense full attention: sliding
        windows where `config.layer_windows()` has one (a family with soft-capping,
        sinks or experts extends this)."""
        windowed = any(window is not None for window in config.layer_windows())
        return BackendFeatures(sliding_window=windowed)

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window in tokens, None for full attention (the config's
        `layer_windows`, which the layers were built with)."""
        return self.config.layer_windows()

    def __init__(self, config: ConfigT, backend: KernelBackend, max_positions: int,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.ops = ops = backend.ops
        self.rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling
        )
        self.add_rotary_tables(config, max_positions)
        self.embed_tokens = (nn.Embedding(config.vocab_size, config.hidden_size) if tp.size == 1
                             else VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                         tp))
        self.layers = nn.ModuleList(
            self.make_layer(config, index, backend.attention, ops)
            for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.norm_plus_one)
        self.lm_head = (nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                        if tp.size == 1 else ParallelLMHead(config.hidden_size,
                                                            config.vocab_size, tp))
        if config.tie_word_embeddings:
            # One tensor, unless the backend repacks the LM head's weight for its
            # matmul (oneDNN on the CPU); the embedding then keeps the dense copy.
            self.lm_head.weight = self.embed_tokens.weight

    def recurrent_state_specs(self, chunk_size: int) -> dict[int, list[StateSpec]]:
        """Each recurrent (linear-attention) layer's per-request state, by layer index
        (`models/recurrent_state.py`); none in a family without such layers. Such a layer
        receives a `RecurrentLayerStep` in place of attention metadata."""
        return {}

    def add_rotary_tables(self, config: ConfigT, max_positions: int) -> None:
        """Called by `__init__` before the layers are made: a family whose layers rotate by
        other tables than `self.rotary` adds them here (and lists them in `rotary_tables`)."""

    def rotary_tables(self) -> list[RotaryEmbedding]:
        """Every rotary table of the model (the model runner keeps them float32)."""
        return [self.rotary]

    def make_layer(self, config: ConfigT, index: int, attention: Any,
                   ops: ModelOps) -> nn.Module:
        """Decoder layer `index` (called once per layer, in order, by `__init__`)."""
        raise NotImplementedError(f"{type(self).__name__} must say how its layers are built")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: Any,
        before_layer: Any = None,
        after_layer: Any = None,
        layer_meta: Sequence[Any] | None = None,
    ) -> torch.Tensor:
        """Hidden states of the step. `kv_caches[i]` is layer i's cache; `layer_meta`
        (one per layer: its KV cache group's record) replaces `attn_meta` where given."""
        hidden = self.embed(input_ids)
        residual: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(index)
            meta = attn_meta if layer_meta is None else layer_meta[index]
            hidden, residual = layer(positions, hidden, residual, kv_caches[index], meta)
            if after_layer is not None:
                after_layer(index)
        if residual is None:
            raise ValueError("the model has no decoder layers: config.json's num_hidden_layers "
                             "must be at least 1")
        return self.norm.add_norm(self.ops, hidden, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of `input_ids` (a family that scales them overrides this)."""
        embed = self.embed_tokens
        if isinstance(embed, VocabParallelEmbedding):
            return embed.lookup(input_ids, self.ops)
        return self.ops.embedding(input_ids, embed.weight)

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor | None:
        """Float32 logits for the given final hidden states (the model's dtype unless
        `upcast`: a caller that casts them itself), soft-capped in the model's dtype where
        `final_logit_softcap` is set. Under tensor parallelism the whole vocabulary's
        logits on rank 0, and None on the other ranks."""
        head = self.lm_head
        if isinstance(head, ParallelLMHead):
            logits = head.logits(hidden, self.ops)
            if logits is None:
                return None
        else:
            logits = self.ops.linear(hidden, head)
        if self.final_logit_softcap is not None:
            logits = soft_cap(logits, self.final_logit_softcap)
        return logits.float() if upcast else logits

    @property
    def final_logit_softcap(self) -> float | None:
        """The cap of the final logits (None: uncapped; Gemma 2's `final_logit_softcapping`)."""
        return None

    # Checkpoint tensors the model does not use (full-name regexes), skipped at load; e.g.
    # Qwen3-Next's multi-token-prediction head `mtp.*`, which Hugging Face ignores too.
    checkpoint_ignored: tuple[str, ...] = ()
    # Where the checkpoint nests the decoder inside `model.` (a multimodal checkpoint run
    # as text only: `language_model.`); "" for a decoder-only checkpoint.
    checkpoint_prefix = ""

    # Checkpoint names the fragments below do not cover (per-expert tensors into stacked
    # weights: `models.moe.expert_renames`); tried first.
    checkpoint_renames: tuple[CheckpointRename, ...] = ()

    # Hugging Face parameter name fragments -> (our fragment, shard id).
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

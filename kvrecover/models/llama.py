"""Llama-family decoder (Llama 2/3, SmolLM, Qwen2, Qwen3) over a paged KV cache."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvrecover.models.config import ModelConfig
from kvrecover.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 like the reference."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)


def _load_shard(param: nn.Parameter, loaded: torch.Tensor, offset: int) -> None:
    param.data[offset : offset + loaded.shape[0]].copy_(loaded)


class LlamaAttention(nn.Module):
    """Self-attention with fused QKV projection, GQA and an optional per-head q/k norm."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: Any) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.scale = self.head_dim**-0.5
        shard_offsets = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}
        for param in self.qkv_proj.parameters():
            param.weight_loader = lambda p, w, shard, o=shard_offsets: _load_shard(p, w, o[shard])

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, attn_meta: Any
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache, attn_meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with fused gate and up projections."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        offsets = {"gate": 0, "up": config.intermediate_size}
        self.gate_up_proj.weight.weight_loader = lambda p, w, shard: _load_shard(p, w, offsets[shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, attn_meta: Any
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), kv_cache, attn_meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head; `forward` returns hidden states, `logits` projects them.

    `layer_hook(layer_index)` (optional) runs before each layer's attention reads
    the KV cache and `after_layer(layer_index)` after the layer wrote it: that is
    where a KV connector waits for a layer's load and saves a layer's KV.
    """

    def __init__(self, config: ModelConfig, backend: Any, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary, backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: Any,
        before_layer: Any = None,
        after_layer: Any = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for index, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(index)
            hidden = layer(positions, hidden, kv_caches[index], attn_meta)
            if after_layer is not None:
                after_layer(index)
        return self.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given final hidden states."""
        return self.lm_head(hidden).float()

    # Hugging Face parameter name fragments -> (our fragment, shard id).
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

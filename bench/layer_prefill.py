"""Prefill cost of a model shape without its weights: num_layers x one measured layer.

One Llama decoder layer of the given shape (random weights, float32 on the CPU,
bfloat16 on a GPU) runs a causal prefill of n tokens: RMSNorm, q/k/v projections,
SDPA with grouped KV heads, output projection, RMSNorm and the SwiGLU MLP. Its best
time times the number of layers estimates the model's prefill of n fresh tokens
(rotary embedding, the embedding lookup and the LM head are left out, so the
estimate is a little low: it favours recomputing, never loading).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerShape:
    """The sizes of one Llama decoder layer, and how many the model has."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    num_layers: int


SHAPES = {
    "smollm2-135m f32": LayerShape(576, 1536, 9, 3, 64, 30),
    "llama3.2-1b bf16": LayerShape(2048, 8192, 32, 8, 64, 16),
    "llama3-8b bf16": LayerShape(4096, 14336, 32, 8, 128, 32),
}


def prefill_seconds(shape: LayerShape, tokens: int, device: str, dtype: torch.dtype,
                    repeats: int) -> float:
    """Best-of-`repeats` seconds of a `tokens`-token prefill through all layers of `shape`."""
    generator = torch.Generator().manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=generator) * 0.02).to(device=device, dtype=dtype)

    q_size, kv_size = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    w_qkv = weight(q_size + 2 * kv_size, shape.hidden)
    w_o = weight(shape.hidden, q_size)
    w_gate_up = weight(2 * shape.intermediate, shape.hidden)
    w_down = weight(shape.hidden, shape.intermediate)
    norm = torch.ones(shape.hidden, device=device, dtype=dtype)
    x = torch.randn(tokens, shape.hidden, generator=generator).to(device=device, dtype=dtype)

    def layer() -> torch.Tensor:
        h = F.rms_norm(x, (shape.hidden,), norm)
        q, k, v = (h @ w_qkv.T).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(tokens, shape.heads, shape.head_dim).transpose(0, 1)
        k = k.view(tokens, shape.kv_heads, shape.head_dim).transpose(0, 1)
        v = v.view(tokens, shape.kv_heads, shape.head_dim).transpose(0, 1)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = x + attention.transpose(0, 1).reshape(tokens, q_size) @ w_o.T
        gate, up = (F.rms_norm(h, (shape.hidden,), norm) @ w_gate_up.T).chunk(2, dim=-1)
        return h + (F.silu(gate) * up) @ w_down.T

    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            layer()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best * shape.num_layers

"""ops.backend: one kernel backend chosen from the engine arguments, weights packed at load."""

from __future__ import annotations

import pytest
import torch

from kvrecover import LLM
from kvrecover.config import EngineArgs
from kvrecover.ops.backend import select_backend
from kvrecover.ops.torch_attention import TorchPagedAttention
from kvrecover.ops.torch_ops import TorchOps


def test_attention_backend_is_validated_with_the_allowed_values():
    with pytest.raises(ValueError, match="attention_backend must be one of 'auto', 'torch', 'triton', got 'cuda'"):
        EngineArgs(attention_backend="cuda")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        select_backend("fast", torch.device("cpu"))


def test_auto_on_the_cpu_is_the_torch_reference():
    backend = select_backend("auto", torch.device("cpu"))
    assert backend.name == "torch"
    assert isinstance(backend.attention, TorchPagedAttention)
    assert type(backend.ops) is TorchOps
    assert not backend.batch_invariant
    # batch_invariant keeps its promise on the CPU too (tests/test_cpu_invariant.py).
    assert select_backend("auto", torch.device("cpu"), batch_invariant=True).name == "cpu_invariant"


def test_model_and_runner_share_the_backend_and_weights_are_packed_at_load(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=32,
              attention_backend="torch")
    runner = llm.engine.model_runner
    model = runner.model
    assert model.ops is runner.backend.ops
    assert all(layer.self_attn.attention is runner.backend.attention for layer in model.layers)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    # Packed before the first step, not by the first forward.
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.is_mkldnn for m in linears)
    assert not model.embed_tokens.weight.is_mkldnn  # lookups need the dense table

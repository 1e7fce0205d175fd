"""ops.backend: one kernel backend chosen from the engine arguments, weights packed at load,
behind the declared interface (ops.interface): features checked against the model's needs,
one attention entry point, the native_kernels option."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

import kvrecover
from kvrecover import LLM
from kvrecover.config import EngineArgs, add_engine_flags, engine_args_from_namespace
from kvrecover.models.llama import LlamaForCausalLM
from kvrecover.models.rope import RotaryEmbedding
from kvrecover.ops.backend import select_backend
from kvrecover.ops.cpu.attention import CpuInvariantAttention
from kvrecover.ops.cpu.row_kernel_ops import RowKernelOps
from kvrecover.ops.interface import BackendFeatures
from kvrecover.ops.reference.attention_metadata import AttentionMetadata
from kvrecover.ops.reference.torch_attention import TorchPagedAttention
from kvrecover.ops.reference.torch_ops import TorchOps
from kvrecover.worker import model_runner

CPU = torch.device("cpu")


def test_attention_backend_is_validated_with_the_allowed_values():
    with pytest.raises(ValueError, match="attention_backend must be one of 'auto', 'torch', 'triton', got 'cuda'"):
        EngineArgs(attention_backend="cuda")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        select_backend("fast", torch.device("cpu"))


def test_auto_on_the_cpu_is_the_torch_reference():
    backend = select_backend("auto", torch.device("cpu"))
    assert backend.name == "torch"
    assert isinstance(backend.attention, TorchPagedAttention)
    # TorchOps with its float32 norms and rotary in C, bit-equal (tests/ops/test_row_kernel_ops.py).
    assert type(backend.ops) is RowKernelOps and isinstance(backend.ops, TorchOps)
    assert not backend.batch_invariant
    # batch_invariant keeps its promise on the CPU too (tests/ops/test_cpu_invariant.py).
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


# ----- the declared interface -------------------------------------------------------------
def test_every_backend_declares_its_features_and_names_what_is_missing():
    for backend in (select_backend("torch", CPU), select_backend("auto", CPU, dtype=torch.bfloat16),
                    select_backend("auto", CPU, batch_invariant=True)):
        assert backend.features == BackendFeatures(sliding_window=True, logit_softcap=True,
                                                   attention_sinks=True, moe=True,
                                                   linear_attention=True)
        backend.check_supports(BackendFeatures(), "LlamaForCausalLM")  # a dense model runs
        backend.check_supports(BackendFeatures(sliding_window=True), "MistralForCausalLM")
        backend.check_supports(BackendFeatures(moe=True), "MixtralForCausalLM")
        backend.check_supports(BackendFeatures(moe=True, sliding_window=True,
                                               attention_sinks=True), "GptOssForCausalLM")
        backend.check_supports(BackendFeatures(linear_attention=True, moe=True),
                               "Qwen3NextForCausalLM")
    needed = BackendFeatures(moe=True, sliding_window=True, tensor_parallel=True)
    assert BackendFeatures().missing(needed) == ["sliding_window", "moe", "tensor_parallel"]
    assert BackendFeatures(sliding_window=True).missing(needed) == ["moe", "tensor_parallel"]
    with pytest.raises(ValueError, match=r"model LlamaForCausalLM needs tensor_parallel, "
                                         r"which the 'torch' kernel backend does not support"):
        select_backend("torch", CPU).check_supports(needed, "LlamaForCausalLM")


def test_a_model_needing_a_feature_the_backend_lacks_is_refused_at_start_up(
    tiny_llama, monkeypatch
):
    """A fabricated requirement: the Llama model says it needs a feature no backend has."""
    loaded = []
    monkeypatch.setattr(LlamaForCausalLM, "required_features",
                        classmethod(lambda cls, config: BackendFeatures(tensor_parallel=True)))
    monkeypatch.setattr(model_runner, "load_weights", lambda *args: loaded.append(args))
    for dtype, backend in (("float32", "torch"), ("bfloat16", "cpu_invariant")):
        with pytest.raises(ValueError, match=f"model LlamaForCausalLM needs tensor_parallel, "
                                             f"which the '{backend}' kernel backend"):
            LLM(str(tiny_llama), device="cpu", dtype=dtype, num_kv_blocks=32)
    assert loaded == []  # refused before any weight was read


def test_attend_rotates_with_the_backends_rotary_then_attends():
    """The one entry point: a backend that does not fuse rotary applies its own rotary op
    (here the CPU-invariant C kernel in bf16), bit for bit as rotating first did."""
    generator = torch.Generator().manual_seed(3)
    rotary = RotaryEmbedding(16, 64, 10000.0, None)
    positions = torch.tensor([0, 1, 2, 3, 4])
    meta = AttentionMetadata.build([0], [5], [[1]], 16, CPU)
    for dtype in (torch.float32, torch.bfloat16):
        backend = select_backend("auto", CPU, dtype=dtype, batch_invariant=True)
        q, k, v = (torch.randn(5, h, 16, generator=generator).to(dtype) for h in (4, 2, 2))
        cache = torch.zeros(2, 2, 16, 2, 16, dtype=dtype)
        out = backend.attention.attend(q.clone(), k.clone(), v, rotary, positions, cache.clone(),
                                       meta, 0.25)
        rotated_q, rotated_k = backend.ops.rotary(rotary, positions, q.clone(), k.clone())
        want = backend.attention.forward(rotated_q, rotated_k, v, cache.clone(), meta, 0.25)
        assert torch.equal(out, want)
        plain = backend.attention.attend(q.clone(), k.clone(), v, None, positions, cache.clone(),
                                         meta, 0.25)
        assert torch.equal(plain, backend.attention.forward(q, k, v, cache.clone(), meta, 0.25))


def test_the_runner_and_the_model_never_name_a_backend():
    """Which kernel runs is decided in ops.backend alone (issue 20, point 1)."""
    package = Path(kvrecover.__file__).parent
    runner = (package / "worker" / "model_runner.py").read_text()
    model = (package / "models" / "llama.py").read_text()
    for forbidden in ("ops.triton", "ops.cpu", "ops.reference", 'name == "', "fuses_rotary"):
        assert forbidden not in runner and forbidden not in model, forbidden
    ops_sources = "\n".join(p.read_text() for p in (package / "ops").rglob("*.py"))
    assert "kvrecover.models" not in ops_sources  # rotary tables come as ops.interface types


# ----- native_kernels -----------------------------------------------------------------------
def test_native_kernels_option_is_validated_and_has_both_flags():
    with pytest.raises(ValueError, match=r"native_kernels must be True or False \(or None\), "
                                         r"got 'no'"):
        EngineArgs(native_kernels="no")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    for argv, value in (([], None), (["--native-kernels"], True),
                        (["--no-native-kernels"], False)):
        args = engine_args_from_namespace(parser.parse_args(argv))
        assert args.native_kernels is value
        assert args.to_argv() == argv  # the round trip to another process


def test_native_kernels_false_runs_the_torch_kernels_and_builds_nothing(monkeypatch):
    from kvrecover.ops.cpu import native_build

    builds = []
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setattr(native_build, "_build_and_load", lambda name: builds.append(name))
    monkeypatch.delenv("KVRECOVER_NATIVE_KERNELS", raising=False)
    with pytest.warns(RuntimeWarning, match="native_kernels=False"):
        backend = select_backend("auto", CPU, dtype=torch.bfloat16, native_kernels=False)
    assert isinstance(backend.attention, CpuInvariantAttention)
    x = torch.ones(3, 8, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="the C kernel 'row_ops' is off"):
        backend.ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    assert builds == []
    # The option overrides the environment's default, both ways.
    monkeypatch.setenv("KVRECOVER_NATIVE_KERNELS", "0")
    select_backend("auto", CPU, dtype=torch.bfloat16, native_kernels=True)
    assert builds == ["paged_attention"]


def test_engine_passes_native_kernels_to_the_backend(tiny_llama):
    with pytest.warns(RuntimeWarning, match="native_kernels=False"):
        llm = LLM(str(tiny_llama), device="cpu", dtype="bfloat16", num_kv_blocks=32,
                  native_kernels=False)
    assert isinstance(llm.engine.model_runner.backend.attention, CpuInvariantAttention)

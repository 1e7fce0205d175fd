"""The Gemma building blocks of the small ops: the (1 + w) RMSNorm and GeGLU, bitwise
equal to Hugging Face's modules on the torch path, and row-local in the CPU
invariant ops (a row's bits do not depend on its batch)."""

from __future__ import annotations

import pytest
import torch

from kvrecover.ops.cpu.invariant_ops import InvariantCpuOps
from kvrecover.ops.reference.torch_ops import TorchOps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plus_one_norm_is_bitwise_hf_gemma2_rms_norm(dtype):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    hf = Gemma2RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96))
    x, residual = torch.randn(11, 96).to(dtype), torch.randn(11, 96).to(dtype)
    ops = TorchOps()
    assert torch.equal(ops.rms_norm_plus_one(x, hf.weight, 1e-6), hf(x))
    normed, summed = ops.add_rms_norm_plus_one(x, residual.clone(), hf.weight, 1e-6)
    assert torch.equal(summed, residual + x)
    assert torch.equal(normed, hf(residual + x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_is_bitwise_hf_geglu(dtype):
    from transformers.activations import ACT2FN

    gate_up = torch.randn(11, 2 * 96).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(TorchOps().gelu_tanh_mul(gate_up), ACT2FN["gelu_pytorch_tanh"](gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_ops_are_row_local_in_the_invariant_ops(dtype):
    ops = InvariantCpuOps(native_kernels=True)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(64, 256, generator=generator).to(dtype)
    residual = torch.randn(64, 256, generator=generator).to(dtype)
    weight = torch.randn(256, generator=generator).to(dtype)
    gate_up = torch.randn(64, 512, generator=generator).to(dtype)
    full_norm = ops.rms_norm_plus_one(x, weight, 1e-6)
    full_add = ops.add_rms_norm_plus_one(x, residual.clone(), weight, 1e-6)[0]
    full_gelu = ops.gelu_tanh_mul(gate_up)
    for rows in (slice(0, 1), slice(5, 12), slice(63, 64)):
        assert torch.equal(ops.rms_norm_plus_one(x[rows], weight, 1e-6), full_norm[rows])
        assert torch.equal(ops.add_rms_norm_plus_one(x[rows], residual[rows].clone(), weight,
                                                     1e-6)[0], full_add[rows])
        assert torch.equal(ops.gelu_tanh_mul(gate_up[rows]), full_gelu[rows])

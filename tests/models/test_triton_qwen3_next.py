"""A tiny Qwen3-Next through the engine on the Triton backend, whose Gated DeltaNet
layers run the batched Triton convolution and delta rule: in float32 its greedy tokens
equal the torch backend's, batched prompts of different lengths, chunked prefill and
decode. Marked `gpu`; runs on the CPU under `TRITON_INTERPRET=1` (slowly)."""

from __future__ import annotations

from conftest import CUDA, TRITON_TESTS
from test_qwen3_next_vs_hf import FAMILIES, PROMPTS, build_hybrid

from kvrecover import LLM, SamplingParams

pytestmark = TRITON_TESTS
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_triton_backend_tokens_equal_the_torch_backend(tmp_path):
    folder = build_hybrid(tmp_path / "qwen3_next", **FAMILIES["qwen3_next"])
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    device = "cuda:0" if CUDA else "cpu"
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(folder), device=device, dtype="float32", block_size=16,
                  max_num_batched_tokens=24, attention_backend=backend)
        results[backend] = [o.outputs[0].token_ids for o in llm.generate(requests, GREEDY)]
        if backend == "triton":  # the linear layers ran the batched Triton kernels
            ops = llm.engine.model_runner.backend.ops
            assert getattr(ops, "_plan", None) is not None, type(ops)
        llm.close()
    assert results["triton"] == results["torch"]

"""KV cache groups on the GPU path (rule 8): per-group block tables in the Triton step
inputs, eager and CUDA-graph decode, and windowed recovery, on a tiny Gemma 3 (three
local layers and one global: four groups). Marked `gpu`, skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model, random_prompts

from kvrecover import LLM, KVTransferConfig, SamplingParams

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a real GPU")]
DEVICE = "cuda:0"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
WINDOW = 16
PROMPTS = [{"prompt_token_ids": p}
           for p in random_prompts(5, [5, WINDOW, WINDOW + 1, 80, 140], 384, seed=14)]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    return build_tiny_model(
        tmp_path_factory.mktemp("gemma3_gpu"), model_type="gemma3_text", seed=13,
        sliding_window=WINDOW, head_dim=16, num_hidden_layers=4, layer_types=types,
        query_pre_attn_scalar=24, rope_local_base_freq=500.0, tie_word_embeddings=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_float32_groups_match_the_cpu(tiny_gemma3, enforce_eager, block_size):
    cpu = LLM(str(tiny_gemma3), device="cpu", block_size=block_size, max_num_batched_tokens=64)
    expected = token_ids(cpu.generate(PROMPTS, GREEDY))
    gpu = LLM(str(tiny_gemma3), device=DEVICE, attention_backend="triton", dtype="float32",
              block_size=block_size, max_num_batched_tokens=64, enforce_eager=enforce_eager)
    assert len(gpu.engine.layout.kv_groups) == 4
    assert token_ids(gpu.generate(PROMPTS, GREEDY)) == expected
    if not enforce_eager:
        assert gpu.engine.model_runner.graphs is not None and gpu.engine.model_runner.graphs.graphs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_of_groups_matches_eager(tiny_gemma3, dtype):
    eager = LLM(str(tiny_gemma3), device=DEVICE, dtype=dtype, enforce_eager=True,
                batch_invariant=True)
    graphs = LLM(str(tiny_gemma3), device=DEVICE, dtype=dtype, batch_invariant=True)
    assert token_ids(graphs.generate(PROMPTS, GREEDY)) == token_ids(eager.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_windowed_recovery_on_the_gpu(tiny_gemma3, tmp_path, async_load):
    store = tmp_path / "store"
    producer = KVTransferConfig("SharedStorageConnector", "kv_producer",
                                {"shared_storage_path": str(store)})
    LLM(str(tiny_gemma3), device=DEVICE, kv_transfer_config=producer).generate(PROMPTS, GREEDY)
    baseline = token_ids(LLM(str(tiny_gemma3), device=DEVICE).generate(PROMPTS, GREEDY))
    faults = [{"requests": "all", "blocks": "last", "kind": "corrupt", "group": g}
              for g in range(4)]
    consumer = KVTransferConfig(
        "FaultInjectionConnector", "kv_consumer",
        {"shared_storage_path": str(store), "async_load": async_load, "faults": faults},
        kv_load_retry_limit=0)
    llm = LLM(str(tiny_gemma3), device=DEVICE, kv_transfer_config=consumer)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == baseline
    assert llm.stats["kv_load_recovered_requests"] >= 1
    assert llm.stats["kv_load_failed_requests"] == 0

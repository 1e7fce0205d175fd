"""`LLM.close()` on a GPU gives the KV cache, the weights and the CUDA graphs back, so one
process can open a second `LLM` with the same KV budget (issue 28, goal 5).

Marked `gpu` and skipped without CUDA; `tests/test_shutdown.py` proves on the CPU that no
reference to the cache or the weights survives a close.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, random_prompts

from kvrecover import LLM, KVTransferConfig, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a real GPU"),
]
GIB, MIB = 1 << 30, 1 << 20
PROMPTS = random_prompts(4, [300, 170, 64, 257], 384, seed=7)
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """Small weights, but 128 KiB KV blocks (16 tokens, bf16) and 32k positions: the KV
    budget (a share of the GPU) binds, not the cap of max_num_seqs full sequences."""
    return build_tiny_model(tmp_path_factory.mktemp("wide"), hidden_size=512,
                            intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=4, max_position_embeddings=32768)


def open_and_run(model: Path, store: Path) -> LLM:
    """An LLM whose KV budget is 40% of the GPU less what is in use, with CUDA graphs and
    a connector's pinned staging rows, that saved its prompts' KV and loaded it back."""
    transfer = KVTransferConfig("SharedStorageConnector", "kv_both",
                                {"shared_storage_path": str(store)})
    llm = LLM(str(model), device="cuda:0", dtype="bfloat16", gpu_memory_utilization=0.4,
              enable_prefix_caching=False, kv_transfer_config=transfer)
    for _ in range(2):  # saves, then loads what it saved
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    assert llm.stats["prompt_tokens_external"] > 0
    assert llm.engine.model_runner.graphs.graphs, "no decode step replayed a CUDA graph"
    return llm


def settled_allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def test_close_gives_the_memory_back_and_a_second_llm_the_same_kv_budget(wide_model, tmp_path):
    # One-time allocations of the process (cuBLAS workspaces, loaded kernels) happen here.
    open_and_run(wide_model, tmp_path / "warm-up").close()
    baseline = settled_allocated()
    baseline_reserved = torch.cuda.memory_reserved()
    first = open_and_run(wide_model, tmp_path / "first")
    first_blocks = first.engine.num_blocks
    assert first_blocks < first.engine.config.kv_sizing.max_useful_blocks  # the budget bound
    assert torch.cuda.memory_allocated() - baseline > 10 * GIB  # the KV cache is in
    first.close()
    torch.cuda.synchronize()
    left = torch.cuda.memory_allocated() - baseline  # close itself freed it: no gc.collect here
    assert left <= 8 * MIB, f"{left / MIB:.1f} MiB still allocated after close"
    assert torch.cuda.memory_reserved() - baseline_reserved <= 64 * MIB  # and returned it to the driver
    second = open_and_run(wide_model, tmp_path / "second")
    assert second.engine.num_blocks == first_blocks, (
        f"the second LLM got {second.engine.num_blocks} KV blocks, the first {first_blocks}")
    second.close()
    with pytest.raises(RuntimeError, match="closed"):
        second.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS)

"""Linear-attention hybrids on the GPU: a tiny Qwen3-Next (linear and full layers, experts)
on CUDA gives the CPU's tokens in float32, and in bf16 with `batch_invariant` the same
tokens whatever the prefill chunking and with a prefix-cache hit resuming from a state
checkpoint. Marked `gpu`, skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from test_qwen3_next_vs_hf import FAMILIES, PROMPTS, build_hybrid

from kvrecover import LLM, SamplingParams

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a real GPU")]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
REQUESTS = [{"prompt_token_ids": p} for p in PROMPTS]


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory):
    return build_hybrid(tmp_path_factory.mktemp("qwen3_next_gpu"), **FAMILIES["qwen3_next"])


def token_ids(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(REQUESTS, GREEDY)]


def test_float32_on_the_gpu_matches_the_cpu(qwen3_next_dir):
    cpu = LLM(str(qwen3_next_dir), device="cpu", block_size=16, max_num_batched_tokens=12)
    gpu = LLM(str(qwen3_next_dir), device="cuda:0", dtype="float32", block_size=16,
              max_num_batched_tokens=12)
    assert token_ids(gpu) == token_ids(cpu)


@pytest.mark.parametrize("block_size", [4, 16])
def test_bf16_invariant_tokens_do_not_depend_on_chunking_or_prefix_reuse(qwen3_next_dir,
                                                                         block_size):
    def engine(budget: int) -> LLM:
        return LLM(str(qwen3_next_dir), device="cuda:0", dtype="bfloat16", block_size=block_size,
                   max_num_batched_tokens=budget, batch_invariant=True)

    whole = engine(256)
    expected = token_ids(whole)
    assert token_ids(whole) == expected  # the second pass resumes from checkpoints
    assert whole.stats["prefix_cache_hit_tokens"] > 0
    assert token_ids(engine(7)) == expected


def test_the_gpu_holds_a_state_slot_for_every_sequence_before_sizing_the_kv_cache(
        qwen3_next_dir):
    llm = LLM(str(qwen3_next_dir), device="cuda:0", dtype="bfloat16", block_size=16,
              max_num_seqs=6, batch_invariant=True)
    pool = llm.engine.model_runner.recurrent_states
    assert pool.num_slots == 6
    tensors = [t for layer in pool.tensors.values() for t in layer.values()]
    addresses = [t.data_ptr() for t in tensors]
    many = [{"prompt_token_ids": p} for p in PROMPTS * 3]  # more requests than slots
    outputs = llm.generate(many, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs[: len(PROMPTS)]] == token_ids(llm)
    assert pool.num_slots == 6  # never grown: the pool the KV cache was sized around
    assert [t.data_ptr() for layer in pool.tensors.values() for t in layer.values()] == addresses


def test_a_default_max_num_seqs_is_cut_to_the_state_slots_that_fit(qwen3_next_dir, monkeypatch):
    from kvrecover.worker import model_runner

    probe = LLM(str(qwen3_next_dir), device="cuda:0", dtype="bfloat16", block_size=16,
                max_num_seqs=1, batch_invariant=True)
    per_request = probe.engine.model_runner.recurrent_states.bytes_per_request
    expected = token_ids(probe)
    probe.close()
    free = torch.cuda.mem_get_info()[0]
    monkeypatch.setattr(model_runner, "STATE_MEMORY_SHARE", 2.5 * per_request / free)
    llm = LLM(str(qwen3_next_dir), device="cuda:0", dtype="bfloat16", block_size=16,
              batch_invariant=True)  # max_num_seqs: the device's default
    assert llm.engine.model_runner.recurrent_states.num_slots == 2
    assert llm.engine.scheduler_config.max_num_seqs == 2
    assert token_ids(llm) == expected  # 4 prompts through 2 slots

"""Prompts of a hybrid (Qwen3-Next) that share prefixes and run in the same steps, laid
out as the reference scenario's: two long prompts sharing a prefix, two short ones
sharing a shorter prefix that is the long prompts' start. The recurrent-state
checkpoints one request writes in a step are no restore point for another request
until the step ran, two requests of a step never write one checkpoint slot, and a
producer stores the state at every prompt's last loadable boundary even when another
request of the step (or an earlier one) holds its checkpoint already. Token ids are
compared with a run without prefix caching or connector."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import random_prompts, storage_transfer
from test_qwen3_next_connectors import last_boundary_key, state_entries
from test_qwen3_next_vs_hf import FAMILIES, build_hybrid, generate

from kvrecover import LLM

BLOCK = 4
LONG = random_prompts(1, [46], vocab_size=384, seed=11)[0]
# The short prompts' shared prefix is the long ones' start, and their last loadable
# boundary (24) lies inside it, as in the scenario (a long prompt checkpoints it first).
SHORT = LONG[:25]
TAILS = random_prompts(4, [2, 3], vocab_size=384, seed=12)
PROMPTS = [LONG + TAILS[0], LONG + TAILS[1], SHORT + TAILS[2], SHORT + TAILS[3]]


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory) -> Path:
    return build_hybrid(tmp_path_factory.mktemp("qwen3_next"), **FAMILIES["qwen3_next"])


@pytest.fixture(scope="module")
def baseline(qwen3_next_dir) -> list[list[int]]:
    llm = LLM(str(qwen3_next_dir), block_size=BLOCK, device="cpu", enable_prefix_caching=False)
    outputs = generate(llm, PROMPTS)
    llm.close()
    return outputs


def hybrid_llm(folder: Path, **engine) -> LLM:
    settings = dict(block_size=BLOCK, device="cpu", max_num_seqs=16)
    return LLM(str(folder), **{**settings, **engine})


@pytest.mark.parametrize("budget", [12, 16, 64])
@pytest.mark.parametrize("num_checkpoints", [3, 32])
def test_prefix_hits_within_one_batch_equal_the_uncached_run(qwen3_next_dir, baseline, budget,
                                                             num_checkpoints):
    llm = hybrid_llm(qwen3_next_dir, max_num_batched_tokens=budget,
                     num_state_checkpoints=num_checkpoints)
    assert generate(llm, PROMPTS) == baseline
    llm.close()


# Producer budget 256: one step, the long prompts checkpoint the short ones' boundary;
# 12: the short prompts hit the long ones' blocks exactly up to their last loadable
# boundary, and store the state they restore from there.
@pytest.mark.parametrize(("producer_budget", "consumer_budget", "prefix_caching"), [
    (256, 12, True), (256, 64, True), (256, 12, False), (12, 12, False), (12, 64, True)])
def test_a_producer_stores_every_prompts_state_and_a_consumer_loads_them(
        qwen3_next_dir, baseline, tmp_path, producer_budget, consumer_budget, prefix_caching):
    producer = hybrid_llm(qwen3_next_dir, max_num_batched_tokens=producer_budget,
                          kv_transfer_config=storage_transfer(tmp_path, "kv_producer"))
    assert generate(producer, PROMPTS) == baseline
    producer.close()
    stored = {path.name for path in state_entries(tmp_path)}
    for prompt in PROMPTS:  # the short prompts' boundary was checkpointed by a long one
        assert any(last_boundary_key(prompt).hex() in name for name in stored)
    consumer = hybrid_llm(qwen3_next_dir, max_num_batched_tokens=consumer_budget,
                          enable_prefix_caching=prefix_caching,
                          kv_transfer_config=storage_transfer(tmp_path, "kv_consumer"))
    assert generate(consumer, PROMPTS) == baseline
    loadable = [(len(prompt) - 1) // BLOCK * BLOCK for prompt in PROMPTS]
    stats = consumer.stats
    # Every prompt's KV comes from the store, or from a prompt of the batch that loaded it.
    assert stats["prompt_tokens_external"] + stats["prefix_cache_hit_tokens"] == sum(loadable)
    if not prefix_caching:
        assert stats["prompt_tokens_external"] == sum(loadable)
    consumer.close()

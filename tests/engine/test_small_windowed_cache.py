"""A KV cache too small for a windowed model's prompt in one chunk, large enough with
smaller ones (issue 41 item 5).

A windowed group holds only its window, so a request's peak need depends on its chunk:
the scheduler shrinks a chunk that does not fit rather than fail or preempt the request
itself. Admission refuses, with the block counts, only a request that could never fit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import WINDOWED_CHECKPOINTS, build_tiny_model, random_prompts

from kvrecover import LLM, KVTransferConfig, SamplingParams

BLOCK = 8
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=[*WINDOWED_CHECKPOINTS, "gpt_oss"])
def model(request, tmp_path_factory) -> Path:
    if request.param == "gpt_oss":
        return request.getfixturevalue("tiny_gpt_oss")  # window 24 too
    return build_tiny_model(tmp_path_factory.mktemp(request.param),
                            **WINDOWED_CHECKPOINTS[request.param])


def engine(model: Path, num_kv_blocks: int | None = None, kv=None) -> LLM:
    return LLM(str(model), device="cpu", block_size=BLOCK, max_num_batched_tokens=512,
               num_kv_blocks=num_kv_blocks, kv_transfer_config=kv)


def smallest_cache(model: Path, num_tokens: int) -> int:
    """The fewest blocks (null block included) admission accepts for that many tokens."""
    return engine(model).engine.scheduler.kv_manager.max_blocks_needed(num_tokens) + 1


@pytest.mark.parametrize("length", [150, 333, 500])
def test_a_prompt_that_fits_only_in_smaller_chunks_is_served_exactly(model, length):
    prompt = random_prompts(1, [length], 384, seed=length)[0]
    expected = engine(model).generate([{"prompt_token_ids": prompt}], PARAMS)[0]
    total = length + PARAMS.max_tokens
    # In one chunk every group holds a block for each of the prompt's positions.
    num_groups = len(engine(model).engine.layout.kv_groups)
    one_chunk = num_groups * -(-length // BLOCK) + 1
    smallest = smallest_cache(model, total)
    assert smallest < one_chunk
    for blocks in sorted({smallest, (smallest + one_chunk) // 2}):
        output = engine(model, blocks).generate([{"prompt_token_ids": prompt}], PARAMS)[0]
        assert output.error is None, (blocks, output.error)
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids, blocks


def test_several_requests_share_a_small_cache_and_all_finish_exactly(model):
    prompts = random_prompts(3, [300, 200, 260], 384, seed=5)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    expected = [o.outputs[0].token_ids for o in engine(model).generate(inputs, PARAMS)]
    blocks = smallest_cache(model, 300 + PARAMS.max_tokens)
    outputs = engine(model, blocks).generate(inputs, PARAMS)
    assert [o.error for o in outputs] == [None] * 3
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_load_into_a_small_cache_is_exact(model, tmp_path, async_load):
    prompt = random_prompts(1, [333], 384, seed=3)[0]
    store = {"shared_storage_path": str(tmp_path)}
    engine(model, kv=KVTransferConfig("SharedStorageConnector", "kv_producer", store)
           ).generate([{"prompt_token_ids": prompt}], PARAMS)
    expected = engine(model).generate([{"prompt_token_ids": prompt}], PARAMS)[0]
    consumer = KVTransferConfig("SharedStorageConnector", "kv_consumer",
                                {**store, "async_load": async_load})
    llm = engine(model, smallest_cache(model, 333 + PARAMS.max_tokens), consumer)
    output = llm.generate([{"prompt_token_ids": prompt}], PARAMS)[0]
    assert output.error is None
    assert output.outputs[0].token_ids == expected.outputs[0].token_ids
    assert llm.stats["prompt_tokens_external"] > 0


def test_a_request_that_can_never_fit_is_refused_at_admission(model):
    prompt = random_prompts(1, [333], 384, seed=4)[0]
    blocks = smallest_cache(model, 333 + PARAMS.max_tokens) - 1
    with pytest.raises(ValueError, match=rf"needs {blocks} KV blocks but the cache has "
                                         rf"{blocks - 1}"):
        engine(model, blocks).generate([{"prompt_token_ids": prompt}], PARAMS)

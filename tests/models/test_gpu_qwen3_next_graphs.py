"""CUDA-graphed decode of linear-attention hybrids: a tiny Qwen3-Next / Qwen3.5 in bf16
on CUDA replays decode graphs (the recurrent plan packed into the graph's static
inputs, checkpoints written inside the graph) and gives the token ids of
`enforce_eager=True`, over batch sizes 1/3/8 and lengths crossing chunk and block
boundaries, with prefix-cache hits resuming from checkpoints the graphs wrote, with a
store connector, and through a failed load's recovery. Marked `gpu`, skipped without
CUDA."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import random_prompts, storage_transfer
from test_qwen3_next_recovery import faulty
from test_qwen3_next_vs_hf import FAMILIES, build_hybrid

from kvrecover import LLM, SamplingParams

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a real GPU")]
BLOCK = 16  # the delta rule's chunk is 16 too: decode crosses both every 16 tokens
# Prompt lengths around chunk/block boundaries; 40 new tokens cross two or three more.
LENGTHS = [5, 16, 23, 31, 1, 47, 15, 33]
PROMPTS = random_prompts(len(LENGTHS), LENGTHS, vocab_size=384, seed=11)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def hybrid_dir(request, tmp_path_factory) -> Path:
    family = request.param
    return build_hybrid(tmp_path_factory.mktemp(family), **FAMILIES[family])


def engine(folder: Path, eager: bool, **settings) -> LLM:
    base = dict(device="cuda:0", dtype="bfloat16", block_size=BLOCK, batch_invariant=True,
                max_num_batched_tokens=64, enforce_eager=eager, gpu_memory_utilization=0.3)
    return LLM(str(folder), **{**base, **settings})


def count_replays(llm: LLM) -> list[int]:
    """Wrap the runner's graph replay; the list's length counts graphed decode steps."""
    graphs = llm.engine.model_runner.graphs
    assert graphs is not None, "a hybrid model on CUDA must have decode graphs"
    replays: list[int] = []
    run = graphs.run

    def counted(scheduled, *args, **kwargs):
        replays.append(len(scheduled))
        return run(scheduled, *args, **kwargs)

    graphs.run = counted
    return replays


def token_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graphed_decode_gives_the_eager_tokens(hybrid_dir, batch):
    prompts = PROMPTS[:batch]
    eager = engine(hybrid_dir, eager=True, enable_prefix_caching=False)
    assert eager.engine.model_runner.graphs is None
    expected = token_ids(eager, prompts)
    eager.close()
    graphed = engine(hybrid_dir, eager=False, enable_prefix_caching=False)
    replays = count_replays(graphed)
    assert token_ids(graphed, prompts) == expected
    # Every pure decode step replays (steps with a prefill chunk run eagerly).
    assert len(replays) >= GREEDY.max_tokens // 2 and max(replays) == batch
    assert graphed.engine.model_runner.graphs.graphs  # captured, then replayed
    graphed.close()


def test_prefix_hits_resume_from_checkpoints_the_graphs_wrote(hybrid_dir):
    """The second pass's prompts extend the first's outputs past block boundaries that
    only graphed decode steps reached: their prefix hits restore checkpoints that the
    graphs wrote, and must give what a cold eager engine computes."""
    first = PROMPTS[:3]
    graphed = engine(hybrid_dir, eager=False)
    replays = count_replays(graphed)
    outputs = token_ids(graphed, first)
    assert replays
    extended = [p + o[:33] + [7, 8, 9] for p, o in zip(first, outputs)]
    hits = graphed.stats["prefix_cache_hit_tokens"]
    got = token_ids(graphed, extended)
    assert graphed.stats["prefix_cache_hit_tokens"] - hits >= 3 * 2 * BLOCK
    graphed.close()
    cold = engine(hybrid_dir, eager=True, enable_prefix_caching=False)
    assert token_ids(cold, extended) == got
    cold.close()


def test_a_store_connector_and_a_failed_load_give_the_eager_tokens(hybrid_dir, tmp_path):
    prompts = [PROMPTS[5], PROMPTS[7], PROMPTS[2], PROMPTS[0]]  # the first loads 2 blocks
    eager = engine(hybrid_dir, eager=True, enable_prefix_caching=False)
    expected = token_ids(eager, prompts)
    eager.close()
    store = tmp_path / "store"
    producer = engine(hybrid_dir, eager=False, enable_prefix_caching=False,
                      kv_transfer_config=storage_transfer(store, "kv_producer"))
    replays = count_replays(producer)
    assert token_ids(producer, prompts) == expected
    assert replays
    producer.close()
    consumer = engine(hybrid_dir, eager=False, enable_prefix_caching=False,
                      kv_transfer_config=storage_transfer(store, "kv_consumer"))
    replays = count_replays(consumer)
    assert token_ids(consumer, prompts) == expected
    assert consumer.stats["prompt_tokens_external"] > 0 and replays
    consumer.close()
    for target in ("kv", "state"):
        copy = tmp_path / f"store-{target}"  # each recovery on a pristine copy
        shutil.copytree(store, copy)
        recovering = engine(hybrid_dir, eager=False, enable_prefix_caching=False,
                            kv_transfer_config=faulty(copy, target, "corrupt"))
        replays = count_replays(recovering)
        assert token_ids(recovering, prompts) == expected, target
        assert recovering.stats["kv_load_recovered_requests"] > 0 and replays
        recovering.close()

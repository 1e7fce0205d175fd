"""The NCCL path on one GPU, as far as one GPU takes it: a size-1 NCCL group through the
same rendezvous and collectives as size N, the vocabulary-parallel layers over it, and a
whole engine whose model runner is the tensor-parallel one at size 1 (same tokens as the
plain runner). Marked `gpu`; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from kvrecover import LLM, SamplingParams
from kvrecover.distributed.group import DistributedGroup, create_process_group
from kvrecover.distributed.rendezvous import open_store

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


def nccl_group(fixed_order: bool) -> DistributedGroup:
    store = open_store(None, timeout_s=60)
    device = torch.device("cuda", 0)
    return DistributedGroup(create_process_group(store, 0, 1, device, 60), 0, 1,
                            fixed_order=fixed_order)


@pytest.mark.parametrize("fixed_order", [False, True])
def test_nccl_collectives_at_size_1(fixed_order):
    group = nccl_group(fixed_order)
    tensor = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(group.all_reduce(tensor.clone()), tensor)
    assert torch.equal(group.gather_to_first(tensor), tensor)
    group.shutdown()


def test_vocab_parallel_layers_over_nccl_equal_the_plain_ones():
    from kvrecover.models.parallel_layers import ParallelLMHead, VocabParallelEmbedding
    from kvrecover.ops.reference.torch_ops import TorchOps

    group, ops = nccl_group(fixed_order=True), TorchOps()
    with torch.device("cuda"):
        embed = VocabParallelEmbedding(100, 32, group)
        head = ParallelLMHead(32, 100, group)
    ids = torch.tensor([0, 5, 99], device="cuda")
    assert torch.equal(embed.lookup(ids, ops), embed.weight[ids])
    hidden = torch.randn(3, 32, device="cuda")
    assert torch.equal(head.logits(hidden, ops), hidden @ head.weight.T)
    group.shutdown()


def test_an_engine_on_the_tensor_parallel_runner_at_size_1(tiny_llama, monkeypatch):
    from kvrecover.engine import engine as engine_module
    from kvrecover.worker.parallel_runner import RankSpec, TensorParallelRunner

    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, [7, 40, 100], 384, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    settings = dict(device="cuda", dtype="float32", enforce_eager=True, num_kv_blocks=64)
    with LLM(str(tiny_llama), **settings) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]

    def size_1_group_runner(config):
        args = config.args
        return TensorParallelRunner(RankSpec(
            config.model_config, config.model_dir, config.device, config.dtype,
            config.max_model_len, config.layout, True, args.batch_invariant,
            config.attention_backend, args.native_kernels, args.kv_transfer_config,
            args.seed, 1))

    monkeypatch.setattr(engine_module, "_model_runner", size_1_group_runner)
    with LLM(str(tiny_llama), **settings) as grouped:
        assert isinstance(grouped.engine.model_runner, TensorParallelRunner)
        assert [o.outputs[0].token_ids for o in grouped.generate(prompts, params)] == want

"""Tensor parallelism at size 2 on the CPU (gloo, two processes): greedy ids equal
Hugging Face for the Llama and Qwen families, sharded weights hold only their slice,
and bad sizes are refused at start-up naming both numbers."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, hf_greedy, random_prompts
from safetensors.torch import load_file

from kvrecover import LLM, SamplingParams
from kvrecover.distributed.rendezvous import open_store
from kvrecover.models.config import ModelConfig
from kvrecover.models.loader import load_weights, skip_weight_init
from kvrecover.models.parallel_layers import HeadShard, shard_heads, vocab_range
from kvrecover.models.registry import build_model, load_model_config
from kvrecover.ops.backend import select_backend

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPT_LENGTHS = [5, 40, 90]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    """Qwen3: q/k norms, explicit head_dim, untied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("tp_qwen3"), model_type="qwen3", seed=3,
                            head_dim=32)


@pytest.fixture(scope="module")
def tiny_qwen2_one_kv_head(tmp_path_factory) -> Path:
    """Qwen2 with q/k/v biases, one KV head (replicated on both ranks) and a vocabulary
    that two ranks do not split evenly (the last rank's slice is padded)."""
    return build_tiny_model(tmp_path_factory.mktemp("tp_qwen2"), model_type="qwen2", seed=2,
                            num_key_value_heads=1, vocab_size=383, tie_word_embeddings=True)


def generate_ids(model_dir: Path, prompts: list[list[int]], **options) -> list[list[int]]:
    with LLM(str(model_dir), device="cpu", block_size=8, num_kv_blocks=64, **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3", "tiny_qwen2_one_kv_head"])
def test_greedy_at_size_2_equals_hugging_face(family, request):
    model_dir = request.getfixturevalue(family)
    vocab = load_model_config(model_dir).vocab_size
    prompts = random_prompts(3, PROMPT_LENGTHS, vocab, seed=5)
    expected = hf_greedy(model_dir, prompts, MAX_NEW)
    assert generate_ids(model_dir, prompts, tensor_parallel_size=2) == expected


def _rank_model(model_dir: Path, rank: int, size: int):
    class FakeGroup:  # loading needs the rank only; no collective runs here
        def __init__(self) -> None:
            self.rank, self.size = rank, size

    config = load_model_config(model_dir)
    backend = select_backend("torch", torch.device("cpu"))
    with skip_weight_init():
        model = build_model(config, backend, 64, FakeGroup())
    load_weights(model, model_dir)
    return config, model


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_holds_exactly_its_slice_of_each_weight(tiny_qwen3, rank):
    config, model = _rank_model(tiny_qwen3, rank, 2)
    weights = load_file(str(tiny_qwen3 / "model.safetensors"))
    heads = shard_heads(config.num_attention_heads, config.num_key_value_heads, 2, rank)
    dim = config.head_dim
    q_rows = slice(heads.head_start * dim, (heads.head_start + heads.num_heads) * dim)
    kv_rows = slice(heads.kv_head_start * dim, (heads.kv_head_start + heads.num_kv_heads) * dim)
    attn = model.layers[1].self_attn
    expected_qkv = torch.cat([weights["model.layers.1.self_attn.q_proj.weight"][q_rows],
                              weights["model.layers.1.self_attn.k_proj.weight"][kv_rows],
                              weights["model.layers.1.self_attn.v_proj.weight"][kv_rows]])
    assert torch.equal(attn.qkv_proj.weight, expected_qkv)
    assert torch.equal(attn.o_proj.weight,
                       weights["model.layers.1.self_attn.o_proj.weight"][:, q_rows])
    half = config.intermediate_size // 2
    mlp_rows = slice(rank * half, (rank + 1) * half)
    mlp = model.layers[1].mlp
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([
        weights["model.layers.1.mlp.gate_proj.weight"][mlp_rows],
        weights["model.layers.1.mlp.up_proj.weight"][mlp_rows]]))
    assert torch.equal(mlp.down_proj.weight, weights["model.layers.1.mlp.down_proj.weight"][:, mlp_rows])
    start, per_rank = vocab_range(config.vocab_size, 2, rank)
    assert torch.equal(model.lm_head.weight, weights["lm_head.weight"][start : start + per_rank])
    total = sum(p.numel() for p in model.parameters())
    whole = sum(w.numel() for w in weights.values())
    assert total < 0.6 * whole  # norms are replicated; everything else is halved


def test_fewer_kv_heads_than_ranks_replicates_them():
    assert [shard_heads(8, 2, 4, rank) for rank in range(4)] == [
        HeadShard(2, 2 * rank, 1, rank // 2) for rank in range(4)]
    assert shard_heads(8, 4, 2, 1).num_kv_heads == 2 and shard_heads(8, 4, 2, 1).kv_head_start == 2
    assert vocab_range(383, 2, 1) == (192, 192)


@pytest.mark.parametrize(("size", "numbers"), [(3, ("3", "num_attention_heads 4")),
                                               (8, ("8", "num_attention_heads 4"))])
def test_a_size_that_does_not_split_the_heads_is_refused_at_start_up(tiny_llama, size, numbers):
    started = time.monotonic()
    with pytest.raises(ValueError) as error:
        LLM(str(tiny_llama), device="cpu", tensor_parallel_size=size)
    for number in numbers:
        assert number in str(error.value)
    assert time.monotonic() - started < 5  # refused before any rank process starts


def test_kv_heads_that_do_not_divide_the_ranks_are_refused():
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=48,
                         intermediate_size=48, num_hidden_layers=1, num_attention_heads=6,
                         num_key_value_heads=3, head_dim=8, rms_norm_eps=1e-5,
                         rope_theta=1e4, max_position_embeddings=16, tie_word_embeddings=False)
    from kvrecover.models.registry import check_tensor_parallel_family, model_class

    with pytest.raises(ValueError, match="tensor_parallel_size 2 and the model's "
                                         "num_key_value_heads 3"):
        check_tensor_parallel_family(model_class(config.architecture), config, 2)


def test_a_rendezvous_port_in_use_is_replaced_by_a_free_one():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        store = open_store(port, timeout_s=5)
        assert store.port != port
        assert time.monotonic() - started < 5


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["prefill"], ["decode"],
                                     ["scenario"], ["serve"], ["serve-demo"]])
def test_every_engine_command_takes_the_tensor_parallel_size_flag(command):
    from kvrecover.config import engine_args_from_namespace
    from kvrecover.entrypoints.cli.main import build_parser

    namespace = build_parser().parse_args([*command, "--tensor-parallel-size", "2"])
    assert engine_args_from_namespace(namespace).tensor_parallel_size == 2


def test_sampling_controls_grammars_and_logprobs_at_size_2_equal_size_1(tiny_llama):
    """Prompt and output logprobs (the LM head is a collective: every rank scores the
    prompt rows, rank 0 reads them), a penalty, a JSON schema and n=2 choices, seeded:
    the same tokens and logprobs as one rank."""
    from structured_helpers import PERSON_SCHEMA

    from kvrecover.structured.params import StructuredOutputsParams

    prompts = random_prompts(2, [21, 37], 384, seed=9)
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_NEW, n=2, logprobs=2,
                             prompt_logprobs=1, presence_penalty=1.0),
              SamplingParams(temperature=0, max_tokens=80, logprobs=1, frequency_penalty=0.5,
                             structured_outputs=StructuredOutputsParams(json=PERSON_SCHEMA))]

    def run(size: int):
        with LLM(str(tiny_llama), device="cpu", block_size=8, num_kv_blocks=64,
                 tensor_parallel_size=size) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [([c.token_ids for c in o.outputs],
                 [[(r.token_id, r.rank) for r in c.logprobs] for c in o.outputs],
                 [[round(r.logprob, 3) for r in c.logprobs] for c in o.outputs],
                 None if o.prompt_logprobs is None else
                 [None if r is None else (r.token_id, round(r.logprob, 3))
                  for r in o.prompt_logprobs]) for o in outputs]

    one, two = run(1), run(2)
    assert one[0][3] is not None and len(one[0][3]) == len(prompts[0])
    assert one[1][0][0][-1] == 1  # the grammar completed: EOS
    assert two == one

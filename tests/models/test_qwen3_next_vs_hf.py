"""Linear-attention hybrids (Qwen3-Next, Qwen3.5 dense and MoE) equal Hugging Face token
for token: float32 on the CPU, tiny random checkpoints with linear and full layers
(`layer_types`, or Hugging Face's `full_attention_interval`), under chunked prefill,
block sizes 4 and 16, a KV budget tight enough to preempt, batches of prompts of
different lengths, and prefix-cache reuse resuming from recurrent-state checkpoints
(connectors carrying the states: `test_qwen3_next_connectors.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tokenizer, hf_greedy, random_prompts

from kvrecover import LLM, SamplingParams

LENGTHS = [5, 23, 41]
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = random_prompts(len(LENGTHS), LENGTHS, vocab_size=384, seed=0)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)
FAMILIES = {
    # Full layers 1 and 3 (layer_types), experts except in layer 2 (mlp_only_layers).
    "qwen3_next": dict(model_type="qwen3_next", seed=3, mlp_only_layers=[2], **EXPERTS,
                       layer_types=["linear_attention", "full_attention", "linear_attention",
                                    "full_attention"]),
    # Hugging Face's default layout: every second layer full (full_attention_interval).
    "qwen3_5": dict(model_type="qwen3_5_text", seed=4, full_attention_interval=2),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", seed=5, **EXPERTS),
}
_HF: dict[str, list[list[int]]] = {}


def build_hybrid(folder: Path, *, seed: int, **overrides) -> Path:
    """A random tiny hybrid checkpoint; every weight random (norms and gates too, so
    that (1 + w) norms and the decay parameters are exercised)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = overrides.pop("model_type")
    settings = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0,
                    eos_token_id=1, tie_word_embeddings=False, **LINEAR)
    settings.update(overrides)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.08)
            elif name.endswith("A_log"):
                param.uniform_(-1.0, 1.0)
            else:
                param.normal_(0, 0.2).add_(1.0 if "linear_attn.norm" in name else 0.0)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder, settings["vocab_size"])
    return folder


@pytest.fixture(scope="module", params=list(FAMILIES))
def hybrid(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    return name, build_hybrid(tmp_path_factory.mktemp(name), **FAMILIES[name])


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory) -> Path:
    return build_hybrid(tmp_path_factory.mktemp("qwen3_next"), **FAMILIES["qwen3_next"])


def reference(hybrid: tuple[str, Path]) -> list[list[int]]:
    name, folder = hybrid
    if name not in _HF:
        _HF[name] = hf_greedy(folder, PROMPTS, MAX_NEW)
    return _HF[name]


def generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


def test_checkpoints_are_hybrids(hybrid):
    name, folder = hybrid
    config = LLM(str(folder), device="cpu", block_size=16).engine.model_runner.model.config
    assert 0 < len(config.recurrent_layers()) < config.num_hidden_layers
    assert (config.num_experts > 0) == (name != "qwen3_5")


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_matches_hf_under_chunked_prefill(hybrid, block_size):
    # A 12-token budget prefills the longer prompts in several chunks, mid-block too.
    llm = LLM(str(hybrid[1]), block_size=block_size, max_num_batched_tokens=12, device="cpu")
    assert generate(llm) == reference(hybrid)
    assert llm.stats["prompt_tokens_computed"] == sum(map(len, PROMPTS))


def test_tight_kv_budget_preempts_and_keeps_hf_outputs(hybrid):
    # The longest request (41 + 8 tokens) needs 13 blocks of 4; 16 hold it, not the batch.
    llm = LLM(str(hybrid[1]), block_size=4, max_num_batched_tokens=32, device="cpu",
              num_kv_blocks=17)
    assert generate(llm) == reference(hybrid)
    assert llm.stats["num_preemptions"] > 0


def test_float32_batch_invariant_kernels_match_hf(qwen3_next_dir):
    llm = LLM(str(qwen3_next_dir), block_size=16, max_num_batched_tokens=16, device="cpu",
              batch_invariant=True)
    assert llm.engine.model_runner.backend.name == "cpu_invariant"
    assert generate(llm) == reference(("qwen3_next", qwen3_next_dir))


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefix_cache_reuse_resumes_from_state_checkpoints(hybrid, block_size):
    """The second pass hits every cached block boundary that has a state checkpoint and
    resumes there, with Hugging Face's tokens."""
    llm = LLM(str(hybrid[1]), block_size=block_size, max_num_batched_tokens=12, device="cpu")
    first = generate(llm)
    computed = llm.stats["prompt_tokens_computed"]
    assert first == generate(llm) == reference(hybrid)
    hits = sum((len(p) - 1) // block_size * block_size for p in PROMPTS)
    assert hits > 0 and llm.stats["prefix_cache_hit_tokens"] == hits
    assert llm.stats["prompt_tokens_computed"] == 2 * computed - hits


def test_checkpoint_memory_is_bounded_and_outputs_stay_hf(qwen3_next_dir):
    """Two checkpoint slots: the pool stays that size (the oldest boundaries give way),
    same tokens; none: no prefix is reused at all."""
    for slots in (2, 0):
        llm = LLM(str(qwen3_next_dir), block_size=4, device="cpu", num_state_checkpoints=slots)
        assert generate(llm) == generate(llm) == reference(("qwen3_next", qwen3_next_dir))
        states = llm.engine.model_runner.recurrent_states
        assert all(t.shape[0] == slots for layer in states.checkpoints.values()
                   for t in layer.values())
        assert states.bytes_per_checkpoint > 0
        if slots == 0:
            assert llm.stats["prefix_cache_hit_tokens"] == 0


def _edited_copy(folder: Path, target: Path, **changes) -> Path:
    target.mkdir()
    for item in folder.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(("changes", "field"), [
    ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]},
     "layer_types names mamba"),
    ({"layer_types": ["linear_attention"] * 4}, "no full_attention layer"),
    ({"layer_types": ["full_attention"]}, "one type per layer"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
    ({"linear_value_head_dim": 16}, "linear_attn"),  # shapes that do not fit the weights
])
def test_bad_configs_are_value_errors_naming_the_field(qwen3_next_dir, tmp_path, changes, field):
    folder = _edited_copy(qwen3_next_dir, tmp_path / "edited", **changes)
    with pytest.raises(ValueError, match=field):
        LLM(str(folder), device="cpu")


def checkpoint_bits(llm: LLM) -> dict[bytes, list[torch.Tensor]]:
    """Every checkpointed block boundary (by its block's chain hash) -> its states."""
    states = llm.engine.model_runner.recurrent_states
    slots = llm.engine.scheduler.state_checkpoints._slots
    return {block_hash: [t[slot] for layer in states.checkpoints.values() for t in layer.values()]
            for block_hash, slot in slots.items()}


def test_bf16_states_at_block_boundaries_have_the_same_bits_for_every_chunking(qwen3_next_dir):
    """Issue 23 point 2, end to end: on the CPU's batch-invariant kernels (bf16's default)
    the conv and recurrent states at every block boundary, prompt and output alike, and
    the tokens, do not depend on the prefill chunk or the batch."""
    runs = []
    for budget, prompts in ((64, PROMPTS), (7, PROMPTS), (64, PROMPTS[2:])):
        llm = LLM(str(qwen3_next_dir), dtype="bfloat16", block_size=4, device="cpu",
                  max_num_batched_tokens=budget, num_state_checkpoints=64)
        assert llm.engine.model_runner.backend.name == "cpu_invariant"
        runs.append((generate(llm, prompts), checkpoint_bits(llm)))
    (tokens, whole), (chunked_tokens, chunked), (alone_tokens, alone) = runs
    assert chunked_tokens == tokens and alone_tokens == tokens[2:]
    assert len(whole) == len(chunked) == sum((len(p) + MAX_NEW - 1) // 4 for p in PROMPTS)
    assert set(alone) <= set(whole)
    for other in (chunked, alone):
        for block_hash, states in other.items():
            for ours, reference_state in zip(states, whole[block_hash]):
                assert torch.equal(ours.view(torch.int16 if ours.dtype == torch.bfloat16
                                             else torch.int32),
                                   reference_state.view(torch.int16 if ours.dtype ==
                                                        torch.bfloat16 else torch.int32))


def test_the_multi_token_prediction_head_is_skipped_at_load(qwen3_next_dir, tmp_path):
    """Qwen3-Next checkpoints carry `mtp.*` tensors that Hugging Face ignores; so do we
    (any other unknown tensor is still an error)."""
    from safetensors.torch import save_file

    folder = _edited_copy(qwen3_next_dir, tmp_path / "with_mtp")
    save_file({"mtp.fc.weight": torch.ones(64, 128), "mtp.norm.weight": torch.ones(64)},
              str(folder / "mtp.safetensors"))
    llm = LLM(str(folder), block_size=16, device="cpu")
    assert generate(llm) == reference(("qwen3_next", qwen3_next_dir))
    save_file({"model.layers.0.unknown.weight": torch.ones(4)}, str(folder / "mtp.safetensors"))
    with pytest.raises(ValueError, match="unknown.weight"):
        LLM(str(folder), block_size=16, device="cpu")


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def vision_language(request, tmp_path_factory) -> tuple[str, Path]:
    """Qwen3.5's released form: a vision-language checkpoint (`text_config`, the decoder
    under `model.language_model.`, a vision tower) with random weights everywhere."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    name = request.param
    text = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
                full_attention_interval=2, **LINEAR, **(EXPERTS if name == "qwen3_5_moe" else {}))
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = AutoConfig.for_model(name, text_config=text, vision_config=vision,
                                  tie_word_embeddings=False)
    torch.manual_seed(6)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.08)
            elif not param_name.endswith("A_log"):
                param.normal_(0, 0.2).add_(1.0 if "linear_attn.norm" in param_name else 0.0)
    folder = tmp_path_factory.mktemp(f"{name}_vl")
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder, 384)
    return f"{name}_vl", folder


def test_vision_language_checkpoints_run_as_text_and_match_hf(vision_language):
    name, folder = vision_language
    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    assert architecture.endswith("ForConditionalGeneration")
    llm = LLM(str(folder), block_size=4, max_num_batched_tokens=12, device="cpu")
    assert generate(llm) == generate(llm) == reference(vision_language)
    assert llm.stats["prefix_cache_hit_tokens"] > 0

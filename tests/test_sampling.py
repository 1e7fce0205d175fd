"""Sampling: greedy, seeded random sampling, top-k / top-p, and the stop conditions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import random_prompts

from kvrecover import LLM, SamplingParams
from kvrecover.worker.sampler import Sampler

VOCAB = 384


def random_logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_the_argmax():
    logits = random_logits(6)
    tokens = Sampler(torch.device("cpu"))(logits, [SamplingParams(temperature=0)] * 6, [0] * 6)
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = random_logits(6)
    greedy = logits.argmax(-1).tolist()
    sampler = Sampler(torch.device("cpu"))
    seeds = list(range(6))
    assert sampler(logits, [SamplingParams(temperature=1.0, top_k=1)] * 6, seeds) == greedy
    assert sampler(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 6, seeds) == greedy


def test_seeded_sampling_depends_only_on_row_and_seed():
    logits = random_logits(4)
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(temperature=1.0)
    alone = [sampler(logits[i : i + 1], [params], [1000 + i])[0] for i in range(4)]
    # Same seeds in a batch, in another order, with greedy rows mixed in.
    greedy = SamplingParams(temperature=0)
    mixed = torch.cat([logits[[3, 1]], logits[:1], logits[[2, 0]]])
    tokens = sampler(mixed, [params, params, greedy, params, params], [1003, 1001, 5, 1002, 1000])
    assert tokens == [alone[3], alone[1], int(logits[0].argmax()), alone[2], alone[0]]
    assert sampler(logits, [params] * 4, [1000, 1001, 1002, 1003]) == alone


def test_sampling_follows_the_distribution_across_seeds():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    probs = logits.softmax(-1)[0]
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(temperature=1.0)
    draws = torch.tensor([sampler(logits, [params], [seed])[0] for seed in range(3000)])
    frequencies = torch.bincount(draws, minlength=5).float() / len(draws)
    assert torch.allclose(frequencies, probs, atol=0.03), (frequencies, probs)


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    sampler = Sampler(torch.device("cpu"))

    def top_share(temperature: float) -> float:
        params = SamplingParams(temperature=temperature)
        draws = [sampler(logits, [params], [seed])[0] for seed in range(1000)]
        return draws.count(0) / len(draws)

    # p(token 0) = e^(1/T) / (e^(1/T) + 3): 0.95 at T=0.25, 0.48 at T=1, 0.31 at T=4.
    assert top_share(0.25) > 0.9
    assert 0.42 < top_share(1.0) < 0.54
    assert top_share(4.0) < 0.37


def test_top_k_and_top_p_restrict_the_candidates():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    sampler = Sampler(torch.device("cpu"))
    top_k = SamplingParams(temperature=1.0, top_k=2)
    assert {sampler(logits, [top_k], [s])[0] for s in range(300)} == {1, 3}
    # Sorted: 0.5, 0.3, 0.15, 0.05; 0.5 < 0.7 keeps token 3, 0.8 >= 0.7 drops the rest.
    top_p = SamplingParams(temperature=1.0, top_p=0.7)
    assert {sampler(logits, [top_p], [s])[0] for s in range(300)} == {1, 3}
    both = SamplingParams(temperature=1.0, top_p=0.9, top_k=3)
    assert {sampler(logits, [both], [s])[0] for s in range(300)} == {1, 2, 3}


# ----- through the engine -----------------------------------------------------------

PROMPTS = random_prompts(4, [5, 30, 70, 12], VOCAB, seed=11)


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), device="cpu", max_num_batched_tokens=64)


def test_engine_greedy_equals_top_k_one_and_tiny_top_p(llm):
    greedy = generate(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    top_k = generate(
        llm, PROMPTS, SamplingParams(temperature=0.8, top_k=1, max_tokens=12, ignore_eos=True)
    )
    top_p = generate(
        llm, PROMPTS,
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12, seed=3, ignore_eos=True),
    )
    assert greedy == top_k == top_p
    assert [len(t) for t in greedy] == [12] * 4


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.5, max_tokens=16, seed=seed, ignore_eos=True)

    seeded = [params(100 + i) for i in range(4)]
    together = generate(llm, PROMPTS, seeded)
    again = generate(llm, PROMPTS, seeded)
    alone = [generate(llm, [p], params(100 + i))[0] for i, p in enumerate(PROMPTS)]
    reversed_batch = generate(llm, PROMPTS[::-1], seeded[::-1])[::-1]
    assert together == again == alone == reversed_batch
    greedy = generate(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert together != greedy  # it really sampled


def test_a_continuation_with_the_resumed_seed_samples_the_undisturbed_tokens(llm):
    """A seeded request continued from its prompt + first k outputs (a migration)
    under `resumed_request_seed(seed, k)` draws the original's tokens k, k+1, ..."""
    from kvrecover.sampling import resumed_request_seed

    prompt_ids = list(PROMPTS[2])

    def sample(ids: list[int], seed: int, max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=1.5, top_k=40, max_tokens=max_tokens, seed=seed,
                                ignore_eos=True)
        return llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids

    whole = sample(prompt_ids, 11, 14)
    greedy = generate(llm, [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=14,
                                                        ignore_eos=True))[0]
    assert whole != greedy  # it really sampled
    for k in (1, 6, 13):
        assert sample(prompt_ids + whole[:k], resumed_request_seed(11, k), 14 - k) == whole[k:]
    # Restarting the per-token seeds (the plain seed) draws other tokens.
    assert sample(prompt_ids + whole[:6], 11, 8) != whole[6:]


def test_different_seeds_give_different_samples(llm):
    prompt = PROMPTS[1]
    samples = generate(
        llm, [prompt] * 32,
        [SamplingParams(temperature=1.5, max_tokens=8, seed=s, ignore_eos=True) for s in range(32)],
    )
    assert len({tuple(s) for s in samples}) >= 24
    assert len({s[0] for s in samples}) >= 4


def test_unseeded_sampling_follows_the_engine_seed(tiny_llama):
    params = SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True)
    first = generate(LLM(str(tiny_llama), device="cpu", seed=7), PROMPTS, params)
    second = generate(LLM(str(tiny_llama), device="cpu", seed=7), PROMPTS, params)
    other = generate(LLM(str(tiny_llama), device="cpu", seed=8), PROMPTS, params)
    assert first == second
    assert first != other


def test_stop_token_ids_end_with_stop(llm):
    greedy = generate(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop = greedy[0][4]
    first = greedy[0].index(stop)
    outputs = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop], ignore_eos=True),
    )
    completion = outputs[0].outputs[0]
    assert completion.token_ids == greedy[0][: first + 1]
    assert completion.finish_reason == "stop"


@pytest.fixture(scope="module")
def eos_model(tiny_llama, tmp_path_factory) -> tuple[Path, list[int]]:
    """The tiny Llama with its EOS set to the 4th greedy token of PROMPTS[0]."""
    greedy = generate(
        LLM(str(tiny_llama), device="cpu"), PROMPTS[:1],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    )[0]
    eos = greedy[3]
    assert eos != 1  # not the tokenizer's own EOS, "</s>"
    folder = tmp_path_factory.mktemp("eos_model") / "model"
    shutil.copytree(tiny_llama, folder)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            config = json.loads(path.read_text())
            config["eos_token_id"] = eos
            path.write_text(json.dumps(config))
    return folder, greedy


def test_eos_stops_with_stop_unless_ignored(eos_model):
    folder, greedy = eos_model
    llm = LLM(str(folder), device="cpu")
    request = [{"prompt_token_ids": PROMPTS[0]}]
    stopped = llm.generate(request, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert stopped.token_ids == greedy[: greedy.index(greedy[3]) + 1]
    assert stopped.finish_reason == "stop"
    ignored = llm.generate(
        request, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0].outputs[0]
    assert ignored.token_ids == greedy
    assert ignored.finish_reason == "length"


def test_max_tokens_and_max_model_len_stop_with_length(tiny_llama):
    prompt = PROMPTS[2]  # 70 tokens
    llm = LLM(str(tiny_llama), device="cpu", max_model_len=len(prompt) + 5)
    full = generate(
        LLM(str(tiny_llama), device="cpu"), [prompt],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    )[0]
    output = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0].outputs[0]
    assert output.token_ids == full[:5]
    assert output.finish_reason == "length"
    short = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    )[0].outputs[0]
    assert short.token_ids == full[:3]
    assert short.finish_reason == "length"

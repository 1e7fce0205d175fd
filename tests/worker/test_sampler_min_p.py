"""min-p sampling (vLLM's `min_p`): after temperature, tokens less likely than `min_p`
times the most likely one are dropped, then top-k and top-p apply; the seeded draw is
the same exponential race as every other random sample, so it is exact per seed."""

from __future__ import annotations

import pytest
import torch

from kvrecover import SamplingParams
from kvrecover.worker.sampler import Sampler


def random_logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def reference_token(logits: torch.Tensor, temperature: float, min_p: float, top_p: float,
                    seed: int) -> int:
    """vLLM's order written out: temperature, min-p, top-p, then the seeded race."""
    scaled = logits / temperature
    probs = scaled.softmax(-1)
    scaled = torch.where(probs < probs.max() * min_p, float("-inf"), scaled)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        drop[0] = False
        scaled = scaled.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    final = scaled.softmax(-1)
    noise = torch.empty_like(final).exponential_(generator=torch.Generator().manual_seed(seed))
    return int((final / noise).argmax())


@pytest.mark.parametrize("temperature, min_p, top_p", [
    (1.0, 0.1, 1.0), (1.7, 0.05, 1.0), (0.8, 0.3, 0.9), (1.0, 0.0, 1.0)])
def test_min_p_samples_the_reference_per_seed(temperature, min_p, top_p):
    logits = random_logits(4)
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(temperature=temperature, min_p=min_p, top_p=top_p)
    for seed in range(40):
        got = sampler(logits, [params] * 4, [seed] * 4)
        assert got == [reference_token(row, temperature, min_p, top_p, seed) for row in logits]


def test_min_p_keeps_only_the_likely_tokens():
    logits = random_logits(1, vocab=200)[0]
    probs = (logits / 1.5).softmax(-1)
    kept = set((probs >= probs.max() * 0.2).nonzero().flatten().tolist())
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(temperature=1.5, min_p=0.2)
    drawn = {sampler(logits[None], [params], [seed])[0] for seed in range(300)}
    assert drawn <= kept and len(drawn) > 1
    plain = {sampler(logits[None], [SamplingParams(temperature=1.5)], [seed])[0]
             for seed in range(300)}
    assert not plain <= kept  # without min_p the unlikely tokens are drawn too
    greedy = sampler(logits[None], [SamplingParams(temperature=1.5, min_p=1.0)], [7])
    assert greedy == [int(logits.argmax())]


@pytest.mark.parametrize("value", [-0.1, 1.01, float("nan")])
def test_a_min_p_outside_0_1_names_the_field(value):
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=value)

"""Penalties, biases and bans: each against a small reference over Hugging Face's logits
(greedy, exact token ids), batched with requests that have none, and across the
overlapped decode path; plus the device state's count rebuild."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model

from kvrecover import LLM, SamplingParams
from kvrecover.step_messages import LogitsSpec, ScheduledRequest
from kvrecover.worker.logits_processors import LogitsProcessors

PROMPT = [5, 17, 42, 99, 17, 5, 230, 64, 17, 120, 8, 301]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("processors_model"), seed=3)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir))


def reference_processed(logits: torch.Tensor, prompt: list[int], output: list[int],
                        params: SamplingParams, eos: set[int]) -> torch.Tensor:
    """The logits after the processors, written plainly for one row (vLLM's order)."""
    x = logits.clone()
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    if params.allowed_token_ids is not None:
        keep = torch.full_like(x, float("-inf"))
        keep[params.allowed_token_ids] = 0
        x = x + keep
    if len(output) < params.min_tokens:
        for token in set(params.stop_token_ids or ()) | (set() if params.ignore_eos else eos):
            x[token] = float("-inf")
    seen = set(prompt) | set(output)
    for token in seen:
        if x[token] > 0:
            x[token] /= params.repetition_penalty
        else:
            x[token] *= params.repetition_penalty
    for token in set(output):
        x[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return x


def reference_greedy(hf_model, prompt: list[int], params: SamplingParams,
                     eos: set[int], banned_after: dict | None = None) -> list[int]:
    """Greedy over HF's logits with the processors; `banned_after` maps a prefix tuple of
    the output's tail to a token it bans (bad words)."""
    output: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = hf_model(torch.tensor([prompt + output])).logits[0, -1].float()
            x = reference_processed(logits, prompt, output, params, eos)
            for prefix, token in (banned_after or {}).items():
                if not prefix or tuple(output[len(output) - len(prefix):]) == prefix:
                    x[token] = float("-inf")
            token = int(x.argmax())
            output.append(token)
            if token in eos and not params.ignore_eos:
                break
    return output


CASES = {
    "presence": dict(presence_penalty=1.5),
    "negative_presence": dict(presence_penalty=-1.0),
    "frequency": dict(frequency_penalty=1.2),
    "repetition": dict(repetition_penalty=1.8),
    "repetition_below_one": dict(repetition_penalty=0.6),
    "logit_bias": dict(logit_bias={7: 6.0, 363: -100.0}),
    "allowed": dict(allowed_token_ids=[3, 9, 17, 42, 77, 200]),
    "all": dict(presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3,
                logit_bias={11: 2.5}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_processor_matches_the_reference(name, llm, hf_model):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **CASES[name])
    want = reference_greedy(hf_model, PROMPT, params, set())
    plain = llm.generate([{"prompt_token_ids": PROMPT}],
                         SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    # In a batch with a request that has no processors (and another with other ones).
    outputs = llm.generate(
        [{"prompt_token_ids": PROMPT}] * 3,
        [params, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
         SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                        frequency_penalty=2.0)])
    assert outputs[0].outputs[0].token_ids == want
    assert outputs[1].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert want != plain[0].outputs[0].token_ids  # the processor changed something


def test_min_tokens_bans_eos_and_stop_ids_until_reached(llm, hf_model):
    plain = llm.generate([{"prompt_token_ids": PROMPT}],
                         SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    tokens = plain[0].outputs[0].token_ids
    stop = tokens[1]  # stops the plain request after two tokens
    stopped = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop]))[0].outputs[0]
    assert stopped.token_ids == tokens[:2] and stopped.finish_reason == "stop"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop],
                            min_tokens=6)
    got = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
    eos = set(llm.engine.eos_token_ids)
    want = reference_greedy(hf_model, PROMPT, params, eos)
    want = want[: next((i + 1 for i, t in enumerate(want) if t == stop or t in eos), len(want))]
    assert got.token_ids == want
    assert len(got.token_ids) > 6 or got.finish_reason == "length"
    assert stop not in got.token_ids[:6] and not eos & set(got.token_ids[:6])


def test_bad_words_of_one_and_several_tokens(llm, hf_model):
    tokenizer = llm.get_tokenizer()
    plain = llm.generate([{"prompt_token_ids": PROMPT}],
                         SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    tokens = plain[0].outputs[0].token_ids
    # Two tokens of the plain output that are a word of their own (no leading space).
    word, sequence = next(
        (text, pair) for i in range(len(tokens) - 1)
        if (text := tokenizer.decode(pair := tokens[i:i + 2])) == text.strip()
        and tokenizer.encode(text, add_special_tokens=False) == pair)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            bad_words=[word])
    banned = {tuple(sequence[:-1]): sequence[-1]}
    spaced = tokenizer.encode(" " + word, add_special_tokens=False)
    if spaced[0] != sequence[0] and len(spaced) == len(sequence):
        banned[tuple(spaced[:-1])] = spaced[-1]
    want = reference_greedy(hf_model, PROMPT, params, set(), banned)
    got = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    assert got == want and got != tokens


def test_processors_on_the_overlapped_decode_path(model_dir, llm):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            presence_penalty=1.0, frequency_penalty=0.5,
                            repetition_penalty=1.2, min_tokens=3, logit_bias={9: 3.0})
    want = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    overlapped = LLM(str(model_dir))
    overlapped.engine.model_runner.eager_overlap = True
    got = overlapped.generate([{"prompt_token_ids": PROMPT}], params)
    assert got[0].outputs[0].token_ids == want
    assert overlapped.stats["overlapped_steps"] > 0
    seeded = SamplingParams(temperature=0.9, seed=4, max_tokens=MAX_TOKENS, ignore_eos=True,
                            presence_penalty=1.0, frequency_penalty=0.5)
    assert overlapped.generate([{"prompt_token_ids": PROMPT}], seeded)[0].outputs[0].token_ids \
        == llm.generate([{"prompt_token_ids": PROMPT}], seeded)[0].outputs[0].token_ids


def _item(request_id: str, outputs: list[int], spec: LogitsSpec) -> ScheduledRequest:
    return ScheduledRequest(request_id, [outputs[-1] if outputs else 1], 0, [], True,
                            SamplingParams(temperature=0), 0, num_output_tokens=len(outputs),
                            logits_spec=spec, output_token_ids=outputs)


def test_counts_follow_the_device_and_are_rebuilt_after_a_discarded_token():
    spec = LogitsSpec([1, 2], 0.0, 1.0, 1.0, 0, [], {}, None, [], [])
    processors = LogitsProcessors(torch.device("cpu"))
    logits = torch.zeros(1, 10)
    outputs: list[int] = []
    for token in (4, 4, 7):
        processed = processors.apply(logits, [_item("r", outputs, spec)])
        processors.count(torch.tensor([token]))
        outputs.append(token)
    processed = processors.apply(logits, [_item("r", outputs, spec)])
    assert processed[0, 4] == -2 and processed[0, 7] == -1 and processed[0, 3] == 0
    # The last token was discarded (a recovery): the counts are rebuilt from the host.
    processors.count(torch.tensor([7]))
    processed = processors.apply(logits, [_item("r", outputs[:2], spec)])
    assert processed[0, 4] == -2 and processed[0, 7] == 0
    processors.release({"r"})
    assert not processors.slots

"""`kvrecover serve` through the official `openai` client: logprobs (completions, chat,
echo, vLLM's prompt_logprobs) equal Hugging Face's log_softmax; `n` choices; every
penalty and control equals the offline API (itself checked against a reference in
tests/test_logits_processors.py); bad values are 400s and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from conftest import build_tiny_model
from serving_utils import add_chat_template, served

from kvrecover import LLM, SamplingParams

pytestmark = pytest.mark.slow  # a separate process

PROMPT = "the capital of france is paris and the capital of china is"
CHAT = [{"role": "user", "content": "the quick brown fox"}]
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_chat_template(build_tiny_model(tmp_path_factory.mktemp("sampling_model"), seed=3))


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(str(model_dir))


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)
    return run


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with served(logs, model_dir, "--served-model-name", "tiny") as process:
        yield process


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def completion_ids(server, **fields) -> list[int]:
    extra = {"return_token_ids": True, "ignore_eos": True}
    extra.update(fields.pop("extra_body", {}))
    got = sdk(server.url).completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                             temperature=0, extra_body=extra, **fields)
    return got.choices[0].model_extra["token_ids"]


def offline_ids(reference, **params) -> list[int]:
    params = SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **params})
    return reference.generate([PROMPT], params)[0].outputs[0].token_ids


def test_presence_penalty_changes_the_tokens(server, reference):
    plain = completion_ids(server)
    penalized = completion_ids(server, presence_penalty=1.5)
    assert penalized != plain  # the penalized argmax differs on this prompt
    assert plain == offline_ids(reference)
    assert penalized == offline_ids(reference, presence_penalty=1.5)


@pytest.mark.parametrize("fields, params", [
    ({"frequency_penalty": 1.2}, {"frequency_penalty": 1.2}),
    ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition_penalty": 1.8}),
    ({"logit_bias": {"7": 6, "363": -100}}, {"logit_bias": {7: 6.0, 363: -100.0}}),
    ({"extra_body": {"allowed_token_ids": [3, 9, 17, 42]}}, {"allowed_token_ids": [3, 9, 17, 42]}),
    ({"extra_body": {"bad_words": ["capital"]}}, {"bad_words": ["capital"]}),
    ({"extra_body": {"min_tokens": 5, "ignore_eos": False, "stop_token_ids": [71]}},
     {"min_tokens": 5, "ignore_eos": False, "stop_token_ids": [71]}),
])
def test_each_control_equals_the_offline_api(server, reference, fields, params):
    assert completion_ids(server, **fields) == offline_ids(reference, **params)


def check_logprob(value: float, want: torch.Tensor, token: int) -> None:
    assert abs(value - float(want[token])) < TOL


def test_completion_logprobs_equal_hf_whole_and_streamed(server, hf_logprobs, reference):
    client = sdk(server.url)
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                    logprobs=3, extra_body={"return_token_ids": True,
                                                            "ignore_eos": True})
    choice = got.choices[0]
    prompt_ids, ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    want = hf_logprobs(prompt_ids + ids)
    logprobs = choice.logprobs
    assert len(logprobs.token_logprobs) == len(ids) == len(logprobs.tokens)
    for j, token in enumerate(ids):
        row = want[len(prompt_ids) - 1 + j]
        check_logprob(logprobs.token_logprobs[j], row, token)
        # OpenAI's shape keys the top tokens (and the chosen one) by text; distinct
        # tokens of one text keep the more likely entry.
        expected: dict[str, float] = {}
        top_ids = [*row.topk(3).indices.tolist(), token]
        for text, top_id in zip(reference.get_tokenizer().token_texts(top_ids), top_ids):
            expected.setdefault(text, float(row[top_id]))
        assert logprobs.top_logprobs[j].keys() == expected.keys()
        assert all(abs(logprobs.top_logprobs[j][k] - v) < TOL for k, v in expected.items())
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i])
                                    for i in range(len(ids))]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                           temperature=0, logprobs=3, stream=True,
                                           extra_body={"ignore_eos": True}):
        part = chunk.choices[0].logprobs
        if part is not None:
            for key in streamed:
                streamed[key].extend(getattr(part, key))
    assert streamed["tokens"] == logprobs.tokens
    assert streamed["text_offset"] == logprobs.text_offset
    assert max(abs(a - b) for a, b in zip(streamed["token_logprobs"],
                                          logprobs.token_logprobs)) < 1e-6


def test_echo_logprobs_max_tokens_zero_scores_the_prompt(server, hf_logprobs, reference):
    """lm-eval's log-likelihood request, through the official client."""
    got = sdk(server.url).completions.create(model="tiny", prompt=PROMPT, max_tokens=0,
                                             echo=True, logprobs=1, temperature=0,
                                             extra_body={"return_token_ids": True})
    choice = got.choices[0]
    prompt_ids = choice.model_extra["prompt_token_ids"]
    assert choice.text == PROMPT and choice.model_extra["token_ids"] == []
    assert got.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert len(logprobs.token_logprobs) == len(prompt_ids)
    want = hf_logprobs(prompt_ids)
    for i in range(1, len(prompt_ids)):
        check_logprob(logprobs.token_logprobs[i], want[i - 1], prompt_ids[i])
    offline = reference.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert max(abs(a - b.logprob) for a, b in zip(logprobs.token_logprobs[1:],
                                                  offline.prompt_logprobs[1:])) < 1e-5
    # echo without max_tokens=0: the prompt's logprobs, then the output's.
    more = sdk(server.url).completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                              echo=True, logprobs=2, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert more.choices[0].text.startswith(PROMPT)
    assert len(more.choices[0].logprobs.tokens) == len(prompt_ids) + 3


def test_vllm_prompt_logprobs_name_the_token_ids(server, hf_logprobs):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 2, "return_token_ids": True}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    choice = answer["choices"][0]
    prompt_ids = choice["prompt_token_ids"]
    want = hf_logprobs(prompt_ids)
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for i in range(1, len(prompt_ids)):
        top = want[i - 1].topk(2).indices.tolist()
        assert {int(t) for t in entries[i]} == {prompt_ids[i], *top}
        check_logprob(entries[i][str(prompt_ids[i])]["logprob"], want[i - 1], prompt_ids[i])
        assert entries[i][str(top[0])]["rank"] == 1


def test_chat_logprobs_and_top_logprobs(server, hf_logprobs, reference):
    client = sdk(server.url)
    got = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"return_token_ids": True,
                                                     "ignore_eos": True})
    choice = got.choices[0]
    ids = choice.model_extra["token_ids"]
    want = hf_logprobs(got.model_extra["prompt_token_ids"] + ids)
    start = len(got.model_extra["prompt_token_ids"]) - 1
    texts = reference.get_tokenizer().token_texts(ids)
    content = choice.logprobs.content
    assert [c.token for c in content] == texts
    for j, entry in enumerate(content):
        check_logprob(entry.logprob, want[start + j], ids[j])
        assert entry.bytes == list(texts[j].encode())
        top_ids = want[start + j].topk(2).indices.tolist()
        assert [t.token for t in entry.top_logprobs] == \
            reference.get_tokenizer().token_texts(top_ids)
    streamed = []
    for chunk in client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5,
                                                temperature=0, logprobs=True, top_logprobs=2,
                                                stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(c.token, round(c.logprob, 5)) for c in streamed] == \
        [(c.token, round(c.logprob, 5)) for c in content]


def test_n_choices_seeded_streamed_and_whole(server, reference):
    client = sdk(server.url)
    fields = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11, n=3,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**fields)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    choices = [c.model_extra["token_ids"] for c in whole.choices]
    assert len({tuple(c) for c in choices}) == 3
    assert whole.usage.completion_tokens == 18
    offline = reference.generate([PROMPT], SamplingParams(temperature=1.0, seed=11, n=3,
                                                          max_tokens=6, ignore_eos=True))[0]
    assert [c.token_ids for c in offline.outputs] == choices
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for chunk in client.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            streamed[choice.index].extend(choice.model_extra["token_ids"])
    assert [streamed[i] for i in range(3)] == choices
    assert client.completions.create(**fields).choices[2].model_extra["token_ids"] == choices[2]
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, n=2,
                                          temperature=1.0, seed=3)
    assert [c.index for c in chat.choices] == [0, 1]


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"n": 17}, "n"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 200}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"99999": 1}}, None),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
])
def test_bad_values_are_400s_and_the_server_keeps_serving(server, path, fields, param):
    body = {"model": "tiny", "max_tokens": 2, **fields}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT})
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    ok = httpx.post(f"{server.url}/v1/completions", timeout=60,
                    json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")

"""Issue 41 item 4: vLLM's and OpenAI's request fields that the server used to accept and
ignore, through the official `openai` client against a real server on loopback. Each
one is honoured as vLLM honours it (vLLM's older `guided_*` structured-output fields,
`min_p`, `include_stop_str_in_output`, chat `echo`) or is a 400 naming it (`best_of`
above `n`, beam search, `length_penalty` without it, chat's fields on completions);
an unknown field is ignored with a warning and named in `x-kvrecover-ignored-fields`."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import httpx
import openai
import pytest
from conftest import build_tiny_model
from serving_utils import add_chat_template, in_process_server
from structured_helpers import CHOICES, GRAMMAR, PERSON_SCHEMA, REGEX, schema_errors

from kvrecover import LLM, SamplingParams
from kvrecover.entrypoints.openai.protocol import IGNORED_FIELDS_HEADER
from kvrecover.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # a server

PROMPT = "the capital of france is paris and the capital of china is"
CHAT = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_chat_template(build_tiny_model(tmp_path_factory.mktemp("fields"), seed=3))


@pytest.fixture(scope="module")
def url(model_dir):
    with in_process_server(model_dir) as server_url:
        yield server_url


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(str(model_dir))


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def completion(url: str, **fields) -> openai.types.Completion:
    extra = {"return_token_ids": True, **fields.pop("extra_body", {})}
    fields = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **fields}
    return sdk(url).completions.create(model="tiny", extra_body=extra, **fields)


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def assert_400(call, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    error = caught.value.body
    assert error["param"] == param, error
    assert param.split(".")[0] in error["message"], error


# ----- guided_* (vLLM's older spelling of structured_outputs) ------------------------------
@pytest.mark.parametrize("guided, structured", [
    ({"guided_json": PERSON_SCHEMA}, {"json": PERSON_SCHEMA}),
    ({"guided_json": json.dumps(PERSON_SCHEMA)}, {"json": PERSON_SCHEMA}),
    ({"guided_regex": REGEX}, {"regex": REGEX}),
    ({"guided_choice": CHOICES}, {"choice": CHOICES}),
    ({"guided_grammar": GRAMMAR}, {"grammar": GRAMMAR}),
])
def test_guided_fields_are_structured_outputs(url, guided, structured):
    got = completion(url, max_tokens=100, extra_body=guided).choices[0]
    want = completion(url, max_tokens=100,
                      extra_body={"structured_outputs": structured}).choices[0]
    assert token_ids(got) == token_ids(want)
    assert got.text == want.text
    kind = next(iter(structured))
    if kind == "json":
        assert schema_errors(json.loads(got.text), PERSON_SCHEMA) == []
    elif kind == "regex":
        assert re.fullmatch(REGEX, got.text)
    elif kind == "choice":
        assert got.text in CHOICES
    else:
        assert re.fullmatch(r"\([0-9](\+[0-9])?\)", got.text)
    chat = sdk(url).chat.completions.create(model="tiny", messages=CHAT, max_tokens=100,
                                            temperature=0, extra_body=guided)
    want_chat = sdk(url).chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=100, temperature=0,
        extra_body={"structured_outputs": structured})
    assert chat.choices[0].message.content == want_chat.choices[0].message.content


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": REGEX, "guided_choice": CHOICES}, "guided_choice"),
    ({"guided_json": PERSON_SCHEMA, "structured_outputs": {"regex": REGEX}}, "guided_json"),
    ({"guided_regex": REGEX, "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_regex": "[a-"}, "guided_regex"),  # does not compile
    ({"guided_choice": "yes"}, "guided_choice"),  # not a list
])
def test_bad_or_several_guided_fields_are_a_400_naming_one(url, extra, param):
    assert_400(lambda: completion(url, extra_body=extra), param)


# ----- min_p ------------------------------------------------------------------------------
def test_min_p_samples_as_the_offline_api(url, reference):
    def served(**extra):
        return token_ids(completion(url, temperature=1.5, seed=11, extra_body={
            "ignore_eos": True, **extra}).choices[0])

    def offline(**params):
        params = SamplingParams(temperature=1.5, seed=11, max_tokens=12, ignore_eos=True,
                                **params)
        return reference.generate([PROMPT], params)[0].outputs[0].token_ids

    plain, cut = served(), served(min_p=0.3)
    assert plain == offline()
    assert cut == offline(min_p=0.3)
    assert cut != plain  # min_p changed what was drawn
    assert served(min_p=1.0) == token_ids(completion(url, extra_body={"ignore_eos": True})
                                          .choices[0])  # only the most likely token is left
    chat = sdk(url).chat.completions.create(model="tiny", messages=CHAT, max_tokens=12,
                                            temperature=1.5, seed=11,
                                            extra_body={"min_p": 1.0, "ignore_eos": True,
                                                        "return_token_ids": True})
    greedy = sdk(url).chat.completions.create(model="tiny", messages=CHAT, max_tokens=12,
                                              temperature=0,
                                              extra_body={"ignore_eos": True,
                                                          "return_token_ids": True})
    assert token_ids(chat.choices[0]) == token_ids(greedy.choices[0])


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_min_p_out_of_range_is_a_400(url, value):
    assert_400(lambda: completion(url, extra_body={"min_p": value}), "min_p")


# ----- best_of, beam search, length_penalty ---------------------------------------------------
@pytest.mark.parametrize("extra, param", [
    ({"best_of": 2}, "best_of"),
    ({"best_of": 2, "n": 3}, "best_of"),  # below n
    ({"use_beam_search": True}, "use_beam_search"),
    ({"length_penalty": 0.5}, "length_penalty"),
])
def test_best_of_beam_search_and_length_penalty_are_a_400(url, extra, param):
    assert_400(lambda: completion(url, extra_body=extra), param)
    assert_400(lambda: sdk(url).chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, extra_body=extra), param)


def test_their_no_op_values_are_accepted(url):
    plain = completion(url).choices[0]
    same = completion(url, best_of=1, extra_body={
        "use_beam_search": False, "length_penalty": 1.0}).choices[0]
    assert token_ids(same) == token_ids(plain)
    two = completion(url, n=2, best_of=2, temperature=1.0, seed=3).choices
    assert len(two) == 2


# ----- include_stop_str_in_output -------------------------------------------------------------
def test_include_stop_str_in_output_keeps_the_stop_string(url):
    full = completion(url, max_tokens=30, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 3:len(full) // 3 + 3]
    assert len(stop) == 3 and full.find(stop) >= 0
    want = full[:full.find(stop) + len(stop)]
    fields = {"max_tokens": 30, "stop": [stop],
              "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}}
    whole = completion(url, **fields).choices[0]
    assert whole.text == want and whole.finish_reason == "stop"
    streamed = sdk(url).completions.create(model="tiny", prompt=PROMPT, temperature=0,
                                           stream=True, **fields)
    assert "".join(c.choices[0].text for c in streamed) == want
    dropped = completion(url, max_tokens=30, stop=[stop], extra_body={"ignore_eos": True})
    assert dropped.choices[0].text == full[:full.find(stop)]
    chat_full = sdk(url).chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=30, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].message.content
    stop = chat_full[10:13]
    chat = sdk(url).chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=30, temperature=0, stop=stop,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert chat.choices[0].message.content == chat_full[:chat_full.find(stop) + 3]


# ----- chat echo --------------------------------------------------------------------------------
def test_chat_echo_puts_the_last_assistant_message_first(url):
    messages = [*CHAT, {"role": "assistant", "content": "jumps over"}]
    fields = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
    plain = sdk(url).chat.completions.create(**fields).choices[0].message.content
    echoed = sdk(url).chat.completions.create(**fields, extra_body={"echo": True})
    assert echoed.choices[0].message.content == "jumps over" + plain
    streamed = sdk(url).chat.completions.create(**fields, stream=True,
                                                extra_body={"echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "jumps over" + plain
    # The last message is not the assistant's: nothing to echo (as vLLM).
    user_last = sdk(url).chat.completions.create(model="tiny", messages=CHAT, max_tokens=8,
                                                 temperature=0, extra_body={"echo": True})
    assert user_last.choices[0].message.content == sdk(url).chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=8, temperature=0).choices[0].message.content


# ----- chat's fields on completions ---------------------------------------------------------------
@pytest.mark.parametrize("extra, param", [
    ({"max_completion_tokens": 5}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_chat_only_fields_on_completions_are_a_400(url, extra, param):
    assert_400(lambda: completion(url, extra_body=extra), param)


@pytest.mark.parametrize("value", [-1, 0])
def test_a_bad_max_completion_tokens_is_named(url, value):
    assert_400(lambda: sdk(url).chat.completions.create(
        model="tiny", messages=CHAT, max_completion_tokens=value), "max_completion_tokens")


# ----- min_tokens, seed, logprobs ------------------------------------------------------------------
def test_min_tokens_above_max_tokens_is_a_400(url):
    assert_400(lambda: completion(url, max_tokens=4, extra_body={"min_tokens": 5}),
               "min_tokens")
    assert_400(lambda: sdk(url).chat.completions.create(
        model="tiny", messages=CHAT, max_completion_tokens=4, extra_body={"min_tokens": 5}),
        "min_tokens")
    ok = completion(url, max_tokens=4, extra_body={"min_tokens": 4, "ignore_eos": False})
    assert len(token_ids(ok.choices[0])) == 4


@pytest.mark.parametrize("seed", [2**63, -2**63 - 1, 2**70])
def test_a_seed_outside_64_bits_is_a_400(url, seed):
    assert_400(lambda: completion(url, seed=seed, temperature=1.0), "seed")


@pytest.mark.parametrize("seed", [2**63 - 1, -2**63])
def test_a_seed_at_the_64_bit_edges_is_accepted(url, seed):
    first = completion(url, seed=seed, temperature=1.0).choices[0]
    assert token_ids(completion(url, seed=seed, temperature=1.0).choices[0]) == token_ids(first)


def test_twenty_logprobs_give_twenty_alternatives(url, reference, model_dir):
    got = completion(url, max_tokens=4, logprobs=20).choices[0]
    # Completions key the alternatives by text (as vLLM): the 20 best and the chosen
    # token, tokens of one text merged (this tiny vocabulary has many).
    texts = Tokenizer(model_dir).token_texts
    offline = reference.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4,
                                                          logprobs=20))[0].outputs[0]
    assert [len(record.top) for record in offline.logprobs] == [20] * 4
    assert [sorted(top) for top in got.logprobs.top_logprobs] == [
        sorted(set(texts([t for t, _ in record.top] + [record.token_id])))
        for record in offline.logprobs]
    chat = sdk(url).chat.completions.create(model="tiny", messages=CHAT, max_tokens=4,
                                            temperature=0, logprobs=True, top_logprobs=20)
    assert [len(t.top_logprobs) for t in chat.choices[0].logprobs.content] == [20] * 4
    assert_400(lambda: completion(url, logprobs=21), "logprobs")


# ----- unknown fields ----------------------------------------------------------------------------
def test_unknown_fields_are_ignored_with_a_warning_and_named_in_a_header(url, caplog):
    client = sdk(url)
    plain = client.completions.with_raw_response.create(model="tiny", prompt=PROMPT,
                                                        max_tokens=4, temperature=0)
    assert IGNORED_FIELDS_HEADER not in plain.headers
    with caplog.at_level(logging.WARNING, logger="kvrecover.entrypoints.openai.protocol"):
        for _ in range(2):
            raw = client.completions.with_raw_response.create(
                model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                extra_body={"zz_unknown": 1, "aa_unknown": {"x": 1}})
            assert raw.headers[IGNORED_FIELDS_HEADER] == "aa_unknown,zz_unknown"
            assert raw.parse().choices[0].text == plain.parse().choices[0].text
    warned = [r.getMessage() for r in caplog.records if "zz_unknown" in r.getMessage()]
    assert len(warned) == 1  # once per field name
    streamed = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": CHAT, "max_tokens": 2, "stream": True, "yy_unknown": 0})
    assert streamed.status_code == 200
    assert streamed.headers[IGNORED_FIELDS_HEADER] == "yy_unknown"


def test_a_continuations_resumed_tokens_count_toward_min_tokens(url):
    """A request the proxy migrated: its resumed tokens are output already, so its
    min_tokens is bounded by them plus the max_tokens left (the engine counts them)."""
    first = token_ids(completion(url, max_tokens=8, extra_body={"ignore_eos": True})
                      .choices[0])
    ids = completion(url, max_tokens=1).choices[0].model_extra["prompt_token_ids"]
    fields = {"prompt": ids + first[:5], "max_tokens": 3,
              "extra_body": {"resumed_output_tokens": 5, "ignore_eos": True}}
    rest = completion(url, **{**fields, "extra_body": {**fields["extra_body"],
                                                       "min_tokens": 8}}).choices[0]
    assert token_ids(rest) == first[5:]
    assert_400(lambda: completion(url, **{**fields, "extra_body": {
        **fields["extra_body"], "min_tokens": 9}}), "min_tokens")


@pytest.mark.parametrize("path, prefix", [("/v1/completions", "cmpl"),
                                          ("/v1/chat/completions", "chatcmpl")])
def test_x_request_id_names_the_answer_and_one_value_may_run_twice_at_once(url, path, prefix):
    """As in vLLM (vllm-router sends its prefill and decode one X-Request-Id)."""
    body = {"max_tokens": 4, "temperature": 0, "stream": False}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": PROMPT})
    headers = {"X-Request-Id": "___prefill_addr_127.0.0.1:1___decode_addr_127.0.0.1:2_ab"}

    async def two_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return list(await asyncio.gather(*(client.post(path, json=body, headers=headers)
                                               for _ in range(2))))

    for response in asyncio.run(two_at_once()):
        assert response.status_code == 200, response.text
        assert response.json()["id"] == f"{prefix}-{headers['X-Request-Id']}"
    unnamed = httpx.post(url + path, json=body, timeout=120).json()["id"]
    assert re.fullmatch(f"{prefix}-[0-9a-f]{{32}}", unnamed), unnamed

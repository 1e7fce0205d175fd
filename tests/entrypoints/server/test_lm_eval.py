"""lm-eval's log-likelihood requests against `kvrecover serve`: the request itself
through the official `openai` client (runs everywhere), and `lm-eval` itself
(`local-completions`, a local task file, no download) giving the offline API's scores.

lm-eval lives beside the project (`scripts/setup_lm_eval.sh`, which ./test.sh runs), not in it: the
test finds `lm_eval` in $KVRECOVER_CLIENTS_BIN, that script's virtualenv, or PATH.
Without it the test is skipped, except under CI (CI=true), where it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import openai
import pytest
from conftest import build_tiny_model
from serving_utils import add_chat_template, required_client_binary, served

from kvrecover import LLM, SamplingParams

pytestmark = pytest.mark.slow  # a separate process

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "kvrecover_tiny_loglikelihood"
TOL = 1e-4
MISSING = "lm_eval is not installed (scripts/setup_lm_eval.sh, which ./test.sh runs, installs it)"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_chat_template(build_tiny_model(tmp_path_factory.mktemp("lm_eval_model"), seed=3))


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(str(model_dir))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with served(logs, model_dir, "--served-model-name", "tiny") as process:
        yield process


def documents() -> list[dict]:
    lines = (TASK_DIR / "tiny_loglikelihood.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def offline_loglikelihood(reference, context: str, continuation: str) -> tuple[float, bool]:
    """(sum of the continuation tokens' logprobs, whether each is the argmax), by
    lm-eval's split: the continuation is what `context + continuation` adds to `context`."""
    tokenizer = reference.get_tokenizer()
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    start = len(tokenizer.encode(context, add_special_tokens=False))
    output = reference.generate([{"prompt_token_ids": whole}],
                                SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    records = output.prompt_logprobs[start:]
    return sum(r.logprob for r in records), all(r.rank == 1 for r in records)


def test_lm_eval_loglikelihood_request_through_the_openai_client(server, reference):
    """What `local-completions` sends for a log-likelihood: the token ids as a batch of
    one, echo, logprobs=1, max_tokens=1; it sums token_logprobs[ctxlen:-1]."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    tokenizer = reference.get_tokenizer()
    for doc in documents():
        whole = tokenizer.encode(doc["context"] + doc["continuation"], add_special_tokens=False)
        ctxlen = len(tokenizer.encode(doc["context"], add_special_tokens=False))
        answer = client.completions.create(model="tiny", prompt=[whole], temperature=0,
                                           max_tokens=1, logprobs=1, echo=True, seed=1234)
        logprobs = answer.choices[0].logprobs
        assert len(logprobs.token_logprobs) == len(whole) + 1
        score = sum(logprobs.token_logprobs[ctxlen:-1])
        greedy = all(lp == max(top.values()) for lp, top in
                     zip(logprobs.token_logprobs[ctxlen:-1], logprobs.top_logprobs[ctxlen:-1]))
        want, want_greedy = offline_loglikelihood(reference, doc["context"], doc["continuation"])
        assert abs(score - want) < TOL and greedy == want_greedy


def sample_scores(output_dir: Path) -> dict[tuple[str, str], float]:
    """(context, continuation) -> log-likelihood, from lm-eval's logged samples."""
    scores = {}
    files = list(output_dir.rglob(f"samples_{TASK}_*.jsonl"))
    assert files, f"lm-eval wrote no samples under {output_dir}"
    for line in files[0].read_text().splitlines():
        sample = json.loads(line)
        arguments = sample["arguments"]
        first = arguments["gen_args_0"] if isinstance(arguments, dict) else arguments[0]
        context, continuation = (first["arg_0"], first["arg_1"]) if isinstance(first, dict) \
            else first[:2]
        response = sample["filtered_resps"][0]
        scores[(context, continuation)] = float(response[0])
    return scores


def test_lm_eval_scores_equal_the_offline_api(server, reference, model_dir, tmp_path):
    binary = required_client_binary("lm_eval", MISSING)
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    data = str((TASK_DIR / "tiny_loglikelihood.jsonl").resolve())
    (task_dir / "tiny_loglikelihood.yaml").write_text(
        (TASK_DIR / "tiny_loglikelihood.yaml.in").read_text().replace("DATA_FILE", data))
    output_dir = tmp_path / "out"
    model_args = ",".join([
        "model=tiny", f"base_url={server.url}/v1/completions", "tokenizer_backend=huggingface",
        f"tokenizer={model_dir}", "num_concurrent=1", "max_retries=1", "tokenized_requests=True"])
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OPENAI_API_KEY="unused")
    run = subprocess.run(
        [str(binary), "--model", "local-completions", "--model_args", model_args,
         "--tasks", TASK, "--include_path", str(task_dir), "--batch_size", "1",
         "--output_path", str(output_dir), "--log_samples"],
        capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    scores = sample_scores(output_dir)
    assert len(scores) == len(documents())
    for doc in documents():
        want, _ = offline_loglikelihood(reference, doc["context"], doc["continuation"])
        assert abs(scores[(doc["context"], doc["continuation"])] - want) < TOL

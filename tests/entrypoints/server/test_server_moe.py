"""`kvrecover serve` with mixture-of-experts checkpoints (Qwen3-MoE, gpt-oss): an OpenAI
client's completion, plain and streamed, is exactly what `LLM.generate` returns offline."""

from __future__ import annotations

import openai
import pytest
from serving_utils import served

from kvrecover import LLM, SamplingParams

pytestmark = pytest.mark.slow  # a separate process

PROMPT = "the capital of france is paris and the capital of china is"


@pytest.mark.parametrize("family", ["tiny_qwen3_moe", "tiny_gpt_oss"])
def test_moe_completion_equals_the_offline_api(request, family, tmp_path):
    model_dir = request.getfixturevalue(family)
    expected = LLM(str(model_dir)).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    with served(tmp_path, model_dir, "--served-model-name", "moe") as process:
        sdk = openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0,
                            timeout=60)
        got = sdk.completions.create(model="moe", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0]
        assert got.model_extra["token_ids"] == expected.token_ids
        assert (got.text, got.finish_reason) == (expected.text, expected.finish_reason)
        streamed = sdk.completions.create(model="moe", prompt=PROMPT, max_tokens=12,
                                          temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text

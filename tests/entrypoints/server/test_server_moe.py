"""`kvrecover serve` with a mixture-of-experts checkpoint (Qwen3-MoE): an OpenAI client's
completion, plain and streamed, is exactly what `LLM.generate` returns offline."""

from __future__ import annotations

import openai
import pytest
from serving_utils import serve

from kvrecover import LLM, SamplingParams

pytestmark = pytest.mark.slow  # a separate process

PROMPT = "the capital of france is paris and the capital of china is"


def test_moe_completion_equals_the_offline_api(tiny_qwen3_moe, tmp_path):
    expected = LLM(str(tiny_qwen3_moe)).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    process = serve(tmp_path, tiny_qwen3_moe, "--served-model-name", "moe")
    try:
        sdk = openai.OpenAI(base_url=f"{process.wait_healthy().url}/v1", api_key="unused",
                            max_retries=0, timeout=60)
        got = sdk.completions.create(model="moe", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0]
        assert got.model_extra["token_ids"] == expected.token_ids
        assert (got.text, got.finish_reason) == (expected.text, expected.finish_reason)
        streamed = sdk.completions.create(model="moe", prompt=PROMPT, max_tokens=12,
                                          temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text
    finally:
        process.kill()

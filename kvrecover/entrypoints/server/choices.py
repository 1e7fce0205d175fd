"""The choices of one answer: each generation's deltas as OpenAI fragments (with their
logprobs formatted, and the echoed prompt first); `openai/interleave.py` interleaves
the `n` choices' fragments, `ChoicesProgress` counts the usage of all of them.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from kvrecover.entrypoints.openai.logprobs import LogprobsFormatter, prompt_logprobs_json
from kvrecover.entrypoints.server.generation import Generation
from kvrecover.outputs import TokenLogprob


@dataclass
class Chunk:
    """One fragment of one choice (the writer's `Fragment`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: list[Any] | None = None


@dataclass
class EchoedPrompt:
    """What a completion with `echo` puts before the output: the prompt's text (and
    its logprobs when asked for)."""

    text: str
    with_logprobs: bool


class ChoicesProgress:
    """The usage of an answer of several choices: one prompt, all their outputs."""

    def __init__(self, generations: list[Generation]) -> None:
        self.generations = generations

    @property
    def prompt_token_ids(self) -> list[int] | None:
        return self.generations[0].prompt_token_ids

    @property
    def num_output_tokens(self) -> int:
        return sum(g.num_output_tokens for g in self.generations)

    def kv_transfer_params(self) -> dict[str, Any] | None:
        """A P2P producer's reference to the prompt's kept blocks (the first choice's
        that has one, once it finished), or None."""
        return next((g.kv_transfer_params for g in self.generations
                     if g.kv_transfer_params is not None), None)


async def choice_chunks(generation: Generation, formatter: LogprobsFormatter | None,
                        echo: EchoedPrompt | None, vllm_prompt_logprobs: bool
                        ) -> AsyncGenerator[Chunk, None]:
    """`generation`'s deltas as chunks of choice `generation.index`: the first carries
    the echoed prompt (with `echo`) and vLLM's `prompt_logprobs` (when asked for)."""
    first = True
    texts = formatter.token_texts if formatter is not None else None
    async with aclosing(generation.deltas()) as deltas:
        async for delta in deltas:
            records: list[TokenLogprob | None] = list(delta.logprobs or [])
            text = delta.text
            prompt_json = None
            token_ids_of_records: list[int] = []
            if first:
                prompt_records = generation.prompt_logprobs
                if echo is not None:
                    text = echo.text + text
                    if echo.with_logprobs and prompt_records is not None:
                        records = [*prompt_records, *records]
                        token_ids_of_records = generation.prompt_token_ids
                if vllm_prompt_logprobs and prompt_records is not None and texts is not None:
                    prompt_json = prompt_logprobs_json(prompt_records, texts)
            logprobs = None
            if formatter is not None and (delta.logprobs is not None or token_ids_of_records):
                logprobs = formatter.piece(records, token_ids_of_records)
            yield Chunk(generation.index, text, delta.token_ids, delta.finish_reason,
                        logprobs, prompt_json)
            first = False

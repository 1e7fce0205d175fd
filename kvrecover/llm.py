"""The offline entry point: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import inspect
from typing import Any

from kvrecover.config import ENGINE_OPTIONS, EngineArgs
from kvrecover.engine.engine import Engine
from kvrecover.engine.snapshot import EngineSnapshot
from kvrecover.options import option_fields, reject_unknown
from kvrecover.outputs import RequestOutput, choice_request_id
from kvrecover.sampling import SamplingParams
from kvrecover.structured.params import StructuredOutputsParams


class LLM:
    """An inference engine for one model, optionally loading and saving KV through a connector.

    `model` is a local Hugging Face checkpoint folder (config.json, safetensors,
    tokenizer), a hub id already in the local cache, or None for the built-in
    default model. Every other argument is a keyword option of `EngineArgs`
    (listed below); an unknown keyword is an error with a "did you mean".
    `close()` (or leaving a `with LLM(...) as llm:` block) stops the connector's
    background loads and frees the KV cache, the weights and the CUDA graphs; a closed
    LLM generates no more.
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        reject_unknown(options, ENGINE_OPTIONS[1:], "LLM option")
        self._start(EngineArgs(model=model, **options))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        """An LLM from ready-made `EngineArgs` (what the CLI builds from its flags)."""
        llm = cls.__new__(cls)
        llm._start(args)
        return llm

    def _start(self, args: EngineArgs) -> None:
        self.engine = Engine(args)
        self._batch_counter = 0

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Shut the engine down: in-flight KV loads are cancelled and their threads
        joined, the KV cache, the weights and the CUDA graphs freed (`Engine.close`).
        Idempotent; `generate` raises afterwards, `stats` still reads."""
        self.engine.close()

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot of the engine's counters."""
        return self.engine.stats.snapshot()

    def snapshot(self) -> EngineSnapshot:
        """The engine's counters, queue sizes and KV cache use now (between steps)."""
        return self.engine.snapshot()

    def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile and cache a structured-output grammar before it is used (a ValueError
        when it does not compile); safe from any thread (`Engine.compile_grammar`)."""
        self.engine.compile_grammar(spec)

    def get_tokenizer(self) -> Any:
        """The tokenizer used to encode prompts and decode outputs."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | list[str | dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one output per prompt, in input order.

        A request that fails inside a step ends with finish_reason "error" (see
        `RequestOutput.error`); the others, and the LLM, carry on.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or token-id dicts")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            raise ValueError(
                "sampling_params must be a SamplingParams or a list of them, "
                f"got {type(sampling_params).__name__}"
            )
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling params for {len(prompts)} prompts"
            )
        batch = self._batch_counter
        self._batch_counter += 1
        request_ids = [f"{batch}-{i}" for i in range(len(prompts))]
        added = []
        try:
            for request_id, prompt, params in zip(request_ids, prompts, sampling_params):
                self.engine.add_request(request_id, prompt, params)
                added.append(request_id)
        except BaseException:  # bad input (ValueError) or a bug: leave nothing queued
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        from tqdm import tqdm  # here, not at module level: the import costs ~60 ms of start-up

        choices = {request_id: [choice_request_id(request_id, i, params.n)
                                for i in range(params.n)]
                   for request_id, params in zip(request_ids, sampling_params)}
        results: dict[str, RequestOutput] = {}
        num_choices = sum(len(ids) for ids in choices.values())
        try:
            with tqdm(total=len(prompts), desc="generate", disable=not use_tqdm) as progress:
                # A producer that keeps blocks for a consumer to pull returns at once;
                # later steps (or `close`) hand them back.
                while self.engine.has_unfinished() and not (
                        len(results) == num_choices and self.engine.awaits_only_sends()):
                    for output in self.engine.step():
                        if output.finished:
                            results[output.request_id] = output
                            progress.update(1)
        except BaseException:  # an engine error or Ctrl-C: leave no request of ours behind
            for request_id in request_ids:
                if any(choice not in results for choice in choices[request_id]):
                    self.engine.abort_request(request_id)
            raise
        return [merge_choices(request_id, [results[c] for c in choices[request_id]])
                for request_id in request_ids]


def merge_choices(request_id: str, outputs: list[RequestOutput]) -> RequestOutput:
    """One request's output from the finished outputs of its `n` choices (in index
    order; the first error, if any, is the request's)."""
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    failed = next((o for o in outputs if o.error is not None), None)
    return RequestOutput(
        request_id=request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
        outputs=[o.outputs[0] for o in outputs], finished=True,
        error=None if failed is None else failed.error,
        error_type=None if failed is None else failed.error_type,
        prompt_logprobs=first.prompt_logprobs,
    )


def _options_doc() -> str:
    lines = ["\n    Options (keyword only; the CLI takes each as --flag-name):\n"]
    for f, spec in option_fields(EngineArgs):
        lines.append(f"    - `{f.name}` (default {f.default!r}): {spec.help}")
    return "\n".join(lines) + "\n"


def _signature() -> inspect.Signature:
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f, _ in option_fields(EngineArgs):
        kind = (inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name == "model"
                else inspect.Parameter.KEYWORD_ONLY)
        parameters.append(inspect.Parameter(f.name, kind, default=f.default,
                                            annotation=f.type))
    return inspect.Signature(parameters, return_annotation=None)


LLM.__doc__ = (LLM.__doc__ or "") + _options_doc()
# inspect.signature reads __signature__; typeshed's function type does not declare it.
LLM.__init__.__signature__ = _signature()  # type: ignore[attr-defined]

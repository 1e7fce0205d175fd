"""The offline entry point: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from typing import Any

from kvrecover.config import EngineArgs, KVTransferConfig
from kvrecover.engine.engine import Engine
from kvrecover.outputs import RequestOutput
from kvrecover.sampling import SamplingParams


class LLM:
    """An inference engine for one model, optionally loading and saving KV through a connector.

    `model` is a local Hugging Face checkpoint folder (config.json, safetensors,
    tokenizer), a hub id already in the local cache, or None for the built-in
    default model. `block_size` sets the KV block size in tokens,
    `max_num_batched_tokens` the tokens computed per step (longer prompts are
    prefilled in chunks), `max_num_seqs` the requests decoded together. The KV
    cache size comes from a memory budget (`kv_cache_memory_gb`, or
    `gpu_memory_utilization` of the GPU) unless `num_kv_blocks` fixes it.
    `batch_invariant=True` makes each request's numerics independent of what
    else is in the batch (exact recovery on GPUs in bf16). `attention_backend`
    picks the kernels: "auto" (Triton on CUDA, the torch reference elsewhere),
    "torch" or "triton".
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        kv_transfer_config: KVTransferConfig | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float | None = None,
        gpu_memory_utilization: float = 0.85,
        batch_invariant: bool = False,
        attention_backend: str = "auto",
    ) -> None:
        args = EngineArgs(
            model=model,
            dtype=dtype,
            device=device,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            kv_transfer_config=kv_transfer_config,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_gb=kv_cache_memory_gb,
            gpu_memory_utilization=gpu_memory_utilization,
            batch_invariant=batch_invariant,
            attention_backend=attention_backend,
        )
        self.engine = Engine(args)
        self._batch_counter = 0

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot of the engine's counters."""
        return self.engine.stats.snapshot()

    def get_tokenizer(self) -> Any:
        """The tokenizer used to encode prompts and decode outputs."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | list[str | dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one output per prompt, in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or token-id dicts")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
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
        except ValueError:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        from tqdm import tqdm  # here, not at module level: the import costs ~60 ms of start-up

        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generate", disable=not use_tqdm) as progress:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        progress.update(1)
        return [results[request_id] for request_id in request_ids]

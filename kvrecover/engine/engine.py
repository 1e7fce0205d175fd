"""The step-level engine: add requests, step, collect outputs."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from kvrecover.config import EngineArgs, SchedulerConfig
from kvrecover.engine.kv_cache_manager import KVCacheManager
from kvrecover.engine.request import Request, RequestStatus
from kvrecover.engine.scheduler import Scheduler
from kvrecover.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvrecover.engine.stats import EngineStats
from kvrecover.kv_layout import KVCacheLayout, blocks_needed, update_block_hashes
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.model_source import resolve_model_dir
from kvrecover.models.config import ModelConfig
from kvrecover.models.fingerprint import checkpoint_fingerprint
from kvrecover.outputs import CompletionOutput, RequestOutput
from kvrecover.sampling import SamplingParams
from kvrecover.tokenizer import Tokenizer
from kvrecover.worker.kv_cache import available_kv_cache_bytes
from kvrecover.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from kvrecover.worker.overlap import PendingDecode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine:
    """Drives scheduler and model runner one step at a time.

    Requests may be added or aborted between steps. `step()` returns the
    requests that produced a token or finished in that step.
    """

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.model_dir = resolve_model_dir(args.model)
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        self.device = _resolve_device(args.device)
        self.dtype = _resolve_dtype(args.dtype, self.device, self.model_config)
        self.tokenizer = Tokenizer(self.model_dir)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        cuda = self.device.type == "cuda"
        self.max_model_len = args.max_model_len or min(
            self.model_config.max_position_embeddings, 32768
        )
        self.scheduler_config = SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens or (8192 if cuda else 2048),
            max_num_seqs=args.max_num_seqs or (256 if cuda else 64),
            max_model_len=self.max_model_len,
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        self.layout = KVCacheLayout(
            model_identity=f"{self.model_config.identity}-{checkpoint_fingerprint(self.model_dir)}",
            dtype=self.dtype,
            block_size=args.block_size,
            num_layers=self.model_config.num_hidden_layers,
            num_kv_heads=self.model_config.num_key_value_heads,
            head_dim=self.model_config.head_dim,
        )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(args.seed)
        self.model_runner = ModelRunner(
            self.model_config, self.model_dir, self.device, self.dtype, self.max_model_len,
            self.layout, enforce_eager=args.enforce_eager, batch_invariant=args.batch_invariant,
            attention_backend=args.attention_backend,
        )
        self.model_runner.allocate_kv_cache(self._num_blocks())
        self.num_blocks = self.model_runner.kv_caches[0].shape[1]
        self.stats = EngineStats()
        kv_manager = KVCacheManager(self.num_blocks, args.block_size, args.enable_prefix_caching)
        connector = None
        transfer = args.kv_transfer_config
        if transfer is not None:
            from kvrecover.kv_transfer.registry import create_connector

            connector = create_connector(transfer, KVConnectorRole.SCHEDULER, self.layout)
            worker_connector = create_connector(transfer, KVConnectorRole.WORKER, self.layout)
            self.model_runner.attach_connector(worker_connector)
        self.scheduler = Scheduler(self.scheduler_config, kv_manager, self.stats, connector, transfer)
        self._request_counter = 0
        # Prefix caching and connectors key blocks by their chain hash: hash the
        # prompt once here; connectors only read `request.block_hashes`.
        self._hash_prompts = args.enable_prefix_caching or connector is not None
        # A launched, overlapped decode step: (its schedule, its pending tokens).
        self._in_flight: tuple[SchedulerOutput, PendingDecode] | None = None

    def _num_blocks(self) -> int:
        if self.args.num_kv_blocks is not None:
            return self.args.num_kv_blocks
        if self.args.kv_cache_memory_gb is not None:
            budget = int(self.args.kv_cache_memory_gb * (1 << 30))
        else:
            budget = available_kv_cache_bytes(self.device, self.args.gpu_memory_utilization)
        num_blocks = budget // self.layout.block_nbytes
        # No point in more blocks than every sequence slot at full length needs.
        cap = self.scheduler_config.max_num_seqs * blocks_needed(self.max_model_len, self.args.block_size)
        num_blocks = min(num_blocks, cap + 1)
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds fewer than 2 blocks of "
                f"{self.layout.block_nbytes} bytes; raise kv_cache_memory_gb or num_kv_blocks"
            )
        return num_blocks

    # ----- requests ------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | dict | list[int],
        sampling_params: SamplingParams | None = None,
    ) -> None:
        """Tokenize (if needed), validate and queue a request."""
        sampling_params = sampling_params or SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError("sampling_params must be a kvrecover.SamplingParams")
        text, token_ids = self._prompt_tokens(prompt)
        if not token_ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(token_ids)} tokens does not fit "
                f"max_model_len={self.max_model_len} (at least one new token must fit)"
            )
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"request {request_id!r}: token ids must be in [0, {vocab})")
        longest = min(len(token_ids) + sampling_params.max_tokens, self.max_model_len)
        if blocks_needed(longest, self.args.block_size) > self.num_blocks - 1:
            raise ValueError(
                f"request {request_id!r} needs {blocks_needed(longest, self.args.block_size)} "
                f"KV blocks but the cache has {self.num_blocks - 1}; raise num_kv_blocks or "
                "kv_cache_memory_gb, or shorten the request"
            )
        seed = sampling_params.seed
        if seed is None:
            seed = self.args.seed * 1_000_003 + self._request_counter
        self._request_counter += 1
        request = Request(
            str(request_id), text, token_ids, sampling_params, self.eos_token_ids, seed,
            self.max_model_len,
        )
        if self._hash_prompts:
            update_block_hashes(request.block_hashes, token_ids, self.args.block_size)
        self.scheduler.add_request(request)

    def _prompt_tokens(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            "a prompt must be a string or {'prompt_token_ids': [...]}, "
            f"got {type(prompt).__name__}"
        )

    def abort_request(self, request_id: str) -> None:
        """Stop a request; a later `step()` no longer reports it."""
        request = self.scheduler.abort_request(str(request_id))
        if request is not None:
            self.scheduler.pop_finished(request.request_id)

    def has_unfinished(self) -> bool:
        """Whether `step()` still has work."""
        return self._in_flight is not None or self.scheduler.has_unfinished()

    # ----- stepping ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and post-process one step."""
        if self._in_flight is not None:
            return self._land_in_flight()
        scheduler_output = self.scheduler.schedule()
        if self.model_runner.can_overlap(scheduler_output):
            pending = self.model_runner.launch_decode(scheduler_output)
            self._in_flight = (scheduler_output, pending)
            return self._land_in_flight()
        runner_output = self.model_runner.execute(scheduler_output)
        return self._apply(scheduler_output, runner_output)

    def _land_in_flight(self) -> list[RequestOutput]:
        """Finish the launched decode step, launching the one after it first (when the
        scheduler can tell it already) so the device never waits for the host."""
        scheduler_output, pending = self._in_flight
        self._in_flight = None
        following = self.scheduler.schedule_next_decode(scheduler_output)
        if following is not None:
            self._in_flight = (following, self.model_runner.launch_decode(following, pending))
        outputs = self._apply(scheduler_output, pending.result())
        requests = self.scheduler.requests
        if self._in_flight is not None and all(
            (request := requests.get(s.request_id)) is None or request.is_finished
            for s in following.scheduled
        ):
            # Every request it continues stopped on its last token: nothing to report.
            self._in_flight[1].result()
            self._in_flight = None
        return outputs

    def _apply(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        progressed = self.scheduler.update_from_output(scheduler_output, runner_output)
        if not (scheduler_output.scheduled or progressed or runner_output.finished_recving):
            self._check_progress()
        outputs = [self._output(request) for request in progressed]
        for request in progressed:
            if request.is_finished:
                self.scheduler.pop_finished(request.request_id)
        return outputs

    def _check_progress(self) -> None:
        """An idle step is fine only while async loads are in flight."""
        if self.scheduler.loads_in_flight():
            time.sleep(0.0005)  # let the loader threads run instead of spinning
        elif self.scheduler.waiting:
            # The scheduler fails a request it cannot place; reaching this is a bug.
            raise RuntimeError("the scheduler could not place any waiting request")

    def _output(self, request: Request) -> RequestOutput:
        finished = request.is_finished
        text = self.tokenizer.decode(request.output_token_ids) if finished else ""
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
        )
        if request.status is RequestStatus.FINISHED_ERROR:
            completion.text, completion.token_ids = "", []
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            error=request.error,
            error_type=request.error_type,
        )


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return _resolve_device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from error
    if resolved.type not in ("cpu", "cuda"):  # torch knows more types than we run on
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but CUDA is not available")
        if resolved.index is None:  # torch.cuda.set_device needs an index
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _resolve_dtype(dtype: str, device: torch.device, config: ModelConfig) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    return torch.float16 if config.checkpoint_dtype == torch.float16 else torch.bfloat16


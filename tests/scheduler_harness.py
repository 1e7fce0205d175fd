"""A scheduler without a model: a fake scheduler-role connector, a fake clock, and a
step helper that plays the worker with fabricated runner outputs (sampled tokens,
invalid block ids, finished loads). Used by test_scheduler.py and
test_scheduler_connector.py, like vLLM's tests/v1/kv_connector/unit/utils.py.
"""

from __future__ import annotations

from kvrecover.config import KVTransferConfig, SchedulerConfig
from kvrecover.engine.kv_cache_manager import KVCacheManager
from kvrecover.engine.request import Request
from kvrecover.engine.scheduler import Scheduler
from kvrecover.engine.stats import EngineStats
from kvrecover.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from kvrecover.sampling import SamplingParams
from kvrecover.step_messages import ModelRunnerOutput, SchedulerOutput

BLOCK = 4
TOKEN = 7  # every fabricated sample
TIMEOUT = 10.0  # load_timeout_s of every scheduler made here


class FakeClock:
    """The scheduler's clock for deadline tests: time moves only when a test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeConnector(KVConnectorBase):
    """Scheduler role only. `claims[request_id]` is a list of answers, one per lookup
    (the last one repeats); `raise_in` names methods that raise."""

    def __init__(self, claims: dict | None = None, raise_in: set[str] = frozenset()):
        super().__init__(KVTransferConfig("Fake", "kv_consumer"), KVConnectorRole.SCHEDULER, None)
        self.load_timeout_s = TIMEOUT  # what a connector reads from its extra config
        self.claims = claims or {}
        self.raise_in = set(raise_in)
        self.lookups: list[tuple[str, int]] = []
        self.allocs: list[tuple[str, list[int], int, int]] = []  # id, blocks, external, start
        self.finished: list[str] = []

    def _maybe_raise(self, method: str) -> None:
        if method in self.raise_in:
            raise RuntimeError(f"{method} exploded")

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._maybe_raise("get_num_new_matched_tokens")
        self.lookups.append((request.request_id, num_computed_tokens))
        answers = self.claims.get(request.request_id, [(0, False)])
        return answers[min(len(self.lookups_of(request.request_id)), len(answers)) - 1]

    def lookups_of(self, request_id: str) -> list[int]:
        return [n for r, n in self.lookups if r == request_id]

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens,
                            request.num_computed_tokens))
        self._maybe_raise("update_state_after_alloc")

    def build_connector_meta(self, scheduler_output):
        self._maybe_raise("build_connector_meta")
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        self._maybe_raise("request_finished")
        return False


def make_scheduler(connector=None, *, num_blocks=64, policy="recompute", retry_limit=1,
                   clock=None, budget=64, groups=None, recompute="prefix") -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=256,
                             block_size=BLOCK)
    transfer = KVTransferConfig("Fake", "kv_consumer", {"load_timeout_s": TIMEOUT},
                                kv_load_failure_policy=policy, kv_load_retry_limit=retry_limit,
                                kv_load_recompute=recompute)
    manager = (KVCacheManager(num_blocks, BLOCK, True) if groups is None
               else KVCacheManager(num_blocks, BLOCK, True, groups))
    return Scheduler(config, manager, EngineStats(),
                     connector, transfer, clock=clock or FakeClock())


def add(scheduler: Scheduler, request_id: str, prompt: list[int], max_tokens: int = 3) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request = Request(request_id, None, prompt, params, frozenset(), 0, 256,
                      scheduler.kv_manager.num_groups)
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler, invalid=(), finished_recving=(), **output_fields):
    """Schedule one step and report it as the worker would; returns (schedule, progressed).

    `invalid` may be a function, called once the step is scheduled (blocks are known).
    """
    output = scheduler.schedule()
    if callable(invalid):
        invalid = invalid()
    sampled = {s.request_id: TOKEN for s in output.scheduled if s.sample}
    runner_output = ModelRunnerOutput(sampled, set(invalid), set(finished_recving),
                                      **output_fields)
    return output, scheduler.update_from_output(output, runner_output)


def slice_of(output: SchedulerOutput, request_id: str):
    return next((s for s in output.scheduled if s.request_id == request_id), None)


def run_to_completion(scheduler: Scheduler, max_steps: int = 200, **report) -> None:
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return
        step(scheduler, **report)
    raise AssertionError("the scheduler did not finish within the step bound")


def all_blocks_free(scheduler: Scheduler) -> bool:
    pool = scheduler.kv_manager.pool
    return pool.num_free_blocks == pool.num_usable_blocks


PROMPT = list(range(100, 121))  # 21 tokens: 5 full blocks + 1; the connector may offer 20

"""KV load failure recovery: the fault matrix and the patterns that break engines.

Every recovered run must give exactly the baseline's token ids; under policy
`fail` only the affected requests end with an error. The matrix also runs on the
mixture-of-experts families (Mixtral, Qwen3-MoE, gpt-oss), in float32 and in bf16.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from conftest import random_prompts

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.engine.request import RequestStatus
from kvrecover.kv_transfer.stores.shared_storage import SharedStorageConnector

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def make_prompts() -> list[list[int]]:
    """Four prompts: two share a 100-token prefix, two a 40-token prefix."""
    base = random_prompts(6, [100, 40, 30, 25, 20, 17], 384, seed=11)
    return [
        base[0] + base[2],
        base[0] + base[3],
        base[1] + base[4],
        base[1] + base[5],
    ]


def as_inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def fill_store(model: Path, store: Path, **engine) -> tuple[Path, Path, list[list[int]]]:
    """Fill `store` with a producer run; returns (model, store, no-connector baseline ids).
    `engine` (e.g. dtype) applies to both runs."""
    prompts = make_prompts()
    producer = KVTransferConfig("SharedStorageConnector", "kv_producer",
                                {"shared_storage_path": str(store)})
    LLM(str(model), device="cpu", kv_transfer_config=producer, **engine).generate(
        as_inputs(prompts), PARAMS)
    baseline = LLM(str(model), device="cpu", max_num_batched_tokens=32, **engine).generate(
        as_inputs(prompts), PARAMS)
    return model, store, token_ids(baseline)


@pytest.fixture(scope="module")
def stored(tiny_llama, tmp_path_factory) -> tuple[Path, Path, list[list[int]]]:
    """A store filled by a producer run, and the no-connector baseline token ids."""
    return fill_store(tiny_llama, tmp_path_factory.mktemp("store"))


# The mixture-of-experts families, in float32 and in bf16 (the CPU-invariant kernels).
MOE_CASES = [(family, dtype) for family in ("tiny_mixtral", "tiny_qwen3_moe", "tiny_gpt_oss")
             for dtype in ("float32", "bfloat16")]


@pytest.fixture(scope="module", params=MOE_CASES, ids=["-".join(case) for case in MOE_CASES])
def moe_stored(request, tmp_path_factory) -> tuple[Path, Path, list[list[int]], str]:
    """`stored` for a MoE checkpoint and dtype, plus that dtype."""
    family, dtype = request.param
    model = request.getfixturevalue(family)
    return (*fill_store(model, tmp_path_factory.mktemp("moe_store"), dtype=dtype), dtype)


def decode(model: Path, store: Path, *, async_load=False, faults=None, policy="recompute",
           retry_limit=1, connector="FaultInjectionConnector", module_path=None, prompts=None,
           load_timeout_s=5.0, fault_seed=None, recompute="prefix", **llm_kwargs):
    extra = {"shared_storage_path": str(store), "async_load": async_load,
             "load_timeout_s": load_timeout_s}
    if faults is not None:
        extra["faults"] = faults
    if fault_seed is not None:
        extra["seed"] = fault_seed
    transfer = KVTransferConfig(connector, "kv_consumer", extra, kv_connector_module_path=module_path,
                                kv_load_failure_policy=policy, kv_load_retry_limit=retry_limit,
                                kv_load_recompute=recompute)
    llm_kwargs.setdefault("max_num_batched_tokens", 32)
    llm = LLM(str(model), device="cpu", kv_transfer_config=transfer, **llm_kwargs)
    outputs = llm.generate(as_inputs(prompts or make_prompts()), PARAMS)
    return outputs, llm


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("blocks", ["all", "first", "middle", "last", 0.5])
@pytest.mark.parametrize("kind", ["missing", "error"])
def test_recompute_matrix(stored, async_load, blocks, kind):
    check_recompute(stored, async_load, blocks, kind)


def check_recompute(stored, async_load, blocks, kind, **engine) -> None:
    """The first request's `blocks` fail with `kind`; every output equals the baseline."""
    model, store, baseline = stored
    faults = [{"requests": "first", "blocks": blocks, "kind": kind}]
    outputs, llm = decode(model, store, async_load=async_load, faults=faults, **engine)
    assert token_ids(outputs) == baseline
    stats = llm.stats
    assert stats["kv_load_failed_blocks"] >= 1
    assert stats["kv_load_recovered_requests"] >= 1
    assert stats["kv_load_failed_requests"] == 0
    assert stats["prompt_tokens_external"] > 0  # the other requests still loaded


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("blocks", ["all", "first", "middle", "last", 0.5])
@pytest.mark.parametrize("kind", ["missing", "error"])
def test_fail_policy_matrix(stored, async_load, blocks, kind):
    check_fail_policy(stored, async_load, blocks, kind)


def check_fail_policy(stored, async_load, blocks, kind, **engine) -> None:
    """Under policy `fail` only the first request (whose `blocks` fail) ends in error."""
    model, store, baseline = stored
    faults = [{"requests": "first", "blocks": blocks, "kind": kind}]
    outputs, llm = decode(model, store, async_load=async_load, faults=faults, policy="fail",
                          **engine)
    assert outputs[0].outputs[0].finish_reason == "error"
    assert outputs[0].outputs[0].token_ids == []
    assert token_ids(outputs)[1:] == baseline[1:]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs[1:])
    assert llm.stats["kv_load_failed_requests"] == 1


BLOCK_SIZE = 16  # the engine's default, used by every run here


# Fault selectors of the first request's 8 loaded blocks, and how many blocks each fails.
HOLES = {"first": 1, "middle": 1, "last": 1, "1,3": 2, "2,3,6": 3, "half": 4}
SELECTORS = {"1,3": [1, 3], "2,3,6": [2, 3, 6], "half": 0.5}


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("holes", list(HOLES))
@pytest.mark.parametrize("kind", ["missing", "error", "corrupt"])
def test_recompute_only_the_failed_blocks_matrix(stored, async_load, holes, kind):
    """Scope "blocks": exact ids, and only the failed blocks' tokens are recomputed (plus,
    after a sync load, the tokens its step computed on top of them)."""
    blocks = SELECTORS.get(holes, holes)
    model, store, baseline = stored
    faults = [{"requests": "first", "blocks": blocks, "kind": kind}]
    outputs, llm = decode(model, store, async_load=async_load, faults=faults,
                          recompute="blocks", retry_limit=0)
    assert token_ids(outputs) == baseline
    stats = llm.stats
    first = make_prompts()[0]  # the first to load: 8 stored blocks, then its last tokens
    loaded = (len(first) - 1) // BLOCK_SIZE * BLOCK_SIZE
    tail = 0 if async_load else len(first) - loaded
    assert stats["kv_load_recovered_requests"] == 1
    assert stats["kv_load_failed_blocks"] == HOLES[holes]
    assert stats["kv_load_recomputed_tokens"] == HOLES[holes] * BLOCK_SIZE + tail
    assert stats["kv_load_failed_requests"] == 0


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("blocks", ["middle", [1, 3]])
def test_fail_policy_is_the_same_under_scope_blocks(stored, async_load, blocks):
    check_fail_policy(stored, async_load, blocks, "missing", recompute="blocks")


# The matrix on the MoE families: nothing MoE-specific in recovery, exact ids in float32
# and bf16. A cross-section by default (each fault kind once per mode), the rest slow.
MOE_FAST = [(False, "middle", "missing"), (True, 0.5, "error")]
MOE_MATRIX = [(async_load, blocks, kind) for async_load in (False, True)
              for blocks in ("all", "first", "middle", "last", 0.5)
              for kind in ("missing", "error")]
MOE_SLOW = [pytest.param(*case, marks=pytest.mark.slow) for case in MOE_MATRIX
            if case not in MOE_FAST]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("async_load, blocks, kind", [*MOE_FAST, *MOE_SLOW])
def test_moe_fault_matrix(moe_stored, policy, async_load, blocks, kind):
    *stored, dtype = moe_stored
    check = check_recompute if policy == "recompute" else check_fail_policy
    check(tuple(stored), async_load, blocks, kind, dtype=dtype)


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_every_request_failing_at_once(stored, async_load):
    model, store, baseline = stored
    faults = [{"requests": "all", "blocks": "all", "kind": "missing"}]
    outputs, llm = decode(model, store, async_load=async_load, faults=faults)
    assert token_ids(outputs) == baseline
    assert llm.stats["prompt_tokens_external"] == 0
    outputs, llm = decode(model, store, async_load=async_load, faults=faults, policy="fail")
    assert [o.outputs[0].finish_reason for o in outputs] == ["error"] * 4


@pytest.mark.parametrize("retry_limit", [0, 1, 3])
def test_reoffers_after_total_failure_are_bounded(stored, retry_limit):
    """A store that keeps offering the same broken KV: bounded re-offers, then local."""
    model, store, baseline = stored
    faults = [{"requests": "all", "blocks": "all", "kind": "missing"}]
    outputs, llm = decode(model, store, async_load=True, faults=faults, retry_limit=retry_limit)
    assert token_ids(outputs) == baseline
    # Each request: one failed load, plus one per allowed re-offer.
    assert llm.stats["kv_load_recovered_requests"] == 4 * (retry_limit + 1)


@pytest.mark.parametrize("seed", range(4))
def test_random_fraction_of_requests(stored, seed):
    """The seed picks which requests and blocks fail (one request always does) and the
    order of the prompts; every run equals the baseline and really hit failures."""
    model, store, baseline = stored
    order = list(range(4))
    random.Random(seed).shuffle(order)
    prompts = [make_prompts()[i] for i in order]
    faults = [{"requests": 0.5, "blocks": 0.3, "kind": "error"},
              {"requests": seed % 4, "blocks": "first", "kind": "missing"}]
    outputs, llm = decode(model, store, async_load=bool(seed % 2), faults=faults,
                          fault_seed=seed, prompts=prompts)
    assert token_ids(outputs) == [baseline[i] for i in order]
    stats = llm.stats
    assert stats["kv_load_failed_blocks"] >= 1
    assert stats["kv_load_recovered_requests"] >= 1
    assert stats["kv_load_failed_requests"] == 0


@pytest.mark.parametrize("recompute", ["prefix", "blocks"])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_failures_under_preemption(stored, async_load, recompute):
    """A KV budget that forces preemption while requests grow and loads fail."""
    model, store, _ = stored
    long_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = LLM(str(model), device="cpu").generate(as_inputs(make_prompts()), long_params)
    extra = {"shared_storage_path": str(store), "async_load": async_load,
             "faults": [{"requests": "all", "blocks": "middle", "kind": "missing"}]}
    transfer = KVTransferConfig("FaultInjectionConnector", "kv_consumer", extra,
                                kv_load_recompute=recompute)
    llm = LLM(str(model), device="cpu", kv_transfer_config=transfer, num_kv_blocks=24,
              max_num_batched_tokens=32)
    outputs = llm.generate(as_inputs(make_prompts()), long_params)
    assert token_ids(outputs) == token_ids(reference)
    assert llm.stats["num_preemptions"] > 0
    assert llm.stats["kv_load_recovered_requests"] > 0
    pool = llm.engine.scheduler.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks  # nothing leaked


@pytest.mark.parametrize("recompute", ["prefix", "blocks"])
def test_failure_while_remaining_prompt_is_chunked(stored, recompute):
    """The prompt continues past the stored prefix: chunked prefill after a failed load."""
    model, store, baseline = stored
    long_tail = random_prompts(1, [150], 384, seed=99)[0]
    prompts = [make_prompts()[0] + long_tail, *make_prompts()[1:]]
    reference = LLM(str(model), device="cpu", max_num_batched_tokens=16).generate(
        as_inputs(prompts), PARAMS)
    for async_load in (False, True):
        faults = [{"requests": "first", "blocks": [1, 3], "kind": "missing"}]
        outputs, llm = decode(model, store, async_load=async_load, faults=faults,
                              prompts=prompts, max_num_batched_tokens=16, recompute=recompute)
        assert token_ids(outputs) == token_ids(reference)
        assert llm.stats["kv_load_recovered_requests"] >= 1


class LateReportConnector(SharedStorageConnector):
    """Loads correctly but reports its first load's blocks invalid `delay` steps later,
    after they entered the prefix cache (like a late integrity check would)."""

    delay = 2

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._held: set[int] | None = None
        self._countdown = -1
        self._done = False

    def start_load_kv(self, kv_caches):
        super().start_load_kv(kv_caches)
        if not self._done:
            for transfer in self._get_connector_metadata().loads:
                self._held = set(transfer.block_ids[: len(transfer.block_ids) // 2 + 1])
                self._countdown, self._done = self.delay, True
                break

    def get_block_ids_with_load_errors(self):
        invalid = super().get_block_ids_with_load_errors()
        if self._countdown == 0 and self._held:
            invalid |= self._held
            for block_id in self._held:  # the data really was bad: scribble over it
                for cache in self._kv_caches:
                    cache[:, block_id].fill_(float("nan"))
            self._held = None
        self._countdown -= 1
        return invalid


def run_steps(llm, prompts, add_at: dict[int, int], max_steps=500):
    """Step the engine, adding prompt i at step add_at[i]; returns outputs by request id."""
    engine = llm.engine
    results = {}
    for step in range(max_steps):
        for index, when in add_at.items():
            if when == step:
                engine.add_request(str(index), {"prompt_token_ids": prompts[index]}, PARAMS)
        if not engine.has_unfinished() and step > max(add_at.values()):
            break
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
    return [results[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("recompute", ["prefix", "blocks"])
def test_failed_shared_block_with_chunked_owner_recompute(stored, tmp_path, recompute):
    """A block in the prefix cache, shared by two requests, is reported invalid; the
    owner recomputes it over several steps while the sharer must never read it
    half-rewritten, and a request arriving meanwhile must not hit it."""
    model, store, _ = stored
    module = tmp_path / "late_connector.py"
    shutil.copy(__file__, module)
    prompts = make_prompts()[:2] + [make_prompts()[0]]
    reference = LLM(str(model), device="cpu", max_num_batched_tokens=8).generate(
        as_inputs(prompts), PARAMS)
    transfer = KVTransferConfig("LateReportConnector", "kv_consumer",
                                {"shared_storage_path": str(store)},
                                kv_connector_module_path=str(module), kv_load_recompute=recompute)
    llm = LLM(str(model), device="cpu", kv_transfer_config=transfer, max_num_batched_tokens=8)
    # Request 0 loads; request 1 (same 100-token prefix) arrives next step and hits the
    # prefix cache; the failure is reported while both run; request 2 arrives mid-recompute.
    outputs = run_steps(llm, prompts, {0: 0, 1: 1, 2: 4})
    assert outputs == token_ids(reference)
    stats = llm.stats
    assert stats["kv_load_recovered_requests"] >= 2  # owner and sharer both rolled back
    assert stats["prefix_cache_hit_tokens"] > 0


def test_new_request_never_hits_an_invalid_block(stored, tmp_path):
    model, store, _ = stored
    module = tmp_path / "late_connector.py"
    shutil.copy(__file__, module)
    transfer = KVTransferConfig("LateReportConnector", "kv_consumer",
                                {"shared_storage_path": str(store)},
                                kv_connector_module_path=str(module))
    llm = LLM(str(model), device="cpu", kv_transfer_config=transfer, max_num_batched_tokens=8)
    prompts = make_prompts()
    engine = llm.engine
    engine.add_request("0", {"prompt_token_ids": prompts[0]}, PARAMS)
    invalid_seen: set[int] = set()
    original_plan = engine.scheduler.recovery.plan

    def spy(invalid, requests):
        invalid_seen.update(invalid)
        return original_plan(invalid, requests)

    engine.scheduler.recovery.plan = spy
    for _ in range(3):
        engine.step()
    assert invalid_seen, "the late report should have arrived"
    engine.add_request("1", {"prompt_token_ids": prompts[1]}, PARAMS)
    engine.step()
    request = engine.scheduler.requests["1"]
    assert not invalid_seen & set(request.block_ids[: request.num_computed_tokens // 16])
    while engine.has_unfinished():
        engine.step()


class SlowAsyncConnector(SharedStorageConnector):
    """Async loads that report finished only after `steps` polls."""

    steps = 5

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.polls: dict[str, int] = {}

    def get_finished(self, finished_req_ids):
        for request_id in list(self._async_loads):
            self.polls[request_id] = self.polls.get(request_id, 0) + 1
            if self.polls[request_id] < self.steps and request_id not in finished_req_ids:
                self._async_loads[request_id].deadline = float("inf")
        ready = {r for r, n in self.polls.items() if n >= self.steps} | set(finished_req_ids)
        pending = {r: load for r, load in self._async_loads.items() if r not in ready}
        kept = self._async_loads
        self._async_loads = {r: load for r, load in kept.items() if r in ready}
        _, done = super().get_finished(finished_req_ids)
        self._async_loads.update(pending)
        return None, done


def test_abort_while_async_load_in_flight(stored, tmp_path):
    """Blocks an in-flight load may write stay held until the worker confirms."""
    model, store, baseline = stored
    module = tmp_path / "slow_connector.py"
    shutil.copy(__file__, module)
    transfer = KVTransferConfig("SlowAsyncConnector", "kv_consumer",
                                {"shared_storage_path": str(store), "async_load": True},
                                kv_connector_module_path=str(module))
    llm = LLM(str(model), device="cpu", kv_transfer_config=transfer, max_num_batched_tokens=32)
    engine = llm.engine
    scheduler = engine.scheduler
    prompts = make_prompts()
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, PARAMS)
    engine.step()
    victim = scheduler.requests["0"]
    assert victim.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    held = list(victim.block_ids)
    engine.abort_request("0")
    assert scheduler.loads.orphans["0"].block_ids == held
    assert all(scheduler.kv_manager.block(b).ref_count == 1 for b in held)
    results = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
    assert "0" not in results
    assert "0" not in scheduler.requests and not scheduler.loads.orphans
    assert [results[str(i)] for i in range(1, 4)] == baseline[1:]
    pool = scheduler.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_connector_exception_is_contained(stored, tmp_path):
    """A connector that raises in start_load_kv: all its loads become invalid, no crash."""
    model, store, baseline = stored
    module = tmp_path / "raising_connector.py"
    module.write_text(
        "from kvrecover.kv_transfer.stores.shared_storage import SharedStorageConnector\n"
        "class Raising(SharedStorageConnector):\n"
        "    def start_load_kv(self, kv_caches):\n"
        "        super().start_load_kv(kv_caches)\n"
        "        if self._get_connector_metadata().loads:\n"
        "            raise RuntimeError('store exploded')\n"
    )
    for async_load in (False, True):
        outputs, llm = decode(model, store, async_load=async_load, connector="Raising",
                              module_path=str(module))
        assert token_ids(outputs) == baseline
        assert llm.stats["kv_load_recovered_requests"] >= 1

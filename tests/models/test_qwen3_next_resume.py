"""Rule 8 on a plain load of a hybrid (Qwen3-Next): the producer stores the recurrent
state every K blocks (`state_interval_blocks`), and a consumer whose load fails at block
b resumes from the stored state at the latest multiple of K blocks inside the load at or
before b's start, not from 0. Exact greedy ids against a connector-free run and the exact
number of recomputed tokens that rule predicts, sync and async, both policies, for
failures at the first, a middle, a last-K and the last block, with block sizes 4 and 8,
K = 1, 2 and larger than the prompt, prompts not a multiple of the block size, and the
stored state at the resume point failing too (the next earlier one, then 0)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import storage_transfer
from test_qwen3_next_connectors import hybrid_llm, state_entries
from test_qwen3_next_vs_hf import FAMILIES, GREEDY, PROMPTS, build_hybrid, generate

from kvrecover import KVTransferConfig
from kvrecover.kv_layout import hash_block_tokens
from kvrecover.kv_transfer.stores.state_entries import state_key

LONG = PROMPTS[2]  # 41 tokens
# name -> (block size, K, prompt): 41 = 10 blocks of 4 + 1, 23 = 5 x 4 + 3, 37 = 4 x 8 + 5.
CASES = {
    "block4_k2": (4, 2, LONG),
    "block4_k1": (4, 1, PROMPTS[1]),
    "block8_k2": (8, 2, LONG[:37]),
    "block4_k16": (4, 16, LONG),  # K past the prompt: only the last boundary's state
}
_STORES: dict[tuple[int, int], Path] = {}
_BASELINES: dict[tuple[int, tuple[int, ...]], list[int]] = {}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_hybrid(tmp_path_factory.mktemp("qwen3_next"), **FAMILIES["qwen3_next"])


def transfer(store: Path, role: str, interval: int, **extra) -> KVTransferConfig:
    config = storage_transfer(store, role, **extra)
    config.state_interval_blocks = interval
    return config


def pristine_store(model: Path, root: Path, block: int, interval: int) -> Path:
    """The producer's store of every prompt of CASES at this block size and K."""
    if (block, interval) not in _STORES:
        store = root / f"store_{block}_{interval}"
        producer = hybrid_llm(model, transfer(store, "kv_producer", interval), block_size=block)
        generate(producer, [prompt for b, k, prompt in CASES.values()
                            if (b, k) == (block, interval)])
        producer.close()
        _STORES[block, interval] = store
    return _STORES[block, interval]


def baseline(model: Path, block: int, prompt: list[int]) -> list[int]:
    if (block, tuple(prompt)) not in _BASELINES:
        _BASELINES[block, tuple(prompt)] = generate(hybrid_llm(model, block_size=block),
                                                    [prompt])[0]
    return _BASELINES[block, tuple(prompt)]


def store_copy(model: Path, tmp_path_factory, tmp_path: Path, block: int, interval: int) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(pristine_store(model, tmp_path_factory.getbasetemp(), block, interval), copy)
    return copy


def resume_point(block: int, interval: int, prompt: list[int], failed_block: int) -> int:
    """The rule: the latest multiple of K blocks inside the load (0, end) at or before the
    failed block's start, else 0."""
    end = (len(prompt) - 1) // block * block
    step = interval * block
    latest = min(failed_block * block, end - 1) // step * step
    return latest if latest > 0 else 0


def failing(store: Path, interval: int, blocks: list[int], policy: str = "recompute",
            async_load: bool = False, state_too: bool = False) -> KVTransferConfig:
    faults = [{"requests": "first", "blocks": blocks, "kind": "missing"}]
    if state_too:
        faults.append({"requests": "first", "kind": "error", "target": "state"})
    config = transfer(store, "kv_consumer", interval, connector="FaultInjectionConnector",
                      faults=faults, async_load=async_load)
    config.kv_load_failure_policy = policy
    return config


def recomputed(prompt: list[int], block: int, resume: int, async_load: bool) -> int:
    """Tokens a rollback to `resume` recomputes: an async load's up to its end; a sync
    load's up to the prompt's end (its step computed the rest, on invalid KV)."""
    end = (len(prompt) - 1) // block * block
    return (end if async_load else len(prompt)) - resume


POSITIONS = {"first": lambda n, k: 0, "middle": lambda n, k: n // 2,
             "last_k": lambda n, k: max(0, n - k), "last": lambda n, k: n - 1}


def cases_by(names: list[str], positions: list[str]) -> list:
    return [pytest.param(name, position, id=f"{name}-{position}")
            for name in names for position in positions]


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case,position",
                         cases_by(["block4_k2"], list(POSITIONS))
                         + cases_by(["block4_k1", "block8_k2", "block4_k16"], ["middle", "last"]))
def test_a_failed_load_resumes_from_the_latest_stored_state_before_it(
        model, tmp_path_factory, tmp_path, case, position, async_load):
    block, interval, prompt = CASES[case]
    store = store_copy(model, tmp_path_factory, tmp_path, block, interval)
    num_loaded = (len(prompt) - 1) // block
    failed = POSITIONS[position](num_loaded, interval)
    llm = hybrid_llm(model, failing(store, interval, [failed], async_load=async_load),
                     block_size=block)
    assert generate(llm, [prompt]) == [baseline(model, block, prompt)]
    resume = resume_point(block, interval, prompt, failed)
    if case == "block4_k2" and position != "first":
        assert resume > 0  # the point of it: not 0
    # An async load's request asks the connector again once (kv_load_retry_limit) and
    # fails at the same block again; a sync one ran past its load.
    assert llm.stats["kv_load_failed_blocks"] == (2 if async_load else 1)
    assert llm.stats["kv_load_recomputed_tokens"] == recomputed(prompt, block, resume, async_load)


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("position", ["middle", "last"])
def test_a_failed_resume_state_falls_back_to_the_one_before(model, tmp_path_factory, tmp_path,
                                                            position, async_load):
    """The stored state at the resume point is gone too: the request resumes from the
    stored state K blocks earlier (its loss reported as the block ending there)."""
    block, interval, prompt = CASES["block4_k2"]
    store = store_copy(model, tmp_path_factory, tmp_path, block, interval)
    failed = POSITIONS[position]((len(prompt) - 1) // block, interval)
    resume = resume_point(block, interval, prompt, failed)
    (chunk,) = [path for path in state_entries(store)
                if state_key(chain_hash(prompt, resume // block)).hex() in path.name]
    chunk.unlink()
    llm = hybrid_llm(model, failing(store, interval, [failed], async_load=async_load),
                     block_size=block)
    assert generate(llm, [prompt]) == [baseline(model, block, prompt)]
    earlier = resume - interval * block
    assert earlier > 0
    assert llm.stats["kv_load_recomputed_tokens"] == recomputed(prompt, block, earlier, async_load)


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_with_every_state_failing_the_request_resumes_from_0(model, tmp_path_factory, tmp_path,
                                                             async_load):
    """KV block 7 and every state read fail (at most two resume reads, then nothing of
    the load is used): from 0, same tokens, never a wrong state."""
    block, interval, prompt = CASES["block4_k2"]
    store = store_copy(model, tmp_path_factory, tmp_path, block, interval)
    llm = hybrid_llm(model, failing(store, interval, [7], async_load=async_load,
                                    state_too=True), block_size=block)
    assert generate(llm, [prompt]) == [baseline(model, block, prompt)]
    assert llm.stats["kv_load_recomputed_tokens"] == recomputed(prompt, block, 0, async_load)


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_policy_fail_ends_only_the_failed_request(model, tmp_path_factory, tmp_path, async_load):
    block, interval, prompt = CASES["block4_k2"]
    store = store_copy(model, tmp_path_factory, tmp_path, block, interval)
    llm = hybrid_llm(model, failing(store, interval, [5], policy="fail", async_load=async_load),
                     block_size=block)
    outputs = llm.generate([{"prompt_token_ids": p} for p in (prompt, PROMPTS[0])], GREEDY)
    assert [o.outputs[0].finish_reason for o in outputs] == ["error", "length"]
    assert outputs[1].outputs[0].token_ids == baseline(model, block, PROMPTS[0])
    assert llm.stats["kv_load_failed_requests"] == 1


def chain_hash(prompt: list[int], num_blocks: int, block: int = 4) -> bytes:
    block_hash = None
    for start in range(0, num_blocks * block, block):
        block_hash = hash_block_tokens(block_hash, prompt[start : start + block])
    assert block_hash is not None
    return block_hash


@pytest.mark.parametrize("case", list(CASES))
def test_the_producer_stores_a_state_every_k_blocks(model, tmp_path_factory, case):
    """States at every multiple of K blocks before the last loadable boundary, and at it."""
    block, interval, prompt = CASES[case]
    store = pristine_store(model, tmp_path_factory.getbasetemp(), block, interval)
    last_loadable = (len(prompt) - 1) // block
    expected = [b for b in range(1, last_loadable) if b % interval == 0] + [last_loadable]
    names = [path.name for path in state_entries(store)]
    for boundary in expected:
        key = state_key(chain_hash(prompt, boundary, block)).hex()
        assert sum(key in name for name in names) == 1, boundary
    assert len(names) == len(expected)  # one prompt per store


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_through_redis_a_failed_load_resumes_from_the_state_before_it(model, redis_server,
                                                                      async_load):
    """The same rule over RedisConnector (the batched block-store connector)."""
    block, interval, prompt = CASES["block4_k2"]
    producer = KVTransferConfig("RedisConnector", "kv_producer", {"url": redis_server.url},
                                state_interval_blocks=interval)
    generate(hybrid_llm(model, producer, block_size=block), [prompt])
    faults = [{"requests": "first", "blocks": [7], "kind": "corrupt"}]
    consumer = KVTransferConfig(
        "FaultInjectionConnector", "kv_consumer",
        {"inner_connector": "RedisConnector", "url": redis_server.url, "faults": faults,
         "async_load": async_load}, state_interval_blocks=interval)
    llm = hybrid_llm(model, consumer, block_size=block)
    assert generate(llm, [prompt]) == [baseline(model, block, prompt)]
    resume = resume_point(block, interval, prompt, 7)
    assert resume == 24
    assert llm.stats["kv_load_recomputed_tokens"] == recomputed(prompt, block, resume, async_load)

"""KV connectors end to end: disaggregated prefill and decode through shared storage.

A producer engine stores the KV of its prompts; a consumer engine that loads it
must produce exactly the token ids of an engine without any connector, and
`LLM.stats` must show what was loaded and what was computed.
"""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import greedy_token_ids

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.kv_transfer.stores.block_store import SUFFIX
from kvrecover.kv_transfer.stores.shared_storage import SharedStorageConnector

VOCAB = 384  # the tiny models of conftest.py
MAX_TOKENS = 6
REPO = Path(__file__).resolve().parents[2]


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(length)]


def storage(path: Path, role: str = "kv_both", **extra) -> KVTransferConfig:
    return KVTransferConfig("SharedStorageConnector", role,
                            {"shared_storage_path": str(path), **extra})


def make_llm(model: Path, transfer: KVTransferConfig | None = None, block_size: int = 16) -> LLM:
    return LLM(str(model), device="cpu", block_size=block_size, max_num_batched_tokens=64,
               num_kv_blocks=256, kv_transfer_config=transfer)


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return greedy_token_ids(llm, prompts, max_tokens)


@functools.cache
def _baseline(model: str, prompts: tuple[tuple[int, ...], ...], block_size: int) -> list[list[int]]:
    return generate(make_llm(Path(model), block_size=block_size), [list(p) for p in prompts])


def baseline(model: Path, prompts: list[list[int]], block_size: int = 16) -> list[list[int]]:
    """Greedy token ids of an engine without a connector (cached per model and prompts)."""
    return _baseline(str(model), tuple(tuple(p) for p in prompts), block_size)


def stored_files(root: Path) -> dict[Path, tuple[int, int]]:
    """Every block file under a store root -> (inode, mtime_ns)."""
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob(f"*{SUFFIX}")}


def prefill(model: Path, store: Path, prompts: list[list[int]], block_size: int = 16,
            role: str = "kv_producer") -> dict:
    llm = make_llm(model, storage(store, role), block_size)
    generate(llm, prompts, max_tokens=1)
    return llm.stats


# ----- decode from stored KV -------------------------------------------------------------
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("block_size", [16, 12])
def test_decode_with_loaded_kv_equals_decode_without_connector(tiny_llama, tmp_path, block_size,
                                                               async_load):
    # short (no full block), block-aligned, aligned + 1, long (chunked: budget 64)
    lengths = [5, 4 * block_size, 4 * block_size + 1, 17 * block_size + 7]
    prompts = [random_prompt(n, seed=i) for i, n in enumerate(lengths)]
    stats = prefill(tiny_llama, tmp_path, prompts, block_size)
    assert stats["prompt_tokens_computed"] == sum(lengths)
    assert stats["prompt_tokens_external"] == 0
    assert len(stored_files(tmp_path)) == sum(n // block_size for n in lengths)

    llm = make_llm(tiny_llama, storage(tmp_path, async_load=async_load), block_size)
    assert generate(llm, prompts) == baseline(tiny_llama, prompts, block_size)
    # Every full block before the last prompt token is loaded; the rest is computed.
    loaded = sum((n - 1) // block_size * block_size for n in lengths)
    assert loaded == (0 + 3 + 4 + 17) * block_size
    stats = llm.stats
    assert stats["prompt_tokens_external"] == loaded
    assert stats["prompt_tokens_computed"] == sum(lengths) - loaded
    assert stats["prefix_cache_hit_tokens"] == 0
    assert stats["kv_load_failed_blocks"] == stats["kv_save_failed_blocks"] == 0
    assert stats["generation_tokens"] == MAX_TOKENS * len(prompts)


@pytest.mark.parametrize(
    "shared_blocks, extra_tokens", [(6, 0), (6, 5), (7, -1)],
    ids=["aligned", "not-aligned", "prefix-of-stored"],
)
@pytest.mark.parametrize("block_size", [16, 13])
def test_prompt_sharing_a_prefix_with_a_stored_one_loads_the_shared_blocks(
    tiny_llama, tmp_path, block_size, shared_blocks, extra_tokens
):
    stored = random_prompt(10 * block_size + 3, seed=1)
    prefill(tiny_llama, tmp_path, [stored], block_size)
    if extra_tokens >= 0:  # the stored prefix, then a tail of its own
        shared = shared_blocks * block_size + extra_tokens
        prompt = stored[:shared] + random_prompt(30, seed=2)
        assert prompt[:shared] == stored[:shared] and prompt[shared] != stored[shared]
        expected_loaded = shared_blocks * block_size
    else:  # a block-aligned strict prefix of the stored prompt: its last token is computed
        prompt = stored[: shared_blocks * block_size]
        expected_loaded = (shared_blocks - 1) * block_size

    llm = make_llm(tiny_llama, storage(tmp_path, "kv_consumer"), block_size)
    assert generate(llm, [prompt]) == baseline(tiny_llama, [prompt], block_size)
    assert llm.stats["prompt_tokens_external"] == expected_loaded
    assert llm.stats["prompt_tokens_computed"] == len(prompt) - expected_loaded


def test_two_prompts_sharing_a_stored_prefix_in_one_batch(tiny_llama, tmp_path):
    stored = random_prompt(100, seed=3)
    prefill(tiny_llama, tmp_path, [stored])
    prompts = [stored[:80] + random_prompt(20, seed=4), stored[:90] + random_prompt(7, seed=5)]
    for async_load in (False, True):
        llm = make_llm(tiny_llama, storage(tmp_path, "kv_consumer", async_load=async_load))
        assert generate(llm, prompts) == baseline(tiny_llama, prompts)
        stats = llm.stats
        # 80 shared tokens each, loaded by the connector or hit in the local prefix cache.
        assert stats["prompt_tokens_external"] + stats["prefix_cache_hit_tokens"] == 160
        assert stats["prompt_tokens_external"] >= 80
        assert stats["prompt_tokens_computed"] == 100 + 97 - 160


# ----- roles ----------------------------------------------------------------------------
def test_producer_saves_and_never_loads(tiny_llama, tmp_path):
    prompts = [random_prompt(70, seed=10), random_prompt(40, seed=11)]
    prefill(tiny_llama, tmp_path, prompts)
    before = stored_files(tmp_path)
    assert len(before) == 4 + 2

    new_prompt = random_prompt(50, seed=12)
    llm = make_llm(tiny_llama, storage(tmp_path, "kv_producer"))
    assert generate(llm, [*prompts, new_prompt]) == baseline(tiny_llama, [*prompts, new_prompt])
    assert llm.stats["prompt_tokens_external"] == 0
    assert llm.stats["prompt_tokens_computed"] == 70 + 40 + 50
    after = stored_files(tmp_path)
    # The stored entries were neither loaded nor rewritten; the new prompt's blocks were saved.
    assert {p: after[p] for p in before} == before
    assert len(after) == len(before) + 3


def test_consumer_loads_and_never_saves(tiny_llama, tmp_path):
    store = tmp_path / "store"
    prompt = random_prompt(70, seed=20)
    llm = make_llm(tiny_llama, storage(store, "kv_consumer"))
    assert generate(llm, [prompt]) == baseline(tiny_llama, [prompt])
    assert llm.stats["prompt_tokens_external"] == 0
    assert not store.exists()  # nothing was saved, not even a folder

    prefill(tiny_llama, store, [prompt])
    before = stored_files(store)
    longer = prompt[:64] + random_prompt(60, seed=21)  # 4 stored blocks + 3 new full blocks
    llm = make_llm(tiny_llama, storage(store, "kv_consumer"))
    assert generate(llm, [prompt, longer]) == baseline(tiny_llama, [prompt, longer])
    assert llm.stats["prompt_tokens_external"] + llm.stats["prefix_cache_hit_tokens"] == 64 + 64
    assert stored_files(store) == before


# ----- a user's own connector ------------------------------------------------------------
class CountingConnector(SharedStorageConnector):
    """A user's connector: the shared-storage one, counting the blocks it installs and saves."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.installed_blocks = 0
        self.saved_blocks = 0

    def _install_batch(self, transfers, results):  # every load's install, sync or async
        self.installed_blocks += sum(block is not None for blocks in results if blocks
                                     for block in blocks)
        super()._install_batch(transfers, results)

    def wait_for_save(self):
        self.saved_blocks += self._get_connector_metadata().num_save_blocks()
        super().wait_for_save()


NOT_A_CONNECTOR = 42


@pytest.mark.parametrize("how", ["dotted-module", "file-path"])
def test_connector_loaded_through_module_path(tiny_llama, tmp_path, how):
    module_path = __name__ if how == "dotted-module" else __file__
    prompts = [random_prompt(75, seed=30), random_prompt(33, seed=31)]

    def engine() -> LLM:
        transfer = KVTransferConfig("CountingConnector", "kv_both",
                                    {"shared_storage_path": str(tmp_path)},
                                    kv_connector_module_path=module_path)
        return make_llm(tiny_llama, transfer)

    producer = engine()
    generate(producer, prompts, max_tokens=1)
    worker_connector = producer.engine.model_runner.connector
    assert type(worker_connector).__name__ == "CountingConnector"
    assert isinstance(producer.engine.scheduler.connector, type(worker_connector))
    if how == "file-path":
        assert type(worker_connector).__module__ == "kvrecover_user_connector_test_connectors"
    assert (worker_connector.saved_blocks, worker_connector.installed_blocks) == (4 + 2, 0)

    consumer = engine()
    assert generate(consumer, prompts) == baseline(tiny_llama, prompts)
    assert consumer.engine.model_runner.connector.installed_blocks == 4 + 2
    assert consumer.stats["prompt_tokens_external"] == 64 + 32


# ----- configuration errors --------------------------------------------------------------
def _fault_config(tmp_path: Path, **extra) -> dict:
    return {"kv_connector": "FaultInjectionConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path), **extra}}


BAD_CONFIGS = {
    "unknown-name": (lambda d: {"kv_connector": "NoSuchConnector"},
                     r"unknown kv_connector 'NoSuchConnector'; registered connectors: .*"
                     r"SharedStorageConnector"),
    "bad-role": (lambda d: {"kv_connector": "SharedStorageConnector", "kv_role": "decoder"},
                 r"kv_role must be one of \('kv_producer', 'kv_consumer', 'kv_both'\), "
                 r"got 'decoder'"),
    "bad-policy": (lambda d: {"kv_connector": "SharedStorageConnector",
                              "kv_load_failure_policy": "retry"},
                   r"kv_load_failure_policy must be one of \('recompute', 'fail'\)"),
    "bad-retry-limit": (lambda d: {"kv_connector": "SharedStorageConnector",
                                   "kv_load_retry_limit": -1},
                        r"kv_load_retry_limit must be an integer >= 0"),
    "module-not-found": (lambda d: {"kv_connector": "X",
                                    "kv_connector_module_path": "no_such_module_kvrecover_test"},
                         r"kv_connector_module_path 'no_such_module_kvrecover_test' could not "
                         r"be imported"),
    "module-file-missing": (lambda d: {"kv_connector": "X",
                                       "kv_connector_module_path": str(d / "missing.py")},
                            r"kv_connector_module_path '.*missing.py': no such file"),
    "module-file-broken": (lambda d: {"kv_connector": "X",
                                      "kv_connector_module_path": str(d / "broken.py")},
                           r"kv_connector_module_path '.*broken.py' could not be imported: "
                           r"SyntaxError"),
    "module-file-not-python": (lambda d: {"kv_connector": "X",
                                          "kv_connector_module_path": str(d / "connector.txt")},
                               r"kv_connector_module_path '.*connector.txt': not an importable "
                               r"Python file"),
    "class-missing": (lambda d: {"kv_connector": "MissingConnector",
                                 "kv_connector_module_path": __name__},
                      r"has no class named 'MissingConnector' \(kv_connector\)"),
    "not-a-connector": (lambda d: {"kv_connector": "NOT_A_CONNECTOR",
                                   "kv_connector_module_path": __name__},
                        r"kv_connector 'NOT_A_CONNECTOR' is not a KVConnectorBase subclass"),
    "no-storage-path": (lambda d: {"kv_connector": "SharedStorageConnector"},
                        r"needs kv_connector_extra_config\['shared_storage_path'\]"),
    "bad-timeout": (lambda d: {"kv_connector": "SharedStorageConnector",
                               "kv_connector_extra_config": {"shared_storage_path": str(d),
                                                             "load_timeout_s": 0}},
                    r"kv_connector_extra_config\['load_timeout_s'\] must be a number of "
                    r"seconds > 0, got 0"),
    "timeout-not-a-number": (lambda d: {"kv_connector": "SharedStorageConnector",
                                        "kv_connector_extra_config": {
                                            "shared_storage_path": str(d),
                                            "load_timeout_s": "soon"}},
                             r"\['load_timeout_s'\] must be a number of seconds > 0"),
    "async-not-a-bool": (lambda d: {"kv_connector": "SharedStorageConnector",
                                    "kv_connector_extra_config": {"shared_storage_path": str(d),
                                                                  "async_load": "false"}},
                         r"kv_connector_extra_config\['async_load'\] must be True or False"),
    "faults-not-a-list": (lambda d: _fault_config(d, faults={"kind": "missing"}),
                          r"'faults' must be a list of fault dicts"),
    "fault-not-a-dict": (lambda d: _fault_config(d, faults=["missing"]),
                         r"each fault must be a dict, got 'missing'"),
    "fault-bad-kind": (lambda d: _fault_config(d, faults=[{"kind": "explode"}]),
                       r"fault 'kind' must be one of \('missing', 'error', 'corrupt', 'hang'\), "
                       r"got 'explode'"),
    "fault-bad-requests": (lambda d: _fault_config(d, faults=[{"requests": "some"}]),
                           r"fault 'requests' must be 'first', 'all', an int or a float"),
    "fault-negative-request": (lambda d: _fault_config(d, faults=[{"requests": -1}]),
                               r"fault 'requests' must be"),
    "fault-bad-blocks": (lambda d: _fault_config(d, faults=[{"blocks": "odd"}]),
                         r"fault 'blocks' must be one of \('all', 'first', 'last', 'middle'\)"),
    "fault-bad-fraction": (lambda d: _fault_config(d, faults=[{"blocks": 1.5}]),
                           r"fault 'blocks' must be one of"),
    "fault-bad-seed": (lambda d: _fault_config(d, seed="x"),
                       r"fault 'seed' must be an integer >= 0, got 'x'"),
    "fault-unknown-inner": (lambda d: _fault_config(d, inner_connector="Nope"),
                            r"inner_connector 'Nope': unknown kv_connector 'Nope'"),
    "fault-inner-is-itself": (lambda d: _fault_config(d, inner_connector="FaultInjectionConnector"),
                              r"inner_connector cannot be FaultInjectionConnector itself"),
    "fault-inner-no-path": (lambda d: {"kv_connector": "FaultInjectionConnector"},
                            r"inner_connector 'SharedStorageConnector': SharedStorageConnector "
                            r"needs kv_connector_extra_config\['shared_storage_path'\]"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_is_a_value_error_naming_the_field(tiny_llama, tmp_path, case):
    (tmp_path / "broken.py").write_text("class X(:\n")
    (tmp_path / "connector.txt").write_text("class X:\n    pass\n")
    make_kwargs, message = BAD_CONFIGS[case]
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_llama, KVTransferConfig(**make_kwargs(tmp_path)))


# ----- prefill and decode as two processes (the example scripts) -------------------------
def _run_example(script: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "examples" / "disaggregated" / script), *args]
    # One thread, like this process (single_thread): the same matmul splits, the same numerics.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture
def single_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.mark.slow
def test_prefill_and_decode_processes_on_the_default_model(tmp_path, single_thread):
    store = tmp_path / "kv_store"
    prompts_file = tmp_path / "prompts.json"
    prompts = ["Hi " * 120 + "Hello, my name is", "Hi " * 120 + "The capital of France is",
               "Hey " * 60 + "The capital of China is"]
    prompts_file.write_text(json.dumps(prompts))
    common = ["--storage", str(store), "--prompts-file", str(prompts_file), "--device", "cpu"]
    prefill_run = _run_example("prefill.py", *common)
    assert "stored" in prefill_run.stdout
    assert any(store.rglob(f"*{SUFFIX}"))
    decode_run = _run_example("decode.py", *common, "--max-tokens", "8", "--json")
    lines = [json.loads(line) for line in decode_run.stdout.splitlines() if line.startswith("{")]
    results, stats = lines[:-1], lines[-1]["stats"]
    assert [r["prompt"] for r in results] == prompts

    llm = LLM(None, device="cpu")
    reference = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [r["prompt_token_ids"] for r in results] == [o.prompt_token_ids for o in reference]
    assert [r["token_ids"] for r in results] == [o.outputs[0].token_ids for o in reference]
    assert [r["text"] for r in results] == [o.outputs[0].text for o in reference]
    lengths = [len(o.prompt_token_ids) for o in reference]
    # The two "Hi" prompts share their first blocks: loaded or hit in the local prefix cache.
    assert stats["prompt_tokens_external"] + stats["prefix_cache_hit_tokens"] == sum(
        (n - 1) // 16 * 16 for n in lengths)
    assert stats["prompt_tokens_external"] > 0
    assert stats["kv_load_failed_blocks"] == 0

"""Shutting down: `LLM.close()`, `with LLM(...)`, and interpreter exit with KV loads in flight.

A "hang" fault keeps each async load's thread busy until it is cancelled, so
loads are reliably in flight when the engine closes or the interpreter exits.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
from conftest import random_prompts

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.engine.request import RequestStatus

REPO = Path(__file__).resolve().parents[1]
PROMPTS = random_prompts(3, [40, 57, 33], 384, seed=5)
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kv-load-") and t.is_alive()]


@pytest.fixture(scope="module")
def store(tiny_llama, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("store")
    transfer = KVTransferConfig("SharedStorageConnector", "kv_producer",
                                {"shared_storage_path": str(path)})
    with LLM(str(tiny_llama), device="cpu", block_size=8, kv_transfer_config=transfer) as llm:
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
        assert llm.stats["kv_save_failed_blocks"] == 0
    return path


def hanging_consumer(model: Path, store: Path) -> LLM:
    extra = {"shared_storage_path": str(store), "async_load": True, "load_timeout_s": 600,
             "faults": [{"requests": "all", "blocks": "all", "kind": "hang"}]}
    transfer = KVTransferConfig("FaultInjectionConnector", "kv_consumer", extra)
    return LLM(str(model), device="cpu", block_size=8, kv_transfer_config=transfer)


def loads_in_flight(llm: LLM) -> int:
    """How many requests wait for an async load while its reader thread runs (a step's
    async loads share one reader: `batched_async_reads`)."""
    if not loader_threads():
        return 0
    return sum(request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
               for request in llm.engine.scheduler.requests.values())


def start_loads(llm: LLM) -> None:
    """Add every prompt and step until their loads are in flight (bounded)."""
    for i, prompt in enumerate(PROMPTS):
        llm.engine.add_request(str(i), {"prompt_token_ids": prompt}, PARAMS)
    for _ in range(20):
        llm.engine.step()
        if loads_in_flight(llm) == len(PROMPTS):
            return
    raise AssertionError(f"{loads_in_flight(llm)} loads in flight, expected {len(PROMPTS)}")


def test_close_cancels_and_joins_the_loader_threads(tiny_llama, store):
    llm = hanging_consumer(tiny_llama, store)
    start_loads(llm)
    llm.close()
    assert loader_threads() == []
    assert not llm.engine.has_unfinished()
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS)


def test_the_with_block_closes(tiny_llama, store):
    with hanging_consumer(tiny_llama, store) as llm:
        start_loads(llm)
    assert llm.engine.closed
    assert loader_threads() == []


def test_a_forgotten_llm_stops_its_loads_when_collected(tiny_llama, store):
    """An LLM dropped without close() (say, built inside a function) still stops its
    loader threads: when collected, or else at interpreter exit."""

    def use_and_forget() -> None:
        start_loads(hanging_consumer(tiny_llama, store))

    use_and_forget()
    gc.collect()
    assert loader_threads() == []


def test_a_closed_llm_frees_the_way_for_a_new_one(tiny_llama, store):
    """After close, a fresh LLM on the same store decodes as usual (loads, no faults)."""
    with hanging_consumer(tiny_llama, store) as llm:
        start_loads(llm)
    with LLM(str(tiny_llama), device="cpu", block_size=8) as plain:
        expected = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    transfer = KVTransferConfig("SharedStorageConnector", "kv_consumer",
                                {"shared_storage_path": str(store), "async_load": True})
    with LLM(str(tiny_llama), device="cpu", block_size=8, kv_transfer_config=transfer) as llm:
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
        assert llm.stats["prompt_tokens_external"] > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def storage_views_of(data_ptrs: set[int]) -> list[torch.Tensor]:
    """Every live (gc-tracked) strided tensor whose storage starts at one of `data_ptrs`."""
    return [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)
            and obj.layout == torch.strided and obj.untyped_storage().data_ptr() in data_ptrs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_close_releases_the_kv_cache_and_the_weights(tiny_llama, tmp_path, dtype):
    """A closed LLM keeps no KV cache tensor and no weight alive (nor a view of the cache:
    the connector that registered it included), even while the LLM itself is held."""
    transfer = KVTransferConfig("SharedStorageConnector", "kv_both",
                                {"shared_storage_path": str(tmp_path), "async_load": True})
    llm = LLM(str(tiny_llama), device="cpu", block_size=8, dtype=dtype,
              enable_prefix_caching=False, kv_transfer_config=transfer)
    for _ in range(2):  # saves, then loads what it saved
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    assert llm.stats["prompt_tokens_external"] > 0
    runner = llm.engine.model_runner
    cache_storages = {cache.untyped_storage().data_ptr() for cache in runner.kv_caches}
    assert len(storage_views_of(cache_storages)) > len(runner.kv_caches)  # the connector's views
    held = [weakref.ref(tensor) for tensor in
            (*runner.kv_caches, *runner.model.parameters(), *runner.model.buffers())]
    assert len(held) > 10
    del runner
    llm.close()
    gc.collect()
    assert [ref for ref in held if ref() is not None] == []
    assert storage_views_of(cache_storages) == []
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS)
    assert llm.stats["prompt_tokens_external"] > 0  # the counters outlive the close


EXIT_SCRIPT = """
import atexit, sys, threading
# Registered first, so it runs last: after kvrecover's own exit handler.
atexit.register(lambda: print("loader threads at exit:", sum(
    t.name.startswith("kv-load-") and t.is_alive() for t in threading.enumerate()), flush=True))
sys.path[:0] = [{repo!r}, {tests!r}]
from pathlib import Path
import test_shutdown as t
llm = t.hanging_consumer(Path({model!r}), Path({store!r}))
t.start_loads(llm)
print("exiting with", t.loads_in_flight(llm), "loads in flight", flush=True)
"""


@pytest.mark.slow
def test_exit_with_loads_in_flight_is_clean(tiny_llama, store):
    script = EXIT_SCRIPT.format(repo=str(REPO), tests=str(REPO / "tests"), model=str(tiny_llama),
                                store=str(store))
    for _ in range(3):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "terminate called" not in result.stderr
        assert f"exiting with {len(PROMPTS)} loads in flight" in result.stdout
        # Cancelled and joined before the interpreter tears down (their deadline is 600 s).
        assert "loader threads at exit: 0" in result.stdout

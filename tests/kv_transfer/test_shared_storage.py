"""SharedStorageConnector and stored-KV integrity: a damaged, unsavable or
concurrently written entry never changes an output.

Every decode here runs under policy `recompute` and must return exactly the
greedy token ids of an engine without any connector. Loads are bounded by
design (small `load_timeout_s`), never by a test timeout.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    KV_BLOCK,
    KV_LOADABLE,
    KV_PROMPT_LENGTHS,
    KV_PROMPTS,
    block_files,
    copy_store,
    kv_generate,
    make_kv_llm,
    no_connector_ids,
    random_prompt,
    simulate_full_disk,
    storage_transfer,
)

import kvrecover.kv_transfer.stores.block_store as block_store_module
from kvrecover.cli import main as cli_main
from kvrecover.kv_transfer.stores.shared_storage import SharedStorageConnector
from kvrecover.kv_transfer.stores.storage_check import check_entry

# ----- fuzzing the stored files ---------------------------------------------------------
MUTATIONS = ("flip", "truncate", "zero", "delete", "swap", "extend", "garbage")


def mutate(rng: random.Random, chains: list[list[Path]]) -> tuple[set[Path], set[Path], str]:
    """Damage 1-3 stored files; returns (damaged files, deleted files, a description)."""
    damaged: set[Path] = set()
    deleted: set[Path] = set()
    steps = []
    for _ in range(rng.randint(1, 3)):
        present = [p for chain in chains for p in chain if p not in deleted]
        kind = rng.choice(MUTATIONS)
        path = rng.choice(present)
        raw = bytearray(path.read_bytes())
        if kind == "flip":
            offset = rng.randrange(len(raw))
            raw[offset] ^= rng.randint(1, 255)
            path.write_bytes(bytes(raw))
        elif kind == "truncate":
            path.write_bytes(bytes(raw[: rng.randrange(1, len(raw))]))
        elif kind == "zero":
            path.write_bytes(b"")
        elif kind == "delete":
            path.unlink()
            deleted.add(path)
            damaged.discard(path)
            steps.append(f"delete {path.name[:6]}")
            continue
        elif kind == "swap":  # with a file of another prompt: a valid entry under a wrong key
            index = next(i for i, chain in enumerate(chains) if path in chain)
            others = [p for i, chain in enumerate(chains) if i != index for p in chain
                      if p not in deleted]
            other = rng.choice(others)
            other_raw = other.read_bytes()
            other.write_bytes(bytes(raw))
            path.write_bytes(other_raw)
            damaged.add(other)
        elif kind == "extend":
            os.truncate(path, len(raw) + rng.choice([1, 7, 1 << 30]))  # sparse: never read
        else:
            path.write_bytes(rng.randbytes(len(raw)))
        damaged.add(path)
        steps.append(f"{kind} {path.name[:6]}")
    return damaged, deleted, ", ".join(steps)


def expected_loaded_tokens(chains, damaged, deleted) -> tuple[int, bool]:
    """Tokens a consumer ends up loading, and whether any load must fail."""
    loaded, any_failure = 0, False
    for chain, loadable in zip(chains, KV_LOADABLE):
        for path in chain[:loadable]:
            if path in deleted:
                break  # a miss: never offered
            if path in damaged:
                any_failure = True  # offered, fails verification, recomputed from here
                break
            loaded += KV_BLOCK
    return loaded, any_failure


NUM_FUZZ_CASES = 40


def test_fuzzed_store_never_changes_the_output(tiny_llama, pristine_store, tmp_path):
    expected = no_connector_ids(tiny_llama)
    rng = random.Random(20261129)
    for case in range(NUM_FUZZ_CASES):
        chains = copy_store(pristine_store, tmp_path / f"case{case}")
        damaged, deleted, description = mutate(rng, chains)
        async_load, verify_after_load = rng.random() < 0.5, rng.random() < 0.5
        kv = storage_transfer(tmp_path / f"case{case}", "kv_consumer", async_load=async_load,
                              verify_after_load=verify_after_load, load_timeout_s=2.0)
        llm = make_kv_llm(tiny_llama, kv)
        outputs = kv_generate(llm, KV_PROMPTS)
        label = (f"case {case} ({description}, {'async' if async_load else 'sync'}, "
                 f"verify_after_load={verify_after_load})")
        assert outputs == expected, label
        loaded, any_failure = expected_loaded_tokens(chains, damaged, deleted)
        stats = llm.stats
        assert stats["prompt_tokens_external"] == loaded, label
        assert (stats["kv_load_failed_blocks"] > 0) == any_failure, label
        assert stats["kv_load_failed_requests"] == 0, label
        shutil.rmtree(tmp_path / f"case{case}")


def test_a_damaged_entry_is_replaced_when_the_decoder_also_produces(tiny_llama, pristine_store,
                                                                    tmp_path):
    chains = copy_store(pristine_store, tmp_path / "store")
    damaged = chains[0][1]
    raw = bytearray(damaged.read_bytes())
    raw[-3] ^= 0x10
    damaged.write_bytes(bytes(raw))
    assert check_entry(damaged) == "payload checksum mismatch"
    llm = make_kv_llm(tiny_llama, storage_transfer(tmp_path / "store", "kv_both"))
    assert kv_generate(llm, KV_PROMPTS) == no_connector_ids(tiny_llama)
    assert llm.stats["kv_load_recovered_requests"] == 1
    assert llm.stats["prompt_tokens_external"] == KV_BLOCK * (1 + KV_LOADABLE[1] + KV_LOADABLE[2])
    assert check_entry(damaged) is None  # the recomputed block was saved over it
    again = make_kv_llm(tiny_llama, storage_transfer(tmp_path / "store", "kv_consumer"))
    assert kv_generate(again, KV_PROMPTS) == no_connector_ids(tiny_llama)
    assert again.stats["prompt_tokens_external"] == KV_BLOCK * sum(KV_LOADABLE)


# ----- verify_after_load ----------------------------------------------------------------
class _CopiesDiscarded:
    """A cache tensor whose writes go nowhere: reads see the real (zeroed) cache."""

    def __init__(self, cache: torch.Tensor):
        self.cache = cache
        self.device = cache.device

    def __getitem__(self, index):
        return self.cache[index].clone()

    def index_copy_(self, dim, index, source):
        return self  # the copy "succeeds" without writing anything

    def index_select(self, dim, index):
        return self.cache.index_select(dim, index)

    def copy_(self, source, non_blocking=False):
        return self


class SilentlyFailingCopyConnector(SharedStorageConnector):
    """Reads and verifies blocks, then "copies" them into the cache without writing anything."""

    def register_kv_caches(self, kv_caches):
        for cache in kv_caches:
            cache.zero_()  # so what a failed copy leaves behind is deterministic
        super().register_kv_caches([_CopiesDiscarded(cache) for cache in kv_caches])


@pytest.mark.parametrize("verify_after_load", ["default", True], ids=["default", "on"])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_verify_after_load_catches_a_copy_that_wrote_nothing(tiny_llama, pristine_store, tmp_path,
                                                             caplog, async_load, verify_after_load):
    """The contract: KV that did not arrive in the cache is never used, so the output is the
    no-connector output; and this protection is on unless switched off."""
    copy_store(pristine_store, tmp_path / "store")
    flag = {} if verify_after_load == "default" else {"verify_after_load": verify_after_load}
    kv = storage_transfer(tmp_path / "store", "kv_consumer", "SilentlyFailingCopyConnector",
                          module_path=__name__, async_load=async_load, **flag)
    llm = make_kv_llm(tiny_llama, kv)
    with caplog.at_level(logging.WARNING):
        outputs = kv_generate(llm, KV_PROMPTS)
    assert outputs == no_connector_ids(tiny_llama)
    assert "does not match its stored checksum after the load" in caplog.text
    stats = llm.stats
    assert stats["prompt_tokens_external"] == 0  # the first block of every load is caught
    assert stats["kv_load_failed_blocks"] >= sum(KV_LOADABLE)
    assert stats["kv_load_recovered_requests"] >= len(KV_PROMPTS)


def test_verify_after_load_false_takes_the_copy_on_trust(tiny_llama, pristine_store, tmp_path,
                                                         caplog):
    """The opt-out really skips the check: the bad copies count as loaded, nothing is logged
    (what the output then is depends on what the cache held, so it is not asserted)."""
    copy_store(pristine_store, tmp_path / "store")
    kv = storage_transfer(tmp_path / "store", "kv_consumer", "SilentlyFailingCopyConnector",
                          module_path=__name__, verify_after_load=False)
    llm = make_kv_llm(tiny_llama, kv)
    with caplog.at_level(logging.WARNING):
        kv_generate(llm, KV_PROMPTS)
    assert "does not match its stored checksum" not in caplog.text
    assert llm.stats["kv_load_failed_blocks"] == 0
    assert llm.stats["prompt_tokens_external"] == KV_BLOCK * sum(KV_LOADABLE)


# ----- saves that cannot be written ------------------------------------------------------
def test_saving_into_a_path_that_is_a_file_fails_softly(tiny_llama, tmp_path, caplog):
    """Root ignores permissions, so the store is made unwritable by being a regular file."""
    not_a_folder = tmp_path / "store"
    not_a_folder.write_bytes(b"this is a file")
    llm = make_kv_llm(tiny_llama, storage_transfer(not_a_folder, "kv_both"))
    with caplog.at_level(logging.WARNING):
        outputs = kv_generate(llm, KV_PROMPTS)
    assert outputs == no_connector_ids(tiny_llama)
    assert "KV save failed" in caplog.text
    assert llm.stats["kv_save_failed_blocks"] == sum(n // KV_BLOCK for n in KV_PROMPT_LENGTHS)
    assert llm.stats["prompt_tokens_external"] == 0
    assert not_a_folder.read_bytes() == b"this is a file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_a_full_disk_leaves_no_partial_or_temporary_files(tiny_llama, tmp_path, caplog,
                                                          monkeypatch):
    simulate_full_disk(monkeypatch, block_store_module, bytes_before_failure=100)
    store = tmp_path / "store"
    llm = make_kv_llm(tiny_llama, storage_transfer(store, "kv_both"))
    with caplog.at_level(logging.WARNING):
        outputs = kv_generate(llm, KV_PROMPTS)
    assert outputs == no_connector_ids(tiny_llama)
    assert "KV save failed" in caplog.text
    assert llm.stats["kv_save_failed_blocks"] == sum(n // KV_BLOCK for n in KV_PROMPT_LENGTHS)
    assert [p for p in store.rglob("*") if p.is_file()] == []
    monkeypatch.undo()
    assert cli_main(["storage", "verify", str(store)]) == 0


# ----- concurrent producers ------------------------------------------------------------
PRODUCER = """
import json, sys, torch
torch.set_num_threads(1)
from kvrecover import LLM, KVTransferConfig, SamplingParams
model, store, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
kv = KVTransferConfig("SharedStorageConnector", "kv_producer", {"shared_storage_path": store})
llm = LLM(model, device="cpu", max_num_batched_tokens=64, num_kv_blocks=128,
          kv_transfer_config=kv)
params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
llm.generate([{"prompt_token_ids": p} for p in prompts], params)
print(json.dumps(llm.stats))
"""


def test_two_prefill_processes_writing_overlapping_prefixes(tiny_llama, tmp_path, capsys):
    shared = random_prompt(5 * KV_BLOCK, seed=7)
    prompts = [shared + random_prompt(40 + 9 * i, seed=8 + i) for i in range(3)]
    store = tmp_path / "store"
    plans = [[prompts[0], prompts[1]], [prompts[2], prompts[0]]]  # both write shared + prompt 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes = [
        subprocess.Popen([sys.executable, "-c", PRODUCER, str(tiny_llama), str(store),
                          json.dumps(plan)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
        for plan in plans
    ]
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        assert json.loads(out.splitlines()[-1])["kv_save_failed_blocks"] == 0
    distinct_blocks = 5 + sum((len(p) - 5 * KV_BLOCK) // KV_BLOCK for p in prompts)
    assert len(block_files(store)) == distinct_blocks
    assert not [p for p in store.rglob("*.tmp")]

    llm = make_kv_llm(tiny_llama, storage_transfer(store, "kv_consumer"))
    assert kv_generate(llm, prompts) == no_connector_ids(tiny_llama, prompts)
    stats = llm.stats
    loadable = sum((len(p) - 1) // KV_BLOCK * KV_BLOCK for p in prompts)
    assert stats["prompt_tokens_external"] + stats["prefix_cache_hit_tokens"] == loadable
    assert stats["kv_load_failed_blocks"] == 0

    capsys.readouterr()
    assert cli_main(["storage", "verify", str(store)]) == 0
    assert capsys.readouterr().out.strip() == f"{distinct_blocks} good, 0 bad entries under {store}"

"""Integrity of stored KV: a damaged, foreign, hung or unsavable entry never changes an output.

Every decode here runs under policy `recompute` and must return exactly the
greedy token ids of an engine without any connector. Loads are bounded by
design (small `load_timeout_s`), never by a test timeout.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import LLAMA3_ROPE, build_tiny_model, greedy_token_ids, simulate_full_disk

import kvrecover.kv_transfer.block_store as block_store_module
from kvrecover import LLM, KVTransferConfig
from kvrecover.cli import main as cli_main
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.block_store import PREFIX_SIZE, SUFFIX, BlockStore
from kvrecover.kv_transfer.shared_storage import SharedStorageConnector
from kvrecover.kv_transfer.storage_check import check_entry

VOCAB = 384
BLOCK = 16
MAX_TOKENS = 4
# Three unrelated prompts: 4, 5 and 3 full blocks, all loadable (the last token is not).
LENGTHS = (70, 93, 50)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(length)]


PROMPTS = [random_prompt(n, seed=100 + i) for i, n in enumerate(LENGTHS)]
LOADABLE = [(n - 1) // BLOCK for n in LENGTHS]


def transfer(store: Path, role: str = "kv_both", connector: str = "SharedStorageConnector",
             **extra) -> KVTransferConfig:
    module_path = extra.pop("module_path", None)
    return KVTransferConfig(connector, role, {"shared_storage_path": str(store), **extra},
                            kv_connector_module_path=module_path)


def make_llm(model: Path, kv: KVTransferConfig | None = None, **engine) -> LLM:
    settings = dict(device="cpu", block_size=BLOCK, max_num_batched_tokens=64, num_kv_blocks=128)
    settings.update(engine)
    return LLM(str(model), kv_transfer_config=kv, **settings)


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return greedy_token_ids(llm, prompts, max_tokens)


@functools.cache
def _baseline(model: str, prompts: tuple[tuple[int, ...], ...], engine: tuple) -> list[list[int]]:
    return generate(make_llm(Path(model), **dict(engine)), [list(p) for p in prompts])


def baseline(model: Path, prompts: list[list[int]] = PROMPTS, **engine) -> list[list[int]]:
    """Token ids of an engine without a connector (cached)."""
    return _baseline(str(model), tuple(map(tuple, prompts)), tuple(sorted(engine.items())))


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob(f"*{SUFFIX}"))


@pytest.fixture(scope="module")
def pristine_store(tiny_llama, tmp_path_factory) -> tuple[Path, list[list[Path]]]:
    """A store holding the KV of PROMPTS, and each prompt's block files in chain order."""
    root = tmp_path_factory.mktemp("pristine_store")
    llm = make_llm(tiny_llama, transfer(root, "kv_producer"))
    generate(llm, PROMPTS, max_tokens=1)
    layout = llm.engine.layout
    store = BlockStore(root, layout)
    from kvrecover.kv_layout import update_block_hashes

    chains = []
    for prompt in PROMPTS:
        keys: list[bytes] = []
        update_block_hashes(keys, prompt, BLOCK)
        chains.append([store.path(key) for key in keys])
    assert sorted(p for chain in chains for p in chain) == block_files(root)
    return root, chains


def copy_store(pristine: tuple[Path, list[list[Path]]], target: Path) -> list[list[Path]]:
    root, chains = pristine
    shutil.copytree(root, target)
    return [[target / path.relative_to(root) for path in chain] for chain in chains]


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
    for chain, loadable in zip(chains, LOADABLE):
        for path in chain[:loadable]:
            if path in deleted:
                break  # a miss: never offered
            if path in damaged:
                any_failure = True  # offered, fails verification, recomputed from here
                break
            loaded += BLOCK
    return loaded, any_failure


NUM_FUZZ_CASES = 40


def test_fuzzed_store_never_changes_the_output(tiny_llama, pristine_store, tmp_path):
    expected = baseline(tiny_llama)
    rng = random.Random(20261129)
    for case in range(NUM_FUZZ_CASES):
        chains = copy_store(pristine_store, tmp_path / f"case{case}")
        damaged, deleted, description = mutate(rng, chains)
        async_load, verify_after_load = rng.random() < 0.5, rng.random() < 0.5
        kv = transfer(tmp_path / f"case{case}", "kv_consumer", async_load=async_load,
                      verify_after_load=verify_after_load, load_timeout_s=2.0)
        llm = make_llm(tiny_llama, kv)
        started = time.monotonic()
        outputs = generate(llm, PROMPTS)
        label = (f"case {case} ({description}, {'async' if async_load else 'sync'}, "
                 f"verify_after_load={verify_after_load})")
        assert outputs == expected, label
        assert time.monotonic() - started < 30, label
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
    llm = make_llm(tiny_llama, transfer(tmp_path / "store", "kv_both"))
    assert generate(llm, PROMPTS) == baseline(tiny_llama)
    assert llm.stats["kv_load_recovered_requests"] == 1
    assert llm.stats["prompt_tokens_external"] == BLOCK * (1 + LOADABLE[1] + LOADABLE[2])
    assert check_entry(damaged) is None  # the recomputed block was saved over it
    again = make_llm(tiny_llama, transfer(tmp_path / "store", "kv_consumer"))
    assert generate(again, PROMPTS) == baseline(tiny_llama)
    assert again.stats["prompt_tokens_external"] == BLOCK * sum(LOADABLE)


# ----- KV of another model or layout ------------------------------------------------------
@pytest.fixture(scope="module")
def lookalike_llama(tmp_path_factory) -> Path:
    """Same layout as tiny_llama (layers, KV heads, head dim) but another rope: other KV."""
    return build_tiny_model(tmp_path_factory.mktemp("lookalike"), seed=2, rope_theta=10000.0,
                            tie_word_embeddings=True)


@pytest.fixture(scope="module")
def retrained_llama(tmp_path_factory) -> Path:
    """tiny_llama's exact config with other weights (a fine-tune of the same architecture)."""
    return build_tiny_model(tmp_path_factory.mktemp("retrained"), seed=3,
                            rope_scaling=LLAMA3_ROPE, rope_theta=500000.0,
                            tie_word_embeddings=True)


@pytest.mark.parametrize("other", ["other-model", "same-layout-other-model", "block-size-12",
                                   "bfloat16"])
def test_kv_of_another_model_or_layout_is_a_miss(tiny_llama, tiny_llama_untied,
                                                 lookalike_llama, pristine_store, tmp_path,
                                                 other):
    model, engine = {
        "other-model": (tiny_llama_untied, {}),
        "same-layout-other-model": (lookalike_llama, {}),
        "block-size-12": (tiny_llama, {"block_size": 12}),
        "bfloat16": (tiny_llama, {"dtype": "bfloat16"}),
    }[other]
    copy_store(pristine_store, tmp_path / "store")
    llm = make_llm(model, transfer(tmp_path / "store", "kv_both"), **engine)
    assert generate(llm, PROMPTS) == baseline(model, **engine)
    stats = llm.stats
    assert stats["prompt_tokens_external"] == 0
    assert stats["kv_load_failed_blocks"] == 0
    assert stats["prompt_tokens_computed"] == sum(LENGTHS)
    # It stored its own KV beside, under its own layout folder.
    folders = sorted(p.name for p in (tmp_path / "store").iterdir())
    assert len(folders) == 2 and llm.engine.layout.fingerprint in folders


@pytest.mark.parametrize("target", ["same-layout-other-model", "bfloat16"])
def test_kv_copied_into_another_layouts_folder_fails_verification(tiny_llama, lookalike_llama,
                                                                  pristine_store, tmp_path,
                                                                  target):
    """Files moved by hand into the wrong layout folder: the header check rejects each one."""
    model, engine = {"same-layout-other-model": (lookalike_llama, {}),
                     "bfloat16": (tiny_llama, {"dtype": "bfloat16"})}[target]
    root, _ = pristine_store
    (source,) = list(root.iterdir())
    llm = make_llm(model, transfer(tmp_path / "store", "kv_consumer"), **engine)
    shutil.copytree(source, tmp_path / "store" / llm.engine.layout.fingerprint)
    assert generate(llm, PROMPTS) == baseline(model, **engine)
    assert llm.stats["prompt_tokens_external"] == 0
    assert llm.stats["kv_load_failed_blocks"] == sum(LOADABLE)
    assert llm.stats["kv_load_recovered_requests"] == len(PROMPTS)


def test_kv_of_a_model_with_the_same_config_but_other_weights_is_a_miss(
    tiny_llama, retrained_llama, pristine_store, tmp_path
):
    copy_store(pristine_store, tmp_path / "store")
    llm = make_llm(retrained_llama, transfer(tmp_path / "store", "kv_consumer"))
    outputs = generate(llm, PROMPTS)
    assert llm.stats["prompt_tokens_external"] == 0
    assert outputs == baseline(retrained_llama)


# ----- hung and corrupted loads ----------------------------------------------------------
def fault_transfer(store: Path, faults: list[dict], **extra) -> KVTransferConfig:
    return transfer(store, "kv_consumer", "FaultInjectionConnector", faults=faults, **extra)


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_hung_load_ends_at_its_deadline_and_recovers(tiny_llama, pristine_store, tmp_path,
                                                       async_load):
    copy_store(pristine_store, tmp_path / "store")
    faults = [{"requests": "first", "blocks": "middle", "kind": "hang"}]
    llm = make_llm(tiny_llama, fault_transfer(tmp_path / "store", faults, async_load=async_load,
                                              load_timeout_s=0.5))
    started = time.monotonic()
    outputs = generate(llm, PROMPTS)
    elapsed = time.monotonic() - started
    assert outputs == baseline(tiny_llama)
    # It waited for the deadline (0.5 s per attempt; async retries once), not for the injected
    # hang to give up by itself (after 10 x load_timeout_s = 5 s).
    assert 0.5 <= elapsed < 4.5
    stats = llm.stats
    assert stats["kv_load_failed_blocks"] > 0
    assert stats["kv_load_recovered_requests"] >= 1
    # The first loading request hung: at most its blocks before the hung one count as loaded.
    others = BLOCK * sum(LOADABLE[1:])
    assert others <= stats["prompt_tokens_external"] <= others + BLOCK * (LOADABLE[0] // 2)


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_corrupted_read_is_caught_by_the_checksum(tiny_llama, pristine_store, tmp_path,
                                                    caplog, async_load):
    copy_store(pristine_store, tmp_path / "store")
    faults = [{"requests": "all", "blocks": [2], "kind": "corrupt"}]
    llm = make_llm(tiny_llama, fault_transfer(tmp_path / "store", faults, async_load=async_load,
                                              load_timeout_s=2.0))
    with caplog.at_level(logging.WARNING):
        outputs = generate(llm, PROMPTS)
    assert outputs == baseline(tiny_llama)
    assert "payload checksum mismatch" in caplog.text
    stats = llm.stats
    assert stats["kv_load_recovered_requests"] >= len(PROMPTS)
    assert stats["kv_load_failed_requests"] == 0
    if async_load:
        # A waiting request asks again (retry limit 1); the fault hits position 2 of the new,
        # shorter load, which only the 5-block prompt still has.
        assert stats["prompt_tokens_external"] == BLOCK * (4 + 4 + 3)
    else:
        assert stats["prompt_tokens_external"] == BLOCK * 2 * len(PROMPTS)
    # The store itself is intact: the damage was in flight.
    assert all(check_entry(p) is None for p in block_files(tmp_path / "store"))


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


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_verify_after_load_catches_a_copy_that_wrote_nothing(tiny_llama, pristine_store, tmp_path,
                                                             caplog, async_load):
    copy_store(pristine_store, tmp_path / "store")
    kv = transfer(tmp_path / "store", "kv_consumer", "SilentlyFailingCopyConnector",
                  module_path=__name__, async_load=async_load, verify_after_load=True)
    llm = make_llm(tiny_llama, kv)
    with caplog.at_level(logging.WARNING):
        outputs = generate(llm, PROMPTS)
    assert outputs == baseline(tiny_llama)
    assert "does not match its stored checksum after the load" in caplog.text
    stats = llm.stats
    assert stats["prompt_tokens_external"] == 0  # the first block of every load is caught
    assert stats["kv_load_failed_blocks"] >= sum(LOADABLE)
    assert stats["kv_load_recovered_requests"] >= len(PROMPTS)


def test_without_verify_after_load_a_silent_copy_failure_goes_unnoticed(tiny_llama,
                                                                        pristine_store, tmp_path):
    """Documents why verify_after_load defaults to True: nothing else notices the bad copy."""
    copy_store(pristine_store, tmp_path / "store")
    kv = transfer(tmp_path / "store", "kv_consumer", "SilentlyFailingCopyConnector",
                  module_path=__name__, verify_after_load=False)
    llm = make_llm(tiny_llama, kv)
    outputs = generate(llm, PROMPTS)
    stats = llm.stats
    assert stats["kv_load_failed_blocks"] == 0
    assert stats["prompt_tokens_external"] == BLOCK * sum(LOADABLE)
    expected = baseline(tiny_llama)
    assert outputs != expected  # all-zero KV was used: the output may change, silently


# ----- saves that cannot be written ------------------------------------------------------
def test_saving_into_a_path_that_is_a_file_fails_softly(tiny_llama, tmp_path, caplog):
    """Root ignores permissions, so the store is made unwritable by being a regular file."""
    not_a_folder = tmp_path / "store"
    not_a_folder.write_bytes(b"this is a file")
    llm = make_llm(tiny_llama, transfer(not_a_folder, "kv_both"))
    with caplog.at_level(logging.WARNING):
        outputs = generate(llm, PROMPTS)
    assert outputs == baseline(tiny_llama)
    assert "KV save failed" in caplog.text
    assert llm.stats["kv_save_failed_blocks"] == sum(n // BLOCK for n in LENGTHS)
    assert llm.stats["prompt_tokens_external"] == 0
    assert not_a_folder.read_bytes() == b"this is a file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_a_full_disk_leaves_no_partial_or_temporary_files(tiny_llama, tmp_path, caplog,
                                                          monkeypatch):
    simulate_full_disk(monkeypatch, block_store_module, bytes_before_failure=100)
    store = tmp_path / "store"
    llm = make_llm(tiny_llama, transfer(store, "kv_both"))
    with caplog.at_level(logging.WARNING):
        outputs = generate(llm, PROMPTS)
    assert outputs == baseline(tiny_llama)
    assert "KV save failed" in caplog.text
    assert llm.stats["kv_save_failed_blocks"] == sum(n // BLOCK for n in LENGTHS)
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
    shared = random_prompt(5 * BLOCK, seed=7)
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
    distinct_blocks = 5 + sum((len(p) - 5 * BLOCK) // BLOCK for p in prompts)
    assert len(block_files(store)) == distinct_blocks
    assert not [p for p in store.rglob("*.tmp")]

    llm = make_llm(tiny_llama, transfer(store, "kv_consumer"))
    assert generate(llm, prompts) == baseline(tiny_llama, prompts)
    stats = llm.stats
    loadable = sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
    assert stats["prompt_tokens_external"] + stats["prefix_cache_hit_tokens"] == loadable
    assert stats["kv_load_failed_blocks"] == 0

    capsys.readouterr()
    assert cli_main(["storage", "verify", str(store)]) == 0
    assert capsys.readouterr().out.strip() == f"{distinct_blocks} good, 0 bad entries under {store}"


# ----- kvrecover storage verify -----------------------------------------------------------
def test_storage_verify_counts_reports_and_fixes(tmp_path, capsys):
    layout = KVCacheLayout("verify-test", torch.float32, 4, 2, 2, 8)
    store = BlockStore(tmp_path, layout)
    generator = torch.Generator().manual_seed(0)
    keys = [bytes([i]) * 16 for i in range(6)]
    for key in keys:
        store.write(key, torch.randn(store.block_shape, generator=generator))
    flipped, truncated, emptied = (store.path(k) for k in keys[:3])
    raw = bytearray(flipped.read_bytes())
    raw[PREFIX_SIZE + 5] ^= 1
    flipped.write_bytes(bytes(raw))
    os.truncate(truncated, PREFIX_SIZE + 3)
    emptied.write_bytes(b"")
    leftover = store.path(keys[3]).with_name(f".{keys[3].hex()}{SUFFIX}.99.abcd.tmp")
    leftover.write_bytes(b"partial")

    assert cli_main(["storage", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert sorted(out[:-1]) == sorted([
        f"bad: {flipped}: payload checksum mismatch",
        f"bad: {truncated}: size {PREFIX_SIZE + 3} bytes, header says "
        f"{PREFIX_SIZE + layout.block_nbytes}",
        f"bad: {emptied}: truncated: 0 bytes",
        f"bad: {leftover}: leftover temporary file of an interrupted write",
    ])
    assert out[-1] == f"3 good, 4 bad entries under {tmp_path}"

    assert cli_main(["storage", "verify", str(tmp_path), "--fix"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("removed: ") for line in out) == 4
    assert block_files(tmp_path) == sorted(store.path(k) for k in keys[3:])
    assert not leftover.exists()

    assert cli_main(["storage", "verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"3 good, 0 bad entries under {tmp_path}"]
    assert all(store.read(k).tensor.shape == store.block_shape for k in keys[3:])


def test_storage_verify_of_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    assert cli_main(["storage", "verify", str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert cli_main(["storage", "verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"0 good, 0 bad entries under {tmp_path}"

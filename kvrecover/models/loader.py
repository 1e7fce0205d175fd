"""Load safetensors checkpoints (single file or sharded via the index) into our modules."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


@contextlib.contextmanager
def skip_weight_init() -> Iterator[None]:
    """Build modules without random initialisation (the checkpoint overwrites it)."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, in index order when sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in dict.fromkeys(weight_map.values())]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {model_dir} has no *.safetensors weights")
    return files


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy every checkpoint tensor into `model`; fail if a parameter was never loaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                tensor = handle.get_tensor(name)
                target = name.removeprefix("model.")  # HF nests the decoder under `model.`
                shard = None
                for fragment, (ours, shard_id) in packed.items():
                    if f".{fragment}." in target:
                        target, shard = target.replace(f".{fragment}.", f".{ours}."), shard_id
                        break
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
                with torch.no_grad():
                    if shard is None:
                        if param.shape != tensor.shape:
                            raise ValueError(
                                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                f"expected {tuple(param.shape)}"
                            )
                        param.data.copy_(tensor)
                    else:
                        param.weight_loader(param, tensor, shard)
                loaded.add(target)
    if getattr(model.config, "tie_word_embeddings", False):
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for: {', '.join(missing[:5])}")

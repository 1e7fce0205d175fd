"""Write a checkpoint with random weights for a given config and tokenizer.

For machines without the real weights (the GPU box cannot download, and the
built-in model's GGUF is too big to carry there): the scenario and the
benchmarks only need a model of the right shape.

    python bench/random_checkpoint.py SOURCE_DIR OUT_DIR [--dtype bfloat16] [--seed 0]

SOURCE_DIR holds config.json and the tokenizer files (weights are not read).
`write_random_checkpoint` does the same from a config dict (`model_shapes.py`).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch


def write_random_checkpoint(config: Any, out: Path, *, dtype: str = "bfloat16", seed: int = 0,
                            device: str = "cpu") -> Path:
    """Save random weights of `config` (a transformers config, or a config.json dict)
    to `out` as safetensors, built on `device`; the config's `architectures` are kept."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    architectures = None
    if isinstance(config, dict):
        architectures = config.get("architectures")
        config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    del model
    if architectures is not None:
        config_file = out / "config.json"
        saved = json.loads(config_file.read_text())
        saved["architectures"] = architectures
        config_file.write_text(json.dumps(saved))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="folder with config.json and tokenizer files")
    parser.add_argument("out", type=Path, help="where the checkpoint goes")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoConfig

    write_random_checkpoint(AutoConfig.from_pretrained(args.source), args.out, dtype=args.dtype,
                            seed=args.seed)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "special_tokens_map.json"):
        if (args.source / name).is_file():
            shutil.copy(args.source / name, args.out / name)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

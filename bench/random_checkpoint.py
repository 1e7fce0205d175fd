"""Write a checkpoint with random weights for a given config and tokenizer.

For machines without the real weights (the GPU box cannot download, and the
built-in model's GGUF is too big to carry there): the scenario and the
benchmarks only need a model of the right shape.

    python bench/random_checkpoint.py SOURCE_DIR OUT_DIR [--dtype bfloat16] [--seed 0]

SOURCE_DIR holds config.json and the tokenizer files (weights are not read).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="folder with config.json and tokenizer files")
    parser.add_argument("out", type=Path, help="where the checkpoint goes")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    args.out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(args.source)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "special_tokens_map.json"):
        if (args.source / name).is_file():
            shutil.copy(args.source / name, args.out / name)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

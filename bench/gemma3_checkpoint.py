"""Random-weight Gemma 3-shaped checkpoints: the windowed model and its all-full twin.

`bench/gemma3_shape/config.json` (the gemma3-1b text shape) or `tiny` (small enough for
the CPU), with `layer_types` written out (every sixth layer global), and the same weights
under a config whose every layer is "full_attention" (the model a window saves against).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from bench_recovery import release_memory
from model_shapes import write_word_tokenizer

SHAPE_FILE = Path(__file__).parent / "gemma3_shape" / "config.json"
TINY = dict(vocab_size=32768, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32)


def shape_config(shape: str, window: int | None, full_attention: bool) -> dict:
    """The Gemma 3 shape's config.json (shrunk for `tiny`), every layer full if asked."""
    config = json.loads(SHAPE_FILE.read_text())
    if shape == "tiny":
        config.update(TINY, sliding_window=128)
    config["sliding_window"] = window or config["sliding_window"]
    config["max_position_embeddings"] = 65536
    pattern = config["sliding_window_pattern"]
    config["layer_types"] = [
        "full_attention" if full_attention or (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(config["num_hidden_layers"])]
    return config


def write_checkpoints(folder: Path, shape: str, window: int | None, device: str
                      ) -> dict[str, Path]:
    """The windowed checkpoint (random weights) and its all-full twin (same weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dirs = {"windowed": folder / "windowed", "full": folder / "full"}
    if not (dirs["windowed"] / "model.safetensors").is_file():
        config = shape_config(shape, window, full_attention=False)
        settings = {k: v for k, v in config.items()
                    if k not in ("architectures", "model_type", "torch_dtype")}
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.for_model(config["model_type"], **settings), dtype=dtype)
        if shape == "tiny":  # larger weights give peaked, varied greedy outputs
            with torch.no_grad():
                for param in model.parameters():
                    if param.dim() == 2:
                        param.normal_(0, 0.08)
        model.save_pretrained(dirs["windowed"], safe_serialization=True)
        (dirs["windowed"] / "config.json").write_text(json.dumps(config))
        write_word_tokenizer(dirs["windowed"], config["vocab_size"], config["eos_token_id"])
        del model
        release_memory()
    dirs["full"].mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        link = dirs["full"] / name
        if not link.exists():
            link.symlink_to(dirs["windowed"] / name)
    (dirs["full"] / "config.json").write_text(
        json.dumps(shape_config(shape, window, full_attention=True)))
    return dirs

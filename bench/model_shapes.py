"""The model shapes the GPU benchmarks run, read from the checkpoint they run.

`SHAPES` names the two Llama shapes of the notes ("1b": Llama-3.2-1B, "8b":
Llama-3.1-8B); `build_checkpoint` writes random bf16 weights of one with a word-level
tokenizer (`random_checkpoint.write_random_checkpoint`; no download), and
`ModelShape.of(model_dir)` reads the dimensions back from any checkpoint's
config.json, so a roofline or a label always describes what was run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_LLAMA3_COMMON: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
    rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
    bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16",
)
SHAPES: dict[str, dict[str, Any]] = {
    "1b": dict(_LLAMA3_COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               tie_word_embeddings=True,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}),
    "8b": dict(_LLAMA3_COMMON, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               tie_word_embeddings=False,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}),
}
SHAPE_NAMES = {"1b": "Llama-3.2-1B", "8b": "Llama-3.1-8B"}
_DIMENSIONS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions a roofline needs, of one checkpoint."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    @classmethod
    def of(cls, model_dir: Path) -> ModelShape:
        """The shape in `model_dir`/config.json (head_dim defaults to hidden / heads)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} holds no config.json: pass a checkpoint folder as "
                             "--model-dir, or --shape to write one")
        return cls.from_config(json.loads(path.read_text()))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        values = dict(config)
        values.setdefault("head_dim", values["hidden_size"] // values["num_attention_heads"])
        return cls(**{name: int(values[name]) for name in _DIMENSIONS})

    @property
    def name(self) -> str | None:
        """"1b" or "8b" when it is one of `SHAPES`, else None."""
        return next((key for key, config in SHAPES.items()
                     if ModelShape.from_config(config) == self), None)

    @property
    def label(self) -> str:
        """"Llama-3.2-1B shape", or the dimensions of an unnamed one."""
        if self.name is not None:
            return f"{SHAPE_NAMES[self.name]} shape"
        return (f"{self.num_hidden_layers} layers x hidden {self.hidden_size} "
                f"(heads {self.num_attention_heads}/{self.num_key_value_heads})")

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer's linears (qkv, o, gate, up, down)."""
        q_size = self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        return (self.hidden_size * (q_size + 2 * kv_size) + q_size * self.hidden_size
                + 3 * self.hidden_size * self.intermediate_size)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's keys and values over all layers, in bf16."""
        return 2 * 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim


def default_model_dir(shape: str) -> Path:
    """Where a benchmark writes the random checkpoint of `shape` when given no folder."""
    return Path(f"/tmp/kvrecover-bench-llama{shape}")


def has_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def resolve_model_dir(model_dir: Path | None, shape: str | None) -> Path:
    """The checkpoint a benchmark runs: `model_dir` as it is when it holds one (it must then
    be of `shape`, if given); else random bf16 weights of `shape` (default "1b") written
    there, or under `default_model_dir`."""
    if shape is not None and shape not in SHAPES:
        raise ValueError(f"--shape must be one of {sorted(SHAPES)}, got {shape!r}")
    folder = model_dir if model_dir is not None else default_model_dir(shape or "1b")
    if has_checkpoint(folder):
        found = ModelShape.of(folder)
        if shape is not None and found != ModelShape.from_config(SHAPES[shape]):
            raise ValueError(f"{folder} holds a {found.label} checkpoint, not the {shape} shape "
                             "asked for: drop --shape, or give another --model-dir")
        return folder
    return build_checkpoint(folder, shape or "1b")


def build_checkpoint(folder: Path, shape: str = "1b") -> Path:
    """A random bf16 checkpoint of `SHAPES[shape]` with a word-level tokenizer, written on
    the GPU; an existing checkpoint in `folder` is kept as it is."""
    import torch
    from random_checkpoint import write_random_checkpoint  # bench/ is on sys.path

    if has_checkpoint(folder):
        return folder
    config = SHAPES[shape]
    write_random_checkpoint(config, folder, dtype="bfloat16", seed=0, device="cuda")
    write_word_tokenizer(folder, config["vocab_size"], config["eos_token_id"])
    torch.cuda.empty_cache()
    return folder


def write_word_tokenizer(folder: Path, vocab_size: int, eos_token_id: int) -> None:
    """A word-level tokenizer "t0 t1 ..." of `vocab_size` ids (random checkpoints need one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{eos_token_id}"}))

"""The model hyper-parameters every family shares, read from a Hugging Face config.

A family (one file under `models/`, see `registry.py`) subclasses `ModelConfig`
with its own fields and extends `hf_fields` to read them, each through a `FieldReader`:
a bad value (wrong type, out of range, missing where required) is a ValueError at
start-up naming the field, its value and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import torch

from kvrecover.models.rope import check_rope_scaling, rope_type_of


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only transformer, common to every family."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    checkpoint_dtype: torch.dtype = torch.float32
    eos_token_ids: list[int] = field(default_factory=list)
    # What an absent head_dim / tie_word_embeddings means (None: hidden_size / heads).
    default_head_dim: ClassVar[int | None] = None
    default_tied_embeddings: ClassVar[bool] = False

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window in tokens (None: full attention); a family with
        windowed layers overrides this. Read by the model's layers and by whoever sizes
        the KV cache per layer."""
        return [None] * self.num_hidden_layers

    def recurrent_layers(self) -> list[int]:
        """The layers that keep a recurrent state instead of a KV cache (linear attention,
        `models/recurrent_state.py`); a hybrid family overrides this. They belong to no KV
        cache group."""
        return []

    @property
    def identity(self) -> str:
        """A short stable digest of everything that shapes the KV cache's contents
        (every field of the family's config, by name: stored KV keys depend on it)."""
        record = asdict(self)
        record["checkpoint_dtype"] = str(self.checkpoint_dtype)
        record.pop("eos_token_ids")
        blob = json.dumps(record, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any], model_dir: Path) -> ModelConfig:
        """This class's config from the parsed `config.json` of checkpoint `model_dir`."""
        return cls(**cls.hf_fields(raw, Path(model_dir)))

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
        """The constructor arguments read from `raw`, each checked (`FieldReader`); a family
        returns these plus its own (`{**super().hf_fields(raw, model_dir), "field": ...}`)
        and may refuse a setting."""
        refuse_quantization(raw, model_dir)  # every family: quantized weights would be misread
        fields = FieldReader.of(raw, model_dir)
        hidden_size = fields.positive_int("hidden_size")
        num_heads = fields.positive_int("num_attention_heads")
        num_kv_heads = fields.positive_int("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            fields.fail("num_key_value_heads", f"a divisor of num_attention_heads ({num_heads})")
        head_dim = fields.positive_int("head_dim", cls.default_head_dim)
        if head_dim is None:  # derived, as Hugging Face does
            if hidden_size % num_heads:
                fields.fail("hidden_size", f"a multiple of num_attention_heads ({num_heads}) "
                            "where head_dim is not given")
            head_dim = hidden_size // num_heads
        if head_dim % 2:
            raise ValueError(f"{fields.source}: head_dim={head_dim} must be even (rotary "
                             "embeddings turn pairs of dimensions)")
        rope_parameters = fields.nested("rope_parameters")
        if raw.get("rope_theta") is not None or rope_parameters is None:
            rope_theta = fields.positive_number("rope_theta", 10000.0)
        else:
            rope_theta = rope_parameters.positive_number("rope_theta", 10000.0)
        scaling = fields.nested("rope_scaling")
        if scaling is None and rope_parameters is not None \
                and rope_type_of(rope_parameters.raw) != "default":
            scaling = rope_parameters
        max_positions = fields.positive_int("max_position_embeddings", 4096)
        return dict(
            architecture=architecture_of(raw),
            vocab_size=fields.positive_int("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=fields.positive_int("intermediate_size"),
            num_hidden_layers=fields.positive_int("num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.positive_number("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=fields.flag("tie_word_embeddings", cls.default_tied_embeddings),
            rope_scaling=checked_rope_scaling(scaling, max_positions),
            checkpoint_dtype=checkpoint_dtype_of(fields),
            eos_token_ids=_eos_token_ids(model_dir, raw),
        )


def checked_rope_scaling(scaling: FieldReader | None,
                         max_positions: int) -> dict[str, Any] | None:
    """The `rope_scaling` (or `rope_parameters`) object `scaling` reads, checked: a type
    kvrecover computes, the fields it needs, each a number in range; with what Hugging Face
    fills in for YaRN and Llama 3 (`original_max_position_embeddings` defaults to
    `max_position_embeddings`)."""
    if scaling is None or not scaling.raw:
        return None
    filled = dict(scaling.raw)
    rope_type = rope_type_of(filled)
    if rope_type in ("yarn", "llama3") and filled.get("original_max_position_embeddings") is None:
        filled["original_max_position_embeddings"] = max_positions
    check_rope_scaling(filled, str(scaling.source))
    fields = FieldReader(filled, scaling.source, scaling.prefix)
    fields.positive_number("factor", 1.0)
    fields.positive_int("original_max_position_embeddings", max_positions)
    low, high = (fields.positive_number(name, default) for name, default in
                 (("low_freq_factor", 1.0), ("high_freq_factor", 4.0)))
    if rope_type == "llama3" and high <= low:
        fields.fail("high_freq_factor", f"greater than low_freq_factor ({low})")
    for name in ("beta_fast", "beta_slow", "attention_factor"):
        fields.positive_number(name, None, nullable=True)
    fields.flag("truncate", True)
    return filled


def checkpoint_dtype_of(fields: FieldReader) -> torch.dtype:
    """The weights' dtype config.json names (`torch_dtype`, or `dtype`; float32 if neither)."""
    name = "torch_dtype" if fields.raw.get("torch_dtype") is not None else "dtype"
    value = fields.raw.get(name) or "float32"
    dtype = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        fields.fail(name, "a floating-point torch dtype name (float32, bfloat16, float16)")
    return dtype


REQUIRED: Any = object()  # a `FieldReader` default: the field must be present


class FieldReader:
    """Checked reads of one config.json object (the file, or a dict nested in it, named
    by `prefix`). Each read returns the field's value (its default where absent or null;
    None where `nullable` and null) or raises a ValueError naming the field, its value
    and what is allowed. Every family's `hf_fields` reads config.json through one."""

    def __init__(self, raw: Any, source: Path | str, prefix: str = "") -> None:
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: {prefix.rstrip('.')}={raw!r} must be a JSON object"
                             if prefix else f"{source} must hold a JSON object, got {raw!r}")
        self.raw, self.source, self.prefix = raw, source, prefix

    @classmethod
    def of(cls, raw: dict[str, Any], model_dir: Path) -> FieldReader:
        """A reader of the parsed config.json of checkpoint `model_dir`."""
        return cls(raw, Path(model_dir) / "config.json")

    def fail(self, name: str, allowed: str) -> NoReturn:
        """A ValueError: field `name`'s value must be `allowed`."""
        raise ValueError(f"{self.source}: {self.prefix}{name}={self.raw.get(name)!r} must be "
                         f"{allowed}")

    def _get(self, name: str, default: Any, nullable: bool) -> tuple[Any, bool]:
        """(value, whether to check it): absent or null gives the default, unchecked."""
        value = self.raw.get(name)
        if value is None and nullable and name in self.raw:
            return None, False
        if value is None:
            if default is REQUIRED:
                raise ValueError(f"{self.source}: {self.prefix}{name} is missing (required)")
            return default, False
        return value, True

    def positive_int(self, name: str, default: Any = REQUIRED, *,
                     nullable: bool = False) -> Any:
        """An integer >= 1 (head counts, sizes, windows); null -> None where `nullable`."""
        value, check = self._get(name, default, nullable)
        if check and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            self.fail(name, "a positive integer" + (" or null" if nullable else ""))
        return value

    def positive_number(self, name: str, default: Any = REQUIRED, *, nullable: bool = False,
                        at_most: float | None = None) -> Any:
        """A finite number > 0 (and <= `at_most`) as a float; null -> None where `nullable`."""
        value, check = self._get(name, default, nullable)
        if check and (isinstance(value, bool) or not isinstance(value, (int, float))
                      or not math.isfinite(value) or value <= 0
                      or (at_most is not None and value > at_most)):
            bound = "" if at_most is None else f" at most {at_most}"
            self.fail(name, f"a positive finite number{bound}" + (" or null" if nullable else ""))
        return None if value is None else float(value)

    def flag(self, name: str, default: bool) -> bool:
        """true or false."""
        value, check = self._get(name, default, False)
        if check and not isinstance(value, bool):
            self.fail(name, "true or false")
        return bool(value)

    def choice(self, name: str, default: Any, allowed: tuple[str, ...]) -> str:
        """One of the strings `allowed`."""
        value, check = self._get(name, default, False)
        if check and value not in allowed:
            self.fail(name, "one of " + ", ".join(allowed))
        return str(value)

    def index_list(self, name: str, count: int) -> list[int]:
        """A list of integers in [0, count) (layer indices); absent or null: empty."""
        value, check = self._get(name, [], False)
        if check and (not isinstance(value, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count
                for i in value)):
            self.fail(name, f"a list of layer indices in [0, {count})")
        return list(value)

    def kinds_list(self, name: str, count: int, default: list[str],
                   allowed: tuple[str, ...]) -> list[str]:
        """A list of `count` strings, each one of `allowed` (`layer_types`)."""
        value, check = self._get(name, default, False)
        if check and (not isinstance(value, list) or len(value) != count):
            self.fail(name, f"a list of one type per layer (num_hidden_layers = {count})")
        unknown = sorted({str(kind) for kind in value if kind not in allowed})
        if unknown:
            raise ValueError(f"{self.source}: {self.prefix}{name} names {', '.join(unknown)}; "
                             f"kvrecover runs {', '.join(allowed)}")
        return list(value)

    def nested(self, name: str) -> FieldReader | None:
        """A reader of the JSON object in field `name` (None where absent or null)."""
        value = self.raw.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            self.fail(name, "a JSON object or null")
        return FieldReader(value, self.source, f"{self.prefix}{name}.")


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint folder (a JSON object, else a ValueError)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"model folder {model_dir} has no config.json")
    return read_json_object(config_path)


def architecture_of(raw: dict[str, Any]) -> str:
    """The architecture name a parsed `config.json` declares (its first `architectures`)."""
    architectures = raw.get("architectures") or [raw.get("model_type", "unknown")]
    if not isinstance(architectures, list) or not isinstance(architectures[0], str):
        raise ValueError(f"config.json: architectures={architectures!r} must be a list of "
                         "architecture names")
    return architectures[0]


def refuse_sliding_window(raw: dict[str, Any], model_dir: Path) -> None:
    """For families that attend over the whole context: a config asking for a window
    is a ValueError (such a model would silently diverge)."""
    asks = FieldReader.of(raw, model_dir).flag("use_sliding_window", False)
    if asks or "sliding_attention" in (raw.get("layer_types") or []):
        raise ValueError(
            f"{Path(model_dir) / 'config.json'} asks for sliding-window attention, which "
            "kvrecover does not support; set use_sliding_window to false if the model allows it"
        )


LAYER_TYPES = ("full_attention", "sliding_attention")  # the `layer_types` kvrecover runs


def refuse_quantization(raw: dict[str, Any], model_dir: Path) -> None:
    """A config with a `quantization_config` is a ValueError naming its method: kvrecover
    runs unquantized weights only, and would misread quantized ones."""
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) \
            else "unknown"
        raise ValueError(
            f"{Path(model_dir) / 'config.json'} has a quantization_config ({method!r}); "
            "kvrecover runs unquantized (float32/bf16/fp16) checkpoints only: use the "
            "unquantized weights of this model"
        )


def _eos_token_ids(model_dir: Path, raw_config: dict[str, Any]) -> list[int]:
    """EOS ids from generation_config.json, falling back to config.json; each a token id
    (an integer >= 0, or a list of them), else a ValueError naming the file."""
    ids: list[int] = []
    generation = Path(model_dir) / "generation_config.json"
    for source in (generation, Path(model_dir) / "config.json"):
        if source == generation:
            if not source.is_file():
                continue
            raw = read_json_object(source)
        else:
            raw = raw_config
        value = raw.get("eos_token_id")
        values = [value] if isinstance(value, int) else value
        if value is not None and (not isinstance(values, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in values)):
            FieldReader(raw, source).fail("eos_token_id", "a token id (an integer >= 0) or a "
                                          "list of them")
        for token_id in values or []:
            if token_id not in ids:
                ids.append(token_id)
    return ids


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in file `path`, else a ValueError naming it."""
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    return FieldReader(raw, path).raw

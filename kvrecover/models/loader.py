"""Load safetensors checkpoints (single file or sharded via the index) into our modules."""

from __future__ import annotations

import contextlib
import json
import mmap
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

ShardLoader = Callable[[nn.Parameter, torch.Tensor, str], None]
"""Copies one checkpoint tensor (shard id: "q", "gate", ...) into its part of a fused
parameter: (parameter, checkpoint tensor, shard id)."""


def attach_shard_loader(param: torch.Tensor, loader: ShardLoader,
                        shards: Collection[str] | None = None) -> None:
    """Mark `param` as fused: `load_weights` hands it its checkpoint shards via `loader`;
    with `shards`, a checkpoint that lacks one of them is refused (unless it holds the
    fused tensor whole)."""
    param.weight_loader = loader  # type: ignore[attr-defined]  # a hook torch does not declare
    param.weight_shards = frozenset(shards or ())  # type: ignore[attr-defined]


SliceLoader = Callable[[nn.Parameter, "CheckpointTensor", "str | None"], None]
"""Copies this rank's slice of one checkpoint tensor into a tensor-parallel parameter:
(parameter, the checkpoint tensor unread, shard id or None for an unfused weight)."""


def attach_slice_loader(param: torch.Tensor, loader: SliceLoader) -> None:
    """Mark `param` as a tensor-parallel slice: `load_weights` hands it the checkpoint
    tensor unread, and `loader` reads only the rows or columns it holds."""
    param.slice_loader = loader  # type: ignore[attr-defined]  # a hook torch does not declare


def _shard_loader(param: nn.Parameter) -> ShardLoader:
    loader: ShardLoader = param.weight_loader  # type: ignore[attr-defined]  # see attach_shard_loader
    return loader


@dataclass(frozen=True)
class CheckpointRename:
    """A checkpoint tensor name (without `model.`) that fills a parameter of another name:
    `pattern` must match the whole name; `target` and `shard` (None: the whole tensor)
    are `re.Match.expand` templates, e.g. per-expert tensors into a stacked weight."""

    pattern: str
    target: str
    shard: str | None = None

    def apply(self, name: str) -> tuple[str, str | None] | None:
        """(our parameter name, shard id) when `name` matches, else None."""
        match = re.fullmatch(self.pattern, name)
        if match is None:
            return None
        return match.expand(self.target), None if self.shard is None else match.expand(self.shard)


def _target_of(name: str, renames: tuple[CheckpointRename, ...],
               packed: dict[str, tuple[str, str]], prefix: str = "") -> tuple[str, str | None]:
    """Our parameter name and shard id for checkpoint tensor `name` (`prefix`: where a
    multimodal checkpoint nests the decoder inside `model.`, e.g. `language_model.`)."""
    target = name.removeprefix("model.").removeprefix(prefix)  # HF nests the decoder there
    for rename in renames:
        renamed = rename.apply(target)
        if renamed is not None:
            return renamed
    for fragment, (ours, shard_id) in packed.items():
        if f".{fragment}." in target:
            return target.replace(f".{fragment}.", f".{ours}."), shard_id
    return target, None


def _no_init(module: nn.Module) -> None:
    """Leaves a module's parameters as allocated."""


@contextlib.contextmanager
def skip_weight_init() -> Iterator[None]:
    """Build modules without random initialisation (the checkpoint overwrites it)."""
    with (mock.patch.object(nn.Linear, "reset_parameters", _no_init),
          mock.patch.object(nn.Embedding, "reset_parameters", _no_init)):
        yield


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


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class SafetensorsFile:
    """Reads the tensors of one safetensors file straight into their targets.

    The file is mapped and each tensor copied once, into the parameter itself
    when dtype and layout match; its pages are dropped from the mapping right
    after (`safe_open` keeps them mapped, so they counted as resident memory on
    top of the parameters: a start-up peak of twice the model size).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            if not 0 < header_len <= size - 8:
                raise ValueError(f"{path} is not a safetensors file (bad header length)")
            try:
                header = json.loads(handle.read(header_len))
            except ValueError as error:
                raise ValueError(f"{path} is not a safetensors file (bad header)") from error
            self._data_start = 8 + header_len
            self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
            header.pop("__metadata__", None)
            for name, entry in header.items():
                self.entries[name] = self._check_entry(name, entry, size)
            # A private mapping: never written, so never copied; no read-only-buffer warning.
            # The header check above guarantees a non-empty file.
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)

    def _check_entry(self, name: str, entry: dict[str, Any], size: int) -> tuple[torch.dtype, tuple[int, ...], int]:
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype", ""))
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if end - begin != nbytes or begin < 0 or self._data_start + end > size:
            raise ValueError(f"{self.path}: tensor {name!r} has inconsistent data offsets")
        return dtype, shape, begin

    def read_into(self, name: str, target: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name`, copied into `target` (same dtype and shape, contiguous, on the
        CPU) or into a new tensor."""
        dtype, shape, begin = self.entries[name]
        if target is None:
            target = torch.empty(shape, dtype=dtype)
        nbytes = target.numel() * dtype.itemsize
        if nbytes == 0:
            return target
        start = self._data_start + begin
        with memoryview(self._map)[start : start + nbytes] as view:
            source = torch.frombuffer(view, dtype=torch.uint8)
            _bytes_of(target).copy_(source)
            del source  # releases the buffer before the view closes
        if hasattr(mmap, "MADV_DONTNEED"):
            page_start = start - start % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, page_start, start + nbytes - page_start)
        return target

    def read_slice(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (`dim` 0) or columns (`dim` 1) [start, start + length) of tensor `name`,
        copied into a new tensor; only those bytes are copied (a tensor-parallel rank
        never holds the whole tensor)."""
        dtype, shape, begin = self.entries[name]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        start_byte = self._data_start + begin
        if nbytes == 0 or length == 0:
            return torch.empty(shape, dtype=dtype).narrow(dim, start, length).clone()
        with memoryview(self._map)[start_byte : start_byte + nbytes] as view:
            whole = torch.frombuffer(view, dtype=dtype).view(shape)
            piece = whole.narrow(dim, start, length).clone()
            del whole  # releases the buffer before the view closes
        if hasattr(mmap, "MADV_DONTNEED"):
            page_start = start_byte - start_byte % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, page_start,
                              start_byte + nbytes - page_start)
        return piece

    def close(self) -> None:
        self._map.close()


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of a safetensors file, not yet read: a slice loader reads its part."""

    file: SafetensorsFile
    name: str
    shape: tuple[int, ...]

    def dim(self) -> int:
        return len(self.shape)

    def read_rows(self, start: int, length: int) -> torch.Tensor:
        """Rows [start, start + length)."""
        return self.file.read_slice(self.name, 0, start, length)

    def read_columns(self, start: int, length: int) -> torch.Tensor:
        """Columns [start, start + length) of a 2-D tensor."""
        return self.file.read_slice(self.name, 1, start, length)


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy every checkpoint tensor into `model`; fail if a parameter was never loaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    renames = getattr(model, "checkpoint_renames", ())
    ignored = [re.compile(pattern) for pattern in getattr(model, "checkpoint_ignored", ())]
    prefix = getattr(model, "checkpoint_prefix", "")
    loaded: set[str] = set()
    loaded_shards: dict[str, set[str]] = {}  # fused parameter -> the shards it received
    for path in checkpoint_files(model_dir):
        handle = SafetensorsFile(path)
        try:
            for name, (dtype, shape, _) in handle.entries.items():
                if "rotary_emb.inv_freq" in name or any(p.fullmatch(name) for p in ignored):
                    continue
                target, shard = _target_of(name, renames, packed, prefix)
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
                with torch.no_grad():
                    slice_loader = getattr(param, "slice_loader", None)
                    if slice_loader is not None:  # a tensor-parallel slice
                        slice_loader(param, CheckpointTensor(handle, name, shape), shard)
                    elif shard is None:
                        if param.shape != shape:
                            raise ValueError(
                                f"checkpoint tensor {name!r} has shape {shape}, "
                                f"expected {tuple(param.shape)}"
                            )
                        direct = (param.device.type == "cpu" and param.dtype == dtype
                                  and param.is_contiguous())
                        if direct:
                            handle.read_into(name, param.data)
                        else:
                            param.data.copy_(handle.read_into(name))
                    else:
                        try:
                            _shard_loader(param)(param, handle.read_into(name), shard)
                        except ValueError as error:
                            raise ValueError(f"checkpoint tensor {name!r}: {error}") from error
                if shard is None:
                    loaded.add(target)
                else:
                    loaded_shards.setdefault(target, set()).add(shard)
        finally:
            handle.close()
    if getattr(model.config, "tie_word_embeddings", False):
        loaded.add("lm_head.weight")
    for target, shards in loaded_shards.items():
        lacking = sorted(getattr(params[target], "weight_shards", frozenset()) - shards)
        if lacking and target not in loaded:
            raise ValueError(f"checkpoint in {model_dir} lacks shards {', '.join(lacking[:5])} "
                             f"of {target}; does config.json match the weights?")
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for: {', '.join(missing[:5])}")

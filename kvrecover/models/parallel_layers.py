"""Tensor-parallel layers: column-, row- and vocabulary-parallel linears and embedding.

A model built for rank `r` of `size` ranks holds only its slice of each weight and
reads only that slice from the checkpoint (`loader.attach_slice_loader`):
- column-parallel (`ColumnParallelLinear`): the fused q/k/v projection (heads split;
  KV heads split, or replicated when there are fewer KV heads than ranks) and the
  fused gate/up projection (the intermediate size split);
- row-parallel (`RowParallelLinear`): o_proj and down_proj; each rank's partial sum
  is all-reduced by the layer that calls it (`TensorParallelGroup.all_reduce`);
- row ranges (`attach_row_ranges`): a plain linear or parameter that holds several
  ranges of one checkpoint tensor's rows (the hybrids' projections, conv channels and
  per-head parameters, `gated_deltanet.py`, `gated_attention.py`); the experts' slices
  are `moe.ExpertWeights`'s;
- vocabulary-parallel (`VocabParallelEmbedding`, `ParallelLMHead`): the vocabulary
  split in equal (padded) ranges; lookups outside a rank's range are zeroed and
  all-reduced; the LM head's logits are gathered on rank 0, where sampling runs.

At size 1 the models build the plain `nn.Linear` / `nn.Embedding` instead (bits and
ops exactly as without tensor parallelism); these classes are used only at size > 1.
The collectives come from a `TensorParallelGroup` (`kvrecover.distributed` implements
it over torch.distributed); this module names no transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from kvrecover.models.loader import CheckpointTensor, attach_slice_loader

if TYPE_CHECKING:
    from kvrecover.models.config import ModelConfig
    from kvrecover.ops.interface import ModelOps


class TensorParallelGroup(Protocol):
    """The ranks one model is sharded over, and the collectives its layers call."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of `tensor` over the ranks (every rank gets it)."""
        ...

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `tensor` concatenated along the last dim in rank order, on
        rank 0; None on the other ranks."""
        ...


@dataclass(frozen=True)
class SingleRank:
    """The group of one rank: no collectives (a model built with it is the plain model)."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return tensor


SINGLE_RANK = SingleRank()


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads: `num_heads` query heads from `head_start`, and
    `num_kv_heads` KV heads from `kv_head_start` (of the checkpoint's heads)."""

    num_heads: int
    head_start: int
    num_kv_heads: int
    kv_head_start: int


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """A ValueError naming both numbers when `size` ranks cannot split `config`'s
    attention heads, KV heads or MLP; called at start-up, before any process starts."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                         f"num_attention_heads {heads}; choose a divisor of {heads}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size {size} and the model's num_key_value_heads "
                         f"{kv_heads} must divide one another (KV heads are split, or "
                         "replicated when there are fewer than ranks)")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                         f"intermediate_size {config.intermediate_size}")


def shard_heads(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """Rank `rank`'s heads (`check_tensor_parallel` passed): query heads split evenly;
    KV heads split, or, with fewer KV heads than ranks, each rank holds the one KV
    head its query heads read."""
    local_heads = num_heads // size
    if num_kv_heads >= size:
        local_kv = num_kv_heads // size
        return HeadShard(local_heads, rank * local_heads, local_kv, rank * local_kv)
    return HeadShard(local_heads, rank * local_heads, 1, rank // (size // num_kv_heads))


def vocab_range(vocab_size: int, size: int, rank: int) -> tuple[int, int]:
    """(first token id, rows per rank) of rank `rank`'s vocabulary slice; the last
    rank's slice is padded with zero rows up to the common size."""
    per_rank = -(-vocab_size // size)
    return rank * per_rank, per_rank


def _copy_rows(param: torch.Tensor, offset: int, source: CheckpointTensor, start: int,
               length: int) -> None:
    """Rows [start, start + length) of `source` into rows [offset, offset + length) of
    `param`; rows past the end of `source` are zeros (vocabulary padding)."""
    available = max(0, min(length, source.shape[0] - start))
    if tuple(source.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(f"checkpoint tensor {source.name!r} of shape {tuple(source.shape)} "
                         f"does not fit a parameter of shape {tuple(param.shape)}; does "
                         "config.json match the weights?")
    if available:
        param.data[offset : offset + available].copy_(source.read_rows(start, available))
    if available < length:
        param.data[offset + available : offset + length].zero_()


def attach_row_ranges(param: torch.Tensor, ranges: Sequence[tuple[int, int]],
                      whole_rows: int) -> None:
    """Make `param` this rank's rows of one unfused checkpoint tensor of `whole_rows`
    rows: the row ranges (first checkpoint row, rows) in order, read range by range
    (e.g. a rank's q, k and v heads of a projection laid out [q all | k all | v all])."""

    def load(target: nn.Parameter, source: CheckpointTensor, shard: str | None) -> None:
        if source.dim() != target.dim() or source.shape[0] != whole_rows:
            raise ValueError(f"checkpoint tensor {source.name!r} of shape "
                             f"{tuple(source.shape)} does not have the {whole_rows} rows "
                             "config.json gives it; does config.json match the weights?")
        offset = 0
        for start, rows in ranges:
            _copy_rows(target, offset, source, start, rows)
            offset += rows

    attach_slice_loader(param, load)


class ColumnParallelLinear(nn.Linear):
    """A linear whose output features are this rank's slice of one or more fused
    checkpoint weights. `shards` maps a checkpoint shard id ("q", "gate", ...) to
    (offset in this weight, first checkpoint row, rows); None as a key stands for an
    unfused weight."""

    def __init__(self, in_features: int, shards: dict[str | None, tuple[int, int, int]],
                 bias: bool = False) -> None:
        out_features = sum(rows for _, _, rows in shards.values())
        super().__init__(in_features, out_features, bias=bias)
        self.shards = shards
        for param in self.parameters():
            attach_slice_loader(param, self._load)

    def _load(self, param: nn.Parameter, source: CheckpointTensor, shard: str | None) -> None:
        offset, start, rows = self.shards[shard]
        _copy_rows(param, offset, source, start, rows)


class RowParallelLinear(nn.Linear):
    """A linear whose input features are this rank's slice (columns [start, start +
    in_features) of the checkpoint weight); the caller all-reduces its output."""

    def __init__(self, in_features: int, out_features: int, start: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.start = start
        attach_slice_loader(self.weight, self._load)

    def _load(self, param: nn.Parameter, source: CheckpointTensor, shard: str | None) -> None:
        expected = (param.shape[0], self.start + param.shape[1])
        if source.dim() != 2 or source.shape[0] != expected[0] or source.shape[1] < expected[1]:
            raise ValueError(f"checkpoint tensor {source.name!r} of shape "
                             f"{tuple(source.shape)} does not fit the columns "
                             f"[{self.start}, {expected[1]}) of a {tuple(param.shape)} slice")
        param.data.copy_(source.read_columns(self.start, param.shape[1]))


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the token embedding (`vocab_range`)."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup) -> None:
        self.vocab_start, per_rank = vocab_range(vocab_size, group.size, group.rank)
        super().__init__(per_rank, hidden_size)
        self.group = group
        attach_slice_loader(self.weight, self._load)

    def _load(self, param: nn.Parameter, source: CheckpointTensor, shard: str | None) -> None:
        _copy_rows(param, 0, source, self.vocab_start, param.shape[0])

    def lookup(self, input_ids: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        """The embeddings of `input_ids`: this rank's rows, zeros elsewhere, all-reduced."""
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = ops.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Linear):
    """This rank's rows of the LM head; `logits` gathers every rank's on rank 0."""

    def __init__(self, hidden_size: int, vocab_size: int, group: TensorParallelGroup) -> None:
        self.vocab_start, per_rank = vocab_range(vocab_size, group.size, group.rank)
        super().__init__(hidden_size, per_rank, bias=False)
        self.vocab_size = vocab_size
        self.group = group
        attach_slice_loader(self.weight, self._load)

    def _load(self, param: nn.Parameter, source: CheckpointTensor, shard: str | None) -> None:
        _copy_rows(param, 0, source, self.vocab_start, param.shape[0])

    def logits(self, hidden: torch.Tensor, ops: ModelOps) -> torch.Tensor | None:
        """The full vocabulary's logits on rank 0 (padding cut), None on other ranks."""
        gathered = self.group.gather_to_first(ops.linear(hidden, self))
        return None if gathered is None else gathered[..., : self.vocab_size]


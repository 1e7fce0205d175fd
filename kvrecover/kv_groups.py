"""KV cache groups: which layers share a block table, and what a window keeps.

Layers with the same attention kind (full, or a sliding window of W tokens) form a
kind. Like vLLM's hybrid allocator, every group has the same number of layers `S`
(the size of the smallest kind; a larger kind is split into groups of S layers, the
last one possibly smaller), so that a block id names one `[block_size, Hkv, D]` slab
in each of the S cache tensors whatever group holds it: all groups share one pool of
block ids, and the cache has S tensors, layer j of a group reading tensor j.

A query at position q of a windowed layer reads the keys q - W < k <= q (Hugging
Face's `sliding_window_causal`). A model without windows has one group of all its
layers: the layout, the block ids and the stored keys are those of a model without
groups.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

# A load for a windowed group brings the window before the resume point plus this many
# windows more: with only the last window loaded, no earlier rollback point would have
# its own window held, so a lost block inside the last window would roll back to 0;
# with one more, it rolls back to its own start.
LOAD_MARGIN_WINDOWS = 1


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one block table per request; `window` None is full attention."""

    window: int | None
    layer_indices: tuple[int, ...]

    def first_needed_block(self, num_computed_tokens: int, block_size: int) -> int:
        """The first block a query at a position >= `num_computed_tokens` may read:
        0 for full attention; for a window W, the block of key num_computed - W + 1."""
        if self.window is None:
            return 0
        return max(0, (num_computed_tokens - self.window + 1) // block_size)

    def first_loaded_block(self, resume_at: int, block_size: int) -> int:
        """The first block a load that ends at `resume_at` brings (the last window and
        `LOAD_MARGIN_WINDOWS` windows before it; every block for full attention)."""
        block = self.first_needed_block(resume_at, block_size)
        for _ in range(LOAD_MARGIN_WINDOWS):
            block = self.first_needed_block(block * block_size, block_size)
        return block

    def first_loaded_span(self, block_size: int) -> int:
        """How many blocks a load of this windowed group spans at most, plus the one
        being written."""
        if self.window is None:
            raise ValueError("a full-attention group holds every block")
        return (1 + LOAD_MARGIN_WINDOWS) * (-(-self.window // block_size) + 1) + 1

    def can_resume_at(self, position: int, block_size: int, table: Sequence[int],
                      invalid: frozenset[int] | set[int], null_block_id: int) -> bool:
        """Whether computing on from `position` finds in `table` every key the queries
        at `position` and after read below it, held (not the null block) and valid."""
        first = self.first_needed_block(position, block_size)
        last = -(-position // block_size)  # blocks holding the keys below `position`
        if last > len(table):
            return False
        return all(table[i] != null_block_id and table[i] not in invalid
                   for i in range(first, last))


    def reads_any(self, position: int, block_size: int, table: Sequence[int],
                  blocks: frozenset[int] | set[int]) -> bool:
        """Whether the query at `position` read a key below it from one of `blocks`
        (through this group's table)."""
        first = self.first_needed_block(position, block_size)
        last = min(-(-position // block_size), len(table))
        return any(table[i] in blocks for i in range(first, last))


def build_kv_groups(layer_windows: Sequence[int | None],
                    recurrent_layers: Collection[int] = ()) -> tuple[KVCacheGroup, ...]:
    """The groups of a model whose layer i has window `layer_windows[i]` (None: full);
    `recurrent_layers` (linear attention: a recurrent state, no KV) belong to none.

    Full attention comes first, then windows by size; within a kind, layers in order,
    S at a time. Raises ValueError for a window that is not a positive int.
    """
    if len(layer_windows) <= len(set(recurrent_layers)):
        raise ValueError("the model has no attention layers: num_hidden_layers must be at "
                         "least 1, and a hybrid model needs one full_attention layer")
    kinds: dict[int | None, list[int]] = {}
    for index, window in enumerate(layer_windows):
        if index in recurrent_layers:
            continue
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ValueError(f"layer {index} has sliding window {window!r}: a window must be "
                             "a positive number of tokens (check sliding_window in config.json)")
        kinds.setdefault(window, []).append(index)
    size = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda w: -1 if w is None else w)
    return tuple(
        KVCacheGroup(window, tuple(kinds[window][start : start + size]))
        for window in order
        for start in range(0, len(kinds[window]), size)
    )


def single_group(num_layers: int) -> tuple[KVCacheGroup, ...]:
    """The one full-attention group of a model without windows."""
    return (KVCacheGroup(None, tuple(range(num_layers))),)


@dataclass(frozen=True)
class LayerSlot:
    """Where layer i's KV lives: its group (block table) and its tensor (position)."""

    group: int
    tensor: int


def layer_slots(groups: Sequence[KVCacheGroup]) -> list[LayerSlot]:
    """One `LayerSlot` per layer, in layer order."""
    slots: dict[int, LayerSlot] = {}
    for group_index, group in enumerate(groups):
        for position, layer in enumerate(group.layer_indices):
            slots[layer] = LayerSlot(group_index, position)
    return [slots[layer] for layer in sorted(slots)]


def layer_slot_map(groups: Sequence[KVCacheGroup], num_layers: int) -> list[LayerSlot | None]:
    """`LayerSlot` of each of `num_layers` layers, None for a layer in no group (a
    recurrent layer)."""
    slots: list[LayerSlot | None] = [None] * num_layers
    for group_index, group in enumerate(groups):
        for position, layer in enumerate(group.layer_indices):
            slots[layer] = LayerSlot(group_index, position)
    return slots


def groups_signature(groups: Sequence[KVCacheGroup]) -> str:
    """The groups and windows as text (part of the layout fingerprint)."""
    return ";".join(
        f"{'full' if g.window is None else f'w{g.window}'}:{','.join(map(str, g.layer_indices))}"
        for g in groups
    )

"""The paged KV cache seen as whole stored blocks: what storage connectors load into and save from.

Each layer's cache is [2 (K, V), num_blocks, block_size, kv_heads, head_dim]; a stored
block is [layers, 2, block_size, kv_heads, head_dim]. On the CPU one block's bytes are
2 x layers contiguous slices of the caches, its "parts" in file order (`block_store`),
so an entry is read into or written from the cache itself with no copy in between
("direct"). Otherwise loads stage whole entries in host memory, pinned for a GPU, and
reach the cache in one host-to-device copy per transfer and one indexed copy per layer;
saves come back the same way.
"""

from __future__ import annotations

import threading

import torch

from kvrecover.kv_transfer.block_store import parts_checksum, payload_checksum

MAX_FREE_STAGING = 4  # staging buffers kept for reuse (async loads in flight at once)


class PagedBlocks:
    """Block-granular access to one worker's per-layer KV cache tensors."""

    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        one_block = kv_caches[0][:, 0]
        self.caches = kv_caches
        self.device = kv_caches[0].device
        self.dtype = one_block.dtype
        self.block_shape = (len(kv_caches), *one_block.shape)
        self.block_nbytes = one_block.numel() * one_block.element_size() * len(kv_caches)
        self.direct = self.device.type == "cpu" and all(
            isinstance(cache, torch.Tensor) and cache.is_contiguous() for cache in kv_caches)
        # Flat byte views of the caches (no copy): one block's parts are slices of them.
        self._layer_bytes = [memoryview(cache.view(torch.uint8).numpy()).cast("B")
                             for cache in kv_caches] if self.direct else []
        self._part_nbytes = one_block[0].numel() * one_block.element_size()
        # In a layer's bytes, V blocks follow all K blocks.
        self._v_offset = kv_caches[0].shape[1] * self._part_nbytes if self.direct else 0
        self._free_staging: list[torch.Tensor] = []
        self._staging_lock = threading.Lock()

    def parts(self, block_id: int) -> list[memoryview]:
        """The block's bytes in file order: layer 0 K, layer 0 V, layer 1 K, ... (direct only)."""
        k, size = block_id * self._part_nbytes, self._part_nbytes
        v = k + self._v_offset
        return [piece for layer in self._layer_bytes for piece in (layer[k : k + size], layer[v : v + size])]

    def staging(self, count: int) -> torch.Tensor:
        """An uninitialised host buffer of at least `count` block rows (uint8), pinned for
        a GPU cache. Any thread may call this."""
        if self.device.type == "cuda":  # PyTorch's caching host allocator reuses pinned
            return torch.empty((count, self.block_nbytes), dtype=torch.uint8, pin_memory=True)
        with self._staging_lock:  # (indices, not list.remove: tensors compare elementwise)
            fits = [i for i, buffer in enumerate(self._free_staging) if buffer.shape[0] >= count]
            if fits:
                return self._free_staging.pop(min(fits, key=lambda i: self._free_staging[i].shape[0]))
        # Fresh memory costs a page fault per 4 KiB on first touch: about as much as
        # the read itself, hence the pool.
        return torch.empty((count, self.block_nbytes), dtype=torch.uint8)

    def release(self, staging: torch.Tensor) -> None:
        """Give a staging buffer back for reuse once nothing will read or write it again."""
        if self.device.type == "cuda":
            return
        with self._staging_lock:
            self._free_staging.append(staging)
            if len(self._free_staging) > MAX_FREE_STAGING:
                self._free_staging.sort(key=lambda buffer: buffer.shape[0])
                del self._free_staging[0]

    def scatter(self, block_ids: list[int], staging: torch.Tensor) -> None:
        """Copy staged rows 0..len(block_ids)-1 into the given cache blocks."""
        count = len(block_ids)
        blocks = staging[:count].view(self.dtype).view(count, *self.block_shape)
        if self.device.type != "cpu":
            blocks = blocks.to(self.device, non_blocking=True)  # one upload for every layer
            index = torch.tensor(block_ids, device=self.device)
            for layer, cache in enumerate(self.caches):
                cache.index_copy_(1, index, blocks[:, layer].transpose(0, 1))
            return
        # On the CPU, strided slice copies over runs of consecutive block ids beat an
        # indexed copy; freshly allocated blocks mostly come in such runs.
        start = 0
        while start < count:
            end = start + 1
            while end < count and block_ids[end] == block_ids[end - 1] + 1:
                end += 1
            first = block_ids[start]
            for layer, cache in enumerate(self.caches):
                cache[:, first : first + end - start].copy_(blocks[start:end, layer].transpose(0, 1))
            start = end

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """The given blocks on the CPU, [len(block_ids), *block_shape] (one indexed copy
        per layer, then one device-to-host transfer)."""
        index = torch.tensor(block_ids, device=self.device)
        gathered = torch.empty((len(block_ids), *self.block_shape), dtype=self.dtype,
                               device=self.device)
        for layer, cache in enumerate(self.caches):
            gathered[:, layer].copy_(cache.index_select(1, index).transpose(0, 1))
        return gathered.to("cpu")

    def checksums(self, block_ids: list[int]) -> list[int]:
        """xxh3-64 of each block's bytes as the cache holds them (the stored checksum)."""
        if self.direct:
            return [parts_checksum(self.parts(block_id)) for block_id in block_ids]
        return [payload_checksum(block) for block in self.gather(block_ids)]

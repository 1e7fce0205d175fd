"""Where a folder KV load's time goes: perf_counter spans around each phase of one step.

    PYTHONPATH=. python bench/profile_load.py [--shape 8b|1b] [--requests 16] [--tokens 1024]
        [--staged] [--device cpu|cuda] [--io-threads N] [--repeats 3] [--dir /dev/shm]

Stores `--requests` x `--tokens` tokens of KV of the shape's layout (block 16) in a
folder, then loads them through `SharedStorageConnector` as the engine would: one
step's sync loads (every request in one step's metadata) and as many concurrent
async loads. Each phase is wrapped in a timer that sums its time over all threads
(so phases running in parallel can add up to more than the wall time): opening the
entry (open + fstat), `os.readv`, the xxh3 checks, staging-buffer allocation,
thread start-up, the reader-thread wait, the install. `--staged` uses strided CPU
caches, which take the staged path a GPU cache takes (bar pinning and uploads);
`--device cuda` puts the cache on the GPU (the real staged path: pinned rows, chunk
uploads, one indexed copy per layer and the device check; each run ends with a device
synchronize). Prints the best repeat's spans per mode.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash
from model_shapes import SHAPES, ModelShape

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.stores import block_store, paged_blocks, shared_storage
from kvrecover.kv_transfer.stores.shared_storage import (
    BlockTransfer,
    SharedStorageConnector,
    StorageConnectorMetadata,
)

BLOCK_SIZE = 16


class Spans:
    """Seconds and calls per phase, summed over every thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                with self.lock:
                    entry = self.totals[name]
                    entry[0] += elapsed
                    entry[1] += 1
        return timed

    def reset(self) -> None:
        self.totals.clear()


def instrument(spans: Spans) -> None:
    """Wrap the phases of the folder load path (for this process's lifetime)."""
    os.readv = spans.wrap("os.readv", os.readv)  # type: ignore[assignment]
    block_store.BlockStore._open_entry = spans.wrap(  # type: ignore[method-assign]
        "open + fstat", block_store.BlockStore._open_entry)
    block_store.BlockStore.read_raw = spans.wrap(  # type: ignore[method-assign]
        "read_raw (filtered reads)", block_store.BlockStore.read_raw)
    checksum = spans.wrap("xxh3 check", block_store.parts_checksum)
    block_store.parts_checksum = checksum  # type: ignore[assignment]
    paged_blocks.parts_checksum = checksum  # type: ignore[attr-defined]
    paged_blocks.PagedBlocks.staging = spans.wrap(  # type: ignore[method-assign]
        "staging buffer", paged_blocks.PagedBlocks.staging)
    paged_blocks.PagedBlocks._copy_row = staticmethod(spans.wrap(  # type: ignore[method-assign]
        "bounce copy into cache", paged_blocks.PagedBlocks._copy_row))
    threading.Thread.start = spans.wrap("Thread.start", threading.Thread.start)  # type: ignore
    paged_blocks.read_rows = spans.wrap("read_rows (reads + uploads queued)",  # type: ignore
                                        paged_blocks.read_rows)
    for name in ("stage", "_scatter", "_mismatched"):
        if hasattr(paged_blocks.PagedBlocks, name):
            setattr(paged_blocks.PagedBlocks, name, spans.wrap(
                f"PagedBlocks.{name}", getattr(paged_blocks.PagedBlocks, name)))
    for name in ("install", "install_each", "install_rows", "install_groups"):
        if hasattr(paged_blocks.PagedBlocks, name):  # (older trees lack some)
            setattr(paged_blocks.PagedBlocks, name, spans.wrap(
                f"PagedBlocks.{name}", getattr(paged_blocks.PagedBlocks, name)))
    connector = shared_storage.SharedStorageConnector
    # An async load's install: `_install` each (older trees), or one `_install_step` for
    # every load a poll lands; the engine thread runs them, serially.
    connector._install = spans.wrap("connector._install", connector._install)  # type: ignore
    connector._install_step = spans.wrap(  # type: ignore[method-assign]
        "connector._install_step", connector._install_step)


def layout_of(shape: str) -> KVCacheLayout:
    model = ModelShape.from_config(SHAPES[shape])
    return KVCacheLayout(f"profile-{shape}", torch.bfloat16, BLOCK_SIZE, model.num_hidden_layers,
                         model.num_key_value_heads, model.head_dim)


def caches_of(layout: KVCacheLayout, num_blocks: int, staged: bool,
              device: str = "cpu") -> list[torch.Tensor]:
    shape = (2, num_blocks + 1, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if device != "cpu":
        return [torch.zeros(shape, dtype=layout.dtype, device=device)
                for _ in range(layout.num_layers)]
    if staged:  # block-major storage seen through a transposed view: not direct
        return [torch.zeros((shape[1], 2, *shape[2:]), dtype=layout.dtype).transpose(0, 1)
                for _ in range(layout.num_layers)]
    return [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--staged", action="store_true", help="the GPU's staged path")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--io-threads", type=int, default=None)
    parser.add_argument("--filtered", action="store_true",
                        help="an identity read filter on every block, as a fault injector sets")
    parser.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    args = parser.parse_args()
    layout = layout_of(args.shape)
    per_request = args.tokens // BLOCK_SIZE
    num_blocks = args.requests * per_request
    root = Path(tempfile.mkdtemp(prefix="kvrecover_profile_", dir=args.dir))
    try:
        extra: dict[str, Any] = {"shared_storage_path": str(root)}
        if args.io_threads:
            extra["io_threads"] = args.io_threads
        config = KVTransferConfig("SharedStorageConnector", "kv_both", extra)
        caches = caches_of(layout, num_blocks, args.staged, args.device)
        connector = SharedStorageConnector(config, KVConnectorRole.WORKER, layout)
        connector.register_kv_caches(caches)
        if args.filtered:  # every read through raw bytes (the injector's path)
            connector.set_read_filter(lambda request_id, block_id, key, raw, cancelled: raw)
        keys = [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(num_blocks)]
        block = torch.randn(connector.store.block_shape).to(layout.dtype)
        for key in keys:
            connector.store.write(key, block)
        transfers = [BlockTransfer(f"r{r}", list(range(1 + r * per_request, 1 + (r + 1) * per_request)),
                                   keys[r * per_request : (r + 1) * per_request])
                     for r in range(args.requests)]
        spans = Spans()
        instrument(spans)
        nbytes = num_blocks * layout.block_nbytes
        print(f"{ModelShape.from_config(SHAPES[args.shape]).label}: {args.requests} x {args.tokens}"
              f" tokens = {num_blocks} blocks x {layout.block_nbytes / 1e6:.2f} MB = "
              f"{nbytes / 1e9:.2f} GB; {'staged' if args.staged or args.device != 'cpu' else 'direct'} "
              f"path on {args.device}"
              f"{', every read filtered' if args.filtered else ''}, "
              f"io_threads {connector.io_threads}, {os.cpu_count()} CPUs\n")

        def sync_step() -> None:
            connector.bind_connector_metadata(StorageConnectorMetadata(loads=transfers))
            connector.start_load_kv(caches)
            connector.clear_connector_metadata()

        def async_step() -> None:
            loads = [BlockTransfer(t.request_id, t.block_ids, t.keys, is_async=True)
                     for t in transfers]
            connector.bind_connector_metadata(StorageConnectorMetadata(loads=loads))
            connector.start_load_kv(caches)
            connector.clear_connector_metadata()
            pending = {t.request_id for t in loads}
            while pending:
                _, done = connector.get_finished(set())
                pending -= done or set()
                time.sleep(0.0005)

        def plain_read() -> None:
            for key in keys:
                with open(connector.store.path(key), "rb") as handle:
                    handle.read()

        for label, run in [("plain read, 1 thread", plain_read), ("sync step", sync_step),
                           ("async loads", async_step)]:
            best: tuple[float, dict[str, list[float]]] = (float("inf"), {})
            for _ in range(args.repeats):
                spans.reset()
                started = time.perf_counter()
                run()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                wall = time.perf_counter() - started
                if connector.get_block_ids_with_load_errors():
                    raise RuntimeError(f"{label}: some blocks failed to load")
                if wall < best[0]:
                    best = (wall, {k: list(v) for k, v in spans.totals.items()})
            wall, totals = best
            print(f"{label}: {wall * 1000:.1f} ms wall, {nbytes / wall / 1e9:.2f} GB/s")
            for name, (seconds, calls) in sorted(totals.items(), key=lambda item: -item[1][0]):
                print(f"    {name:<36}{seconds * 1000:>9.1f} ms {calls:>7} calls"
                      f"{seconds / calls * 1e6:>9.1f} us each")
        connector.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

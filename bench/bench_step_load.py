"""One step's KV loads against their ceiling and against recomputing (issue 28, goal 4).

    PYTHONPATH=. python bench/bench_step_load.py [--device cpu|cuda] [--shape 8b|1b]
        [--batch 16] [--prompt-tokens 1024] [--repeats 3] [--model-dir DIR] [--dir /dev/shm]
        [--read-threads 1 2 4 8 16] [--io-threads N [N ...]] [--engine-io-threads N]
        [--cache warm cold] [--entry-reader native python] [--skip-engine] [--loads-only]
        [--sequential]

Part 1, the connector alone, on the KV layout of `--shape` (block 16, bf16): the
blocks of `--batch` requests of `--prompt-tokens` tokens, one file each, loaded
  - by the ceiling: the same files read with N threads (`readinto` into one staging
    buffer, pinned on CUDA), best N of `--read-threads`, plus one pinned
    host-to-device copy of that buffer (on CUDA); its bandwidth is bytes / (read +
    upload) of the best rounds;
  - by `SharedStorageConnector`: one step whose sync loads are all the requests (one
    staged batch), and the same requests as concurrent async loads polled the way
    the engine polls (`get_finished`), each into a paged cache on --device, with
    `verify_after_load` on (its default).
  With `--cache cold` part 1 runs again with the files dropped from the page cache
  before every timed run (`posix_fadvise(DONTNEED)` after an fsync; needs a disk
  folder, `--dir /tmp`: tmpfs such as /dev/shm keeps its pages whatever it is told).
Part 2, the engine (skipped with --skip-engine): time to first token of the batch
with its KV loaded (sync and async, a plain `SharedStorageConnector` consumer), with
every block failing (`FaultInjectionConnector`, all "missing": the loads fail and
everything is recomputed) and with no connector at all (plain prefill; both left out
with --loads-only, for async against sync on a slow CPU). CUDA: the
checkpoint in --model-dir, else random bf16 weights of --shape written there
(`model_shapes.py`); CPU: the built-in default model or --model-dir.

Rounds interleave every variant (a busy spell hits them all); times are the best
round (`--sequential`: part 2 times one engine after the other instead). Prints the
ratios the goals name, with the shape that really ran.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash
from bench_recovery import consumer, make_plan, random_prompts, release_memory, timed_batch
from bench_storage import best_times
from model_shapes import SHAPES, ModelShape, resolve_model_dir

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.stores import entry_read
from kvrecover.kv_transfer.stores.block_store import PREFIX_SIZE
from kvrecover.kv_transfer.stores.shared_storage import (
    BlockTransfer,
    SharedStorageConnector,
    StorageConnectorMetadata,
)

BLOCK_SIZE = 16
GOALS = {"connector x ceiling": 0.8, "load TTFT x recompute": 0.5, "async TTFT x sync": 1.1}


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class StepLoads:
    """`batch` requests' blocks stored in a folder, a paged cache on `device`, and the
    ways to load them (see module docstring)."""

    def __init__(self, layout: KVCacheLayout, folder: Path, batch: int, per_request: int,
                 device: str) -> None:
        self.device, self.batch, self.per_request = device, batch, per_request
        num_blocks = batch * per_request
        self.caches = [torch.zeros(2, num_blocks + 1, layout.block_size, layout.num_kv_heads,
                                   layout.head_dim, dtype=layout.dtype, device=device)
                       for _ in range(layout.num_layers)]
        config = KVTransferConfig("SharedStorageConnector", "kv_both",
                                  {"shared_storage_path": str(folder)})
        self.connector = SharedStorageConnector(config, KVConnectorRole.WORKER, layout)
        self.connector.register_kv_caches(self.caches)
        self.keys = [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(num_blocks)]
        block = torch.randn(self.connector.store.block_shape, generator=torch.Generator()
                            .manual_seed(0)).to(layout.dtype)
        for key in self.keys:
            self.connector.store.write(key, block)
        self.paths = [str(self.connector.store.path(key)) for key in self.keys]
        for path in self.paths:  # written back, so that dropping them from the cache holds
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        self.entry_nbytes = PREFIX_SIZE + layout.block_nbytes
        self.nbytes = num_blocks * layout.block_nbytes
        on_gpu = device.startswith("cuda")
        self.host = torch.empty((num_blocks, self.entry_nbytes), dtype=torch.uint8,
                                pin_memory=on_gpu)
        self.host.zero_()  # first touch (page faults) outside the timed rounds
        self.on_device = (torch.empty_like(self.host, device=device) if on_gpu else None)

    def connector_with(self, io_threads: int | None) -> SharedStorageConnector:
        """A connector over the same folder and caches with this `io_threads` (None: the
        connector's default)."""
        config = KVTransferConfig("SharedStorageConnector", "kv_both", {
            "shared_storage_path": str(self.connector.store.root),
            **({} if io_threads is None else {"io_threads": io_threads})})
        connector = SharedStorageConnector(config, KVConnectorRole.WORKER, self.connector.layout)
        connector.register_kv_caches(self.caches)
        return connector

    def transfers(self, is_async: bool) -> list[BlockTransfer]:
        n = self.per_request
        return [BlockTransfer(f"r{r}", list(range(1 + r * n, 1 + (r + 1) * n)),
                              self.keys[r * n : (r + 1) * n], is_async=is_async)
                for r in range(self.batch)]

    def plain_read(self, threads: int) -> None:
        """Every file into its row of the staging buffer, `threads` threads."""
        rows = memoryview(self.host.numpy()).cast("B")
        size = self.entry_nbytes
        share = -(-len(self.paths) // threads)

        def read(first: int) -> None:
            for index in range(first, min(first + share, len(self.paths))):
                with open(self.paths[index], "rb", buffering=0) as handle:
                    handle.readinto(rows[index * size : (index + 1) * size])

        readers = [threading.Thread(target=read, args=(i * share,)) for i in range(1, threads)]
        for reader in readers:
            reader.start()
        read(0)
        for reader in readers:
            reader.join()

    def drop_from_page_cache(self) -> None:
        """Evict every file's pages, so that the next read comes from the disk."""
        for path in self.paths:
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)

    def upload(self) -> None:
        if self.on_device is not None:
            self.on_device.copy_(self.host, non_blocking=True)
            synchronize(self.device)

    def sync_step(self, connector: SharedStorageConnector) -> None:
        """One step whose sync loads are every request."""
        connector.bind_connector_metadata(StorageConnectorMetadata(loads=self.transfers(False)))
        connector.start_load_kv(self.caches)
        connector.clear_connector_metadata()
        synchronize(self.device)
        self._check(connector)

    def async_loads(self, connector: SharedStorageConnector) -> None:
        """Every request as an async load, started in one step, polled until all landed."""
        connector.bind_connector_metadata(StorageConnectorMetadata(loads=self.transfers(True)))
        connector.start_load_kv(self.caches)
        connector.clear_connector_metadata()
        pending = {f"r{r}" for r in range(self.batch)}
        give_up = time.monotonic() + 600
        while pending and time.monotonic() < give_up:
            _, done = connector.get_finished(set())
            pending -= done or set()
            if pending:
                time.sleep(0.0005)  # as the engine's idle poll
        synchronize(self.device)
        self._check(connector)

    @staticmethod
    def _check(connector: SharedStorageConnector) -> None:
        if connector.get_block_ids_with_load_errors():
            raise RuntimeError("some blocks failed to load: the figures would be wrong")


def python_entry_reads(run: Callable[[], None]) -> Callable[[], None]:
    """`run` with the stores reading entry by entry in Python (no C entry reader)."""
    def without_native_reader() -> None:
        shared = entry_read.EntryReader.shared()
        entry_read._shared = None
        try:
            run()
        finally:
            entry_read._shared = shared
    return without_native_reader


def bench_connector(args: argparse.Namespace, layout: KVCacheLayout, root: Path,
                    cold: bool = False) -> dict:
    """Part 1; `cold`: every timed read starts with the files out of the page cache."""
    per_request = (args.prompt_tokens - 1) // BLOCK_SIZE  # the last token is never loaded
    loads = StepLoads(layout, root / "connector", args.batch, per_request, args.device)
    connectors = {(threads, reader): loads.connector_with(threads)
                  for threads in args.io_threads for reader in args.entry_reader}
    setup = loads.drop_from_page_cache if cold else (lambda: None)
    runs = [(functools.partial(loads.plain_read, t), setup) for t in args.read_threads]
    runs.append((loads.upload, lambda: None))
    for (_, reader), connector in connectors.items():
        wrap = python_entry_reads if reader == "python" else (lambda run: run)
        runs += [(wrap(functools.partial(loads.sync_step, connector)), setup),
                 (wrap(functools.partial(loads.async_loads, connector)), setup)]
    times = best_times(runs, args.repeats)
    reads = times[: len(args.read_threads)]
    t_upload = times[len(args.read_threads)]
    loaded = times[len(args.read_threads) + 1 :]
    best = min(range(len(reads)), key=reads.__getitem__)
    figures = {
        "cache": "cold" if cold else "warm", "nbytes": loads.nbytes, "blocks": args.batch * per_request,
        "reads": dict(zip(args.read_threads, reads)), "best_threads": args.read_threads[best],
        "read": reads[best], "upload": t_upload,
        "connectors": {(connector.io_threads, reader): (loaded[2 * i], loaded[2 * i + 1])
                       for i, ((_, reader), connector) in enumerate(connectors.items())},
        "read_1": reads[args.read_threads.index(1)] if 1 in args.read_threads else None,
    }
    for connector in [loads.connector, *connectors.values()]:
        connector.shutdown()
    del loads, connectors
    release_memory()
    return figures


def bench_engine(args: argparse.Namespace, llm_args: dict, store: Path) -> dict[str, float]:
    prompts = [random_prompts(args.batch, args.prompt_tokens, 1 + r) for r in range(args.repeats)]
    producer = LLM(**llm_args, enable_prefix_caching=False, kv_transfer_config=KVTransferConfig(
        "SharedStorageConnector", "kv_producer", {"shared_storage_path": str(store)}))
    for batch_prompts in prompts:
        producer.generate([{"prompt_token_ids": p} for p in batch_prompts],
                          SamplingParams(temperature=0, max_tokens=1))
    producer.close()
    del producer
    release_memory()
    threads = {} if args.engine_io_threads is None else {"io_threads": args.engine_io_threads}

    def loading(mode: str) -> LLM:
        return LLM(**llm_args, enable_prefix_caching=False, kv_transfer_config=KVTransferConfig(
            "SharedStorageConnector", "kv_consumer",
            {"shared_storage_path": str(store), "async_load": mode == "async", **threads}))

    # Engines by name, built when needed (`consumer` warms its own engine up).
    makers: dict[str, Callable[[], LLM]] = {
        "load, sync": lambda: loading("sync"), "load, async": lambda: loading("async")}
    if not args.loads_only:
        every_block = make_plan(1.0, args.batch, (args.prompt_tokens - 1) // BLOCK_SIZE, seed=0)
        makers["recompute: every block fails"] = lambda: consumer(
            llm_args, store, "sync", [every_block], args.repeats, args.batch, None)
        makers["recompute: no connector"] = lambda: LLM(**llm_args, enable_prefix_caching=False)

    def ready(name: str) -> LLM:
        llm = makers[name]()
        if not name.startswith("recompute: every"):
            timed_batch(llm, random_prompts(args.batch, 48, seed=999), 2)
        return llm

    best = {name: float("inf") for name in makers}
    if args.sequential:  # one engine in memory at a time (an 8B shape's four do not fit 80 GB)
        for name in makers:
            llm = ready(name)
            for batch_prompts in prompts:
                best[name] = min(best[name], timed_batch(llm, batch_prompts, args.max_tokens)[0])
            llm.close()
            del llm
            release_memory()
        return best
    engines = {name: ready(name) for name in makers}
    for batch_prompts in prompts:
        for name, llm in engines.items():
            best[name] = min(best[name], timed_batch(llm, batch_prompts, args.max_tokens)[0])
    for llm in engines.values():
        llm.close()
    engines.clear()
    release_memory()
    return best


def report(args: argparse.Namespace, label: str, layout_label: str, part_1: list[dict],
           ttft: dict[str, float] | None) -> None:
    def verdict(name: str, value: float) -> str:
        goal = GOALS[name]
        met = value <= goal if "TTFT" in name else value >= goal
        return f"{'<=' if 'TTFT' in name else '>='} {goal} {'met' if met else 'MISSED'}"

    print(f"\n{layout_label}; {args.batch} x {args.prompt_tokens} tokens; device {args.device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if args.device == 'cuda' else ''}; "
          f"{os.cpu_count()} CPUs; best of {args.repeats}")
    for figures in part_1:
        gb = figures["nbytes"] / 1e9
        ceiling = figures["read"] + (figures["upload"] if args.device == "cuda" else 0.0)
        print(f"\n{figures['blocks']} blocks, {gb:.2f} GB of KV, page cache {figures['cache']}\n")
        print(f"{'load':<58}{'ms':>9}{'GB/s':>8}  x ceiling")
        for threads, seconds in figures["reads"].items():
            print(f"{f'plain readinto, {threads} thread(s)':<58}{seconds * 1e3:>9.1f}"
                  f"{gb / seconds:>8.2f}")
        if args.device == "cuda":
            print(f"{'pinned host-to-device copy':<58}{figures['upload'] * 1e3:>9.1f}"
                  f"{gb / figures['upload']:>8.2f}")
        name = f"ceiling: best read ({figures['best_threads']} threads) + upload"
        print(f"{name:<58}{ceiling * 1e3:>9.1f}{gb / ceiling:>8.2f}  1.00")
        for (threads, reader), (t_sync, t_async) in figures["connectors"].items():
            row = f"connector, io_threads {threads}, {reader} reads"
            for name, seconds in [(f"{row}: one step's sync loads", t_sync),
                                  (f"{row}: {args.batch} async loads", t_async)]:
                ratio = ceiling / seconds
                print(f"{name:<58}{seconds * 1e3:>9.1f}{gb / seconds:>8.2f}  {ratio:.2f}"
                      f"  {verdict('connector x ceiling', ratio)}")
        if figures["read_1"] is not None:
            print("\nx a plain 1-thread read (issue 28 goal 6 on the CPU: >= 0.6 sync, >= 0.5 "
                  "async): " + "; ".join(
                      f"io_threads {threads}, {reader}: sync {figures['read_1'] / t_sync:.2f}, "
                      f"async {figures['read_1'] / t_async:.2f}"
                      for (threads, reader), (t_sync, t_async) in figures["connectors"].items()))
    if ttft is not None:
        engine_threads = args.engine_io_threads or "the connector's default"
        print(f"\n{label}, {args.max_tokens} new tokens; loads with io_threads {engine_threads}\n")
        print(f"{'time to first token of the batch':<40}{'s':>8}")
        for name, seconds in ttft.items():
            print(f"{name:<40}{seconds:>8.3f}")
        if "recompute: no connector" in ttft:
            recompute = min(ttft["recompute: every block fails"], ttft["recompute: no connector"])
            load_ratio = ttft["load, sync"] / recompute
            print(f"\nload (sync) x recompute (the faster of the two): {load_ratio:.2f}  "
                  f"{verdict('load TTFT x recompute', load_ratio)}")
        async_ratio = ttft["load, async"] / ttft["load, sync"]
        print(f"load (async) x load (sync): {async_ratio:.2f}  "
              f"{verdict('async TTFT x sync', async_ratio)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                        help="KV layout of part 1; on CUDA also the model of part 2")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--read-threads", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--io-threads", type=int, nargs="+", default=[None],
                        help="part 1: the connectors' io_threads to try (default: the "
                             "connector's own)")
    parser.add_argument("--engine-io-threads", type=int, default=None,
                        help="part 2: the loading engines' io_threads (default: the connector's)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None,
                        help="where the files go (default: %(default)s)")
    parser.add_argument("--entry-reader", nargs="+", choices=["native", "python"],
                        default=["native"],
                        help="part 1: staged reads a chunk per C call, and/or entry by entry "
                             "in Python (as without a C compiler)")
    parser.add_argument("--cache", nargs="+", choices=["warm", "cold"], default=["warm"],
                        help="part 1 with the files in the page cache, and/or dropped from it "
                             "before each timed read (cold: use a disk folder, e.g. --dir /tmp)")
    parser.add_argument("--skip-engine", action="store_true", help="part 1 only")
    parser.add_argument("--sequential", action="store_true",
                        help="part 2: one engine at a time, each timed on every prompt set "
                             "(for shapes whose engines do not fit the GPU together)")
    parser.add_argument("--loads-only", action="store_true",
                        help="part 2: only the loading engines (no recompute rows)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("kvrecover").setLevel(logging.ERROR)  # one warning per failed block
    shape = ModelShape.from_config(SHAPES[args.shape])
    layout = KVCacheLayout(f"bench-step-{args.shape}", torch.bfloat16, BLOCK_SIZE,
                           shape.num_hidden_layers, shape.num_key_value_heads, shape.head_dim)
    layout_label = f"KV layout of the {shape.label} (bf16, block {BLOCK_SIZE})"
    root = Path(tempfile.mkdtemp(prefix="kvrecover_step_load_", dir=args.dir))
    try:
        part_1 = [bench_connector(args, layout, root / cache, cold=cache == "cold")
                  for cache in args.cache]
        ttft, label = None, ""
        if not args.skip_engine:
            if args.device == "cuda":
                model_dir = resolve_model_dir(args.model_dir, args.shape)
                label = f"{ModelShape.of(model_dir).label} bf16, {torch.cuda.get_device_name()}"
                llm_args = dict(model=str(model_dir), device="cuda:0", dtype="bfloat16",
                                kv_cache_memory_gb=8,
                                max_model_len=args.prompt_tokens + args.max_tokens + 16,
                                max_num_seqs=max(16, args.batch))
            else:
                model = None if args.model_dir is None else str(args.model_dir)
                label = ("default model" if model is None
                         else ModelShape.of(args.model_dir).label) + " f32, CPU"
                llm_args = dict(model=model, device="cpu", dtype="float32")
            ttft = bench_engine(args, llm_args, root / "engine")
        report(args, label, layout_label, part_1, ttft)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Storage benchmark: what the verified KV block store costs, and what loading KV saves.

    PYTHONPATH=. python bench/bench_storage.py --threads 1 [--dir /dev/shm] [--megabytes 256]
        [--repeats 3] [--prompt-tokens 1500] [--model DIR] [--device cpu] [--skip-llm]
        [--loads-only] [--profile]

1. For three KV layouts (the default model's: 30 layers, 3 KV heads, head dim 64,
   float32; Llama-3.2-1B's: 16 layers, 8 KV heads, head dim 64, bfloat16; and
   Llama-3-8B's: 32 layers, 8 KV heads, head dim 128, bfloat16; block 16), save and
   load throughput in GB/s of payload bytes: plain file I/O (write: the same bytes,
   one file per block, same folder fan-out; read: `open().read()` of the very files
   the connector loads, on one thread, the reference, and split over the
   connector's `io_threads`), `BlockStore.write` / `BlockStore.read`, and the
   `SharedStorageConnector` worker path (scatter into / save from a paged KV cache
   on --device), sync with `verify_after_load` on and off and async. The ratio to
   plain I/O is the figure; the goals (issue 14) are printed beside it. With
   --device cuda a pinned host-to-device copy of the same bytes is measured too,
   and loads are also compared with min(plain read, that copy). --profile adds the
   phases of one staged load (reads, checks, staging on 1 to 16 threads, install).
2. Per layout, the prompt lengths at which loading its KV beats recomputing it:
   the connector's load time for n tokens against the prefill time of n tokens,
   the latter measured as num_layers x one transformer layer of the model's shape
   (random weights, `layer_prefill.py`; embedding and LM head left out). On the CPU
   the scan stops once loading has won twice; on a GPU every length that the
   loaded blocks cover is tried (there recompute can win at length).
3. On the default model, one long prompt: time to first token and per decode
   step with its KV recomputed (no connector) and loaded from the store
   (`kv_consumer`), and with the prefill saving it (`kv_producer`).

Files live under --dir (default /dev/shm if present, so the page cache, not a
disk, is measured) and are deleted afterwards. Times are the best of --repeats.
The load ratios ("x plain") are the median, over --repeats rounds, of each round's
plain read time over the operation's, the plain read timed right before and right
after the operation in that round (their mean is the reference), and the operations
taking turns in an order reversed every other round: a busy spell on a shared machine
then moves both sides of a ratio, not one. "spread" is the lowest and highest round's
ratio; a change is told apart when the spreads do not overlap. --loads-only skips the
saves, the break-even scan and the long prompt.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash
from layer_prefill import SHAPES, prefill_seconds

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.stores.block_store import PREFIX_SIZE, BlockStore
from kvrecover.kv_transfer.stores.reader_threads import ReadCancel
from kvrecover.kv_transfer.stores.shared_storage import (
    BlockTransfer,
    SharedStorageConnector,
    StorageConnectorMetadata,
)

LAYOUTS = {
    "smollm2-135m f32": KVCacheLayout("bench-smollm2", torch.float32, 16, 30, 3, 64),
    "llama3.2-1b bf16": KVCacheLayout("bench-llama3.2-1b", torch.bfloat16, 16, 16, 8, 64),
    "llama3-8b bf16": KVCacheLayout("bench-llama3-8b", torch.bfloat16, 16, 32, 8, 128),
}
# x plain I/O: saves (issue 14); loads, sync either way and async (issue 28 goal 6, CPU).
GOALS = {"save": 0.6, "load": 0.6, "load, verify_after_load": 0.6, "load, async": 0.5}
BREAK_EVEN_TOKENS = (16, 64, 256, 1024, 4096, 16384)


def best_time(run: Callable[[], None], repeats: int, setup: Callable[[], None] = lambda: None) -> float:
    return best_times([(run, setup)], repeats)[0]


def best_times(runs: list[tuple[Callable[[], None], Callable[[], None]]], repeats: int) -> list[float]:
    """Best time of each (run, setup), the runs interleaved round by round so that a
    busy spell on a shared machine hits all of them, not just one (ratios stay fair)."""
    times = [float("inf")] * len(runs)
    for _ in range(repeats):
        for index, (run, setup) in enumerate(runs):
            setup()
            started = time.perf_counter()
            run()
            times[index] = min(times[index], time.perf_counter() - started)
    return times


def paired_ratios(reference: Callable[[], None], runs: list[Callable[[], None]],
                  repeats: int) -> tuple[float, list[float], list[list[float]]]:
    """Per round, for each run, the reference's time over the run's, the reference timed
    right before and right after the run (their mean); the runs take turns in an order
    reversed every other round. Returns the best reference time, each run's best time
    and each run's per-round ratios (see the module docstring)."""
    ratios: list[list[float]] = [[] for _ in runs]
    best = [float("inf")] * len(runs)
    best_reference = float("inf")

    def timed(run: Callable[[], None]) -> float:
        started = time.perf_counter()
        run()
        return time.perf_counter() - started

    for round_number in range(repeats):
        order = list(range(len(runs)))
        if round_number % 2:
            order.reverse()
        before = timed(reference)
        best_reference = min(best_reference, before)
        for index in order:
            seconds = timed(runs[index])
            best[index] = min(best[index], seconds)
            after = timed(reference)
            best_reference = min(best_reference, after)
            ratios[index].append((before + after) / 2 / seconds)
            before = after
    return best_reference, best, ratios


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def fresh(folder: Path) -> Callable[[], None]:
    def reset() -> None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    return reset


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class ConnectorBench:
    """A worker-role connector over a paged cache of `num_blocks` random blocks on `device`."""

    def __init__(self, layout: KVCacheLayout, folder: Path, num_blocks: int, device: str) -> None:
        generator = torch.Generator().manual_seed(0)
        self.device = device
        # Block 0 is the null block, as in the engine.
        self.caches = [torch.randn(2, num_blocks + 1, layout.block_size, layout.num_kv_heads,
                                   layout.head_dim, generator=generator).to(layout.dtype).to(device)
                       for _ in range(layout.num_layers)]
        self.block_ids = list(range(1, num_blocks + 1))
        self.keys = [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(num_blocks)]
        config = KVTransferConfig("SharedStorageConnector", "kv_both",
                                  {"shared_storage_path": str(folder)})
        self.connector = SharedStorageConnector(config, KVConnectorRole.WORKER, layout)
        self.connector.register_kv_caches(self.caches)

    def save(self) -> None:
        self.connector.bind_connector_metadata(StorageConnectorMetadata(
            saves=[BlockTransfer("bench", self.block_ids, self.keys)]))
        self.connector.wait_for_save()
        self.connector.clear_connector_metadata()
        assert self.connector.get_save_failures() == 0

    def load(self, count: int | None = None, is_async: bool = False) -> None:
        count = len(self.block_ids) if count is None else count
        self.connector.bind_connector_metadata(StorageConnectorMetadata(loads=[BlockTransfer(
            "bench", self.block_ids[:count], self.keys[:count], is_async=is_async)]))
        self.connector.start_load_kv(self.caches)
        self.connector.clear_connector_metadata()
        if is_async:
            self.connector._async_loads["bench"].future.result(timeout=600)
            _, done = self.connector.get_finished(set())
            assert done == {"bench"}
        synchronize(self.device)
        assert not self.connector.get_block_ids_with_load_errors()


def bench_layout(name: str, layout: KVCacheLayout, root: Path, megabytes: int, repeats: int,
                 device: str, loads_only: bool = False,
                 ) -> tuple[list[tuple[str, str, float, float, float | None, float | None]],
                            ConnectorBench]:
    """Rows of (layout, operation, GB/s, ratio to plain file I/O, lowest and highest
    round's ratio or None), and the loaded connector."""
    num_blocks = max(8, megabytes * (1 << 20) // layout.block_nbytes)
    nbytes = num_blocks * layout.block_nbytes
    bench = ConnectorBench(layout, root / "connector", num_blocks, device)
    blocks = [torch.stack([cache[:, b] for cache in bench.caches]).cpu().contiguous()
              for b in bench.block_ids]
    store = BlockStore(root / "store", layout)
    plain = root / "plain"

    def plain_write() -> None:
        for key, block in zip(bench.keys, blocks):
            path = plain / key.hex()[:2] / key.hex()
            path.parent.mkdir(exist_ok=True)
            with open(path, "wb") as handle:
                handle.write(block.view(torch.uint8).numpy())

    def plain_read(keys: list[bytes] = bench.keys) -> None:  # the very files the connector loads
        for key in keys:
            with open(bench.connector.store.path(key), "rb") as handle:
                handle.read()

    threads = bench.connector.io_threads

    def plain_read_threads() -> None:  # the same, split over the connector's io_threads
        share = -(-len(bench.keys) // threads)
        readers = [threading.Thread(target=plain_read, args=(bench.keys[i * share : (i + 1) * share],))
                   for i in range(threads)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()

    def store_write() -> None:
        for key, block in zip(bench.keys, blocks):
            store.write(key, block)

    def store_read() -> None:
        for key in bench.keys:
            store.read(key)

    def checksum_only() -> None:
        for block in blocks:
            xxhash.xxh3_64_intdigest(block.view(torch.uint8).numpy())

    label = f"{name} ({num_blocks} x {layout.block_nbytes / 1e6:.2f} MB)"
    Row = tuple[str, str, float, float, float | None, float | None]

    def row(operation: str, seconds: float, reference: float) -> Row:
        return label, operation, nbytes / seconds / 1e9, reference / seconds, None, None

    rows: list[Row] = []
    if not loads_only:
        t_plain_write, t_store_write, t_conn_save = best_times([
            (plain_write, fresh(plain)), (store_write, fresh(store.root)),
            (bench.save, fresh(root / "connector"))], repeats)
        rows += [row("save: plain file write", t_plain_write, t_plain_write),
                 row("save: BlockStore.write", t_store_write, t_plain_write),
                 row("save: connector wait_for_save", t_conn_save, t_plain_write)]
    else:
        bench.save()
        store_write()

    def with_verify(on: bool, run: Callable[[], None]) -> Callable[[], None]:
        def verified() -> None:
            bench.connector.verify_after_load = on
            run()
        return verified

    loads = [(f"load: plain file read, {threads} threads", plain_read_threads),
             ("load: BlockStore.read (verified)", store_read),
             ("load: connector, verify_after_load=False", with_verify(False, bench.load)),
             ("load: connector, verify_after_load=True", with_verify(True, bench.load)),
             ("load: connector async, verify_after_load",
              with_verify(True, lambda: bench.load(is_async=True))),
             ("xxh3-64 of the payload alone", checksum_only)]
    t_plain_read, times, ratios = paired_ratios(plain_read, [run for _, run in loads], repeats)
    rows.append(row("load: plain file read", t_plain_read, t_plain_read))
    for (operation, _), seconds, paired in zip(loads, times, ratios):
        rows.append((label, operation, nbytes / seconds / 1e9, median(paired), min(paired),
                     max(paired)))
    t_conn_load_noverify, t_conn_load = times[2], times[3]
    if device.startswith("cuda"):
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        t_h2d = best_time(lambda: (on_device.copy_(pinned, non_blocking=True),
                                   synchronize(device)), repeats)
        ceiling = max(t_plain_read, t_h2d)
        rows += [row("load: pinned host-to-device copy", t_h2d, t_plain_read),
                 row("load: connector x min(read, H2D)", t_conn_load_noverify, ceiling),
                 row("load: connector (verify) x min(read, H2D)", t_conn_load, ceiling)]
    return rows, bench


def profile_load(bench: ConnectorBench, repeats: int) -> list[tuple[str, float]]:
    """Seconds per phase of one load of every block (best of `repeats`): the reads
    alone, reads with their checks, `PagedBlocks.stage` on 1 and on io_threads threads
    (uploads included on a GPU), then the install with and without the check; on a CPU
    cache also `PagedBlocks.load_direct` (a sync load's path) on 1 and io_threads threads."""
    connector, paged, store = bench.connector, bench.connector._paged, bench.connector.store
    count, nbytes = len(bench.keys), paged.block_nbytes
    transfer = BlockTransfer("profile", bench.block_ids, bench.keys)
    never = ReadCancel()
    host = paged.staging(count)
    rows = memoryview(host.numpy()).cast("B")
    prefix = bytearray(PREFIX_SIZE)

    def read_only() -> None:
        for position, key in enumerate(bench.keys):
            fd = os.open(store._path(key), os.O_RDONLY)
            os.readv(fd, [prefix, rows[position * nbytes : (position + 1) * nbytes]])
            os.close(fd)

    def read_checked() -> None:
        for position, key in enumerate(bench.keys):
            store.read_into(key, [rows[position * nbytes : (position + 1) * nbytes]])

    def stage(threads: int) -> Callable[[], None]:
        def run() -> None:
            staged, results = paged.stage(count, lambda position, row: connector._read_entry(
                transfer, position, [row], never), never, threads)
            if staged.uploaded is not None:
                staged.uploaded.synchronize()
            paged.release(staged.host, staged.uploaded)
            assert all(isinstance(result, int) for result in results)
        return run

    staged, results = paged.stage(count, lambda position, row: connector._read_entry(
        transfer, position, [row], never), never, connector.io_threads)
    checksums = [result for result in results if isinstance(result, int)]
    assert len(checksums) == count

    def install(checked: bool) -> Callable[[], None]:
        def run() -> None:
            staged.host = paged.staging(count)  # install hands it back each time
            passed = paged.install(bench.block_ids, staged, checksums if checked else None)
            assert passed == count
            synchronize(bench.device)
        return run

    def direct(threads: int) -> Callable[[], None]:
        def run() -> None:
            results = paged.load_direct(bench.block_ids, lambda position, row: connector._read_entry(
                transfer, position, [row], never, check_payload=False), never, threads)
            assert all(isinstance(result, int) for result in results)
        return run

    phases = [("readv into rows, 1 thread", read_only),
              ("readv + checks, 1 thread", read_checked),
              ("stage (+ uploads), 1 thread", stage(1)),
              *[(f"stage, {threads} threads", stage(threads))
                for threads in sorted({2, 4, connector.io_threads, 16}) if threads > 1],
              ("install: scatter", install(False)),
              ("install: scatter + check", install(True)),
              *[(f"load_direct (sync), {threads} thread(s)", direct(threads))
                for threads in sorted({1, connector.io_threads}) if paged.direct]]
    times = best_times([(run, lambda: None) for _, run in phases], repeats)
    paged.release(host)
    return [(name, seconds) for (name, _), seconds in zip(phases, times)]


def break_even(name: str, layout: KVCacheLayout, bench: ConnectorBench, repeats: int,
               device: str) -> list[tuple[int, float, float]]:
    """(tokens, load s, prefill s) per prompt length that the loaded blocks cover."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rows: list[tuple[int, float, float]] = []
    for tokens in BREAK_EVEN_TOKENS:
        count = tokens // layout.block_size
        if count > len(bench.block_ids):
            break
        # On the CPU a prefill costs at least linear time per token, so once loading has
        # won twice in a row it keeps winning. Not on a GPU: short prefills are bound by
        # launches, long ones run at the matmul rate, so recompute can win at length.
        if device == "cpu" and sum(load < prefill for _, load, prefill in rows[-2:]) == 2:
            break
        load_s = best_time(lambda count=count: bench.load(count), repeats)
        prefill_s = prefill_seconds(SHAPES[name], tokens, device, dtype, repeats)
        rows.append((tokens, load_s, prefill_s))
    return rows


def summarise(rows: list[tuple[int, float, float]]) -> str:
    """Which prompt lengths loading wins at, in words."""
    won = [tokens for tokens, load, prefill in rows if load < prefill]
    lost = [tokens for tokens, load, prefill in rows if load >= prefill]
    if not lost:
        return f"loading wins from {won[0]} tokens" if won else ""
    if not won:
        return "recompute wins at every length tried"
    return (f"loading wins at {', '.join(map(str, won))}; "
            f"recompute at {', '.join(map(str, lost))} tokens")


def bench_decode(model: str | None, prompt_tokens: int, device: str, root: Path, repeats: int,
                 max_tokens: int = 16) -> list:
    """Time to first token and per decode step of one long prompt, KV recomputed vs loaded."""
    from kvrecover import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    paragraph = ("Disaggregated serving runs prefill and decode on different machines; the "
                 "decode side loads the prompt's KV cache from shared storage. ")
    store = root / "decode_store"

    def engine(role: str | None) -> LLM:
        transfer = None if role is None else KVTransferConfig(
            "SharedStorageConnector", role, {"shared_storage_path": str(store)})
        # No local prefix cache: every repeat recomputes (or reloads) the whole prompt.
        return LLM(model, device=device, enable_prefix_caching=False, kv_transfer_config=transfer)

    def run_once(llm: LLM, prompt: list[int]) -> tuple[float, float, list[int], int]:
        external = llm.stats["prompt_tokens_external"]
        started = time.perf_counter()
        first = None
        llm.engine.add_request(f"timed-{time.perf_counter_ns()}", {"prompt_token_ids": prompt},
                               params)
        tokens: list[int] = []
        while llm.engine.has_unfinished():
            for output in llm.engine.step():
                if first is None and output.outputs[0].token_ids:
                    first = time.perf_counter() - started
                tokens = output.outputs[0].token_ids
        total = time.perf_counter() - started
        return first, (total - first) / (max_tokens - 1), tokens, (
            llm.stats["prompt_tokens_external"] - external)

    def timed(llm: LLM, prompt: list[int], setup=lambda: None):
        llm.generate({"prompt_token_ids": prompt[:40][::-1]}, params)  # warm-up, another prompt
        runs = []
        for _ in range(repeats):
            setup()
            runs.append(run_once(llm, prompt))
        return min(r[0] for r in runs), min(r[1] for r in runs), runs[-1][2], runs[-1][3]

    baseline = engine(None)
    ids = baseline.get_tokenizer().encode(paragraph * (prompt_tokens // 20 + 1))[:prompt_tokens]
    ttft_recompute, step_recompute, tokens_recompute, _ = timed(baseline, ids)
    del baseline
    producer = engine("kv_producer")
    ttft_save, _, _, _ = timed(producer, ids, lambda: shutil.rmtree(store, ignore_errors=True))
    del producer
    consumer = engine("kv_consumer")
    ttft_load, step_load, tokens_load, loaded = timed(consumer, ids)
    shutil.rmtree(store, ignore_errors=True)
    same = tokens_load == tokens_recompute
    if not same:
        print(f"WARNING: token ids differ: {tokens_load} vs {tokens_recompute}")
    ms = 1000
    return [
        ("recompute (no connector)", ttft_recompute, step_recompute * ms, 0),
        ("prefill + save (kv_producer)", ttft_save, float("nan"), 0),
        ("load (kv_consumer)", ttft_load, step_load * ms, loaded),
        ("recompute / load", ttft_recompute / ttft_load, step_recompute / step_load,
         f"same ids: {same}"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_dir = "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
    parser.add_argument("--dir", default=default_dir, help="where the files go (default: %(default)s)")
    parser.add_argument("--megabytes", type=int, default=256, help="payload per layout (256)")
    parser.add_argument("--repeats", type=int, default=3, help="best of N (3)")
    parser.add_argument("--prompt-tokens", type=int, default=1500, help="long prompt length")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: built-in)")
    parser.add_argument("--device", default="cpu", help="device of the KV cache and the model (cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--skip-llm", action="store_true", help="storage figures only")
    parser.add_argument("--loads-only", action="store_true",
                        help="load figures only: no saves, break-even scan or long prompt")
    parser.add_argument("--profile", action="store_true",
                        help="also time the phases of one staged load per layout")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="kvrecover_bench_", dir=args.dir))
    try:
        print(f"files under {root}; torch threads: {torch.get_num_threads()}; "
              f"KV cache on {args.device}\n")
        print(f"{'layout':<34}{'operation':<46}{'GB/s':>8}{'x plain':>9}{'spread':>13}  goal")
        breaks = {}
        for name in args.layouts:
            folder = root / name.replace(" ", "_")
            rows, bench = bench_layout(name, LAYOUTS[name], folder, args.megabytes, args.repeats,
                                       args.device, args.loads_only)
            for layout_name, operation, rate, ratio, low, high in rows:
                kind = ("load, async" if "async" in operation
                        else "load, verify_after_load" if "verify_after_load=True" in operation
                        or "(verify)" in operation
                        else operation.split(":")[0])
                goal = GOALS.get(kind) if "connector" in operation else None
                verdict = "" if goal is None else f">= {goal} {'met' if ratio >= goal else 'MISSED'}"
                spread = "" if low is None else f"{low:.2f}-{high:.2f}"
                print(f"{layout_name:<34}{operation:<46}{rate:>8.2f}{ratio:>9.2f}{spread:>13}"
                      f"  {verdict}")
            if args.profile:
                for phase, seconds in profile_load(bench, args.repeats):
                    rate = len(bench.block_ids) * bench.connector._paged.block_nbytes / seconds / 1e9
                    print(f"{'':<34}{'profile: ' + phase:<46}{rate:>8.2f}{seconds * 1000:>7.1f} ms")
            if not args.loads_only:
                breaks[name] = break_even(name, LAYOUTS[name], bench, args.repeats, args.device)
            del bench
            shutil.rmtree(folder, ignore_errors=True)
        if args.loads_only:
            return
        print(f"\nload (connector, verified) vs recompute ({args.device}; recompute = layers "
              "x one layer's measured prefill)")
        print(f"{'layout':<20}{'tokens':>8}{'load s':>10}{'recompute s':>13}{'faster':>11}")
        for name, rows in breaks.items():
            for index, (tokens, load_s, prefill_s) in enumerate(rows):
                faster = "load" if load_s < prefill_s else "recompute"
                print(f"{name if index == 0 else '':<20}{tokens:>8}{load_s:>10.4f}{prefill_s:>13.4f}"
                      f"{faster:>11}  {summarise(rows) if index == 0 else ''}")
        if not args.skip_llm:
            print(f"\n{args.model or 'default model'}, {args.prompt_tokens}-token prompt, "
                  f"device {args.device}, best of {args.repeats}")
            print(f"{'':<32}{'first token s':>14}{'ms / decode step':>18}{'loaded tokens':>18}")
            for label, ttft, step, extra in bench_decode(args.model, args.prompt_tokens,
                                                        args.device, root, args.repeats):
                print(f"{label:<32}{ttft:>14.3f}{step:>18.2f}{extra!s:>18}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

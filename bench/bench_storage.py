"""Storage benchmark: what the verified KV block store costs, and what loading KV saves.

    .venv/bin/python bench/bench_storage.py --threads 1 [--dir /dev/shm] [--megabytes 256]
        [--repeats 3] [--prompt-tokens 1500] [--model DIR] [--device cpu] [--skip-llm]

1. For two KV layouts (the default model's: 30 layers, 3 KV heads, head dim 64,
   block 16, float32; and a Llama-3-8B-like one: 32 layers, 8 KV heads, head dim
   128, block 16, bfloat16), save and load throughput in GB/s of payload bytes:
   plain file I/O of the same bytes (one file per block, same folder fan-out),
   `BlockStore.write` / `BlockStore.read`, and the `SharedStorageConnector`
   worker path (gather from / scatter into a paged KV cache), with
   `verify_after_load` on and off. The ratio to plain I/O is the figure.
2. The integrity cost on load: `read_raw` + `parse` (header check and xxh3 of the
   payload) against `read_raw` + the same parse without checksums.
3. On the default model, one long prompt: time to first token and per decode
   step with its KV recomputed (no connector) and loaded from the store
   (`kv_consumer`), and with the prefill saving it (`kv_producer`).

Files live under --dir (default /dev/shm if present, so the page cache, not a
disk, is measured) and are deleted afterwards. Times are the best of --repeats.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.block_store import HEADER, PREFIX_SIZE, BlockStore
from kvrecover.kv_transfer.shared_storage import (
    BlockTransfer,
    SharedStorageConnector,
    StorageConnectorMetadata,
)

LAYOUTS = {
    "smollm2-135m f32": KVCacheLayout("bench-smollm2", torch.float32, 16, 30, 3, 64),
    "llama3-8b bf16": KVCacheLayout("bench-llama3-8b", torch.bfloat16, 16, 32, 8, 128),
}


def best_time(run: Callable[[], None], repeats: int, setup: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        setup()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def fresh(folder: Path) -> Callable[[], None]:
    def reset() -> None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    return reset


def parse_unverified(store: BlockStore, raw: bytes) -> torch.Tensor:
    """`BlockStore.parse` without its two checksums (measurement only)."""
    HEADER.unpack_from(raw, 0)
    payload = memoryview(raw)[PREFIX_SIZE:]
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(
        store.layout.dtype).view(store.block_shape)


def bench_layout(name: str, layout: KVCacheLayout, root: Path, megabytes: int,
                 repeats: int) -> list[tuple[str, str, float, float]]:
    """Rows of (layout, operation, GB/s, ratio to plain file I/O)."""
    num_blocks = max(8, megabytes * (1 << 20) // layout.block_nbytes)
    nbytes = num_blocks * layout.block_nbytes
    generator = torch.Generator().manual_seed(0)
    # The paged cache the connector gathers from and scatters into (block 0 is the null block).
    caches = [torch.randn(2, num_blocks + 1, layout.block_size, layout.num_kv_heads,
                          layout.head_dim, generator=generator).to(layout.dtype)
              for _ in range(layout.num_layers)]
    block_ids = list(range(1, num_blocks + 1))
    blocks = [torch.stack([cache[:, b] for cache in caches]).contiguous() for b in block_ids]
    keys = [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(num_blocks)]
    store = BlockStore(root / "store", layout)
    plain = root / "plain"

    def plain_path(key: bytes) -> Path:
        return plain / key.hex()[:2] / key.hex()

    def plain_write() -> None:
        for key, block in zip(keys, blocks):
            path = plain_path(key)
            path.parent.mkdir(exist_ok=True)
            with open(path, "wb") as handle:
                handle.write(block.view(torch.uint8).numpy())

    def plain_read() -> None:
        for key in keys:
            with open(plain_path(key), "rb") as handle:
                handle.read()

    def store_write() -> None:
        for key, block in zip(keys, blocks):
            store.write(key, block)

    def store_read() -> None:
        for key in keys:
            store.read(key)

    def store_read_unverified() -> None:
        for key in keys:
            parse_unverified(store, store.read_raw(key))

    def checksum_only() -> None:
        for block in blocks:
            xxhash.xxh3_64_intdigest(block.view(torch.uint8).numpy())

    config = KVTransferConfig("SharedStorageConnector", "kv_both",
                              {"shared_storage_path": str(root / "connector")})
    connector = SharedStorageConnector(config, KVConnectorRole.WORKER, layout)
    connector.register_kv_caches(caches)

    def connector_save() -> None:
        connector.bind_connector_metadata(StorageConnectorMetadata(
            saves=[BlockTransfer("bench", block_ids, keys)]))
        connector.wait_for_save()
        connector.clear_connector_metadata()
        assert connector.get_save_failures() == 0

    def connector_load() -> None:
        connector.bind_connector_metadata(StorageConnectorMetadata(
            loads=[BlockTransfer("bench", block_ids, keys)]))
        connector.start_load_kv(caches)
        connector.clear_connector_metadata()
        assert not connector.get_block_ids_with_load_errors()

    t_plain_write = best_time(plain_write, repeats, fresh(plain))
    t_plain_read = best_time(plain_read, repeats)
    t_store_write = best_time(store_write, repeats, fresh(store.root))
    t_store_read = best_time(store_read, repeats)
    t_unverified = best_time(store_read_unverified, repeats)
    t_checksum = best_time(checksum_only, repeats)
    t_conn_save = best_time(connector_save, repeats, fresh(root / "connector"))
    connector.verify_after_load = True
    t_conn_load = best_time(connector_load, repeats)
    connector.verify_after_load = False
    t_conn_load_noverify = best_time(connector_load, repeats)
    shutil.rmtree(root, ignore_errors=True)

    def row(operation: str, seconds: float, reference: float) -> tuple[str, str, float, float]:
        return (f"{name} ({num_blocks} x {layout.block_nbytes / 1e6:.2f} MB)", operation,
                nbytes / seconds / 1e9, reference / seconds)

    return [
        row("save: plain file write", t_plain_write, t_plain_write),
        row("save: BlockStore.write", t_store_write, t_plain_write),
        row("save: connector wait_for_save", t_conn_save, t_plain_write),
        row("load: plain file read", t_plain_read, t_plain_read),
        row("load: read_raw + parse, no checksums", t_unverified, t_plain_read),
        row("load: BlockStore.read (verified)", t_store_read, t_plain_read),
        row("load: connector, verify_after_load=False", t_conn_load_noverify, t_plain_read),
        row("load: connector, verify_after_load=True", t_conn_load, t_plain_read),
        row("xxh3-64 of the payload alone", t_checksum, t_plain_read),
    ]


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
    parser.add_argument("--device", default="cpu", help="device of the decode part (cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--skip-llm", action="store_true", help="storage figures only")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="kvrecover_bench_", dir=args.dir))
    try:
        print(f"files under {root}; torch threads: {torch.get_num_threads()}\n")
        print(f"{'layout':<34}{'operation':<44}{'GB/s':>8}{'x plain':>9}")
        for name, layout in LAYOUTS.items():
            for layout_name, operation, rate, ratio in bench_layout(
                name, layout, root / name.replace(" ", "_"), args.megabytes, args.repeats
            ):
                print(f"{layout_name:<34}{operation:<44}{rate:>8.2f}{ratio:>9.2f}")
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

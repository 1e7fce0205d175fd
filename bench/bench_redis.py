"""Redis benchmark: what the RedisConnector costs next to a raw redis-py pipeline.

    .venv/bin/python bench/bench_redis.py [--megabytes 64] [--batch-blocks 32] [--repeats 5]
        [--url redis://127.0.0.1:6379/0] [--dir /dev/shm] [--cluster [--ttft-only]
        [--prompt-tokens 2048]]

For two KV layouts (the default model's, float32, and a Llama-3-8B-like one,
bfloat16; see bench_storage.py), save and load throughput in GB/s of payload
bytes, `--batch-blocks` blocks per round trip (a step's worth):

- raw redis-py: a pipeline of SETs of the bare payload bytes, MGET to read them
  back (no framing, no checksums, no cache copies): the ceiling;
- the RedisConnector worker path: gather from a paged KV cache, frame and
  checksum, one EXISTS pipeline + one SET pipeline per step (`wait_for_save`);
  one pipeline of size-bounded GETRANGEs (a hostile oversized value is never read
  whole), verify, scatter into the cache per step (`start_load_kv`), with
  `verify_after_load` on and off. The ratio to raw is the figure (goal >= 0.7);
- the SharedStorageConnector on a folder (--dir, /dev/shm by default) for scale;
- with --cluster, the same through a three-node Redis Cluster started on loopback
  ports (tests/redis_cluster_helpers.py), next to a raw redis-py cluster pipeline
  (SET / GET, grouped by node by redis-py), same run; then the time to first token
  of a prompt whose KV is in the cluster: all nodes up, one of three killed (under
  recovery scope "prefix" and "blocks", `kv_load_recompute`), and no connector (all
  computed), on a small random model; `--ttft-only` skips the throughput rows.

Without --url a private redis-server (no persistence) is started on a free
loopback port and stopped afterwards. The store is flushed before each save;
times are the best of --repeats, the variants measured in turn within a repeat.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
import redis.cluster
import torch
import xxhash

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.redis.connector import RedisConnector
from kvrecover.kv_transfer.stores.shared_storage import SharedStorageConnector
from kvrecover.kv_transfer.stores.store_connector import (
    BlockStoreConnector,
    BlockTransfer,
    StorageConnectorMetadata,
)

LAYOUTS = {
    "smollm2-135m f32": KVCacheLayout("bench-smollm2", torch.float32, 16, 30, 3, 64),
    "llama3-8b bf16": KVCacheLayout("bench-llama3-8b", torch.bfloat16, 16, 32, 8, 128),
}


def best_times(runs: dict[str, tuple[Callable[[], None], Callable[[], None]]],
               repeats: int) -> dict[str, float]:
    """Best time of each (setup, run), the runs interleaved so that a noisy neighbour
    slows all of them alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, (setup, run) in runs.items():
            setup()
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def start_server(folder: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
         "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return process, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("redis-server did not start")


def batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def bench_layout(name: str, layout: KVCacheLayout, url: str, folder: Path, megabytes: int,
                 batch: int, repeats: int, cluster_url: str | None = None,
                 ) -> list[tuple[str, str, float, float]]:
    """Rows of (layout, operation, GB/s, ratio to raw redis-py)."""
    num_blocks = max(batch, megabytes * (1 << 20) // layout.block_nbytes)
    nbytes = num_blocks * layout.block_nbytes
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, num_blocks + 1, layout.block_size, layout.num_kv_heads,
                          layout.head_dim, generator=generator).to(layout.dtype)
              for _ in range(layout.num_layers)]
    block_ids = list(range(1, num_blocks + 1))
    keys = [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(num_blocks)]
    payloads = [torch.stack([cache[:, b] for cache in caches]).contiguous().view(torch.uint8)
                .numpy().tobytes() for b in block_ids]
    client = redis.Redis.from_url(url)
    raw_keys = [b"raw:" + key.hex().encode() for key in keys]

    def flush() -> None:
        client.flushdb()

    def raw_save() -> None:
        for chunk in batches(list(zip(raw_keys, payloads)), batch):
            pipeline = client.pipeline(transaction=False)
            for key, payload in chunk:
                pipeline.set(key, payload)
            pipeline.execute()

    def raw_load() -> None:
        for chunk in batches(raw_keys, batch):
            values = client.mget(chunk)
            assert all(v is not None for v in values)

    cluster = None if cluster_url is None else redis.cluster.RedisCluster(
        startup_nodes=[redis.cluster.ClusterNode(*seed.split(":"))
                       for seed in cluster_url.split("://")[1].split(",")])

    def cluster_flush() -> None:
        assert cluster is not None
        cluster.flushdb(target_nodes=redis.cluster.RedisCluster.PRIMARIES)

    def cluster_raw_save() -> None:
        assert cluster is not None
        for chunk in batches(list(zip(raw_keys, payloads)), batch):
            pipeline = cluster.pipeline(transaction=False)
            for key, payload in chunk:
                pipeline.set(key, payload)
            pipeline.execute()

    def cluster_raw_load() -> None:
        assert cluster is not None
        for chunk in batches(raw_keys, batch):
            pipeline = cluster.pipeline(transaction=False)
            for key in chunk:
                pipeline.get(key)
            assert all(v is not None for v in pipeline.execute())

    def connector(kind: str) -> BlockStoreConnector:
        if kind in ("redis", "cluster"):
            config = KVTransferConfig("RedisConnector", "kv_both",
                                      {"url": url if kind == "redis" else cluster_url})
            made = RedisConnector(config, KVConnectorRole.WORKER, layout)
        else:
            config = KVTransferConfig("SharedStorageConnector", "kv_both",
                                      {"shared_storage_path": str(folder)})
            made = SharedStorageConnector(config, KVConnectorRole.WORKER, layout)
        made.register_kv_caches(caches)
        return made

    def save_with(made: BlockStoreConnector) -> Callable[[], None]:
        def run() -> None:
            for chunk in batches(list(zip(block_ids, keys)), batch):
                ids, chunk_keys = [b for b, _ in chunk], [k for _, k in chunk]
                made.bind_connector_metadata(StorageConnectorMetadata(
                    saves=[BlockTransfer("bench", ids, chunk_keys)]))
                made.wait_for_save()
                made.clear_connector_metadata()
            assert made.get_save_failures() == 0
        return run

    def load_with(made: BlockStoreConnector) -> Callable[[], None]:
        def run() -> None:
            for chunk in batches(list(zip(block_ids, keys)), batch):
                ids, chunk_keys = [b for b, _ in chunk], [k for _, k in chunk]
                made.bind_connector_metadata(StorageConnectorMetadata(
                    loads=[BlockTransfer("bench", ids, chunk_keys)]))
                made.start_load_kv(caches)
                made.clear_connector_metadata()
            assert not made.get_block_ids_with_load_errors()
        return run

    def reset_folder() -> None:
        shutil.rmtree(folder, ignore_errors=True)

    redis_connector = connector("redis")
    folder_connector = connector("folder")
    unverified = connector("redis")
    unverified.verify_after_load = False

    def nothing() -> None:
        pass

    save_runs = {
        "raw": (flush, raw_save),
        "redis": (flush, save_with(redis_connector)),
        "folder": (reset_folder, save_with(folder_connector)),
    }
    load_runs = {
        "raw": (nothing, raw_load),
        "redis": (nothing, load_with(redis_connector)),
        "redis-unverified": (nothing, load_with(unverified)),
        "folder": (nothing, load_with(folder_connector)),
    }
    connectors = [redis_connector, unverified]
    if cluster is not None:
        cluster_connector = connector("cluster")
        connectors.append(cluster_connector)
        save_runs["cluster-raw"] = (cluster_flush, cluster_raw_save)
        save_runs["cluster"] = (cluster_flush, save_with(cluster_connector))
        load_runs["cluster-raw"] = (nothing, cluster_raw_load)
        load_runs["cluster"] = (nothing, load_with(cluster_connector))
    saves = best_times(save_runs, repeats)
    flush()
    raw_save()
    save_with(redis_connector)()
    if cluster is not None:
        cluster_flush()
        cluster_raw_save()
        save_with(cluster_connector)()
    loads = best_times(load_runs, repeats)
    for made in connectors:
        made.shutdown()
    flush()
    reset_folder()
    t_raw_save, t_redis_save, t_folder_save = saves["raw"], saves["redis"], saves["folder"]
    t_raw_load, t_redis_load, t_folder_load = loads["raw"], loads["redis"], loads["folder"]
    t_redis_load_noverify = loads["redis-unverified"]

    def row(operation: str, seconds: float, reference: float) -> tuple[str, str, float, float]:
        return (f"{name} ({num_blocks} x {layout.block_nbytes / 1e6:.2f} MB)", operation,
                nbytes / seconds / 1e9, reference / seconds)

    cluster_rows = [] if cluster is None else [
        row("save: raw redis-py cluster pipeline SET", saves["cluster-raw"], t_raw_save),
        row("save: RedisConnector, 3-node cluster", saves["cluster"], saves["cluster-raw"]),
        row("load: raw redis-py cluster pipeline GET", loads["cluster-raw"], t_raw_load),
        row("load: RedisConnector, 3-node cluster", loads["cluster"], loads["cluster-raw"]),
    ]
    if cluster is not None:
        cluster_flush()
        cluster.close()
    return cluster_rows + [
        row("save: raw redis-py pipeline SET", t_raw_save, t_raw_save),
        row("save: RedisConnector wait_for_save", t_redis_save, t_raw_save),
        row("save: SharedStorageConnector (folder)", t_folder_save, t_raw_save),
        row("load: raw redis-py MGET", t_raw_load, t_raw_load),
        row("load: RedisConnector, verify_after_load=False", t_redis_load_noverify, t_raw_load),
        row("load: RedisConnector, verify_after_load=True", t_redis_load, t_raw_load),
        row("load: SharedStorageConnector (folder)", t_folder_load, t_raw_load),
    ]


class NodeKillingRedisConnector(RedisConnector):
    """RedisConnector that kills `victim` (a cluster node) once, after the lookup of the
    first load that claims tokens and before that load reads: a node lost mid-load."""

    victim = None

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        victim = NodeKillingRedisConnector.victim
        if victim is not None and num_external_tokens > 0:
            NodeKillingRedisConnector.victim = None
            victim.kill()
        super().update_state_after_alloc(request, block_ids, num_external_tokens)


def time_to_first_token(cluster, folder: Path, prompt_tokens: int, repeats: int
                        ) -> dict[str, tuple[float, int]]:
    """Best time to first token (seconds) of a `prompt_tokens` prompt whose KV a producer
    stored in `cluster`, and the tokens recovery recomputed in that run: all nodes up;
    one of three lost between the lookup and the load, under recovery scope "prefix"
    (everything from the first lost block on recomputed) and "blocks" (only the lost
    node's blocks); one of three killed before the request (the lookup claims only the
    blocks before the first one on it); no connector. A fresh engine per measurement,
    warmed up first."""
    from conftest import build_tiny_model

    from kvrecover import LLM, SamplingParams
    from kvrecover.kv_transfer.registry import register_connector

    model = build_tiny_model(folder / "model", hidden_size=256, intermediate_size=512,
                             num_hidden_layers=6, num_attention_heads=8,
                             num_key_value_heads=4, max_position_embeddings=4096)
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    register_connector("NodeKillingRedisConnector", f"{__name__}:NodeKillingRedisConnector")

    def engine(role: str | None, recompute: str = "prefix",
               connector: str = "RedisConnector") -> LLM:
        NodeKillingRedisConnector.victim = None  # never during a warm-up
        transfer = None if role is None else KVTransferConfig(
            connector, role, {"url": cluster.url, "timeout_s": 2.0},
            kv_load_recompute=recompute)
        llm = LLM(str(model), device="cpu", block_size=16, max_num_batched_tokens=512,
                  num_kv_blocks=4 * prompt_tokens // 16, kv_transfer_config=transfer)
        llm.generate([{"prompt_token_ids": [5] * 40}], params)  # warm-up (nothing stored)
        return llm

    def ttft(role: str | None, prompt: list[int], recompute: str = "prefix",
             kill_mid_load=None) -> tuple[float, int]:
        llm = engine(role, recompute,
                     "RedisConnector" if kill_mid_load is None else "NodeKillingRedisConnector")
        NodeKillingRedisConnector.victim = kill_mid_load  # armed after the warm-up
        before = llm.stats["kv_load_recomputed_tokens"]
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params)
        elapsed = time.perf_counter() - started
        llm.close()
        return elapsed, llm.stats["kv_load_recomputed_tokens"] - before

    prompts = [torch.randint(2, 384, (prompt_tokens,), generator=generator).tolist()
               for _ in range(2 * repeats)]
    producer = engine("kv_producer")
    producer.generate([{"prompt_token_ids": p} for p in prompts], params)
    producer.close()
    best = {"cluster, all 3 nodes up": min(ttft("kv_consumer", p) for p in prompts[:repeats]),
            "no connector (all computed)": min(ttft(None, p) for p in prompts[:repeats])}
    victim = cluster.nodes[0]
    victim.kill()
    best["1 of 3 killed before the request"] = min(
        ttft("kv_consumer", p, "blocks") for p in prompts[repeats:])
    lost: dict[str, list[tuple[float, int]]] = {"prefix": [], "blocks": []}
    for prompt in prompts[repeats:]:  # the two scopes in turn, on the same prompts
        for recompute, runs in lost.items():
            if victim.process is None:  # back, empty: store the prompt's KV again
                victim.start(cluster.binary)
                cluster.wait_ok()
                producer = engine("kv_producer")
                producer.generate([{"prompt_token_ids": prompt}], params)
                producer.close()
            runs.append(ttft("kv_consumer", prompt, recompute, kill_mid_load=victim))
            if victim.process is not None:
                raise RuntimeError("the lookup claimed nothing: no node was lost mid-load")
    for recompute, runs in lost.items():
        best[f"1 of 3 lost mid-load, {recompute!r}"] = min(runs)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_dir = "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
    parser.add_argument("--url", default=None, help="an existing server (default: start one)")
    parser.add_argument("--dir", default=default_dir, help="folder store location (%(default)s)")
    parser.add_argument("--megabytes", type=int, default=64, help="payload per layout (64)")
    parser.add_argument("--batch-blocks", type=int, default=32, help="blocks per round trip (32)")
    parser.add_argument("--repeats", type=int, default=5, help="best of N (5)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1)")
    parser.add_argument("--cluster", action="store_true",
                        help="also through a 3-node Redis Cluster, and its time to first token")
    parser.add_argument("--prompt-tokens", type=int, default=2048,
                        help="prompt length of the time-to-first-token runs (2048)")
    parser.add_argument("--ttft-only", action="store_true",
                        help="with --cluster: only the time-to-first-token runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="kvrecover_bench_redis_", dir=args.dir))
    server = cluster = None
    try:
        url = args.url
        if url is None:
            server, url = start_server(root)
        if args.cluster:
            import sys

            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from redis_cluster_helpers import RedisClusterProcesses

            cluster = RedisClusterProcesses().start()
        version = redis.Redis.from_url(url).info("server")["redis_version"]
        print(f"redis {version} at {url.split('@')[-1]}, redis-py {redis.__version__}, "
              f"{args.batch_blocks} blocks per round trip, best of {args.repeats}\n")
        print(f"{'layout':<34}{'operation':<48}{'GB/s':>8}{'x raw':>8}")
        for name, layout in ({} if args.ttft_only and cluster is not None else LAYOUTS).items():
            for layout_name, operation, rate, ratio in bench_layout(
                name, layout, url, root / "folder", args.megabytes, args.batch_blocks,
                args.repeats, None if cluster is None else cluster.url,
            ):
                print(f"{layout_name:<34}{operation:<48}{rate:>8.2f}{ratio:>8.2f}")
        if cluster is not None:
            print("\n(cluster rows: 'x raw' is the raw cluster pipeline against the raw one-"
                  "server pipeline, the connector against the raw cluster pipeline)")
            print(f"\ntime to first token, {args.prompt_tokens}-token prompt, best of "
                  f"{args.repeats}:")
            print(f"  {'case':<46}{'TTFT':>12}{'recomputed tokens':>20}")
            for case, (seconds, recomputed) in time_to_first_token(
                    cluster, root, args.prompt_tokens, args.repeats).items():
                print(f"  {case:<46}{seconds * 1000:>9.1f} ms{recomputed:>20}")
    finally:
        if cluster is not None:
            cluster.cleanup()
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""guidellm through vllm-router and through `kvrecover proxy`, in front of the same instances.

    PYTHONPATH=. .venv/bin/python bench/bench_router.py --model DIR
        [--concurrency 1 4 16] [--repeats 1] [--threads 1] [--device cpu]
        [--prompt-tokens 256] [--output-tokens 32] [--requests-per-stream 3]
        [--max-seconds 240] [--guidellm PATH] [--router PATH] [--server-args '...']

One NIXL prefill instance (`kv_producer`) and two NIXL decode instances (`kv_consumer`)
are started once; then vllm-router (`--vllm-pd-disaggregation`, round robin; `--router`,
default `$KVRECOVER_CLIENTS_BIN/vllm-router`, else `.clients-venv`'s: scripts/
setup_vllm_router.sh) and `kvrecover proxy` both stand in front of them. For each
concurrency N the fronts take turns (`--repeats` rounds, the order flipped each turn),
each one `guidellm run` as `bench_guidellm.py` drives it (`--guidellm`, default
`$CLIENTS_BIN/guidellm`: ../shared/peer/setup_clients.sh), with prompts of its own (a
seed per front and round, so no prefix-cache hit crosses turns).

Printed: one row per turn (requests/s, TTFT p50/p99, ITL p50, the blocks the decodes
pulled and failed to pull during it), then per N the proxy / router ratios. The
instances, fronts and any guidellm still running are stopped on every exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import httpx
from bench_guidellm import MODEL_NAME, Turn, stop_on_signals, turn
from serve_servers import Server, engine_env, free_port, kvrecover_argv

REPO = Path(__file__).resolve().parent.parent
FRONTS = ("router", "proxy")
PULLED = "kvrecover_kv_nixl_pulled_blocks_total"
FAILED = "kvrecover_kv_load_failed_blocks_total"


def nixl(role: str, **extra: object) -> str:
    """A `--kv-transfer-config` for the NixlConnector in `role`."""
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                       "kv_connector_extra_config": extra})


def metric_sum(servers: list[Server], name: str) -> float:
    """`name` summed over the servers' /metrics (0 where absent)."""
    total = 0.0
    for server in servers:
        for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                total += float(line.split()[-1])
    return total


def default_router() -> str:
    folder = os.environ.get("KVRECOVER_CLIENTS_BIN") or str(REPO / ".clients-venv" / "bin")
    return str(Path(folder) / "vllm-router")


def start_fleet(args: argparse.Namespace, workdir: Path) -> tuple[Server, list[Server]]:
    """The prefill and the two decodes, healthy."""
    env = engine_env(args.threads)

    def serve(name: str, config: str) -> Server:
        argv = kvrecover_argv(args.model, MODEL_NAME, args.dtype, args.device,
                              args.server_args)
        return Server([*argv, "--kv-transfer-config", config], workdir / f"{name}.log", env)

    prefill = serve("prefill", nixl("kv_producer", side_channel_port=free_port()))
    decodes = [serve(f"decode{i}", nixl("kv_consumer")) for i in range(2)]
    for server in (prefill, *decodes):
        server.wait()
    return prefill, decodes


def start_fronts(args: argparse.Namespace, prefill: Server, decodes: list[Server],
                 workdir: Path) -> dict[str, Server]:
    """vllm-router and `kvrecover proxy` in front of the fleet, healthy."""
    router = [args.router, "--vllm-pd-disaggregation", "--host", "127.0.0.1",
              "--prometheus-port", str(free_port()), "--policy", "round_robin",
              "--prefill", prefill.url, *[a for d in decodes for a in ("--decode", d.url)]]
    proxy = [sys.executable, "-m", "kvrecover", "proxy", "--prefill", prefill.url,
             "--decode", *[d.url for d in decodes]]
    fronts = {"router": Server(router, workdir / "router.log", dict(os.environ)),
              "proxy": Server(proxy, workdir / "proxy.log", dict(os.environ))}
    for server in fronts.values():
        server.wait(timeout=120)
    return fronts


def print_turns(turns: list[tuple[Turn, float, float]]) -> None:
    print("\n| front | N | round | requests | req/s | TTFT p50 / p99 ms | ITL p50 ms | "
          "blocks pulled | pulls failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t, pulled, failed in turns:
        print(f"| {t.engine} | {t.concurrency} | {t.round} | {t.requests}"
              f"{f' ({t.errors} errors)' if t.errors else ''} | {t.requests_per_s:.2f} | "
              f"{t.ttft_p50_ms:.0f} / {t.ttft_p99_ms:.0f} | {t.itl_p50_ms:.1f} | "
              f"{pulled:.0f} | {failed:.0f} |")


def print_ratios(turns: list[Turn]) -> None:
    """Per N: the proxy's figures over the router's (means over rounds)."""
    def mean(n: int, front: str, field: str) -> float:
        values = [getattr(t, field) for t in turns if t.concurrency == n and t.engine == front]
        return sum(values) / len(values)

    fields = ("requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms")
    print("\n| N | req/s router / proxy (x) | TTFT p50 ms (x) | TTFT p99 ms (x) | "
          "ITL p50 ms (x) |")
    print("|---:|---|---|---|---|")
    for n in sorted({t.concurrency for t in turns}):
        cells = []
        for field in fields:
            router, proxy = mean(n, "router", field), mean(n, "proxy", field)
            ratio = proxy / router if router else float("nan")
            cells.append(f"{router:.2f} / {proxy:.2f} ({ratio:.2f}x)")
        print(f"| {n} | {' | '.join(cells)} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.environ.get("PEER_MODEL"),
                        help="Hugging Face folder the instances serve (default: $PEER_MODEL)")
    parser.add_argument("--guidellm", default=str(Path(os.environ.get(
        "CLIENTS_BIN", Path.home() / ".cache" / "kvrecover-peer" / "clients-venv" / "bin"))
        / "guidellm"))
    parser.add_argument("--router", default=default_router())
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per instance")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--max-seconds", type=int, default=240, help="per guidellm run")
    parser.add_argument("--server-args", default="", help="more `kvrecover serve` flags")
    args = parser.parse_args()
    args.profile_dir = None  # what bench_guidellm's `turn` reads
    if not args.model or not Path(args.model).is_dir():
        parser.error("--model (or $PEER_MODEL) must name a model folder")
    for tool in (args.guidellm, args.router):
        if not Path(tool).exists():
            parser.error(f"no {tool}: ../shared/peer/setup_clients.sh (guidellm), "
                         "scripts/setup_vllm_router.sh (vllm-router)")
    stop_on_signals()
    workdir = Path(tempfile.mkdtemp(prefix="bench-router-"))
    servers: list[Server] = []
    rows: list[tuple[Turn, float, float]] = []
    try:
        prefill, decodes = start_fleet(args, workdir)
        servers += [prefill, *decodes]
        fronts = start_fronts(args, prefill, decodes, workdir)
        servers += fronts.values()
        index = 0
        for n in args.concurrency:
            for round_ in range(args.repeats):
                for name in (FRONTS if index % 2 == 0 else FRONTS[::-1]):
                    before = metric_sum(decodes, PULLED), metric_sum(decodes, FAILED)
                    # A seed of its own per front and round: fresh prompts every turn.
                    row, _ = turn(args, name, fronts[name], n, 2 * round_ + FRONTS.index(name),
                                  workdir)
                    row.round = round_
                    pulled = metric_sum(decodes, PULLED) - before[0]
                    failed = metric_sum(decodes, FAILED) - before[1]
                    rows.append((row, pulled, failed))
                    print(json.dumps({**asdict(row), "pulled": pulled, "failed": failed}),
                          flush=True)
                index += 1
    finally:
        for server in reversed(servers):
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print_turns(rows)
    print_ratios([row for row, _, _ in rows])
    return 0 if all(row.errors == 0 for row, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

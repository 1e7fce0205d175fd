"""Serving benchmark: concurrent streamed clients through the proxy and directly.

    PYTHONPATH=. .venv/bin/python bench/bench_serve.py [--model DIR] [--device cpu]
        [--concurrency 1 4 16] [--failure-rates 0 0.1 1] [--num-prompts 32]
        [--prompt-words 150] [--max-tokens 32] [--threads N] [--json out.json]
        [--server-args '--kv-cache-memory-gb 8']

For each KV failure rate (the fraction of loaded blocks a `FaultInjectionConnector`
drops, policy `recompute`) a fresh prefill server, decode server and proxy start
(`kvrecover serve` / `proxy` processes on loopback) and get two untimed warm-up
requests. For each concurrency N, N clients stream greedy completions of a fixed
prompt set:
- direct: to the decode server, after the prefill server stored the prompts' KV
  (untimed), so every request loads its KV, and fails to as often as the rate says;
- proxy: through the proxy, which prefills and then decodes (prefill included).
Reported per run: requests/s, output tokens/s, time to first token and time per
output token (p50, p99), the decode server's failed blocks, and whether every
output equals the failure-free run's (it must: recovery is exact).

Each (mode, N) uses its own prompts (a run tag in front), so the decode server's
prefix cache never hides a load; the same prompts are used at every rate. Where
`vllm` is installed, the same direct load runs against `vllm serve` on the same
model and dtype (rate 0 only); otherwise that column is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

WORDS = ("the quick brown fox jumps over the lazy dog while the capital of france is paris "
         "and disaggregated serving splits prefill from decode so blocks fail and we "
         "recompute them exactly").split()


@dataclass
class RunResult:
    target: str  # kvrecover-direct, kvrecover-proxy, vllm-direct
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
    identical_to_rate_0: bool | None = None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def make_prompts(tag: str, count: int, words: int) -> list[str]:
    prompts = []
    for i in range(count):
        body = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words))
        prompts.append(f"[{tag} {i}] {body}")
    return prompts


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One child process listening on a loopback port."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with open(log, "wb") as handle:
            self.proc = subprocess.Popen([*argv, "--port", str(self.port)], stdout=handle,
                                         stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout: float = 900.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[:4]} exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.proc.args[:4]} did not start in {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def metric(url: str, key: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str,
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
            choice = json.loads(line[6:])["choices"][0]
            new = choice.get("token_ids")
            if new is None:  # a server without return_token_ids (vLLM streams text only)
                new = [0] if choice.get("text") else []
            if new:
                now = time.perf_counter()
                first = first or now
                last = now
                token_ids.extend(new)
    if first is None:
        raise RuntimeError("no token came back")
    tpot = (last - first) / (len(token_ids) - 1) if len(token_ids) > 1 else None
    return first - started, tpot, token_ids


async def run_load(url: str, model: str, prompts: list[str], concurrency: int,
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
    async with httpx.AsyncClient(timeout=timeout) as client:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: built-in)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--failure-rates", type=float, nargs="+", default=[0.0, 0.1, 1.0])
    parser.add_argument("--modes", nargs="+", default=["direct", "proxy"],
                        choices=["direct", "proxy"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS of each server (default: torch's choice)")
    parser.add_argument("--server-args", default="",
                        help="more `kvrecover serve` flags for every server, e.g. "
                             "'--kv-cache-memory-gb 8' when several share one GPU")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    store = workdir / "kv"
    store.mkdir()
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    engine = [sys.executable, "-m", "kvrecover", "serve", "--device", args.device,
              "--dtype", args.dtype]
    if args.model:
        engine += ["--model", args.model]
    model = args.model or "SmolLM2-135M-Instruct"
    engine += ["--served-model-name", model, *shlex.split(args.server_args)]
    rows: list[RunResult] = []
    baseline: dict[tuple[str, int], list] = {}
    servers: list[Server] = []
    try:
        for rate in args.failure_rates:
            # Fresh servers per rate: no prefix cache carries over from the last rate.
            prefill = Server([*engine, "--kv-transfer-config", transfer(store, "kv_producer")],
                             workdir / f"prefill-{rate}.log", env)
            decode = Server([*engine, "--kv-transfer-config",
                             transfer(store, "kv_consumer", rate)],
                            workdir / f"decode-{rate}.log", env)
            servers += [prefill, decode]
            prefill.wait()
            decode.wait()
            proxy = Server([sys.executable, "-m", "kvrecover", "proxy", "--prefill",
                            prefill.url, "--decode", decode.url],
                           workdir / f"proxy-{rate}.log", env).wait()
            servers.append(proxy)
            warmup = make_prompts(f"warmup-{rate}", 2, args.prompt_words)
            asyncio.run(run_load(proxy.url, model, warmup, 2, args.max_tokens))
            for mode in args.modes:
                for concurrency in args.concurrency:
                    prompts = make_prompts(f"{mode}-{concurrency}", args.num_prompts,
                                           args.prompt_words)
                    if mode == "direct":  # store the KV first, untimed
                        asyncio.run(run_load(prefill.url, model, prompts, 4, 1))
                    url = decode.url if mode == "direct" else proxy.url
                    failed_before = metric(decode.url,
                                           "kvrecover_kv_load_failed_blocks_total")
                    seconds, results, errors = asyncio.run(
                        run_load(url, model, prompts, concurrency, args.max_tokens))
                    row = summarize(f"kvrecover-{mode}", rate, concurrency, seconds, results,
                                    errors)
                    row.failed_blocks = metric(
                        decode.url, "kvrecover_kv_load_failed_blocks_total"
                    ) - failed_before
                    tokens = [r[2] if r else None for r in results]
                    key = (mode, concurrency)
                    if key not in baseline:
                        baseline[key] = tokens
                    row.identical_to_rate_0 = tokens == baseline[key]
                    rows.append(row)
                    print(json.dumps(asdict(row)), flush=True)
            for server in (proxy, decode, prefill):
                server.stop()
        rows += run_vllm(args, model, workdir)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0 if all(r.errors == 0 and r.identical_to_rate_0 is not False for r in rows) else 1


def run_vllm(args: argparse.Namespace, model: str, workdir: Path) -> list[RunResult]:
    """The same direct load against `vllm serve`, when vLLM is installed."""
    if shutil.which("vllm") is None or not args.model:
        print("vllm not installed (or no --model folder): no vLLM comparison", file=sys.stderr)
        return []
    argv = ["vllm", "serve", args.model, "--served-model-name", model]
    if args.dtype != "auto":
        argv += ["--dtype", args.dtype]
    server = Server(argv, workdir / "vllm.log", dict(os.environ)).wait()
    rows = []
    try:
        for concurrency in args.concurrency:
            prompts = make_prompts(f"vllm-{concurrency}", args.num_prompts, args.prompt_words)
            seconds, results, errors = asyncio.run(
                run_load(server.url, model, prompts, concurrency, args.max_tokens))
            rows.append(summarize("vllm-direct", 0.0, concurrency, seconds, results, errors))
    finally:
        server.stop()
    return rows


def print_table(rows: list[RunResult]) -> None:
    print("\n| target | KV fail | clients | req/s | out tok/s | TTFT p50 / p99 ms | "
          "TPOT p50 / p99 ms | failed blocks | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        same = "-" if r.identical_to_rate_0 is None else ("yes" if r.identical_to_rate_0
                                                          else "NO")
        print(f"| {r.target} | {r.failure_rate:.0%} | {r.concurrency} | {r.requests_per_s} | "
              f"{r.output_tokens_per_s} | {r.ttft_p50_ms} / {r.ttft_p99_ms} | "
              f"{r.tpot_p50_ms} / {r.tpot_p99_ms} | {r.failed_blocks:.0f} | {same} |"
              + (f" {r.errors} errors" if r.errors else ""))


if __name__ == "__main__":
    sys.exit(main())

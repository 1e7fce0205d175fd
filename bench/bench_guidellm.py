"""Serving under guidellm's load: `kvrecover serve` side by side with vLLM's OpenAI server.

    PEER_PY=... PEER_MODEL=... PYTHONPATH=. .venv/bin/python bench/bench_guidellm.py
        [--concurrency 1 4 16] [--repeats 2] [--threads 1] [--prompt-tokens 256]
        [--output-tokens 32] [--requests-per-stream 3] [--max-seconds 240]
        [--guidellm PATH] [--engines kvrecover vllm] [--server-args '...']
        [--vllm-args '...'] [--json out.json] [--profile-dir DIR]

The load generator is guidellm (neither engine's code: `../shared/peer/setup_clients.sh`
puts it in a venv of its own; `--guidellm`, default `$CLIENTS_BIN/guidellm`, else that
venv's). Both servers serve the same model folder (`--model`, default `$PEER_MODEL`, the
peer's converted default model) in float32 with the same `OMP_NUM_THREADS` (`--threads`,
as `bench_serve.py` sets them, through `serve_servers.py`). They are started one after the
other, each fresh for this run and warmed up (four requests at once on prompts of their
own); then, for each concurrency N, the engines take turns (`--repeats` rounds, the order
flipped each round) so that a change in the machine's load hits both: every turn is one
`guidellm run` with the concurrent profile at N streams on `/v1/completions`, synthetic
text of `--prompt-tokens` tokens, `--output-tokens` greedy tokens (`temperature 0`,
`ignore_eos`), at most `requests-per-stream x N` requests (8 at least) and `--max-seconds`.
Within a (N, round) both engines get the same prompts (guidellm's seed), fresh ones for
every (N, round), so no prefix-cache hit crosses turns.

Printed: one row per turn (guidellm's output tok/s and requests/s, TTFT p50/p99, ITL
p50, the server's CPU seconds, the 1-minute load average when the turn ended), then per
N the range over rounds of each engine's figures and of the paired kvrecover / vLLM
ratios, and how many completions had the same text on both. `--profile-dir` runs py-spy
(`--py-spy`, default `~/.cache/kvrecover-peer/tools-venv/bin/py-spy`, made once with
`python3 -m venv ~/.cache/kvrecover-peer/tools-venv && ~/.cache/kvrecover-peer/tools-venv/bin/pip
install py-spy`) on kvrecover's server during its turns and keeps
one speedscope profile per turn (all threads, idle samples included), printing where the
engine and HTTP threads spent the turn (`spy_breakdown.py`). The servers and
any guidellm still running are stopped on every exit: an error, Ctrl-C, SIGTERM or
SIGHUP.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_serve import Prompts, warm_up
from serve_servers import Server, engine_env, kvrecover_argv, vllm_argv, vllm_env
from spy_breakdown import format_breakdown

PEER_DIR = Path.home() / ".cache" / "kvrecover-peer"
MODEL_NAME = "bench-model"


@dataclass
class Turn:
    """One guidellm run against one engine."""

    engine: str
    concurrency: int
    round: int
    requests: int
    errors: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    server_cpu_s: float | None
    load_average: float


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so every `finally` stops its processes."""
    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit)


def run_bounded(argv: list[str], log: Path, timeout: float, env: dict[str, str]) -> int:
    """Run `argv` in a session of its own; on a timeout or any exit kill the whole group."""
    with open(log, "ab") as handle:
        proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def guidellm_argv(args: argparse.Namespace, url: str, concurrency: int, seed: int,
                  out: Path) -> list[str]:
    backend = {"kind": "openai_http", "target": url, "model": MODEL_NAME,
               "request_format": "/v1/completions",
               "extras": {"body": {"temperature": 0}}}
    count = max(8, args.requests_per_stream * concurrency)
    return [args.guidellm, "run", "--backend", json.dumps(backend),
            "--profile", f"kind=concurrent,streams={concurrency}",
            "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                      f"output_tokens={args.output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={args.model}",
            "--constraint", f"kind=max_requests,count={count}",
            "--constraint", f"kind=max_duration,seconds={args.max_seconds}",
            "--seed", f"kind=static,value={seed}",
            "--output", f"kind=json,path={out}", "--disable-console"]


def parse_report(path: Path) -> tuple[dict, dict[str, str]]:
    """guidellm's JSON: (its figures for the run, prompt -> completion text)."""
    bench = json.loads(path.read_text())["benchmarks"][0]
    metrics = bench["metrics"]

    def stat(name: str, key: str) -> float:
        total = metrics[name]["total"]
        return float(total["mean"] if key == "mean" else total["percentiles"][key])

    figures = {"requests": bench["metrics"]["request_totals"]["successful"],
               "errors": bench["metrics"]["request_totals"]["errored"],
               "output_tokens_per_s": stat("output_tokens_per_second", "mean"),
               "requests_per_s": stat("requests_per_second", "mean"),
               "ttft_p50_ms": stat("time_to_first_token_ms", "p50"),
               "ttft_p99_ms": stat("time_to_first_token_ms", "p99"),
               "itl_p50_ms": stat("inter_token_latency_ms", "p50")}
    texts = {}
    for request in bench["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        texts[str(body.get("prompt"))] = request["output"]
    return figures, texts


def turn(args: argparse.Namespace, name: str, server: Server, concurrency: int, round_: int,
         workdir: Path) -> tuple[Turn, dict[str, str]]:
    """One guidellm run (py-spy on kvrecover's server when asked); the turn and its texts."""
    out = workdir / f"{name}-{concurrency}-{round_}.json"
    seed = 1000 * concurrency + round_
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    spy = profile = None
    if args.profile_dir and name == "kvrecover":
        profile = args.profile_dir / f"kvrecover-c{concurrency}-r{round_}.json"
        spy = subprocess.Popen([args.py_spy, "record", "--pid", str(server.proc.pid),
                                "--threads", "--idle", "--rate", "50", "--format", "speedscope",
                                "--output", str(profile)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cpu_before = server.cpu_seconds()
    try:
        code = run_bounded(guidellm_argv(args, server.url, concurrency, seed, out),
                           workdir / "guidellm.log", args.max_seconds + 180, env)
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
            try:
                spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()
    cpu_after = server.cpu_seconds()
    if profile is not None and profile.exists():
        print(format_breakdown(profile), flush=True)
    if code != 0 or not out.exists():
        tail = (workdir / "guidellm.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"guidellm against {name} at {concurrency} failed ({code}):\n{tail}")
    figures, texts = parse_report(out)
    cpu = None if cpu_before is None or cpu_after is None else round(cpu_after - cpu_before, 1)
    return Turn(name, concurrency, round_, server_cpu_s=cpu,
                load_average=round(os.getloadavg()[0], 1), **figures), texts


def span(values: list[float], digits: int = 1) -> str:
    low, high = min(values), max(values)
    return f"{low:.{digits}f}" if low == high else f"{low:.{digits}f}-{high:.{digits}f}"


def both(pairs: list[tuple[Turn, Turn]], field: str, digits: int = 1,
         ratio: bool = False) -> str:
    """'ours / theirs' ranges of `field` over the (kvrecover, vLLM) pairs, with the
    range of the paired ratios when asked."""
    ours = [getattr(a, field) for a, _ in pairs]
    theirs = [getattr(b, field) for _, b in pairs]
    text = f"{span(ours, digits)} / {span(theirs, digits)}"
    if ratio:
        text += f" ({span([x / y for x, y in zip(ours, theirs)], 2)}x)"
    return text


def print_turns(turns: list[Turn]) -> None:
    print("\n| engine | N | round | requests | out tok/s | req/s | TTFT p50 / p99 ms | "
          "ITL p50 ms | server CPU s | load avg |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in turns:
        print(f"| {t.engine} | {t.concurrency} | {t.round} | {t.requests}"
              f"{f' ({t.errors} errors)' if t.errors else ''} | {t.output_tokens_per_s:.1f} | "
              f"{t.requests_per_s:.2f} | {t.ttft_p50_ms:.0f} / {t.ttft_p99_ms:.0f} | "
              f"{t.itl_p50_ms:.1f} | {t.server_cpu_s} | {t.load_average} |")


def print_side_by_side(turns: list[Turn], same_text: dict[int, list[int]]) -> None:
    """Per N: each engine's range over rounds and the range of the paired ratios."""
    print("\n| N | out tok/s kvr / vLLM (ratio) | TTFT p50 ms kvr / vLLM (ratio) | "
          "TTFT p99 ms kvr / vLLM | ITL p50 ms kvr / vLLM | req/s kvr / vLLM | same text |")
    print("|---:|---|---|---|---|---|---:|")
    for n in sorted({t.concurrency for t in turns}):
        ours = {t.round: t for t in turns if t.concurrency == n and t.engine == "kvrecover"}
        peer = {t.round: t for t in turns if t.concurrency == n and t.engine == "vllm"}
        rounds = sorted(set(ours) & set(peer))
        if not rounds:
            continue

        pairs = [(ours[r], peer[r]) for r in rounds]
        same, total = same_text.get(n, [0, 0])
        print(f"| {n} | {both(pairs, 'output_tokens_per_s', ratio=True)} | "
              f"{both(pairs, 'ttft_p50_ms', 0, ratio=True)} | {both(pairs, 'ttft_p99_ms', 0)} | "
              f"{both(pairs, 'itl_p50_ms')} | {both(pairs, 'requests_per_s', 2)} | "
              f"{same}/{total} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.environ.get("PEER_MODEL"),
                        help="Hugging Face folder both engines serve (default: $PEER_MODEL)")
    parser.add_argument("--vllm", default=os.environ.get("PEER_PY"),
                        help="the vLLM venv's python or its `vllm` command (default: $PEER_PY)")
    parser.add_argument("--guidellm", default=str(Path(os.environ.get(
        "CLIENTS_BIN", PEER_DIR / "clients-venv" / "bin")) / "guidellm"))
    parser.add_argument("--engines", nargs="+", default=["kvrecover", "vllm"],
                        choices=["kvrecover", "vllm"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each server")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--max-seconds", type=int, default=240, help="per guidellm run")
    parser.add_argument("--server-args", default="", help="more `kvrecover serve` flags")
    parser.add_argument("--vllm-args", default="", help="more vLLM server flags")
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="py-spy kvrecover's server during its turns, profiles here")
    parser.add_argument("--py-spy", default=str(PEER_DIR / "tools-venv" / "bin" / "py-spy"))
    parser.add_argument("--json", type=Path, default=None, help="also write the turns here")
    args = parser.parse_args()
    if not args.model or not Path(args.model).is_dir():
        parser.error("--model (or $PEER_MODEL) must name a model folder; "
                     "../shared/peer/setup_vllm.sh makes one")
    if "vllm" in args.engines and not args.vllm:
        parser.error("vLLM needs --vllm (or $PEER_PY): ../shared/peer/setup_vllm.sh")
    if not Path(args.guidellm).exists():
        parser.error(f"no guidellm at {args.guidellm}: run ../shared/peer/setup_clients.sh")
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    stop_on_signals()
    workdir = Path(tempfile.mkdtemp(prefix="bench-guidellm-"))
    argvs = {"kvrecover": (kvrecover_argv(args.model, MODEL_NAME, args.dtype, "cpu",
                                          args.server_args), engine_env(args.threads)),
             "vllm": (vllm_argv(args.vllm or "", args.model, MODEL_NAME, args.dtype,
                                args.vllm_args), vllm_env(args.threads))}
    servers: dict[str, Server] = {}
    turns: list[Turn] = []
    same_text: dict[int, list[int]] = {}
    try:
        warm = Prompts(Path(args.model), 4, 150)
        for name in args.engines:  # one at a time: neither starts while the other does
            argv, env = argvs[name]
            servers[name] = Server(argv, workdir / f"{name}.log", env).wait()
            warm_up(servers[name], MODEL_NAME, warm, args.output_tokens)
        for n in args.concurrency:
            for round_ in range(args.repeats):
                order = args.engines if round_ % 2 == 0 else args.engines[::-1]
                texts = {}
                for name in order:
                    row, texts[name] = turn(args, name, servers[name], n, round_, workdir)
                    turns.append(row)
                    print(json.dumps(asdict(row)), flush=True)
                if len(texts) == 2:
                    a, b = texts["kvrecover"], texts["vllm"]
                    count = same_text.setdefault(n, [0, 0])
                    count[0] += sum(a[p] == b.get(p) for p in a)
                    count[1] += len(a)
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print_turns(turns)
    print_side_by_side(turns, same_text)
    if args.json:
        args.json.write_text(json.dumps([asdict(t) for t in turns], indent=1))
    return 0 if all(t.errors == 0 for t in turns) else 1


if __name__ == "__main__":
    sys.exit(main())

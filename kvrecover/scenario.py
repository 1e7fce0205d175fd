"""The reference scenario: prefill, store KV, decode with and without load failures.

Each phase is a function that a separate process runs (`kvrecover prefill`,
`kvrecover decode ...`); `run_scenario` starts the four phases as processes in
a work folder, checks that the baseline really loaded KV and that each failure
phase really failed and recovered, and compares the recovered outputs with the
baseline byte for byte. The KV goes to a folder in the work folder, or, with a
`store` URL such as `redis://127.0.0.1:6379/0`, to Redis through the RedisConnector.
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvrecover.config import EngineArgs, KVTransferConfig
from kvrecover.options import option, to_argv, validate
from kvrecover.sampling import SamplingParams

STORAGE_DIR = "local_storage"
PREFILL_OUTPUT = "prefill_output.txt"
DECODE_OUTPUT = "decode_output.txt"
SYNC_RECOVERED_OUTPUT = "sync_decode_recovered_output.txt"
ASYNC_RECOVERED_OUTPUT = "async_decode_recovered_output.txt"
SEPARATOR = "-" * 30
# Reference settings: chunked prefill in 64-token steps, up to 16 sequences.
MAX_NUM_BATCHED_TOKENS = 64
MAX_NUM_SEQS = 16
DECODE_MAX_TOKENS = 10


def _as_path(value: Any) -> Any:
    return Path(value) if isinstance(value, (str, os.PathLike)) else value


@dataclass
class ScenarioArgs:
    """The flags of `kvrecover prefill`, `decode` and `scenario` besides the engine's."""

    workdir: Path = option(
        Path("kvrecover_scenario"), "folder for the KV store and the output files", Path,
        convert=_as_path, metavar="DIR")
    store: str | None = option(
        None, "keep the KV in Redis (redis://[:password@]host:port/db, unix:///path.sock, or "
        "a cluster: redis+cluster://host:port[,host:port...]) instead of "
        "<workdir>/local_storage", str, nullable=True, metavar="URL")

    def __post_init__(self) -> None:
        validate(self)


@dataclass
class DecodeArgs:
    """The flags of `kvrecover decode` (phases 2-4) besides the scenario's."""

    simulate_failure: bool = option(False, "make every block of the first KV load fail", bool)
    async_load: bool = option(False, "load KV asynchronously", bool)

    def __post_init__(self) -> None:
        validate(self)


def reference_prompts(long_words: int = 1000, short_words: int = 500) -> list[str]:
    """Four prompts: two share a `long_words`-word prefix, two a `short_words`-word one."""
    long_prefix = "Hi " * long_words
    short_prefix = "Hey " * short_words
    return [
        long_prefix + "Hello, my name is",
        long_prefix + "The capital of France is",
        short_prefix + "Your name is",
        short_prefix + "The capital of China is",
    ]


def store_extra(workdir: Path, store: str | None) -> tuple[str, dict]:
    """The connector and extra config that keep the scenario's KV in `store`
    (a Redis URL) or, when it is None, in the work folder."""
    if store is None:
        return "SharedStorageConnector", {"shared_storage_path": str(workdir / STORAGE_DIR)}
    return "RedisConnector", {"url": store}


def _make_llm(args: EngineArgs, transfer: KVTransferConfig, **overrides):
    from kvrecover.llm import LLM

    return LLM.from_engine_args(replace(args, kv_transfer_config=transfer, **overrides))


def run_prefill(args: EngineArgs, workdir: Path, store: str | None = None) -> list[str]:
    """Phase 1: compute the prompts' KV, store it, write prompt + first token per line (JSON)."""
    connector, extra = store_extra(workdir, store)
    transfer = KVTransferConfig(connector, "kv_both", extra)
    with _make_llm(args, transfer) as llm:
        outputs = llm.generate(reference_prompts(), SamplingParams(temperature=0, max_tokens=1))
        stats = llm.stats
    new_prompts = [o.prompt + o.outputs[0].text for o in outputs]
    with open(workdir / PREFILL_OUTPUT, "w", encoding="utf-8") as handle:
        for prompt in new_prompts:
            handle.write(json.dumps(prompt) + "\n")  # JSON keeps a generated newline on its line
    _write_phase_stats(workdir, "prefill", stats)
    return new_prompts


def read_prefill_output(workdir: Path) -> list[str]:
    """The prompts a prefill phase wrote."""
    path = workdir / PREFILL_OUTPUT
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `kvrecover prefill` first")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def decode_output_name(simulate_failure: bool, async_load: bool) -> str:
    """File name of a decode phase's output."""
    if not simulate_failure:
        return DECODE_OUTPUT
    return ASYNC_RECOVERED_OUTPUT if async_load else SYNC_RECOVERED_OUTPUT


def run_decode(
    args: EngineArgs, workdir: Path, simulate_failure: bool, async_load: bool,
    store: str | None = None,
) -> Path:
    """Phases 2-4: decode the stored prompts, optionally with the first load failing.

    Batching follows the reference settings unless `args` sets it."""
    prompts = read_prefill_output(workdir)
    connector, extra = store_extra(workdir, store)
    extra["async_load"] = async_load
    if simulate_failure:
        extra["faults"] = [{"requests": "first", "blocks": "all", "kind": "missing"}]
        extra["inner_connector"] = connector
        transfer = KVTransferConfig("FaultInjectionConnector", "kv_both", extra)
    else:
        transfer = KVTransferConfig(connector, "kv_both", extra)
    batching = dict(
        max_num_batched_tokens=args.max_num_batched_tokens or MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=args.max_num_seqs or MAX_NUM_SEQS,
    )
    params = SamplingParams(temperature=0, top_p=0.95, max_tokens=DECODE_MAX_TOKENS)
    with _make_llm(args, transfer, **batching) as llm:
        outputs = llm.generate(prompts, params)
        stats = llm.stats
    out_path = workdir / decode_output_name(simulate_failure, async_load)
    with open(out_path, "w", encoding="utf-8") as handle:
        for output in outputs:
            completion = output.outputs[0]
            text = (
                f"Prompt: {output.prompt!r}\nGenerated text: {completion.text!r}\n"
                f"Token ids: {completion.token_ids}\n{SEPARATOR}\n"
            )
            handle.write(text)
            shown = output.prompt if len(output.prompt) <= 60 else "..." + output.prompt[-57:]
            print(f"{shown!r} -> {completion.text!r}")
    _write_phase_stats(workdir, out_path.stem, stats)
    return out_path


def _write_phase_stats(workdir: Path, phase: str, stats: dict[str, int]) -> None:
    (workdir / f"{phase}.stats.json").write_text(json.dumps(stats, indent=1))


PHASES = (
    ("prefill", ["prefill"]),
    ("decode (baseline)", ["decode", *to_argv(DecodeArgs())]),
    ("decode, sync failure", ["decode", *to_argv(DecodeArgs(simulate_failure=True))]),
    ("decode, async failure",
     ["decode", *to_argv(DecodeArgs(simulate_failure=True, async_load=True))]),
)


def run_scenario(args: EngineArgs, workdir: Path, store: str | None = None) -> int:
    """Run the four phases as processes, compare, print a table; returns the exit code."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in (PREFILL_OUTPUT, DECODE_OUTPUT, SYNC_RECOVERED_OUTPUT, ASYNC_RECOVERED_OUTPUT):
        (workdir / name).unlink(missing_ok=True)
    _remove_tree(workdir / STORAGE_DIR)
    timings = []
    engine_flags = args.to_argv()
    for label, phase_args in PHASES:
        print(f"==> {label}", flush=True)
        started = time.perf_counter()
        command = [sys.executable, "-m", "kvrecover", *phase_args, "--workdir", str(workdir),
                   *engine_flags, *to_argv(ScenarioArgs(workdir, store), skip=("workdir",))]
        result = subprocess.run(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        timings.append(time.perf_counter() - started)
        if result.returncode != 0:
            print(f"phase '{label}' failed with exit code {result.returncode}", file=sys.stderr)
            return 1
    _print_table(workdir, timings)
    problem = _check_phases(workdir)
    if problem is not None:
        print(f"FAILED: {problem}")
        return 1
    baseline = (workdir / DECODE_OUTPUT).read_text(encoding="utf-8")
    for name, mode in ((SYNC_RECOVERED_OUTPUT, "sync"), (ASYNC_RECOVERED_OUTPUT, "async")):
        recovered = (workdir / name).read_text(encoding="utf-8")
        if recovered != baseline:
            print(f"FAILED: outputs differ: {mode} recovery did not reproduce the baseline")
            sys.stdout.writelines(difflib.unified_diff(
                baseline.splitlines(keepends=True), recovered.splitlines(keepends=True),
                fromfile=DECODE_OUTPUT, tofile=name,
            ))
            return 1
    print("SUCCESS: sync and async recovered outputs match the baseline byte for byte.")
    return 0


def _check_phases(workdir: Path) -> str | None:
    """Why the run proves nothing, or None: the baseline must really have loaded KV,
    and each failure phase must really have hit failed blocks and recovered."""
    baseline = _read_stats(workdir, Path(DECODE_OUTPUT).stem)
    if baseline["prompt_tokens_external"] <= 0:
        return (f"the baseline decode loaded no KV (0 tokens) from {workdir / STORAGE_DIR}; "
                "the prefill phase stored nothing usable there, so recovery was not tested")
    for name, mode in ((SYNC_RECOVERED_OUTPUT, "sync"), (ASYNC_RECOVERED_OUTPUT, "async")):
        stats = _read_stats(workdir, Path(name).stem)
        if stats["kv_load_failed_blocks"] <= 0 or stats["kv_load_recovered_requests"] <= 0:
            return (f"the {mode} failure phase hit {stats['kv_load_failed_blocks']} invalid "
                    f"blocks and recovered {stats['kv_load_recovered_requests']} requests; "
                    "both must be > 0 for the comparison to mean anything")
    return None


def _read_stats(workdir: Path, stem: str) -> dict[str, int]:
    return json.loads((workdir / f"{stem}.stats.json").read_text())


def _print_table(workdir: Path, timings: list[float]) -> None:
    stems = ["prefill", Path(DECODE_OUTPUT).stem, Path(SYNC_RECOVERED_OUTPUT).stem,
             Path(ASYNC_RECOVERED_OUTPUT).stem]
    print(f"\n{'phase':<24}{'wall s':>8}{'recovered':>11}{'invalid blocks':>16}"
          f"{'recomputed':>12}{'loaded tok':>12}")
    for (label, _), stem, seconds in zip(PHASES, stems, timings):
        stats = _read_stats(workdir, stem)
        print(f"{label:<24}{seconds:>8.1f}{stats['kv_load_recovered_requests']:>11}"
              f"{stats['kv_load_failed_blocks']:>16}{stats['kv_load_recomputed_tokens']:>12}"
              f"{stats['prompt_tokens_external']:>12}")
    print()


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)

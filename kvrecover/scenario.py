"""The reference scenario: prefill, store KV, decode with and without load failures.

Each phase is a function that a separate process runs (`kvrecover prefill`,
`kvrecover decode ...`); `run_scenario` starts the four phases as processes in
a work folder and compares the recovered outputs with the baseline byte for byte.
The KV goes to a folder in the work folder, or, with a `store` URL such as
`redis://127.0.0.1:6379/0`, to Redis through the RedisConnector.
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvrecover.config import KVTransferConfig
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


@dataclass
class EngineOptions:
    """Engine settings shared by every phase."""

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    batch_invariant: bool = False

    def to_args(self) -> list[str]:
        args = ["--device", self.device, "--dtype", self.dtype]
        if self.model:
            args += ["--model", self.model]
        if self.batch_invariant:
            args.append("--batch-invariant")
        return args


def store_extra(workdir: Path, store: str | None) -> tuple[str, dict]:
    """The connector and extra config that keep the scenario's KV in `store`
    (a Redis URL) or, when it is None, in the work folder."""
    if store is None:
        return "SharedStorageConnector", {"shared_storage_path": str(workdir / STORAGE_DIR)}
    return "RedisConnector", {"url": store}


def _make_llm(options: EngineOptions, transfer: KVTransferConfig, **overrides):
    from kvrecover.llm import LLM

    return LLM(
        options.model,
        device=options.device,
        dtype=options.dtype,
        batch_invariant=options.batch_invariant,
        kv_transfer_config=transfer,
        **overrides,
    )


def run_prefill(options: EngineOptions, workdir: Path, store: str | None = None) -> list[str]:
    """Phase 1: compute the prompts' KV, store it, write prompt + first token per line (JSON)."""
    connector, extra = store_extra(workdir, store)
    transfer = KVTransferConfig(connector, "kv_both", extra)
    llm = _make_llm(options, transfer)
    outputs = llm.generate(reference_prompts(), SamplingParams(temperature=0, max_tokens=1))
    new_prompts = [o.prompt + o.outputs[0].text for o in outputs]
    with open(workdir / PREFILL_OUTPUT, "w", encoding="utf-8") as handle:
        for prompt in new_prompts:
            handle.write(json.dumps(prompt) + "\n")  # JSON keeps a generated newline on its line
    _write_phase_stats(workdir, "prefill", llm.stats)
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
    options: EngineOptions, workdir: Path, simulate_failure: bool, async_load: bool,
    store: str | None = None,
) -> Path:
    """Phases 2-4: decode the stored prompts, optionally with the first load failing."""
    prompts = read_prefill_output(workdir)
    connector, extra = store_extra(workdir, store)
    extra["async_load"] = async_load
    if simulate_failure:
        extra["faults"] = [{"requests": "first", "blocks": "all", "kind": "missing"}]
        extra["inner_connector"] = connector
        transfer = KVTransferConfig("FaultInjectionConnector", "kv_both", extra)
    else:
        transfer = KVTransferConfig(connector, "kv_both", extra)
    llm = _make_llm(
        options, transfer,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS,
    )
    outputs = llm.generate(prompts, SamplingParams(temperature=0, top_p=0.95, max_tokens=DECODE_MAX_TOKENS))
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
    _write_phase_stats(workdir, out_path.stem, llm.stats)
    return out_path


def _write_phase_stats(workdir: Path, phase: str, stats: dict[str, int]) -> None:
    (workdir / f"{phase}.stats.json").write_text(json.dumps(stats, indent=1))


PHASES = (
    ("prefill", ["prefill"]),
    ("decode (baseline)", ["decode"]),
    ("decode, sync failure", ["decode", "--simulate-failure"]),
    ("decode, async failure", ["decode", "--simulate-failure", "--async-load"]),
)


def run_scenario(options: EngineOptions, workdir: Path, store: str | None = None) -> int:
    """Run the four phases as processes, compare, print a table; returns the exit code."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in (PREFILL_OUTPUT, DECODE_OUTPUT, SYNC_RECOVERED_OUTPUT, ASYNC_RECOVERED_OUTPUT):
        (workdir / name).unlink(missing_ok=True)
    _remove_tree(workdir / STORAGE_DIR)
    timings = []
    for label, args in PHASES:
        print(f"==> {label}", flush=True)
        started = time.perf_counter()
        command = [sys.executable, "-m", "kvrecover", *args, "--workdir", str(workdir),
                   *options.to_args(), *(["--store", store] if store else [])]
        result = subprocess.run(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        timings.append(time.perf_counter() - started)
        if result.returncode != 0:
            print(f"phase '{label}' failed with exit code {result.returncode}", file=sys.stderr)
            return 1
    _print_table(workdir, timings)
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


def _print_table(workdir: Path, timings: list[float]) -> None:
    stems = ["prefill", Path(DECODE_OUTPUT).stem, Path(SYNC_RECOVERED_OUTPUT).stem,
             Path(ASYNC_RECOVERED_OUTPUT).stem]
    print(f"\n{'phase':<24}{'wall s':>8}{'recovered':>11}{'invalid blocks':>16}"
          f"{'recomputed':>12}{'loaded tok':>12}")
    for (label, _), stem, seconds in zip(PHASES, stems, timings):
        stats = json.loads((workdir / f"{stem}.stats.json").read_text())
        print(f"{label:<24}{seconds:>8.1f}{stats['kv_load_recovered_requests']:>11}"
              f"{stats['kv_load_failed_blocks']:>16}{stats['kv_load_recomputed_tokens']:>12}"
              f"{stats['prompt_tokens_external']:>12}")
    print()


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)

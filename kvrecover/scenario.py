"""The reference scenario: prefill, store KV, decode with and without load failures.

Each phase is a function that a separate process runs (`kvrecover prefill`,
`kvrecover decode ...`); `run_scenario` starts the four phases as processes in
a work folder, checks that the baseline really loaded KV and that each failure
phase really failed and recovered, and compares the recovered outputs with the
baseline byte for byte. The KV goes to a folder in the work folder, or, with a
`store` URL such as `redis://127.0.0.1:6379/0`, to Redis through the RedisConnector.
With `nixl://host:port` nothing is stored: each decode phase pulls the KV point to point
from a prefill process of its own (the NixlConnector, whose side channel listens on that
port), which keeps the prompts' blocks and serves the pull until the phase ends.
"""

from __future__ import annotations

import difflib
import json
import os
import select
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
NIXL_REFERENCES = "nixl_references.json"  # a NIXL prefill's kv_transfer_params, per prompt
NIXL_SCHEME = "nixl://"
NIXL_SERVE_S = 600.0  # a NIXL prefill serves its blocks at most this long
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
        "<workdir>/local_storage; nixl://host:port pulls it point to point from a prefill "
        "process over NIXL instead", str, nullable=True, metavar="URL")

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


def nixl_address(store: str | None) -> tuple[str, int] | None:
    """(host, port) of a `nixl://host:port` store, None for any other store."""
    if store is None or not store.startswith(NIXL_SCHEME):
        return None
    host, _, port = store[len(NIXL_SCHEME):].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--store {store!r}: a NIXL address is nixl://host:port")
    return host, int(port)


def store_extra(workdir: Path, store: str | None) -> tuple[str, dict]:
    """The connector and extra config that keep the scenario's KV in `store`
    (a Redis URL, or a NIXL producer's address) or, when it is None, in the work folder."""
    if store is None:
        return "SharedStorageConnector", {"shared_storage_path": str(workdir / STORAGE_DIR)}
    address = nixl_address(store)
    if address is not None:
        return "NixlConnector", {"side_channel_host": address[0],
                                 "side_channel_port": address[1]}
    return "RedisConnector", {"url": store}


def _make_llm(args: EngineArgs, transfer: KVTransferConfig, **overrides):
    from kvrecover.llm import LLM

    return LLM.from_engine_args(replace(args, kv_transfer_config=transfer, **overrides))


def run_prefill(args: EngineArgs, workdir: Path, store: str | None = None) -> list[str]:
    """Phase 1: compute the prompts' KV, store it, write prompt + first token per line (JSON)."""
    connector, extra = store_extra(workdir, store)
    nixl = nixl_address(store) is not None
    transfer = KVTransferConfig(connector, "kv_producer" if nixl else "kv_both", extra)
    with _make_llm(args, transfer) as llm:
        outputs = llm.generate(reference_prompts(), SamplingParams(temperature=0, max_tokens=1))
        stats = llm.stats
        new_prompts = [o.prompt + o.outputs[0].text for o in outputs]
        with open(workdir / PREFILL_OUTPUT, "w", encoding="utf-8") as handle:
            for prompt in new_prompts:
                handle.write(json.dumps(prompt) + "\n")  # JSON keeps a generated newline
        _write_phase_stats(workdir, "prefill", stats)
        if nixl:
            references = [o.kv_transfer_params for o in outputs]
            (workdir / NIXL_REFERENCES).write_text(json.dumps(references))
            _serve_pulls(llm)
    return new_prompts


def _serve_pulls(llm) -> None:
    """A NIXL prefill keeps stepping, serving pulls and releases, until its standard
    input closes (the scenario ends the phase) or `NIXL_SERVE_S` passes."""
    print("serving the prompts' KV blocks over NIXL", flush=True)
    engine, end = llm.engine, time.monotonic() + NIXL_SERVE_S
    while time.monotonic() < end:
        if engine.has_unfinished():
            engine.step()
        # Idle but for kept blocks: poll for pulls every 10 ms, not in a busy loop.
        idle = not engine.has_unfinished() or engine.awaits_only_sends()
        if select.select([sys.stdin], [], [], 0.01 if idle else 0)[0] \
                and not sys.stdin.readline():
            return


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
    nixl = nixl_address(store) is not None
    role = "kv_consumer" if nixl else "kv_both"
    extra["async_load"] = async_load
    if simulate_failure:
        extra["faults"] = [{"requests": "first", "blocks": "all", "kind": "missing"}]
        extra["inner_connector"] = connector
        transfer = KVTransferConfig("FaultInjectionConnector", role, extra)
    else:
        transfer = KVTransferConfig(connector, role, extra)
    batching = dict(
        max_num_batched_tokens=args.max_num_batched_tokens or MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=args.max_num_seqs or MAX_NUM_SEQS,
    )
    params = SamplingParams(temperature=0, top_p=0.95, max_tokens=DECODE_MAX_TOKENS)
    each: list[SamplingParams] | SamplingParams = params
    if nixl:  # each prompt pulls with the reference its prefill handed out
        references = json.loads((workdir / NIXL_REFERENCES).read_text())
        each = [replace(params, kv_transfer_params=r) for r in references]
    with _make_llm(args, transfer, **batching) as llm:
        outputs = llm.generate(prompts, each)
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
    timings: list[float] = []
    nixl = nixl_address(store) is not None
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    common = ["--workdir", str(workdir), *args.to_argv(),
              *to_argv(ScenarioArgs(workdir, store), skip=("workdir",))]
    for label, phase_args in PHASES:
        command = [sys.executable, "-m", "kvrecover", *phase_args, *common]
        if nixl and phase_args[0] == "prefill":
            continue  # each decode phase pulls from a prefill process of its own
        producer = None
        if nixl:  # the prefill that serves this phase's pulls, until the phase ends
            print("==> prefill (serving over NIXL)", flush=True)
            (workdir / NIXL_REFERENCES).unlink(missing_ok=True)
            started = time.perf_counter()
            producer = _start_nixl_prefill(
                [sys.executable, "-m", "kvrecover", "prefill", *common], workdir, env)
            if producer is None:
                return 1
            if not timings:
                timings.append(time.perf_counter() - started)
        print(f"==> {label}", flush=True)
        started = time.perf_counter()
        try:
            result = subprocess.run(command, env=env)
        finally:
            if producer is not None:
                _stop(producer)
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


def _start_nixl_prefill(command: list[str], workdir: Path,
                        env: dict[str, str]) -> subprocess.Popen | None:
    """Start a NIXL prefill and wait (bounded) until it handed out its references; None,
    having said why, when it failed."""
    producer = subprocess.Popen(command, env=env, stdin=subprocess.PIPE)
    end = time.monotonic() + NIXL_SERVE_S
    while not (workdir / NIXL_REFERENCES).is_file():
        if producer.poll() is not None or time.monotonic() > end:
            print(f"the NIXL prefill ended with exit code {producer.poll()} before it served "
                  "its KV", file=sys.stderr)
            _stop(producer)
            return None
        time.sleep(0.05)
    return producer


def _stop(producer: subprocess.Popen) -> None:
    """End a NIXL prefill: close its standard input, then kill it if it lingers."""
    try:
        if producer.stdin is not None:
            producer.stdin.close()
        producer.wait(timeout=30)
    except subprocess.TimeoutExpired:
        producer.kill()
        producer.wait(timeout=10)


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

"""The `kvrecover` command line.

Engine flags come from `EngineArgs` (`add_engine_flags`), sampling flags from
`SamplingParams`, the scenario's from `scenario.ScenarioArgs` / `DecodeArgs`:
each option is declared once (`kvrecover.options`), with its help and validation.
The serving commands (`serve`, `proxy`, `serve-demo`) import their HTTP stack only
when they run, so `kvrecover --help` stays fast. Errors the user can fix (bad values, missing files, OS errors such as a
read-only folder) print one `kvrecover: error: ...` line and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from kvrecover.config import EngineArgs, add_engine_flags, engine_args_from_namespace
from kvrecover.default_model import DefaultModelError
from kvrecover.entrypoints.cli.proxy import add_proxy_parser, run_proxy
from kvrecover.entrypoints.cli.serve import add_serve_parser, run_serve
from kvrecover.entrypoints.cli.serve_demo import add_demo_parser, run_demo
from kvrecover.options import add_flags, add_record_flags, from_namespace
from kvrecover.sampling import SamplingParams
from kvrecover.scenario import DecodeArgs, ScenarioArgs

DESCRIPTION = """\
kvrecover: LLM inference for disaggregated serving that recovers exactly from
KV cache load failures. Without --model, every command uses the built-in
default model (SmolLM2-135M-Instruct, converted on first use)."""

# `kvrecover generate` samples greedily by default, unlike SamplingParams().
GENERATE_DEFAULTS = {"max_tokens": 32, "temperature": 0.0}
# The scenario commands build their own connector settings.
SCENARIO_SKIPPED_FLAGS = ("kv_transfer_config",)


def _scenario_flags(parser: argparse.ArgumentParser, *records: type) -> None:
    add_record_flags(parser, EngineArgs, ScenarioArgs, *records, skip=SCENARIO_SKIPPED_FLAGS)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="kvrecover", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine events")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser("generate", help="generate a continuation of one prompt")
    generate.add_argument("--prompt", required=True, help="the prompt text")
    add_flags(generate, SamplingParams, only=("max_tokens", "temperature", "top_p", "top_k"),
              defaults=GENERATE_DEFAULTS)
    add_engine_flags(generate)

    prefill = commands.add_parser(
        "prefill", help="scenario phase 1: compute and store the KV of the reference prompts")
    _scenario_flags(prefill)

    decode = commands.add_parser(
        "decode", help="scenario phases 2-4: decode the stored prompts, loading their KV")
    _scenario_flags(decode, DecodeArgs)

    scenario = commands.add_parser(
        "scenario", help="run prefill, decode, and decode with sync and async load failures "
                         "as separate processes; exit 1 unless all outputs match")
    _scenario_flags(scenario)

    storage = commands.add_parser("storage", help="inspect a KV block store")
    storage_commands = storage.add_subparsers(dest="storage_command", required=True,
                                              metavar="SUBCOMMAND")
    verify = storage_commands.add_parser(
        "verify", help="check every stored block; exit 1 if any is bad")
    verify.add_argument("path", type=Path, help="the store folder (shared_storage_path)")
    verify.add_argument("--fix", action="store_true", help="delete the bad entries")

    add_serve_parser(commands)
    add_proxy_parser(commands)
    add_demo_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvrecover` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return _dispatch(args)
    except (ValueError, OSError, DefaultModelError) as error:
        print(f"kvrecover: error: {describe_error(error)}", file=sys.stderr)
        return 2


def describe_error(error: BaseException) -> str:
    """One line for the user: OS errors as "what: path", others as their message."""
    if isinstance(error, OSError) and error.strerror:
        where = " -> ".join(str(p) for p in (error.filename, error.filename2) if p is not None)
        return f"{error.strerror}: {where}" if where else error.strerror
    return " ".join(str(error).split()) or type(error).__name__


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "storage":
        return _storage_verify(args.path, args.fix)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "proxy":
        return run_proxy(args)
    if args.command == "serve-demo":
        return run_demo(args)
    engine_args = engine_args_from_namespace(args)
    if args.command == "generate":
        return _generate(args, engine_args)
    from kvrecover import scenario

    where = from_namespace(ScenarioArgs, args)
    if where.workdir.exists() and not where.workdir.is_dir():
        raise ValueError(f"--workdir {where.workdir} is not a folder")
    if args.command == "prefill":
        where.workdir.mkdir(parents=True, exist_ok=True)
        for prompt in scenario.run_prefill(engine_args, where.workdir, where.store):
            print(repr("..." + prompt[-57:]))
        return 0
    if args.command == "decode":
        decode = from_namespace(DecodeArgs, args)
        scenario.run_decode(engine_args, where.workdir, decode.simulate_failure,
                            decode.async_load, where.store)
        return 0
    return scenario.run_scenario(engine_args, where.workdir, where.store)


def _generate(args: argparse.Namespace, engine_args) -> int:
    from kvrecover import LLM

    params = from_namespace(SamplingParams, args, **GENERATE_DEFAULTS)
    with LLM.from_engine_args(engine_args) as llm:
        output = llm.generate([args.prompt], params)[0]
    if output.outputs[0].finish_reason == "error":
        raise ValueError(f"generation failed: {output.error}")
    print(args.prompt + output.outputs[0].text)
    return 0


def _storage_verify(path: Path, fix: bool) -> int:
    from kvrecover.kv_transfer.stores.storage_check import remove_entry, scan_store

    if not path.is_dir():
        raise ValueError(f"{path} is not a folder")
    good = bad = 0
    for report in scan_store(path):
        if report.problem is None:
            good += 1
            continue
        bad += 1
        action = "removed" if fix else "bad"
        print(f"{action}: {report.path}: {report.problem}")
        if fix:
            remove_entry(report.path)
    print(f"{good} good, {bad} bad entries under {path}")
    return 1 if bad and not fix else 0


if __name__ == "__main__":
    sys.exit(main())

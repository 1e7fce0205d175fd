"""The `kvrecover` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from kvrecover.default_model import DefaultModelError

DESCRIPTION = """\
kvrecover: LLM inference for disaggregated serving that recovers exactly from
KV cache load failures. Without --model, every command uses the built-in
default model (SmolLM2-135M-Instruct, converted on first use)."""


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="local Hugging Face checkpoint folder (default: built-in model)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default: auto)")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto = float32 on CPU, bf16 on GPU")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="numerics independent of batch composition (exact recovery on GPU)")


def _scenario_flags(parser: argparse.ArgumentParser) -> None:
    _engine_flags(parser)
    parser.add_argument("--workdir", type=Path, default=Path("kvrecover_scenario"),
                        help="folder for the KV store and the output files "
                             "(default: ./kvrecover_scenario)")
    parser.add_argument("--store", default=None, metavar="URL",
                        help="keep the KV in Redis (redis://[:password@]host:port/db, "
                             "unix:///path.sock) instead of <workdir>/local_storage")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="kvrecover", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine events")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser("generate", help="generate a continuation of one prompt")
    _engine_flags(generate)
    generate.add_argument("--prompt", required=True, help="the prompt text")
    generate.add_argument("--max-tokens", type=int, default=32, help="new tokens (default: 32)")
    generate.add_argument("--temperature", type=float, default=0.0,
                          help="0 is greedy (default: 0)")
    generate.add_argument("--seed", type=int, default=None, help="sampling seed")

    prefill = commands.add_parser(
        "prefill", help="scenario phase 1: compute and store the KV of the reference prompts")
    _scenario_flags(prefill)

    decode = commands.add_parser(
        "decode", help="scenario phases 2-4: decode the stored prompts, loading their KV")
    _scenario_flags(decode)
    decode.add_argument("--simulate-failure", action="store_true",
                        help="make every block of the first KV load fail")
    decode.add_argument("--async-load", action="store_true", help="load KV asynchronously")

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

    from kvrecover.entrypoints.commands import add_serving_parsers

    add_serving_parsers(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvrecover` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return _dispatch(args)
    except (ValueError, FileNotFoundError, DefaultModelError) as error:
        print(f"kvrecover: error: {error}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "storage":
        return _storage_verify(args.path, args.fix)
    if args.command in ("serve", "proxy", "serve-demo"):
        from kvrecover.entrypoints.commands import run_serving_command

        return run_serving_command(args)
    from kvrecover.scenario import EngineOptions

    options = EngineOptions(args.model, args.device, args.dtype, args.batch_invariant)
    if args.command == "generate":
        return _generate(args, options)
    from kvrecover import scenario

    if args.command == "prefill":
        args.workdir.mkdir(parents=True, exist_ok=True)
        for prompt in scenario.run_prefill(options, args.workdir, args.store):
            print(repr("..." + prompt[-57:]))
        return 0
    if args.command == "decode":
        scenario.run_decode(options, args.workdir, args.simulate_failure, args.async_load,
                            args.store)
        return 0
    return scenario.run_scenario(options, args.workdir, args.store)


def _generate(args: argparse.Namespace, options) -> int:
    from kvrecover import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed)
    llm = LLM(options.model, device=options.device, dtype=options.dtype,
              batch_invariant=options.batch_invariant)
    output = llm.generate([args.prompt], params)[0]
    print(args.prompt + output.outputs[0].text)
    return 0


def _storage_verify(path: Path, fix: bool) -> int:
    from kvrecover.kv_transfer.storage_check import remove_entry, scan_store

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

"""Options declared once (kvrecover/options.py): one field drives the keyword, the flag
and the validation, and a record survives the trip to flags and back."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from kvrecover import LLM, EngineArgs, KVTransferConfig, SamplingParams
from kvrecover.config import add_engine_flags, engine_args_from_namespace
from kvrecover.options import flag_name, option, option_fields, validate


def parse(argv: list[str], **defaults) -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser, **defaults)
    return engine_args_from_namespace(parser.parse_args(argv), **defaults)


def test_every_engine_option_is_a_keyword_and_a_flag():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings} - {"-h"}
    names = [f.name for f, _ in option_fields(EngineArgs)]
    assert names == [f.name for f in dataclasses.fields(EngineArgs)]  # nothing undeclared
    assert flags == {flag_name(n) for n in names}
    signature = inspect.signature(LLM)
    assert list(signature.parameters) == names
    assert all(signature.parameters[f.name].default == f.default
               for f in dataclasses.fields(EngineArgs))
    assert all(f"`{name}`" in LLM.__doc__ for name in names)


def test_unset_flags_keep_the_defaults():
    assert parse([]) == EngineArgs()
    assert parse([], max_num_seqs=16) == EngineArgs(max_num_seqs=16)
    assert parse(["--max-num-seqs", "3"], max_num_seqs=16).max_num_seqs == 3


def test_a_record_round_trips_through_its_flags():
    transfer = KVTransferConfig("SharedStorageConnector", "kv_consumer",
                                {"shared_storage_path": "/kv", "async_load": True})
    args = EngineArgs(model="/models/x", dtype="bfloat16", device="cuda:1", block_size=32,
                      max_num_batched_tokens=512, max_num_seqs=8, max_model_len=4096,
                      enforce_eager=True, enable_prefix_caching=False, seed=42,
                      kv_transfer_config=transfer, num_kv_blocks=100, kv_cache_memory_gb=1.5,
                      gpu_memory_utilization=0.5, batch_invariant=True)
    assert parse(args.to_argv()) == args
    assert EngineArgs().to_argv() == []


@pytest.mark.parametrize("argv, message", [
    (["--block-size", "x"], "block_size must be an integer >= 1"),
    (["--kv-cache-memory-gb", "lots"], "kv_cache_memory_gb must be a finite number > 0"),
    (["--dtype", "float64"], "invalid choice"),
    (["--kv-transfer-config", "{"], "kv_transfer_config is not valid JSON"),
])
def test_unparsable_flags_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_new_option_is_one_line():
    @dataclasses.dataclass
    class Record:
        level: int = option(3, "how much", int, minimum=1, maximum=5)
        name: str | None = option(None, "who", str, nullable=True)

        def __post_init__(self):
            validate(self)

    parser = argparse.ArgumentParser()
    from kvrecover.options import add_flags, from_namespace, to_argv

    add_flags(parser, Record)
    assert from_namespace(Record, parser.parse_args(["--level", "5"])) == Record(level=5)
    assert to_argv(Record(level=4, name="x")) == ["--level", "4", "--name", "x"]
    with pytest.raises(ValueError, match=r"^level must be an integer >= 1 and <= 5, got 6$"):
        Record(level=6)


def test_sampling_params_keep_their_positional_order():
    params = SamplingParams(0.5, 0.9, 5, 7, 1, [3], True)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed,
            params.stop_token_ids, params.ignore_eos) == (0.5, 0.9, 5, 7, 1, [3], True)
    assert isinstance(SamplingParams(temperature=1).temperature, float)

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


# ----- one mechanism for every record -------------------------------------------------------
def connector_settings_classes() -> dict[str, type]:
    from kvrecover.kv_transfer.registry import _REGISTRY, connector_class

    # The package's own connectors (tests register others, without settings records).
    return {name: connector_class(KVTransferConfig(name)).settings_class
            for name, target in _REGISTRY.items() if target.startswith("kvrecover.")}


def every_record() -> list[type]:
    from kvrecover.config import SchedulerConfig
    from kvrecover.entrypoints.cli.listen import ListenArgs
    from kvrecover.entrypoints.cli.serve import ServeArgs
    from kvrecover.entrypoints.cli.serve_demo import DemoArgs
    from kvrecover.entrypoints.proxy.config import ProxyConfig
    from kvrecover.entrypoints.server.app import ServerConfig
    from kvrecover.kv_transfer.faults import FaultRule
    from kvrecover.kv_transfer.tiered.config import TierEntry
    from kvrecover.scenario import DecodeArgs, ScenarioArgs

    return [EngineArgs, SamplingParams, KVTransferConfig, SchedulerConfig, ScenarioArgs,
            DecodeArgs, DemoArgs, ListenArgs, ServeArgs, ServerConfig, ProxyConfig, FaultRule,
            TierEntry, *connector_settings_classes().values()]


def test_every_field_of_every_record_is_a_declared_option_with_help():
    for record in every_record():
        declared = [f.name for f, spec in option_fields(record) if spec.help.strip()]
        undeclared = [f.name for f in dataclasses.fields(record)
                      if f.name not in declared and f.name != "password"]  # Redis: env, not a key
        assert undeclared == [], (record.__name__, undeclared)


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    from kvrecover.cli import build_parser

    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    return commands.choices


@pytest.mark.parametrize("command, records, skipped", [
    ("generate", ["EngineArgs"], ()),
    ("prefill", ["EngineArgs", "ScenarioArgs"], ("kv_transfer_config",)),
    ("decode", ["EngineArgs", "ScenarioArgs", "DecodeArgs"], ("kv_transfer_config",)),
    ("scenario", ["EngineArgs", "ScenarioArgs"], ("kv_transfer_config",)),
    ("serve-demo", ["EngineArgs", "DemoArgs"], ("kv_transfer_config",)),
    ("serve", ["EngineArgs", "ListenArgs", "ServeArgs"], ()),
    ("proxy", ["ProxyConfig", "ListenArgs"], ()),
])
def test_every_command_line_option_has_its_flag_and_help(command, records, skipped):
    by_name = {r.__name__: r for r in every_record()}
    parser = subcommand_parsers()[command]
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    for record in records:
        for f, spec in option_fields(by_name[record]):
            if not spec.flag or f.name in skipped:
                continue
            assert helps.get(flag_name(f.name), "").startswith(spec.help), (command, f.name)
    assert {flag_name(n) for n in skipped}.isdisjoint(helps)


def test_a_misspelt_kv_transfer_config_key_says_did_you_mean():
    with pytest.raises(ValueError, match=r"unknown kv_transfer_config key "
                                         r"'kv_load_retry_limt'; did you mean "
                                         r"'kv_load_retry_limit'\?"):
        KVTransferConfig.from_dict({"kv_connector": "SharedStorageConnector",
                                    "kv_load_retry_limt": 2})


@pytest.mark.parametrize("connector, extra, near", [
    ("SharedStorageConnector", {"shared_storage_pth": "/kv"}, "shared_storage_path"),
    ("SharedStorageConnector", {"io_thread": 2}, "io_threads"),
    ("RedisConnector", {"max_connection": 2}, "max_connections"),
    ("RedisConnector", {"verify_after_lod": True}, "verify_after_load"),
    ("TieredConnector", {"connector": []}, "connectors"),
    ("FaultInjectionConnector", {"sed": 1}, "seed"),
    # A wrapper accepts, and checks, the settings of the connector it wraps.
    ("FaultInjectionConnector", {"inner_connector": "RedisConnector", "urll": "x"}, "url"),
])
def test_a_misspelt_connector_setting_says_did_you_mean(connector, extra, near):
    from kvrecover.kv_transfer.registry import connector_class

    config = KVTransferConfig(connector, "kv_both", extra)
    with pytest.raises(ValueError, match=rf"unknown kv_connector_extra_config key of "
                                         rf"{connector} '{next(iter(extra.keys() - {'inner_connector'}))}'"
                                         rf"; did you mean '{near}'\?"):
        connector_class(config).check_settings(config)


def test_a_wrapper_takes_its_inner_connectors_settings():
    from kvrecover.kv_transfer.faults import FaultInjectionConnector, FaultRule

    config = KVTransferConfig("FaultInjectionConnector", "kv_both",
                              {"inner_connector": "RedisConnector", "url": "redis://h:1/0",
                               "seed": 3, "faults": [{"kind": "corrupt"}]})
    settings = FaultInjectionConnector.check_settings(config)
    assert settings.seed == 3 and settings.faults == (FaultRule(kind="corrupt"),)


def test_a_misspelt_tier_key_says_did_you_mean():
    from kvrecover.kv_transfer.tiered.connector import TieredConnector

    config = KVTransferConfig("TieredConnector", "kv_both",
                              {"connectors": [{"kv_connector": "RedisConnector", "kv_rle": "x"}]})
    with pytest.raises(ValueError, match=r"unknown connectors\[0\] key 'kv_rle'; did you mean "
                                         r"'kv_role'\?"):
        TieredConnector.check_settings(config)


# ----- the HTTP commands: serve and proxy ----------------------------------------------------
def serving_args(argv: list[str]) -> argparse.Namespace:
    from kvrecover.cli import build_parser

    return build_parser().parse_args(argv)


def test_proxy_flags_build_its_config_and_round_trip():
    from kvrecover.entrypoints.cli.listen import ListenArgs
    from kvrecover.entrypoints.proxy.config import ProxyConfig
    from kvrecover.options import from_namespace, to_argv

    namespace = serving_args(["proxy", "--prefill", "http://p:1", "--decode", "http://d:1",
                              "http://d:2", "--max-retries", "0", "--timeout", "3",
                              "--health-check-interval", "0.5", "--port", "9001"])
    config = from_namespace(ProxyConfig, namespace)
    assert config == ProxyConfig(["http://p:1"], ["http://d:1", "http://d:2"], max_retries=0,
                                 timeout=3.0, health_check_interval=0.5)
    assert from_namespace(ListenArgs, namespace) == ListenArgs("127.0.0.1", 9001)
    assert from_namespace(ProxyConfig, serving_args(["proxy", *to_argv(config)])) == config
    assert from_namespace(ProxyConfig, serving_args(["proxy"])) == ProxyConfig()


def test_serve_flags_build_their_records():
    from kvrecover.entrypoints.cli.listen import ListenArgs
    from kvrecover.entrypoints.cli.serve import ServeArgs
    from kvrecover.options import from_namespace

    namespace = serving_args(["serve", "--host", "0.0.0.0", "--port", "0", "--api-key",
                              "s3cret", "--served-model-name", "tiny", "--max-num-seqs", "3"])
    assert from_namespace(ListenArgs, namespace) == ListenArgs("0.0.0.0", 0)
    serve = from_namespace(ServeArgs, namespace)
    assert serve == ServeArgs("tiny", "s3cret") and "s3cret" not in repr(serve)
    assert engine_args_from_namespace(namespace).max_num_seqs == 3
    assert from_namespace(ServeArgs, serving_args(["serve"])) == ServeArgs()


@pytest.mark.parametrize("record, values, message", [
    ("ProxyConfig", {"max_retries": -1}, "max_retries must be an integer >= 0, got -1"),
    ("ProxyConfig", {"timeout": 0}, "timeout must be a finite number > 0, got 0"),
    ("ProxyConfig", {"health_check_interval": float("nan")}, "health_check_interval must be"),
    ("ProxyConfig", {"decode": ["http://d:1", 7]}, "decode must be a list of URLs"),
    ("ListenArgs", {"port": 65536}, "port must be an integer >= 0 and <= 65535"),
    ("ListenArgs", {"host": ""}, "host must be a host name or address"),
    ("ServerConfig", {"model_name": "m", "max_body_bytes": 0}, "max_body_bytes must be"),
])
def test_bad_serving_options_name_the_option(record, values, message):
    by_name = {r.__name__: r for r in every_record()}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        by_name[record](**values)


def test_a_secret_never_appears_in_an_error_or_a_repr():
    from kvrecover.entrypoints.cli.serve import ServeArgs
    from kvrecover.entrypoints.server.app import ServerConfig

    with pytest.raises(ValueError) as info:
        ServerConfig("m", api_key=["s3cret"])
    assert "api_key must be a string" in str(info.value) and "s3cret" not in str(info.value)
    with pytest.raises(ValueError) as info:
        ServeArgs(api_key=["s3cret"])
    assert "s3cret" not in str(info.value)
    assert "s3cret" not in repr(ServerConfig("m", api_key="s3cret"))


@pytest.mark.parametrize("record, key, near", [
    ("ProxyConfig", "max_retry", "max_retries"),
    ("ProxyConfig", "health_interval", "health_check_interval"),
    ("ServeArgs", "served_model", "served_model_name"),
    ("ListenArgs", "hots", "host"),
])
def test_a_misspelt_serving_option_says_did_you_mean(record, key, near):
    from kvrecover.options import from_dict

    by_name = {r.__name__: r for r in every_record()}
    with pytest.raises(ValueError, match=f"unknown serving option '{key}'; did you mean '{near}'"):
        from_dict(by_name[record], {key: 1}, "serving option")


def test_from_dict_names_a_missing_required_option():
    from kvrecover.config import SchedulerConfig
    from kvrecover.options import from_dict

    with pytest.raises(ValueError, match="missing scheduler option 'block_size'"):
        from_dict(SchedulerConfig, {"max_num_batched_tokens": 8, "max_num_seqs": 2,
                                    "max_model_len": 64}, "scheduler option")


def test_a_parser_from_several_records_refuses_a_shared_name():
    from kvrecover.options import add_record_flags

    @dataclasses.dataclass
    class Server:
        port: int = option(8000, "port", int)
        seed: int = option(1, "clashes with EngineArgs.seed", int)

    with pytest.raises(ValueError, match="'seed' is declared by both EngineArgs and Server"):
        add_record_flags(argparse.ArgumentParser(), EngineArgs, Server)
    parser = argparse.ArgumentParser()
    add_record_flags(parser, EngineArgs, Server, skip=("seed",))
    namespace = parser.parse_args(["--port", "9", "--max-num-seqs", "3"])
    from kvrecover.options import from_namespace

    assert from_namespace(Server, namespace) == Server(port=9)
    assert from_namespace(EngineArgs, namespace) == EngineArgs(max_num_seqs=3)


# ----- device-dependent defaults: one table for the help and the engine ---------------------
def test_the_help_of_a_device_dependent_default_states_the_table():
    from kvrecover.device_defaults import DEVICE_DEFAULTS, default_help

    helps = {f.name: spec.help for f, spec in option_fields(EngineArgs)}
    for name, entry in DEVICE_DEFAULTS.items():
        assert default_help(name, "auto") in helps[name] or default_help(name) in helps[name]
        assert f"on a GPU: {entry.gpu}" in helps[name] and f"on the CPU: {entry.cpu}" in helps[name]


def test_the_resolver_takes_the_device_defaults_from_the_same_table(tiny_llama, monkeypatch):
    import torch

    from kvrecover.device_defaults import DEVICE_DEFAULTS, GIB, DeviceDefault
    from kvrecover.engine.resolve import resolve_config
    from kvrecover.worker.kv_cache import available_kv_cache_bytes

    resolved = resolve_config(EngineArgs(model=str(tiny_llama), device="cpu"))
    cpu = {name: entry.cpu for name, entry in DEVICE_DEFAULTS.items()}
    assert resolved.dtype == getattr(torch, cpu["dtype"])
    assert resolved.attention_backend == cpu["attention_backend"]
    assert resolved.scheduler_config.max_num_batched_tokens == cpu["max_num_batched_tokens"]
    assert resolved.scheduler_config.max_num_seqs == cpu["max_num_seqs"]
    assert resolved.kv_sizing.budget_bytes == available_kv_cache_bytes(torch.device("cpu"), 0.85)
    assert resolved.kv_sizing.budget_bytes <= cpu["kv_cache_memory_gb"] * GIB
    # The resolver reads the table (not a copy of its numbers).
    monkeypatch.setitem(DEVICE_DEFAULTS, "max_num_seqs", DeviceDefault(256, 5))
    resolved = resolve_config(EngineArgs(model=str(tiny_llama), device="cpu"))
    assert resolved.scheduler_config.max_num_seqs == 5
    assert resolve_config(EngineArgs(model=str(tiny_llama), device="cpu",
                                     max_num_seqs=7)).scheduler_config.max_num_seqs == 7


def test_the_engine_assembles_from_a_resolved_config(tiny_llama):
    from kvrecover.engine.engine import Engine
    from kvrecover.engine.resolve import resolve_config

    resolved = resolve_config(EngineArgs(model=str(tiny_llama), device="cpu", num_kv_blocks=9))
    engine = Engine(resolved)
    assert engine.config is resolved and engine.num_blocks == 9
    assert engine.scheduler_config is resolved.scheduler_config
    engine.close()


def test_a_bad_connector_setting_fails_before_the_weights_load(tiny_llama, monkeypatch):
    from kvrecover.engine import engine as engine_module

    def no_runner(*args, **kwargs):
        raise AssertionError("the model runner was built before the settings were checked")

    monkeypatch.setattr(engine_module, "ModelRunner", no_runner)
    transfer = KVTransferConfig("SharedStorageConnector", "kv_both",
                                {"shared_storage_path": "/kv", "asyn_load": True})
    with pytest.raises(ValueError, match="did you mean 'async_load'"):
        LLM(str(tiny_llama), device="cpu", kv_transfer_config=transfer)

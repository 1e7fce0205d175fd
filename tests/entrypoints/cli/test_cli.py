"""The `kvrecover` command line: help, generate, and clean errors on bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import hf_greedy

from kvrecover.cli import main


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvrecover")
    for command in ("generate", "prefill", "decode", "scenario", "storage"):
        assert command in out


def test_generate_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--prompt", "--max-tokens", "--temperature", "--model", "--device", "--dtype",
                 "--max-num-seqs", "--max-model-len", "--kv-transfer-config", "--batch-invariant"):
        assert flag in out


def assert_clean_error(capsys, argv: list[str], message: str) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kvrecover: error: ")
    assert message in lines[0]
    assert "Traceback" not in captured.err


def test_missing_model_is_a_clean_error(capsys, tmp_path):
    assert_clean_error(
        capsys,
        ["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi", "--device", "cpu"],
        "neither a local checkpoint folder",
    )


def test_unsupported_architecture_is_a_clean_error(capsys, tiny_llama, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    assert_clean_error(
        capsys, ["generate", "--model", str(folder), "--prompt", "hi", "--device", "cpu"],
        "unsupported architecture 'GPT2LMHeadModel'",
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-tokens", "0"], "max_tokens must be >= 1, got 0"),
        (["--temperature", "-1"], "temperature must be 0 (greedy) or a finite number >= 1e-05"),
        (["--device", "tpu"], "device must be 'auto', 'cpu' or 'cuda"),
    ],
)
def test_bad_values_are_clean_errors(capsys, tiny_llama, flags, message):
    assert_clean_error(
        capsys, ["generate", "--model", str(tiny_llama), "--prompt", "hi", *flags], message
    )


def test_prompt_too_long_is_a_clean_error(capsys, tiny_llama):
    # max_position_embeddings of the tiny model is 1024.
    assert_clean_error(
        capsys,
        ["generate", "--model", str(tiny_llama), "--prompt", "hello paris " * 700,
         "--device", "cpu"],
        "does not fit max_model_len=1024",
    )


def test_argparse_errors_exit_2_without_traceback(capsys):
    for argv in (["generate"], ["generate", "--prompt", "x", "--dtype", "float64"], ["nope"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "error:" in err and "Traceback" not in err


def test_generate_on_a_tiny_model(capsys, tiny_llama):
    from kvrecover.tokenizer import Tokenizer

    prompt = "the capital of france is"
    ids = Tokenizer(tiny_llama).encode(prompt)
    expected = hf_greedy(tiny_llama, [ids], max_new_tokens=8)[0]
    argv = ["generate", "--model", str(tiny_llama), "--prompt", prompt, "--max-tokens", "8",
            "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # The tiny model stops early only at its EOS (id 1): none in the greedy output here.
    assert 1 not in expected
    assert out == prompt + Tokenizer(tiny_llama).decode(expected) + "\n"


@pytest.mark.slow
def test_generate_on_the_default_model(capsys):
    from kvrecover.default_model import default_model_path
    from kvrecover.tokenizer import Tokenizer

    prompt = "The capital of France is"
    tokenizer = Tokenizer(default_model_path())
    expected = hf_greedy(default_model_path(), [tokenizer.encode(prompt)], max_new_tokens=12)[0]
    assert tokenizer.eos_token_id not in expected
    assert main(["generate", "--prompt", prompt, "--max-tokens", "12", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out == prompt + tokenizer.decode(expected) + "\n"
    assert out.startswith("The capital of France is Paris")


# ----- OS errors: one line, exit 2, never a traceback ---------------------------------------
def deny_writes_under(monkeypatch, module, folder: Path) -> None:
    """Make `module`'s open() refuse to write under `folder`, as a read-only folder does
    (the tests may run as root, for whom chmod changes nothing)."""
    import builtins
    import errno

    real_open = builtins.open

    def guarded_open(path, mode="r", *args, **kwargs):
        if any(m in mode for m in "wax+") and Path(path).resolve().is_relative_to(folder):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(module, "open", guarded_open, raising=False)


@pytest.mark.parametrize("command", ["prefill", "decode", "scenario"])
def test_a_workdir_that_is_a_file_is_a_clean_error(capsys, tiny_llama, tmp_path, command):
    workdir = tmp_path / "workdir"
    workdir.write_text("a file")
    assert_clean_error(capsys, [command, "--workdir", str(workdir), "--model", str(tiny_llama),
                                "--device", "cpu"], f"--workdir {workdir} is not a folder")


def test_a_workdir_below_a_file_is_a_clean_error(capsys, tiny_llama, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    assert_clean_error(capsys, ["prefill", "--workdir", str(blocker / "workdir"), "--model",
                                str(tiny_llama), "--device", "cpu"],
                       f"Not a directory: {blocker / 'workdir'}")


def test_a_read_only_workdir_is_a_clean_error(capsys, tiny_llama, tmp_path, monkeypatch):
    from kvrecover import scenario

    workdir = tmp_path / "readonly"
    workdir.mkdir()
    (workdir / scenario.PREFILL_OUTPUT).write_text('"the quick brown fox"\n"hello, my name"\n')
    deny_writes_under(monkeypatch, scenario, workdir.resolve())
    assert_clean_error(capsys, ["decode", "--workdir", str(workdir), "--model", str(tiny_llama),
                                "--device", "cpu", "--num-kv-blocks", "64"],
                       f"Permission denied: {workdir / scenario.DECODE_OUTPUT}")


def test_fix_on_a_read_only_store_is_a_clean_error(capsys, tmp_path, monkeypatch):
    import errno

    bad = tmp_path / "store" / ("0" * 16) / "ab" / "junk.kvblock"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"junk")

    def refuse(self, missing_ok=False):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    assert main(["storage", "verify", str(tmp_path / "store"), "--fix"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"kvrecover: error: Permission denied: {bad}"]
    assert bad.exists()


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_a_bad_kvrecover_cache_is_a_clean_error(capsys, tmp_path, monkeypatch, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    monkeypatch.setenv("KVRECOVER_CACHE", str(blocker if where == "a file" else blocker / "x"))
    assert_clean_error(capsys, ["generate", "--prompt", "hi", "--device", "cpu"],
                       "set KVRECOVER_CACHE to a writable folder")


def test_engine_flags_reach_the_engine(capsys, tiny_llama, monkeypatch):
    """Every engine option is a flag; what the user typed arrives in EngineArgs."""
    from kvrecover import LLM

    seen = {}
    real = LLM.from_engine_args

    def spy(args):
        seen["args"] = args
        return real(args)

    monkeypatch.setattr(LLM, "from_engine_args", staticmethod(spy))
    argv = ["generate", "--model", str(tiny_llama), "--prompt", "hi", "--device", "cpu",
            "--max-tokens", "2", "--block-size", "8", "--max-num-seqs", "3",
            "--max-num-batched-tokens", "40", "--max-model-len", "512", "--no-enable-prefix-caching",
            "--seed", "7", "--num-kv-blocks", "50", "--dtype", "float32"]
    assert main(argv) == 0
    args = seen["args"]
    assert (args.block_size, args.max_num_seqs, args.max_num_batched_tokens) == (8, 3, 40)
    assert (args.max_model_len, args.enable_prefix_caching, args.seed) == (512, False, 7)
    assert (args.num_kv_blocks, args.dtype, args.device) == (50, "float32", "cpu")
    assert args.to_argv() == [
        "--model", str(tiny_llama), "--dtype", "float32", "--device", "cpu", "--block-size", "8",
        "--max-num-batched-tokens", "40", "--max-num-seqs", "3", "--max-model-len", "512",
        "--no-enable-prefix-caching", "--seed", "7", "--num-kv-blocks", "50"]


@pytest.mark.parametrize("flags, message", [
    (["--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1"),
    (["--num-kv-blocks", "1"], "num_kv_blocks must be an integer >= 2"),
    (["--max-model-len", "4096"], "max_model_len must be <= 1024"),
    (["--gpu-memory-utilization", "2"], "gpu_memory_utilization must be a finite number > 0"),
    (["--kv-transfer-config", '{"kv_connector": "SharedStorageConnector", '
      '"kv_connector_extra_config": {"shared_storage_path": "/tmp/x", "asyn_load": true}}'],
     "did you mean 'async_load'"),
])
def test_bad_engine_flags_are_clean_errors(capsys, tiny_llama, flags, message):
    assert_clean_error(capsys, ["generate", "--model", str(tiny_llama), "--prompt", "hi",
                                "--device", "cpu", *flags], message)


def test_a_bad_kv_transfer_config_json_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--prompt", "x", "--kv-transfer-config", '{"kv_conector": "A"}'])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "did you mean 'kv_connector'" in err and "Traceback" not in err


def test_serve_flags_reach_the_engine_and_the_engine_is_closed(capsys, tiny_llama, monkeypatch):
    """`kvrecover serve` builds its engine through EngineArgs and closes it on the way out."""
    import uvicorn

    from kvrecover import LLM

    built = []
    real = LLM.from_engine_args

    def spy(args):
        built.append(real(args))
        return built[-1]

    served = {}
    monkeypatch.setattr(LLM, "from_engine_args", staticmethod(spy))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: served.update(kwargs))
    argv = ["serve", "--model", str(tiny_llama), "--device", "cpu", "--max-num-seqs", "3",
            "--max-model-len", "256", "--batch-invariant", "--port", "8123"]
    assert main(argv) == 0
    (llm,) = built
    assert served["port"] == 8123 and served["host"] == "127.0.0.1"
    assert f"kvrecover serve: {tiny_llama} on http://127.0.0.1:8123" in capsys.readouterr().err
    assert llm.engine.closed
    args = llm.engine.args
    assert (args.max_num_seqs, args.max_model_len, args.batch_invariant) == (3, 256, True)


@pytest.mark.parametrize("flags, budget", [([], 256), (["--max-num-batched-tokens", "40"], 40)])
def test_serve_on_the_cpu_computes_one_short_step_at_a_time(tiny_llama, monkeypatch, flags,
                                                            budget):
    """Unset, `serve` on the CPU computes 256 tokens a step (offline, the engine takes
    2048): a prompt's first token waits for its own prefill, not for a step of eight. A
    given --max-num-batched-tokens wins."""
    import uvicorn

    from kvrecover import LLM

    built = []
    real = LLM.from_engine_args

    def spy(args):
        built.append(real(args))
        return built[-1]

    monkeypatch.setattr(LLM, "from_engine_args", staticmethod(spy))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    assert main(["serve", "--model", str(tiny_llama), "--device", "cpu", *flags]) == 0
    (llm,) = built
    assert llm.engine.scheduler_config.max_num_batched_tokens == budget

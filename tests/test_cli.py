"""The `kvrecover` command line: help, generate, and clean errors on bad input."""

from __future__ import annotations

import json
import shutil

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
    for flag in ("--prompt", "--max-tokens", "--temperature", "--model", "--device", "--dtype"):
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
        (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
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

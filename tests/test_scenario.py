"""The reference scenario end to end: four processes, byte-identical outputs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import build_tiny_model

from kvrecover import scenario


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """A tiny Llama whose context fits the reference prompts (about 3000 tiny-BPE tokens)."""
    return build_tiny_model(tmp_path_factory.mktemp("long_ctx"), seed=4,
                            max_position_embeddings=4096)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrecover", *args], capture_output=True,
                          text=True, timeout=1200)


def test_scenario_on_tiny_model(long_context_model, tmp_path):
    result = run_cli("scenario", "--model", str(long_context_model), "--device", "cpu",
                     "--workdir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    baseline = (tmp_path / scenario.DECODE_OUTPUT).read_text()
    assert baseline.count("Token ids: [") == 4
    for name in (scenario.SYNC_RECOVERED_OUTPUT, scenario.ASYNC_RECOVERED_OUTPUT):
        assert (tmp_path / name).read_text() == baseline
    # The failure phases really failed and recovered.
    for stem in ("sync_decode_recovered_output", "async_decode_recovered_output"):
        stats = (tmp_path / f"{stem}.stats.json").read_text()
        assert '"kv_load_recovered_requests": 0' not in stats


def test_scenario_detects_a_difference(tiny_llama, tmp_path, monkeypatch, capsys):
    """The comparison must fail loudly when a recovered output differs."""
    (tmp_path / scenario.DECODE_OUTPUT).write_text("Token ids: [1]\n")
    for name in (scenario.SYNC_RECOVERED_OUTPUT, scenario.ASYNC_RECOVERED_OUTPUT):
        (tmp_path / name).write_text("Token ids: [2]\n")
    for stem in ("prefill", "decode_output", "sync_decode_recovered_output",
                 "async_decode_recovered_output"):
        (tmp_path / f"{stem}.stats.json").write_text(
            '{"kv_load_recovered_requests": 0, "kv_load_failed_blocks": 0, '
            '"kv_load_recomputed_tokens": 0, "prompt_tokens_external": 0}')

    class Done:
        returncode = 0

    monkeypatch.setattr(scenario.subprocess, "run", lambda *a, **k: Done())
    monkeypatch.setattr(scenario, "_remove_tree", lambda path: None)
    original_unlink = scenario.Path.unlink
    monkeypatch.setattr(scenario.Path, "unlink", lambda self, missing_ok=False: None)
    code = scenario.run_scenario(scenario.EngineOptions(str(tiny_llama), "cpu"), tmp_path)
    monkeypatch.setattr(scenario.Path, "unlink", original_unlink)
    out = capsys.readouterr().out
    assert code == 1
    assert "FAILED" in out and "-Token ids: [1]" in out and "+Token ids: [2]" in out


def test_decode_without_prefill_is_a_clean_error(tmp_path):
    result = run_cli("decode", "--workdir", str(tmp_path), "--device", "cpu")
    assert result.returncode == 2
    assert "run `kvrecover prefill` first" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_reference_scenario_on_default_model(tmp_path):
    """The main job (./run.sh): default model, four processes."""
    result = run_cli("scenario", "--device", "cpu", "--workdir", str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "SUCCESS" in result.stdout
    baseline = (tmp_path / scenario.DECODE_OUTPUT).read_bytes()
    assert (tmp_path / scenario.SYNC_RECOVERED_OUTPUT).read_bytes() == baseline
    assert (tmp_path / scenario.ASYNC_RECOVERED_OUTPUT).read_bytes() == baseline

"""The reference scenario end to end: four processes, byte-identical outputs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from conftest import build_tiny_model, require_nixl

from kvrecover import scenario
from kvrecover.config import EngineArgs


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """A tiny Llama whose context fits the reference prompts (about 3000 tiny-BPE tokens)."""
    return build_tiny_model(tmp_path_factory.mktemp("long_ctx"), seed=4,
                            max_position_embeddings=4096)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrecover", *args], capture_output=True,
                          text=True, timeout=1200)


def run_passing_scenario(model, workdir, *extra: str) -> str:
    """Run the scenario on `model`; check it passed, the recovered outputs equal the
    baseline and both failure phases really failed and recovered. Returns the baseline."""
    result = run_cli("scenario", "--model", str(model), "--device", "cpu",
                     "--workdir", str(workdir), *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    baseline = (workdir / scenario.DECODE_OUTPUT).read_text()
    assert baseline.count("Token ids: [") == 4
    for name in (scenario.SYNC_RECOVERED_OUTPUT, scenario.ASYNC_RECOVERED_OUTPUT):
        assert (workdir / name).read_text() == baseline
    for stem in ("sync_decode_recovered_output", "async_decode_recovered_output"):
        stats = (workdir / f"{stem}.stats.json").read_text()
        assert '"kv_load_recovered_requests": 0' not in stats
    return baseline


@pytest.mark.slow  # four processes, each loading the model
def test_scenario_on_tiny_model(long_context_model, tmp_path):
    run_passing_scenario(long_context_model, tmp_path)


def run_scenario_over_nixl(model, tmp_path) -> str:
    """The passing scenario with its KV pulled over NIXL from a free loopback port."""
    require_nixl()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return run_passing_scenario(model, tmp_path, "--store", f"nixl://127.0.0.1:{port}")


@pytest.mark.slow  # a NIXL prefill process per decode phase
def test_scenario_over_nixl(long_context_model, tmp_path):
    """Prefill and decode in two processes, the KV pulled over NIXL (UCX on loopback),
    the first pull failing through the fault injector around the NixlConnector."""
    baseline = run_scenario_over_nixl(long_context_model, tmp_path)
    stats = json.loads((tmp_path / "decode_output.stats.json").read_text())
    assert stats["prompt_tokens_external"] > 0 and stats["kv_nixl_pulled_blocks"] > 0
    assert baseline.count("Token ids: [") == 4


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    """A tiny Gemma 3 (window 64: the reference prompts cross it many times) of the same
    context."""
    types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    return build_tiny_model(tmp_path_factory.mktemp("windowed_ctx"), seed=5,
                            model_type="gemma3_text", sliding_window=64, head_dim=16,
                            num_hidden_layers=4, layer_types=types, query_pre_attn_scalar=24,
                            max_position_embeddings=4096, tie_word_embeddings=True)


@pytest.mark.slow  # four processes, each loading the model
def test_scenario_on_a_windowed_model(windowed_model, tmp_path):
    run_passing_scenario(windowed_model, tmp_path)


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    """A tiny Qwen3-Next (3 Gated DeltaNet layers, 1 gated full attention, 4 experts) of the
    same context, with a word-level tokenizer as the GPU benches' random checkpoints have:
    "Hi" and "Hey" are both its unknown word (the prompts' endings are words it knows),
    so the short prompts' prefix is the long prompts' start and their last loadable
    boundary is one that a long prompt reaches."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    folder = build_tiny_model(tmp_path_factory.mktemp("hybrid_ctx"), seed=6,
                            model_type="qwen3_next", num_hidden_layers=4, layer_types=types,
                            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=16, linear_value_head_dim=16,
                            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=32,
                            max_position_embeddings=4096)
    known = "Hello , my name is The capital of France China Your".split()
    vocab = {f"w{i}": i for i in range(384 - len(known))} | {
        word: 384 - len(known) + i for i, word in enumerate(known)}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w2"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
    return folder


@pytest.mark.slow  # four processes, each loading the model
def test_scenario_on_a_hybrid_model(hybrid_model, tmp_path):
    baseline = run_passing_scenario(hybrid_model, tmp_path)
    outputs = [line for line in baseline.splitlines() if line.startswith("Token ids: [")]
    assert len(set(outputs)) > 1  # the weights tell the prompts apart: a wrong state shows
    # Every prompt's KV and state were stored and loaded: each computes only its last
    # partial block (the short prompts' states sit at a boundary the long ones reach).
    stats = json.loads((tmp_path / "decode_output.stats.json").read_text())
    assert stats["prompt_tokens_computed"] < 4 * 16, stats


@pytest.mark.slow  # a NIXL prefill process per decode phase
def test_scenario_over_nixl_on_a_hybrid_model(hybrid_model, tmp_path):
    """The hybrid's KV and recurrent states pulled point to point (`p2p/states.py`), the
    first pull failing through the fault injector: outputs byte-identical as always."""
    baseline = run_scenario_over_nixl(hybrid_model, tmp_path)
    outputs = [line for line in baseline.splitlines() if line.startswith("Token ids: [")]
    assert len(set(outputs)) > 1  # the weights tell the prompts apart: a wrong state shows
    stats = json.loads((tmp_path / "decode_output.stats.json").read_text())
    assert stats["prompt_tokens_external"] > 0 and stats["kv_nixl_pulled_blocks"] > 0
    assert stats["kv_load_failed_blocks"] == 0, stats


GOOD_STATS = {
    "prefill": {"prompt_tokens_external": 0, "kv_load_failed_blocks": 0,
                "kv_load_recovered_requests": 0},
    "decode_output": {"prompt_tokens_external": 2400, "kv_load_failed_blocks": 0,
                      "kv_load_recovered_requests": 0},
    "sync_decode_recovered_output": {"prompt_tokens_external": 1900,
                                     "kv_load_failed_blocks": 31,
                                     "kv_load_recovered_requests": 1},
    "async_decode_recovered_output": {"prompt_tokens_external": 1900,
                                      "kv_load_failed_blocks": 31,
                                      "kv_load_recovered_requests": 1},
}


def run_fabricated_scenario(tmp_path, monkeypatch, stats, baseline="Token ids: [1]\n",
                            recovered="Token ids: [1]\n") -> int:
    """`run_scenario` over phase results written here instead of by four processes."""
    (tmp_path / scenario.DECODE_OUTPUT).write_text(baseline)
    for name in (scenario.SYNC_RECOVERED_OUTPUT, scenario.ASYNC_RECOVERED_OUTPUT):
        (tmp_path / name).write_text(recovered)
    for stem, values in stats.items():
        (tmp_path / f"{stem}.stats.json").write_text(
            json.dumps({"kv_load_recomputed_tokens": 0, **values}))

    class Done:
        returncode = 0

    monkeypatch.setattr(scenario.subprocess, "run", lambda *a, **k: Done())
    monkeypatch.setattr(scenario, "_remove_tree", lambda path: None)
    original_unlink = scenario.Path.unlink
    monkeypatch.setattr(scenario.Path, "unlink", lambda self, missing_ok=False: None)
    try:
        return scenario.run_scenario(EngineArgs(model="unused", device="cpu"), tmp_path)
    finally:
        monkeypatch.setattr(scenario.Path, "unlink", original_unlink)


def test_scenario_detects_a_difference(tmp_path, monkeypatch, capsys):
    """The comparison must fail loudly when a recovered output differs."""
    code = run_fabricated_scenario(tmp_path, monkeypatch, GOOD_STATS,
                                   recovered="Token ids: [2]\n")
    out = capsys.readouterr().out
    assert code == 1
    assert "FAILED" in out and "-Token ids: [1]" in out and "+Token ids: [2]" in out


def test_fabricated_good_phases_pass(tmp_path, monkeypatch, capsys):
    assert run_fabricated_scenario(tmp_path, monkeypatch, GOOD_STATS) == 0
    assert "SUCCESS" in capsys.readouterr().out


@pytest.mark.parametrize("stem, counter, message", [
    ("decode_output", "prompt_tokens_external", "the baseline decode loaded no KV"),
    ("sync_decode_recovered_output", "kv_load_failed_blocks", "the sync failure phase hit 0"),
    ("sync_decode_recovered_output", "kv_load_recovered_requests", "recovered 0 requests"),
    ("async_decode_recovered_output", "kv_load_failed_blocks", "the async failure phase hit 0"),
    ("async_decode_recovered_output", "kv_load_recovered_requests", "recovered 0 requests"),
])
def test_a_phase_that_proves_nothing_fails_the_scenario(tmp_path, monkeypatch, capsys, stem,
                                                        counter, message):
    """Identical outputs are no success when nothing was loaded or nothing failed."""
    stats = json.loads(json.dumps(GOOD_STATS))
    stats[stem][counter] = 0
    assert run_fabricated_scenario(tmp_path, monkeypatch, stats) == 1
    out = capsys.readouterr().out
    assert "SUCCESS" not in out
    assert "FAILED: " in out and message in out


@pytest.mark.slow
def test_a_file_where_the_store_should_be_fails_the_scenario(long_context_model, tmp_path):
    (tmp_path / scenario.STORAGE_DIR).write_text("not a folder")
    result = run_cli("scenario", "--model", str(long_context_model), "--device", "cpu",
                     "--workdir", str(tmp_path))
    assert result.returncode != 0
    assert "SUCCESS" not in result.stdout
    assert "Traceback" not in result.stderr
    assert "loaded no KV" in result.stdout or "kvrecover: error:" in result.stderr


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

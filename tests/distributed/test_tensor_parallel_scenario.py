"""The reference scenario (four processes) with `--tensor-parallel-size 2`: every phase
shards the model over two ranks, and the recovered outputs match the baseline, in
float32 and in bf16 with `--batch-invariant` (the all-reduce in a fixed rank order)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import build_tiny_model

from kvrecover import scenario


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tp_long_ctx"), seed=4,
                            max_position_embeddings=4096)


@pytest.mark.slow  # four engines of two processes each
@pytest.mark.parametrize("numerics", [[], ["--dtype", "bfloat16", "--batch-invariant"]],
                         ids=["float32", "bf16-batch-invariant"])
def test_scenario_at_tensor_parallel_size_2(long_context_model, tmp_path, numerics):
    result = subprocess.run(
        [sys.executable, "-m", "kvrecover", "scenario", "--model", str(long_context_model),
         "--device", "cpu", "--workdir", str(tmp_path), "--tensor-parallel-size", "2",
         *numerics],
        capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "SUCCESS" in result.stdout
    baseline = (tmp_path / scenario.DECODE_OUTPUT).read_text()
    for name in (scenario.SYNC_RECOVERED_OUTPUT, scenario.ASYNC_RECOVERED_OUTPUT):
        assert (tmp_path / name).read_text() == baseline
    for stem in ("sync_decode_recovered_output", "async_decode_recovered_output"):
        assert '"kv_load_recovered_requests": 0' not in (tmp_path / f"{stem}.stats.json").read_text()
    assert len([p for p in (tmp_path / scenario.STORAGE_DIR).iterdir() if p.is_dir()]) >= 2

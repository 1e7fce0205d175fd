"""NixlConnector between two GPU engines (issue 42, item 5): the producer registers its
KV cache as VRAM, the consumer stages its READ on its GPU and checks each block there
with fold64 (the GPU's default checksum, named in the producer's handshake), so no block
crosses the host. The token ids are those of a GPU run without a connector, and a
staged block that is wrong on the GPU is exactly the one recomputed.

Marked `gpu` and skipped without CUDA (and without a nixl package: nixl-cu13 on a CUDA 13
machine); `test_nixl_connector.py` covers the protocol on the CPU.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import require_nixl
from test_nixl_connector import (  # noqa: F401 - kill_producers: an autouse fixture
    PARAMS,
    PROMPTS,
    Producer,
    kill_producers,
    staged_pulls,
)

from kvrecover import LLM, KVTransferConfig
from kvrecover.kv_transfer.p2p import pull_reads
from kvrecover.kv_transfer.p2p.pull_reads import PullReader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a real GPU"),
]
if torch.cuda.is_available():
    require_nixl()

ENGINE = {"device": "cuda", "block_size": 8, "num_kv_blocks": 128}


def run(model: Path, references: list[dict | None] | None, async_load: bool = False
        ) -> tuple[list[list[int]], dict[str, int]]:
    """Token ids and stats of a GPU consumer given `references` (None: no connector)."""
    transfer = None if references is None else KVTransferConfig(
        "NixlConnector", "kv_consumer", {"async_load": async_load, "load_timeout_s": 20.0})
    llm = LLM(str(model), kv_transfer_config=transfer, **ENGINE)
    params = []
    for reference in references or [None] * len(PROMPTS):
        each = copy.copy(PARAMS)
        each.kv_transfer_params = reference
        params.append(each)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    llm.close()
    assert all(o.error is None for o in outputs)
    return [o.outputs[0].token_ids for o in outputs], llm.stats


def record_algorithms(monkeypatch) -> list[tuple[str, str]]:
    """(algorithm, device) of each check the consumer runs, from now on."""
    seen: list[tuple[str, str]] = []
    real = pull_reads.checksum_blocks

    def recorded(algorithm: str, sides: Any, block_ids: Any) -> list[int]:
        seen.append((algorithm, sides[0].device.type))
        return real(algorithm, sides, block_ids)

    monkeypatch.setattr(pull_reads, "checksum_blocks", recorded)
    return seen


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_gpu_pull_is_exact_and_checked_on_the_gpu(tiny_llama, monkeypatch, async_load):
    expected, _ = run(tiny_llama, None)
    producer = Producer(tiny_llama, engine={"device": "cuda"})
    seen = record_algorithms(monkeypatch)
    ids, stats = run(tiny_llama, producer.references, async_load)
    assert ids == expected
    assert stats["kv_nixl_pulled_blocks"] > 0 and stats.get("kv_load_failed_blocks", 0) == 0
    assert stats["kv_nixl_read_bytes"] > 0
    assert seen and set(seen) == {("fold64", "cuda")}
    assert producer.finish() == 0


def test_a_wrong_block_staged_on_the_gpu_is_the_one_recomputed(tiny_llama, monkeypatch):
    expected, _ = run(tiny_llama, None)
    producer = Producer(tiny_llama, engine={"device": "cuda"})
    install = PullReader.install
    reported: set[int] = set()

    def one_wrong(self: PullReader, items: list, buffer: Any, fence: Any) -> set[int]:
        blocks, _ = staged_pulls(self, items, buffer)
        blocks[1, -1, 0, -1] ^= 0x01  # one bit of V of the last cache tensor, first row
        bad = install(self, items, buffer, fence)
        reported.update(bad)
        return bad

    monkeypatch.setattr(PullReader, "install", one_wrong)
    ids, stats = run(tiny_llama, producer.references)
    assert ids == expected
    assert len(reported) == 1 and stats["kv_load_failed_blocks"] == 1
    assert producer.finish() == 0

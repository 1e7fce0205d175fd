"""NixlConnector end to end: a producer process keeps its prompts' blocks, this process
pulls them with NIXL READ over UCX on loopback (CPU memory), and every fault is an
invalid block the engine recomputes: the token ids are always those of a run without a
connector (DESIGN rule 10)."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import random_prompts

from kvrecover import LLM, KVTransferConfig, SamplingParams

pytest.importorskip("nixl_cu12")

PRODUCER = Path(__file__).with_name("nixl_producer.py")
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts(2, [61, 45], 384, seed=21)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Producer:
    """The producer process: its references, and the count it still holds at the end."""

    def __init__(self, model: Path, lease_s: float = 60.0, port: int | None = None) -> None:
        self.port = free_port() if port is None else port
        self.process = subprocess.Popen(
            [sys.executable, str(PRODUCER), str(model), str(self.port), str(lease_s),
             json.dumps(PROMPTS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert self.process.stdout is not None
        self.references = []
        for line in self.process.stdout:  # other lines are the libraries' logs
            if line.startswith("REF "):
                self.references.append(json.loads(line[4:]))
                if len(self.references) == len(PROMPTS):
                    break
        assert all(r and r["do_remote_prefill"] for r in self.references), self.references

    def finish(self) -> int:
        """Close its stdin; the number of prompts it still held (bounded wait)."""
        out, _ = self.process.communicate("", timeout=30)
        return int(next(line for line in out.splitlines() if line.startswith("HELD "))[5:])

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def baseline(tiny_llama) -> list[list[int]]:
    llm = LLM(str(tiny_llama), device="cpu", block_size=8)
    return [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]


def consume(model: Path, references: list[dict | None], *, async_load: bool = False,
            policy: str = "recompute"):
    transfer = KVTransferConfig("NixlConnector", "kv_consumer",
                                {"async_load": async_load, "load_timeout_s": 10.0},
                                kv_load_failure_policy=policy)
    llm = LLM(str(model), device="cpu", block_size=8, num_kv_blocks=128,
              kv_transfer_config=transfer)
    params = []
    for reference in references:
        each = copy.copy(PARAMS)
        each.kv_transfer_params = reference
        params.append(each)
    started = time.monotonic()
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    elapsed = time.monotonic() - started
    llm.close()
    return [o.outputs[0].token_ids for o in outputs], llm.stats, elapsed, outputs


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_pull_is_exact_and_frees_the_producers_blocks(tiny_llama, baseline, async_load):
    producer = Producer(tiny_llama)
    ids, stats, _, _ = consume(tiny_llama, producer.references, async_load=async_load)
    assert ids == baseline
    # 61 and 45 tokens: 7 and 5 full blocks below the last token, all pulled.
    assert stats["prompt_tokens_external"] == (7 + 5) * 8
    assert stats.get("kv_nixl_pulled_blocks", 0) == 12 and stats["kv_load_failed_blocks"] == 0
    assert producer.finish() == 0  # released: nothing stays pinned


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_dead_producer_is_recomputed_at_once(tiny_llama, baseline, async_load):
    producer = Producer(tiny_llama)
    producer.kill()
    ids, stats, elapsed, _ = consume(tiny_llama, producer.references, async_load=async_load)
    assert ids == baseline
    assert stats["kv_load_failed_blocks"] >= 12  # async: asked again once (rule 6)
    assert elapsed < 5  # refused connections: no wait for load_timeout_s


def tampered(references: list[dict], change) -> list[dict]:
    result = copy.deepcopy(references)
    change(result[0])
    return result


BAD_REFERENCES = {
    "out-of-range ids": lambda r: r.update(remote_block_ids=[10**6] * 7),
    "other blocks": lambda r: r.update(remote_block_ids=r["remote_block_ids"][::-1]),
    "unknown request": lambda r: r.update(remote_request_id="nobody@0"),
}


def test_another_prompts_reference_is_refused(tiny_llama, baseline):
    producer = Producer(tiny_llama)
    references = [producer.references[1], producer.references[1]]
    ids, stats, _, _ = consume(tiny_llama, references)
    assert ids == baseline
    assert stats.get("kv_nixl_pulled_blocks", 0) == 5  # the second prompt's own
    assert producer.finish() == 1  # the first prompt's, never pulled: left to its lease


@pytest.mark.parametrize("case", list(BAD_REFERENCES))
def test_a_bad_reference_is_recomputed_and_the_others_still_pull(tiny_llama, baseline, case):
    producer = Producer(tiny_llama)
    references = tampered(producer.references, BAD_REFERENCES[case])
    ids, stats, _, _ = consume(tiny_llama, references)
    assert ids == baseline
    assert stats.get("kv_nixl_pulled_blocks", 0) == 5  # the second prompt's
    producer.kill()


def test_a_reference_used_twice_is_refused_the_second_time(tiny_llama, baseline):
    producer = Producer(tiny_llama)
    first, stats, _, _ = consume(tiny_llama, producer.references)
    assert first == baseline and stats.get("kv_nixl_pulled_blocks", 0) == 12
    again, stats, _, _ = consume(tiny_llama, producer.references)
    assert again == baseline
    assert stats.get("kv_nixl_pulled_blocks", 0) == 0 and stats["kv_load_failed_blocks"] == 12
    assert producer.finish() == 0


def test_an_expired_lease_frees_the_blocks_and_is_recomputed(tiny_llama, baseline):
    producer = Producer(tiny_llama, lease_s=1.0)
    time.sleep(2.0)
    ids, stats, _, _ = consume(tiny_llama, producer.references)
    assert ids == baseline and stats.get("kv_nixl_pulled_blocks", 0) == 0
    assert producer.finish() == 0


def test_policy_fail_ends_only_the_request_whose_pull_failed(tiny_llama, baseline):
    producer = Producer(tiny_llama)
    references = tampered(producer.references, BAD_REFERENCES["unknown request"])
    ids, stats, _, outputs = consume(tiny_llama, references, policy="fail")
    assert outputs[0].outputs[0].finish_reason == "error"
    assert outputs[0].error_type == "kv_load_failed"
    assert ids[1] == baseline[1] and outputs[1].error is None
    producer.kill()


@pytest.mark.parametrize("change", [
    lambda r: r.update(remote_port="x"), lambda r: r.pop("remote_block_ids"),
    lambda r: r.update(tp_size=2), lambda r: r.update(kv_fingerprint="0" * 16)],
    ids=["port", "no-blocks", "tp", "fingerprint"])
def test_malformed_or_foreign_params_compute_the_prompt_here(tiny_llama, baseline, change):
    producer = Producer(tiny_llama)
    ids, stats, _, outputs = consume(tiny_llama, tampered(producer.references, change))
    assert ids == baseline and all(o.error is None for o in outputs)
    assert stats.get("kv_nixl_pulled_blocks", 0) == 5
    producer.kill()


def test_a_restarted_producer_is_handshaken_again_and_its_old_references_refused(
        tiny_llama, baseline):
    """Same address, new process: a new agent and new memory. The consumer (one engine
    for all three pulls) never reads the old registration."""
    transfer = KVTransferConfig("NixlConnector", "kv_consumer", {"load_timeout_s": 10.0})
    llm = LLM(str(tiny_llama), device="cpu", block_size=8, num_kv_blocks=128,
              kv_transfer_config=transfer, enable_prefix_caching=False)

    def pull(references):
        params = []
        for reference in references:
            each = copy.copy(PARAMS)
            each.kv_transfer_params = reference
            params.append(each)
        before = llm.stats.get("kv_nixl_pulled_blocks", 0)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        return [o.outputs[0].token_ids for o in outputs], \
            llm.stats.get("kv_nixl_pulled_blocks", 0) - before

    first = Producer(tiny_llama)
    old = first.references
    assert pull(old) == (baseline, 12)  # handshake with the first agent
    first.kill()
    second = Producer(tiny_llama, port=first.port)
    assert pull(old) == (baseline, 0)  # unknown to the new process: recomputed
    assert pull(second.references) == (baseline, 12)  # a new agent: handshaken again
    assert second.finish() == 0
    llm.close()

"""NixlConnector end to end: a producer process keeps its prompts' blocks, this process
pulls them with NIXL READ over UCX on loopback (CPU memory), and every fault is an
invalid block the engine recomputes: the token ids are always those of a run without a
connector (DESIGN rule 10). The core cases run on a model of one full-attention group
(Llama), of one windowed group (Mistral) and of windowed and full groups (Gemma 3): a
block list per group, a window's blocks only (rule 8)."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import WINDOWED_CHECKPOINTS, build_tiny_model, random_prompts, require_nixl

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.kv_transfer.p2p import consumer
from kvrecover.kv_transfer.p2p.pull_reads import PullReader, staging_layout
from kvrecover.kv_transfer.p2p.staging import (
    DESCRIPTOR_COST_BYTES,
    StagingBuffer,
    StagingPool,
    block_runs,
    staged_blocks,
)

require_nixl()

PRODUCER = Path(__file__).with_name("nixl_producer.py")
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts(2, [61, 45], 384, seed=21)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Producer:
    """The producer process: its references, and the count it still holds at the end."""

    started: list[subprocess.Popen] = []  # killed after each test (`kill_producers`)

    def __init__(self, model: Path, lease_s: float = 60.0, port: int | None = None,
                 store: Path | None = None, engine: dict | None = None,
                 prompts: list[list[int]] | None = None) -> None:
        self.port = free_port() if port is None else port
        prompts = PROMPTS if prompts is None else prompts
        self.process = subprocess.Popen(
            [sys.executable, str(PRODUCER), str(model), str(self.port), str(lease_s),
             json.dumps(prompts), "" if store is None else str(store), json.dumps(engine or {})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        Producer.started.append(self.process)
        assert self.process.stdout is not None
        self.references = []
        for line in self.process.stdout:  # other lines are the libraries' logs
            if line.startswith("REF "):
                self.references.append(json.loads(line[4:]))
                if len(self.references) == len(prompts):
                    break
        assert all(r and r["do_remote_prefill"] for r in self.references), self.references

    def finish(self) -> int:
        """Close its stdin; the number of prompts it still held (bounded wait)."""
        out, _ = self.process.communicate("", timeout=30)
        return int(next(line for line in out.splitlines() if line.startswith("HELD "))[5:])

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture(autouse=True)
def kill_producers():
    """Every producer a test started is killed at its end, passed or failed."""
    yield
    while Producer.started:
        process = Producer.started.pop()
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def count_checks(monkeypatch) -> Counter:
    """Counts the consumer's side-channel checks, by reference handle (from now on)."""
    checks: Counter = Counter()
    lock = threading.Lock()  # async pulls check from their own threads
    real = consumer.call

    def counted(host, port, message, **kwargs):
        if message.get("op") == "check":
            with lock:
                checks[message.get("handle")] += 1
        return real(host, port, message, **kwargs)

    monkeypatch.setattr(consumer, "call", counted)
    return checks


def staged_pulls(reader: PullReader, items: list,
                 buffer: StagingBuffer) -> tuple[torch.Tensor, list[list[int]]]:
    """A READ's staged blocks ((side, cache tensor, row) bytes) and each pull's rows."""
    layout = staging_layout(items, reader.caches)
    rows, start = [], 0
    for pull, _, _ in items:
        rows.append(layout.rows[start:start + len(pull.block_ids)])
        start += len(pull.block_ids)
    return staged_blocks(buffer.rows, len(layout.remote_ids), len(reader.caches)), rows


_BASELINES: dict[Path, list[list[int]]] = {}


def no_connector(model: Path) -> list[list[int]]:
    """The token ids of a run without a connector (once per model)."""
    if model not in _BASELINES:
        llm = LLM(str(model), device="cpu", block_size=8)
        _BASELINES[model] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
        llm.close()
    return _BASELINES[model]


@pytest.fixture(scope="module")
def baseline(tiny_llama) -> list[list[int]]:
    return no_connector(tiny_llama)


def load_id(value: object) -> str | None:
    """A case id's loading part ("sync"/"async"); pytest's default id for the rest."""
    return ("async" if value else "sync") if isinstance(value, bool) else None


def tiny_model(name: str, tiny_llama: Path, tmp_path_factory) -> Path:
    """Llama (one full-attention group), Mistral (one windowed group), Gemma 3 (windowed
    and full groups)."""
    if name == "llama":
        return tiny_llama
    return build_tiny_model(tmp_path_factory.mktemp(name), **WINDOWED_CHECKPOINTS[name])


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma3"])
def model(request, tiny_llama, tmp_path_factory) -> Path:
    """Each of `tiny_model`'s checkpoints."""
    return tiny_model(request.param, tiny_llama, tmp_path_factory)


@dataclass
class Consumed:
    """A consumer run: token ids, stats, seconds, outputs, and the blocks a full pull of
    each prompt reads (every group's, a window's from its first loaded block)."""

    ids: list[list[int]]
    stats: dict[str, int]
    elapsed: float
    outputs: list
    full_pulls: list[int]

    @property
    def pulled(self) -> int:
        return self.stats.get("kv_nixl_pulled_blocks", 0)


def with_references(references: list[dict | None]) -> list[SamplingParams]:
    """PARAMS once per prompt, each carrying its reference (None: computed here)."""
    params = []
    for reference in references:
        each = copy.copy(PARAMS)
        each.kv_transfer_params = reference
        params.append(each)
    return params


def consumer_config(async_load: bool, policy: str, store: Path | None,
                    load_timeout_s: float = 10.0) -> KVTransferConfig:
    """A NixlConnector consumer's config; with `store`, a TieredConnector of NIXL first
    and that shared-storage folder behind it."""
    nixl = {"load_timeout_s": load_timeout_s}
    if store is None:
        return KVTransferConfig("NixlConnector", "kv_consumer",
                                {**nixl, "async_load": async_load},
                                kv_load_failure_policy=policy)
    return KVTransferConfig("TieredConnector", "kv_consumer", {"async_load": async_load, "connectors": [
        {"kv_connector": "NixlConnector", "kv_connector_extra_config": nixl},
        {"kv_connector": "SharedStorageConnector",
         "kv_connector_extra_config": {"shared_storage_path": str(store)}}]},
        kv_load_failure_policy=policy)


def consume(model: Path, references: list[dict | None], *, async_load: bool = False,
            policy: str = "recompute", store: Path | None = None,
            load_timeout_s: float = 10.0) -> Consumed:
    transfer = consumer_config(async_load, policy, store, load_timeout_s)
    llm = LLM(str(model), device="cpu", block_size=8, num_kv_blocks=128,
              kv_transfer_config=transfer)
    params = with_references(references)
    started = time.monotonic()
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    elapsed = time.monotonic() - started
    groups = llm.engine.layout.kv_groups
    llm.close()
    ends = [(len(p) - 1) // 8 for p in PROMPTS]
    full_pulls = [sum(end - g.first_loaded_block(end * 8, 8) for g in groups) for end in ends]
    return Consumed([o.outputs[0].token_ids for o in outputs], llm.stats, elapsed, outputs,
                    full_pulls)


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_pull_is_exact_and_frees_the_producers_blocks(model, async_load):
    producer = Producer(model)
    run = consume(model, producer.references, async_load=async_load)
    assert run.ids == no_connector(model)
    # 61 and 45 tokens: 7 and 5 full blocks below the last token, all pulled.
    assert run.stats["prompt_tokens_external"] == (7 + 5) * 8
    assert run.pulled == sum(run.full_pulls) and run.stats["kv_load_failed_blocks"] == 0
    assert producer.finish() == 0  # released: nothing stays pinned


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_used_producers_descending_blocks_are_read_in_one_descriptor_a_run(
        tiny_llama, baseline, monkeypatch, async_load):
    """A producer that has served before hands a prompt its blocks in the order they
    were freed, a request's tail first: descending ids. The consumer still READs each
    run of consecutive producer ids as one descriptor per (side, cache tensor), not one
    per block (the two prompts' runs, a block apart, as one), and the token ids are
    exact."""
    producer = Producer(tiny_llama, engine={"used": True})
    pulled = [b for r in producer.references for b in r["remote_block_ids"]]
    assert len(block_runs(pulled)) == len(pulled) > 2  # descending: a run per block
    runs = [len(block_runs(sorted(r["remote_block_ids"]))) for r in producer.references]
    assert runs == [1, 1]  # each prompt's, sorted: one run of producer ids
    reads: list[int] = []  # the descriptors of each READ
    read = StagingPool.read

    def counted(self: StagingPool, buffer: StagingBuffer, local: list, *args) -> bool:
        reads.append(len(local))
        return read(self, buffer, local, *args)

    monkeypatch.setattr(StagingPool, "read", counted)
    run = consume(tiny_llama, producer.references, async_load=async_load)
    assert run.ids == baseline
    assert run.pulled == len(pulled) and run.stats["kv_load_failed_blocks"] == 0
    layers = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    assert reads and all(count == 2 * layers for count in reads)  # K, V of each layer
    assert producer.finish() == 0


def test_a_producer_block_two_prompts_share_is_read_once_and_installed_twice(
        tiny_llama, monkeypatch):
    """Two prompts with a common 32-token prefix: the producer's prefix cache gives
    both references the same first blocks (the producer prefills one prompt, then the
    other). A consumer without a prefix cache pulls both prompts in one step: the
    shared blocks are staged once and copied into each prompt's own blocks; the token
    ids are exact."""
    shared = PROMPTS[0][:32]
    prompts = [shared + PROMPTS[0][32:], shared + PROMPTS[1][:29]]
    producer = Producer(tiny_llama, prompts=prompts, engine={"max_num_seqs": 1})  # in turn
    first, second = (r["remote_block_ids"] for r in producer.references)
    assert first[:4] == second[:4] and len(set(first + second)) < len(first + second)
    reads: list[int] = []  # the blocks each READ staged
    read = StagingPool.read
    monkeypatch.setitem(DESCRIPTOR_COST_BYTES, "cpu", 0)  # no gap read: exact counts

    def counted(self: StagingPool, buffer: StagingBuffer, local: list, *args) -> bool:
        reads.append(sum(length for _, length, _ in local) // self.row_nbytes)
        return read(self, buffer, local, *args)

    monkeypatch.setattr(StagingPool, "read", counted)
    params = with_references(producer.references)
    alone = LLM(str(tiny_llama), device="cpu", block_size=8)
    expected = alone.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    alone.close()
    llm = LLM(str(tiny_llama), device="cpu", block_size=8, num_kv_blocks=128,
              enable_prefix_caching=False,
              kv_transfer_config=consumer_config(False, "recompute", None))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.close()
    assert [o.outputs[0].token_ids for o in outputs] == \
        [o.outputs[0].token_ids for o in expected]
    assert llm.stats["kv_nixl_pulled_blocks"] == len(first) + len(second)
    assert llm.stats["kv_load_failed_blocks"] == 0
    assert reads == [len(set(first + second))]  # one READ, the shared blocks once
    assert producer.finish() == 0


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_dead_producer_is_recomputed_at_once(model, async_load):
    producer = Producer(model)
    producer.kill()
    run = consume(model, producer.references, async_load=async_load)
    assert run.ids == no_connector(model)
    assert run.stats["kv_load_failed_blocks"] >= sum(run.full_pulls)  # async: asked again
    assert run.elapsed < 5  # refused connections: no wait for load_timeout_s


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_window_the_producer_released_in_part_costs_no_recompute(
        tiny_llama, tmp_path_factory, policy):
    """A producer that prefilled in chunks of 16 tokens released its window's blocks below
    the last chunk's window: the consumer pulls every window it needs, and the margin
    blocks (`first_loaded_block`) it cannot get are invalid blocks no query reads again
    (rule 8): no recompute, no error even under `fail`."""
    model = tiny_model("mistral", tiny_llama, tmp_path_factory)
    producer = Producer(model, engine={"max_num_batched_tokens": 16})
    assert all(0 in r["remote_block_ids"][0] for r in producer.references)  # released some
    run = consume(model, producer.references, policy=policy)
    assert run.ids == no_connector(model) and all(o.error is None for o in run.outputs)
    assert run.stats["prompt_tokens_external"] == (7 + 5) * 8
    assert run.stats["kv_load_failed_blocks"] > 0 and run.stats["kv_load_recomputed_tokens"] == 0
    assert run.pulled + run.stats["kv_load_failed_blocks"] == sum(run.full_pulls)
    assert producer.finish() == 0


def tampered(references: list[dict], change) -> list[dict]:
    result = copy.deepcopy(references)
    change(result[0])
    return result


def each_list(change):
    """Apply `change` to a reference's block list, or to each group's."""
    def apply(reference: dict) -> None:
        ids = reference["remote_block_ids"]
        grouped = isinstance(ids[0], list)
        reference["remote_block_ids"] = [change(g) for g in ids] if grouped else change(ids)
    return apply


BAD_REFERENCES = {
    "out-of-range ids": each_list(lambda ids: [10**6] * len(ids)),
    "other blocks": each_list(lambda ids: ids[::-1]),
    "unknown request": lambda r: r.update(remote_request_id="nobody@0"),
}


def test_another_prompts_reference_is_refused(tiny_llama, baseline):
    producer = Producer(tiny_llama)
    references = [producer.references[1], producer.references[1]]
    run = consume(tiny_llama, references)
    assert run.ids == baseline
    assert run.pulled == 5  # the second prompt's own
    assert producer.finish() == 1  # the first prompt's, never pulled: left to its lease


@pytest.mark.parametrize("case", list(BAD_REFERENCES))
def test_a_bad_reference_is_recomputed_and_the_others_still_pull(model, case):
    producer = Producer(model)
    references = tampered(producer.references, BAD_REFERENCES[case])
    run = consume(model, references)
    assert run.ids == no_connector(model)
    assert run.pulled == run.full_pulls[1]  # the second prompt's
    producer.kill()


@pytest.mark.parametrize("tiered", [False, True], ids=["nixl", "tiered"])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_prompt_the_consumer_caches_whole_still_releases_its_reference(
        tiny_llama, baseline, tmp_path, async_load, tiered):
    """A consumer whose prefix cache holds every block a reference offers pulls nothing
    from it, but releases it (vLLM's notification on a full local hit): the producer
    frees the kept prompt now, not when its lease ends."""
    store = tmp_path / "store" if tiered else None
    producer = Producer(tiny_llama, store=store)
    llm = LLM(str(tiny_llama), device="cpu", block_size=8, num_kv_blocks=128,
              kv_transfer_config=consumer_config(async_load, "recompute", store))
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS)  # its blocks cached here
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           with_references(producer.references))
    stats = llm.stats
    llm.close()
    assert [o.outputs[0].token_ids for o in outputs] == baseline
    assert stats["prefix_cache_hit_tokens"] == (len(PROMPTS[0]) - 1) // 8 * 8
    assert stats["kv_nixl_pulled_blocks"] == (len(PROMPTS[1]) - 1) // 8  # the other's only
    assert producer.finish() == 0  # both released


def test_a_reference_used_twice_is_refused_the_second_time(tiny_llama, baseline):
    producer = Producer(tiny_llama)
    first = consume(tiny_llama, producer.references)
    assert first.ids == baseline and first.pulled == 12
    again = consume(tiny_llama, producer.references)
    assert again.ids == baseline
    assert again.pulled == 0 and again.stats["kv_load_failed_blocks"] == 12
    assert producer.finish() == 0


def test_an_expired_lease_frees_the_blocks_and_is_recomputed(tiny_llama, baseline):
    producer = Producer(tiny_llama, lease_s=1.0)
    time.sleep(2.0)
    run = consume(tiny_llama, producer.references)
    assert run.ids == baseline and run.pulled == 0
    assert producer.finish() == 0


def test_policy_fail_ends_only_the_request_whose_pull_failed(model):
    producer = Producer(model)
    references = tampered(producer.references, BAD_REFERENCES["unknown request"])
    run = consume(model, references, policy="fail")
    assert run.outputs[0].outputs[0].finish_reason == "error"
    assert run.outputs[0].error_type == "kv_load_failed"
    assert run.ids[1] == no_connector(model)[1] and run.outputs[1].error is None
    producer.kill()


@pytest.mark.parametrize("change", [
    lambda r: r.update(remote_port="x"), lambda r: r.pop("remote_block_ids"),
    lambda r: r.update(tp_size=2), lambda r: r.update(kv_fingerprint="0" * 16)],
    ids=["port", "no-blocks", "tp", "fingerprint"])
def test_malformed_or_foreign_params_compute_the_prompt_here(tiny_llama, baseline, change):
    producer = Producer(tiny_llama)
    run = consume(tiny_llama, tampered(producer.references, change))
    assert run.ids == baseline and all(o.error is None for o in run.outputs)
    assert run.pulled == 5
    producer.kill()


def test_a_restarted_producer_is_handshaken_again_and_its_old_references_refused(
        tiny_llama, baseline):
    """Same address, new process: a new agent and new memory. The consumer (one engine
    for all three pulls) never reads the old registration."""
    transfer = KVTransferConfig("NixlConnector", "kv_consumer", {"load_timeout_s": 10.0})
    llm = LLM(str(tiny_llama), device="cpu", block_size=8, num_kv_blocks=128,
              kv_transfer_config=transfer, enable_prefix_caching=False)

    def pull(references):
        params = with_references(references)
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

"""NixlConnector faults around the READ itself (issue 42): the producer SIGKILLed during
the READ or after it (before the release), a READ that ends in NIXL's error state, a READ
that delivers some blocks' bytes wrong, a consumer that holds a prefix of the prompt
already, and a producer that refuses a pull (the consumer falls back at once, not at its
load_timeout_s). The producer runs in its own process; the faults are injected in this
one (the consumer's connector, its NIXL agent and its side-channel calls are wrapped).
Under `recompute` the token ids are those of a run without a connector; under `fail`
only the requests whose blocks were lost end in an error (rule 10)."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import require_nixl
from test_nixl_connector import (  # noqa: F401 - kill_producers: an autouse fixture
    BAD_REFERENCES,
    PARAMS,
    PROMPTS,
    Consumed,
    Producer,
    consume,
    consumer_config,
    count_checks,
    kill_producers,
    load_id,
    no_connector,
    staged_pulls,
    tampered,
    tiny_model,
    with_references,
)

from kvrecover import LLM
from kvrecover.kv_groups import KVCacheGroup
from kvrecover.kv_transfer.p2p import consumer, nixl_connector
from kvrecover.kv_transfer.p2p.nixl_connector import Pull
from kvrecover.kv_transfer.p2p.peers import Peer
from kvrecover.kv_transfer.p2p.pull_reads import PullReader
from kvrecover.kv_transfer.p2p.side_channel import call
from kvrecover.kv_transfer.p2p.staging import StagingBuffer

require_nixl()

LONG_TIMEOUT_S = 60.0  # a pull that waited for it would fail the elapsed bounds below
RELEASE_HANG_S = 3.0
FAST_S = 5.0  # a generous bound on a fallback that must not wait (a loaded 2-core box)

sync_async = pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])


# Every pair of (model, loading, policy) values once, not the whole product: each case
# starts a producer process, and these checks do not depend on three values together.
models_loads_policies = pytest.mark.parametrize("model,async_load,policy", [
    ("llama", False, "recompute"), ("llama", True, "fail"),
    ("gemma3", False, "fail"), ("gemma3", True, "recompute")], indirect=["model"], ids=load_id)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tiny_llama, tmp_path_factory) -> Path:
    """A model of one full-attention group, and one of a windowed and a full group (a
    windowed group alone, Mistral, takes the same paths: test_nixl_connector covers it)."""
    return tiny_model(request.param, tiny_llama, tmp_path_factory)


def affected_first(producer: Producer, policy: str) -> list[dict | None]:
    """The references a faulty pull is given: both prompts' under `recompute`; under `fail`
    the first prompt's only (the second is computed here and must end as without a fault)."""
    first, second = producer.references
    return [first, second] if policy == "recompute" else [first, None]


def assert_outcome(run: Consumed, model: Path, policy: str, failed: set[int]) -> None:
    """Exact token ids, except under `fail` the requests `failed` end in kv_load_failed."""
    baseline = no_connector(model)
    for i, output in enumerate(run.outputs):
        if policy == "fail" and i in failed:
            assert output.outputs[0].finish_reason == "error" and \
                output.error_type == "kv_load_failed", i
        else:
            assert output.error is None and run.ids[i] == baseline[i], i


def pulled_blocks(groups: list[KVCacheGroup], first: int, end: int) -> int:
    """The blocks a pull of prompt blocks first..end reads (a window's from its first
    loaded block)."""
    return sum(end - max(first, g.first_loaded_block(end * 8, 8)) for g in groups)


class Killer:
    """Kills the producer once (thread-safe: async pulls run on their own threads)."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.killed = False
        self._lock = threading.Lock()

    def kill(self) -> None:
        with self._lock:
            if not self.killed:
                self.producer.kill()
                self.killed = True


@models_loads_policies
def test_a_producer_killed_as_the_read_is_posted_is_recomputed_in_bounded_time(
        model, monkeypatch, async_load, policy):
    """The check answered, then the producer dies before its READ is posted: the READ
    errors or never completes, and the pull ends by its deadline at the latest."""
    producer = Producer(model)
    killer = Killer(producer)
    read = PullReader.read

    def killed_first(self: PullReader, agent: str, items: list, deadline: float) -> Any:
        killer.kill()
        return read(self, agent, items, deadline)

    monkeypatch.setattr(PullReader, "read", killed_first)
    timeout_s = 3.0
    run = consume(model, affected_first(producer, policy), async_load=async_load,
                  policy=policy, load_timeout_s=timeout_s)
    assert killer.killed
    assert_outcome(run, model, policy, failed={0})
    assert run.pulled == 0 and run.stats["kv_load_failed_blocks"] >= run.full_pulls[0]
    # Each pull is bounded by its deadline (two in turn at most), plus the recompute.
    assert run.elapsed < 2 * timeout_s + FAST_S


@models_loads_policies
def test_a_producer_killed_after_the_read_before_the_release_costs_nothing(
        model, monkeypatch, async_load, policy):
    """Every block was read and verified; the producer dies before the consumer's release
    reaches it: the release fails without a wait and no request is recomputed or failed."""
    producer = Producer(model)
    killer = Killer(producer)
    install = PullReader.install
    installed: list[str] = []

    def counted(self: PullReader, items: list, buffer: StagingBuffer, fence: Any) -> set[int]:
        bad = install(self, items, buffer, fence)
        installed.extend(pull.request_id for pull, _, _ in items)
        return bad

    def release_to_the_dead(host: str, port: int, message: dict,
                            timeout_s: float = 5.0) -> dict:
        # Killed before the first release that comes after both reads (in sync loading
        # both are read in one step; async pulls release each after its own read).
        if message.get("op") == "release" and len(installed) == len(PROMPTS):
            killer.kill()
        return call(host, port, message, timeout_s=timeout_s)

    monkeypatch.setattr(PullReader, "install", counted)
    monkeypatch.setattr(consumer, "call", release_to_the_dead)
    run = consume(model, producer.references, async_load=async_load, policy=policy,
                  load_timeout_s=LONG_TIMEOUT_S)
    assert killer.killed
    assert_outcome(run, model, policy, failed=set())
    assert run.pulled == sum(run.full_pulls) and run.stats["kv_load_failed_blocks"] == 0
    assert run.stats["kv_load_recomputed_tokens"] == 0
    assert run.elapsed < FAST_S


class FailingReads:
    """A NIXL agent whose READs end in the error state: `transfer` posts nothing and
    answers "ERR", as `check_xfer_state` does; everything else is the real agent's."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.agent, name)

    def transfer(self, handle: Any) -> str:
        self.failed += 1
        return "ERR"

    def check_xfer_state(self, handle: Any) -> str:
        return "ERR"


@models_loads_policies
def test_a_read_in_the_error_state_is_recomputed_at_once(model, monkeypatch, async_load,
                                                         policy):
    agents: list[FailingReads] = []
    make_agent = nixl_connector._nixl_agent

    def failing_agent(name: str, gpu: bool = False) -> FailingReads:
        agents.append(FailingReads(make_agent(name, gpu)))
        return agents[-1]

    monkeypatch.setattr(nixl_connector, "_nixl_agent", failing_agent)
    producer = Producer(model)  # its own process: its agent is not wrapped
    run = consume(model, affected_first(producer, policy), async_load=async_load,
                  policy=policy, load_timeout_s=LONG_TIMEOUT_S)
    [agent] = agents
    assert agent.failed >= 1
    assert_outcome(run, model, policy, failed={0})
    assert run.pulled == 0 and run.stats["kv_load_failed_blocks"] >= run.full_pulls[0]
    assert run.elapsed < FAST_S  # not at load_timeout_s
    # Released though not read; under `fail` the second prompt's was never asked for.
    assert producer.finish() == (0 if policy == "recompute" else 1)


@pytest.mark.parametrize("model,async_load,policy,checksum", [
    ("llama", False, "recompute", "xxh3"), ("llama", True, "fail", "fold64"),
    ("gemma3", False, "fail", "fold64"), ("gemma3", True, "recompute", "fold64"),
    ("gemma3", True, "fail", "xxh3")], indirect=["model"], ids=load_id)  # each pair once
def test_a_read_that_delivers_some_blocks_wrong_invalidates_exactly_those(
        model, monkeypatch, async_load, policy, checksum):
    """The READ completes, but two of the first prompt's staged blocks are not what the
    producer holds: its first block's bytes altered, its last block's never written
    (zeros). Exactly those two are invalid; every other block is used. By either
    checksum a producer may answer (fold64 is a GPU's default; the consumer follows the
    producer's handshake)."""
    producer = Producer(model, engine={"nixl": {"checksum": checksum}})
    handle = producer.references[0]["remote_request_id"]
    install = PullReader.install
    corrupted: list[int] = []
    reported: set[int] = set()
    row_nbytes: list[int] = []

    def partly_wrong(self: PullReader, items: list[tuple[Pull, Peer, list[int]]],
                     buffer: StagingBuffer, fence: Any) -> set[int]:
        row_nbytes.append(buffer.rows.shape[1])  # a block's K and V in every cache tensor
        blocks, rows = staged_pulls(self, items, buffer)
        for (pull, _, _), pull_rows in zip(items, rows):
            if pull.reference.request_id == handle:
                blocks[0, 0, pull_rows[0], 0] ^= 0xFF
                blocks[:, :, pull_rows[-1]].zero_()
                corrupted.extend([pull.block_ids[0], pull.block_ids[-1]])
        bad = install(self, items, buffer, fence)
        reported.update(bad)
        return bad

    monkeypatch.setattr(PullReader, "install", partly_wrong)
    checks = count_checks(monkeypatch)
    run = consume(model, producer.references, async_load=async_load, policy=policy)
    assert len(set(corrupted)) == 2 and reported == set(corrupted)
    assert_outcome(run, model, policy, failed={0})
    assert run.pulled == sum(run.full_pulls) - 2
    # Every block was read once (the two bad ones too; short gaps between runs besides),
    # and the READ and check were timed.
    blocks_read, rest = divmod(run.stats["kv_nixl_read_bytes"], row_nbytes[0])
    assert rest == 0 and sum(run.full_pulls) <= blocks_read <= 2 * sum(run.full_pulls)
    assert run.stats["kv_nixl_read_microseconds"] > 0
    assert run.stats["kv_nixl_check_microseconds"] > 0
    # An async load that failed in part is asked for again; its reference, released
    # after the first pull, claims nothing then: no second check, no more failed blocks.
    assert run.stats["kv_load_failed_blocks"] == 2
    assert checks == Counter(r["remote_request_id"] for r in producer.references)
    assert producer.finish() == 0


@sync_async
def test_a_consumer_that_caches_a_prefix_pulls_only_the_rest(model, async_load):
    """Prefix caching on: the first 24 tokens of the first prompt were computed here
    before; its pull reads the blocks after them only (those of its windows it needs)."""
    producer = Producer(model)
    llm = LLM(str(model), device="cpu", block_size=8, num_kv_blocks=128,
              kv_transfer_config=consumer_config(async_load, "recompute", None))
    llm.generate([{"prompt_token_ids": PROMPTS[0][:24]}], PARAMS)
    hits = llm.stats["prefix_cache_hit_tokens"]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           with_references(producer.references))
    stats = llm.stats
    groups = llm.engine.layout.kv_groups
    llm.close()
    assert [o.outputs[0].token_ids for o in outputs] == no_connector(model)
    first = (stats["prefix_cache_hit_tokens"] - hits) // 8
    assert first == 3  # the prefix's three full blocks
    ends = [(len(p) - 1) // 8 for p in PROMPTS]
    expected = pulled_blocks(groups, first, ends[0]) + pulled_blocks(groups, 0, ends[1])
    assert stats["kv_nixl_pulled_blocks"] == expected
    assert expected < pulled_blocks(groups, 0, ends[0]) + pulled_blocks(groups, 0, ends[1])
    assert stats["prompt_tokens_external"] == (ends[0] - first + ends[1]) * 8
    assert stats["kv_load_failed_blocks"] == 0
    assert producer.finish() == 0


@pytest.mark.parametrize("case,model,async_load", [
    ("unknown request", "llama", False), ("unknown request", "gemma3", True),
    ("other blocks", "llama", True), ("other blocks", "gemma3", False),
    ("released", "llama", False), ("released", "gemma3", True)],
    indirect=["model"], ids=load_id)  # every pair of values once
def test_a_producer_that_cannot_serve_a_read_says_so_at_once(model, async_load, case):
    """With load_timeout_s 60, a pull the producer refuses (a reference it never held,
    blocks that are not the reference's, one released already) falls back within
    seconds: the refusal is an answer, not a wait."""
    producer = Producer(model)
    if case == "released":
        first = consume(model, producer.references)
        assert first.pulled == sum(first.full_pulls)
        references = producer.references
    else:
        references = tampered(producer.references, BAD_REFERENCES[case])
    run = consume(model, references, async_load=async_load, load_timeout_s=LONG_TIMEOUT_S)
    assert run.ids == no_connector(model)
    assert run.elapsed < FAST_S
    refused = 0 if case == "released" else 1  # the second prompt's is still good
    assert run.pulled == refused * run.full_pulls[1]
    producer.kill()



@sync_async
def test_a_producer_that_never_answers_costs_no_more_than_load_timeout_s(
        tiny_llama, async_load):
    """Both references name a side channel that takes the connection but never answers:
    the checks wait no longer than load_timeout_s (1 s) in all, not a side-channel call's
    5 s each (a sync step checked its pulls one after the other: 10 s)."""
    producer = Producer(tiny_llama)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # never accepted: the consumer's call waits for an answer
        port = silent.getsockname()[1]
        references = [{**r, "remote_port": port} for r in producer.references]
        run = consume(tiny_llama, references, async_load=async_load, load_timeout_s=1.0)
    assert run.ids == no_connector(tiny_llama) and run.pulled == 0
    assert run.elapsed < 4.0
    producer.kill()


@sync_async
def test_a_producer_slow_to_take_releases_does_not_hold_up_the_requests(
        tiny_llama, monkeypatch, async_load):
    """Each release waits RELEASE_HANG_S before it fails: the step (sync) or the pull's
    thread (async) tells the producer from a thread of its own, so the requests finish
    as if it answered at once (before, a pull's request waited for its release)."""
    producer = Producer(tiny_llama)
    real = consumer.call

    def slow_release(host: str, port: int, message: dict, **kwargs: Any) -> dict:
        if message.get("op") == "release":
            time.sleep(RELEASE_HANG_S)
            raise consumer.SideChannelError("the producer took too long")
        return real(host, port, message, **kwargs)

    monkeypatch.setattr(consumer, "call", slow_release)
    run = consume(tiny_llama, producer.references, async_load=async_load)
    assert run.ids == no_connector(tiny_llama)
    assert run.pulled == sum(run.full_pulls) and run.stats["kv_load_failed_blocks"] == 0
    assert run.elapsed < RELEASE_HANG_S, f"{run.elapsed:.2f} s: a request waited for a release"
    producer.kill()


@pytest.mark.parametrize("field,value", [("checksum", "md5"), ("memory", "HBM"),
                                         ("device_id", -1), ("device_id", True)])
def test_a_handshake_of_unknown_memory_or_checksum_is_refused_and_recomputed(
        tiny_llama, monkeypatch, field, value):
    """The producer's handshake names its cache's memory, device and checksum algorithm;
    one this consumer cannot read or check is refused: nothing is pulled, all is
    recomputed, exact."""
    producer = Producer(tiny_llama)
    real = consumer.call

    def foreign(host: str, port: int, message: dict, **kwargs: Any) -> dict:
        answer = real(host, port, message, **kwargs)
        if message.get("op") == "handshake":
            answer[field] = value
        return answer

    monkeypatch.setattr(consumer, "call", foreign)
    run = consume(tiny_llama, producer.references)
    assert run.ids == no_connector(tiny_llama)
    assert run.pulled == 0 and run.stats["kv_load_failed_blocks"] == sum(run.full_pulls)
    assert "kv_nixl_read_bytes" not in run.stats


MISSING = object()


@sync_async
@pytest.mark.parametrize("field,value", [("num_blocks", MISSING), ("num_blocks", None),
                                         ("regions", [[0, None]]), ("metadata", MISSING)])
def test_a_malformed_handshake_answer_is_refused_and_recomputed(
        tiny_llama, monkeypatch, field, value, async_load):
    """The producer's answers are untrusted input: a handshake missing a field or giving
    one of the wrong type refuses the pull (sync or async: no pull thread dies with its
    blocks counted as loaded); everything is recomputed, exact."""
    producer = Producer(tiny_llama)
    real = consumer.call

    def malformed(host: str, port: int, message: dict, **kwargs: Any) -> dict:
        answer = real(host, port, message, **kwargs)
        if message.get("op") == "handshake":
            if value is MISSING:
                del answer[field]
            else:
                answer[field] = value
        return answer

    monkeypatch.setattr(consumer, "call", malformed)
    run = consume(tiny_llama, producer.references, async_load=async_load)
    assert run.ids == no_connector(tiny_llama)
    assert run.pulled == 0 and run.stats["kv_load_failed_blocks"] == sum(run.full_pulls)

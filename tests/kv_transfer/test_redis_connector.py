"""RedisConnector against a real redis-server: disaggregated prefill and decode, and
every way the store can fail (DESIGN.md recovery rules; issue #10).

Each test starts from an empty server (conftest.py starts one per session on a free
port). Outputs are compared token for token with an engine without any connector.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis
from conftest import greedy_token_ids
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_helpers import FaultyProxy, SilentServer

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.kv_transfer.redis.connector import RedisConnector

VOCAB = 384  # the tiny models of conftest.py
MAX_TOKENS = 4
REPO = Path(__file__).resolve().parents[2]
# A (4 full blocks) and B (3) are stored by the prefill; C is not.
PROMPT_A = [random.Random(1).randrange(2, VOCAB) for _ in range(70)]
PROMPT_B = [random.Random(2).randrange(2, VOCAB) for _ in range(50)]
PROMPT_C = [random.Random(3).randrange(2, VOCAB) for _ in range(40)]
LOADABLE = {"A": 64, "B": 48}


def redis_transfer(url: str, role: str = "kv_both", policy: str = "recompute",
                   **extra) -> KVTransferConfig:
    return KVTransferConfig("RedisConnector", role, {"url": url, **extra},
                            kv_load_failure_policy=policy)


def make_llm(model: Path, transfer: KVTransferConfig | None = None) -> LLM:
    return LLM(str(model), device="cpu", block_size=16, max_num_batched_tokens=64,
               num_kv_blocks=256, kv_transfer_config=transfer)


@functools.cache
def _baseline(model: str, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    return greedy_token_ids(make_llm(Path(model)), [list(p) for p in prompts], MAX_TOKENS)


def baseline(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return _baseline(str(model), tuple(tuple(p) for p in prompts))


def prefill(model: Path, url: str, prompts: list[list[int]]) -> dict:
    llm = make_llm(model, redis_transfer(url, "kv_producer"))
    greedy_token_ids(llm, prompts, 1)
    return llm.stats


def run(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def stored_keys(server) -> set[bytes]:
    return set(server.client().keys("*"))


# ----- prefill and decode through Redis ---------------------------------------------------
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("transport", ["tcp", "unix", "valkey"])
def test_decode_loads_what_prefill_stored(tiny_llama, redis_server, transport, async_load):
    url = {"tcp": redis_server.url, "unix": redis_server.unix_url,
           "valkey": redis_server.url.replace("redis://", "valkey://")}[transport]
    prompts = [PROMPT_A, PROMPT_B, PROMPT_C]
    stats = prefill(tiny_llama, url, [PROMPT_A, PROMPT_B])
    assert stats["prompt_tokens_external"] == 0 and stats["kv_save_failed_blocks"] == 0
    assert len(stored_keys(redis_server)) == 4 + 3
    commands_before = redis_server.client().info("commandstats")

    llm = make_llm(tiny_llama, redis_transfer(url, "kv_consumer", async_load=async_load))
    assert greedy_token_ids(llm, prompts, MAX_TOKENS) == baseline(tiny_llama, prompts)
    stats = llm.stats
    assert stats["prompt_tokens_external"] == 64 + 48
    assert stats["prompt_tokens_computed"] == 70 + 50 + 40 - 64 - 48
    assert stats["kv_load_failed_blocks"] == 0
    # Bounded reads: one GETRANGE per loaded block (pipelined), never a whole-value GET.
    commands = redis_server.client().info("commandstats")
    reads = commands["cmdstat_getrange"]["calls"] - commands_before.get(
        "cmdstat_getrange", {}).get("calls", 0)
    assert reads == 4 + 3
    assert "cmdstat_get" not in commands and "cmdstat_mget" not in commands


def test_keys_carry_prefix_fingerprint_and_ttl(tiny_llama, redis_server):
    transfer = redis_transfer(redis_server.url, "kv_producer", key_prefix="team-a:", ttl_s=600)
    llm = make_llm(tiny_llama, transfer)
    greedy_token_ids(llm, [PROMPT_B], 1)
    keys = stored_keys(redis_server)
    fingerprint = llm.engine.layout.fingerprint
    assert len(keys) == 3 and all(k.startswith(f"team-a:{fingerprint}:".encode()) for k in keys)
    ttls = [redis_server.client().ttl(k) for k in keys]
    assert all(0 < ttl <= 600 for ttl in ttls)
    # Another prefix is another namespace: nothing to load there.
    consumer = make_llm(tiny_llama, redis_transfer(redis_server.url, "kv_consumer"))
    assert greedy_token_ids(consumer, [PROMPT_B], MAX_TOKENS) == baseline(tiny_llama, [PROMPT_B])
    assert consumer.stats["prompt_tokens_external"] == 0


DECODE_SCRIPT = r"""
import json, logging, sys
import torch
torch.set_num_threads(1)
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
from kvrecover import LLM, KVTransferConfig, SamplingParams
args = json.loads(sys.argv[1])
transfer = KVTransferConfig("RedisConnector", args["role"], args["extra"])
llm = LLM(args["model"], device="cpu", block_size=16, max_num_batched_tokens=64,
          num_kv_blocks=256, kv_transfer_config=transfer)
print(repr(llm.engine.model_runner.connector), file=sys.stderr)
params = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
outputs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params)
print(json.dumps({"token_ids": [o.outputs[0].token_ids for o in outputs], "stats": llm.stats}))
"""


def run_process(model: Path, role: str, extra: dict, prompts: list[list[int]], max_tokens: int,
                env: dict | None = None) -> tuple[dict, str]:
    """One engine in its own process; returns (its JSON result, its stderr)."""
    arguments = json.dumps({"model": str(model), "role": role, "extra": extra,
                            "prompts": prompts, "max_tokens": max_tokens})
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    environment.pop("KVRECOVER_REDIS_PASSWORD", None)
    environment.update(env or {})
    result = subprocess.run([sys.executable, "-c", DECODE_SCRIPT, arguments], capture_output=True,
                            text=True, timeout=300, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stdout + result.stderr


@pytest.mark.slow
def test_prefill_and_decode_processes_through_a_password_protected_redis(tiny_llama,
                                                                       own_redis_server):
    password = "pw-Zq8#not-in-logs"
    server = own_redis_server(password=password)
    prompts = [PROMPT_A, PROMPT_B]
    quoted = password.replace("#", "%23")
    # The prefill takes the password from the URL, the decode from the environment.
    _, prefill_log = run_process(
        tiny_llama, "kv_producer", {"url": f"redis://:{quoted}@127.0.0.1:{server.port}/0"},
        prompts, 1)
    assert len(stored_keys(server)) == 4 + 3
    result, decode_log = run_process(
        tiny_llama, "kv_consumer", {"url": server.url}, prompts, MAX_TOKENS,
        env={"KVRECOVER_REDIS_PASSWORD": password})
    assert result["token_ids"] == baseline(tiny_llama, prompts)
    assert result["stats"]["prompt_tokens_external"] == 64 + 48
    assert "RedisConnector(worker" in decode_log and "***@127.0.0.1" in prefill_log
    assert password not in prefill_log and quoted not in prefill_log
    assert password not in decode_log


def test_wrong_password_is_a_miss_and_never_logged(tiny_llama, own_redis_server, caplog):
    server = own_redis_server(password="right-password")
    prefill(tiny_llama, f"redis://:right-password@127.0.0.1:{server.port}/0", [PROMPT_B])
    url = f"redis://:wrong-password-123@127.0.0.1:{server.port}/0"
    caplog.set_level(logging.DEBUG)
    llm = make_llm(tiny_llama, redis_transfer(url))
    assert greedy_token_ids(llm, [PROMPT_B], MAX_TOKENS) == baseline(tiny_llama, [PROMPT_B])
    assert llm.stats["prompt_tokens_external"] == 0
    assert llm.stats["kv_save_failed_blocks"] == 3
    connector = llm.engine.model_runner.connector
    shown = caplog.text + repr(connector) + repr(connector.store) + str(connector.extra())
    assert "Redis" in caplog.text  # the failure was logged...
    assert "wrong-password-123" not in shown  # ...without the password
    assert "right-password" not in shown


# ----- store failures: recovery under each policy, sync and async ------------------------
class EvictingRedisConnector(RedisConnector):
    """Deletes the stored blocks of the first request that plans a load, right after its
    lookup found them: the keys are gone between lookup and load."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.evicted: list[str] = []

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens > 0 and not self.evicted:
            first = request.num_computed_tokens // self.block_size
            keys = request.block_hashes[first : first + num_external_tokens // self.block_size]
            admin = redis.Redis.from_url(self.store.settings.url)  # the store's client is async
            admin.delete(*[self.store.redis_key(key) for key in keys])
            admin.close()
            self.evicted.append(request.request_id)
        super().update_state_after_alloc(request, block_ids, num_external_tokens)


def corrupt_one_block(server, keys: set[bytes]) -> None:
    """Flip one payload byte of one stored value in place."""
    key = sorted(keys)[0]
    client = server.client()
    offset = client.strlen(key) // 2
    byte = client.getrange(key, offset, offset)
    client.setrange(key, offset, bytes([byte[0] ^ 0x5A]))


FAULTS = ["refused", "killed-mid-load", "timeout-mid-load", "evicted-after-lookup",
          "corrupted", "restarted-before-decode", "never-answers"]
# Which prompts lose loaded blocks (and so fail under policy "fail").
AFFECTED = {"refused": "", "killed-mid-load": "AB", "timeout-mid-load": "AB",
            "evicted-after-lookup": "A", "corrupted": "A", "restarted-before-decode": "",
            "never-answers": ""}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fault", FAULTS)
def test_store_failure_becomes_recovery(tiny_llama, own_redis_server, fault, async_load, policy):
    server = own_redis_server()
    prompts = {"A": PROMPT_A, "B": PROMPT_B, "C": PROMPT_C}
    keys_before = set()
    prefill(tiny_llama, server.url, [PROMPT_A])
    keys_of_a = stored_keys(server)
    prefill(tiny_llama, server.url, [PROMPT_B])
    keys_before = stored_keys(server)
    assert len(keys_of_a) == 4 and len(keys_before) == 7

    # Short timeouts where the fault is silence (the black hole's lookups, before it
    # swallows the load, still need to pass on a busy machine); elsewhere more room.
    timeout_s = {"timeout-mid-load": 2.0, "never-answers": 1.0}.get(fault, 5.0)
    extra = {"async_load": async_load, "timeout_s": timeout_s}
    url, helper, connector = server.url, None, "RedisConnector"
    if fault == "refused":
        server.stop()
    elif fault in ("killed-mid-load", "timeout-mid-load"):
        helper = FaultyProxy(server.port, "kill" if fault == "killed-mid-load" else "blackhole",
                             kill=server.kill)
        url = helper.url
    elif fault == "evicted-after-lookup":
        connector = "EvictingRedisConnector"
    elif fault == "corrupted":
        corrupt_one_block(server, keys_of_a)
    elif fault == "restarted-before-decode":
        server.stop()
        server.start(keep_port=True)  # no persistence: the store comes back empty
    elif fault == "never-answers":
        helper = SilentServer()
        url = helper.url
    transfer = KVTransferConfig(connector, "kv_both", {"url": url, **extra},
                                kv_connector_module_path=__name__ if connector != "RedisConnector"
                                else None, kv_load_failure_policy=policy)

    outcome: dict = {}

    def decode() -> None:
        llm = make_llm(tiny_llama, transfer)
        outcome["outputs"] = run(llm, list(prompts.values()))
        outcome["stats"] = llm.stats

    worker = threading.Thread(target=decode, daemon=True)
    worker.start()
    worker.join(timeout=240)  # bounded by timeout_s; this only guards against a hang
    if helper is not None:
        helper.stop()
    assert not worker.is_alive(), "decode hung on a failing store"
    assert "outputs" in outcome, "decode raised"

    # Both lookups come before either load starts (sync: one batched read; async: A and B
    # park in the same step), and the proxy's fault lands before any other load goes on:
    # A's and B's loads fail whichever of them reaches the server first.
    affected = AFFECTED[fault]
    expected = dict(zip(prompts, baseline(tiny_llama, list(prompts.values()))))
    stats = outcome["stats"]
    for name, output in zip(prompts, outcome["outputs"]):
        completion = output.outputs[0]
        if policy == "fail" and name in affected:
            assert completion.finish_reason == "error" and completion.token_ids == [], name
        else:
            assert completion.token_ids == expected[name], name
    if affected:
        assert stats["kv_load_failed_blocks"] >= 1
        if policy == "fail":
            assert stats["kv_load_failed_requests"] == len(affected)
        else:  # a retried lookup may find (and fail on) the same bad entry once more
            assert stats["kv_load_recovered_requests"] >= len(affected)
    else:
        assert stats["kv_load_failed_blocks"] == 0 and stats["kv_load_failed_requests"] == 0
    if fault in ("refused", "never-answers"):  # nothing loaded; every save failed, counted
        assert stats["prompt_tokens_external"] == 0
        assert stats["kv_save_failed_blocks"] == 4 + 3 + 2
    if fault == "never-answers":
        assert helper.connections >= 1
    if fault in ("killed-mid-load", "timeout-mid-load"):
        assert helper.triggered.is_set()
    if fault == "restarted-before-decode":
        assert stats["prompt_tokens_external"] == 0
    if fault == "evicted-after-lookup" and policy == "recompute":
        assert stats["prompt_tokens_external"] == LOADABLE["B"]  # B still loaded, A not
    if fault == "corrupted" and policy == "recompute":  # B and A's blocks before the bad one
        assert LOADABLE["B"] <= stats["prompt_tokens_external"] < LOADABLE["A"] + LOADABLE["B"]


def test_no_load_is_answered_once_the_faulty_proxy_saw_the_first(own_redis_server):
    """The fault lands before any other connection's load goes on, however slowly the
    proxy's thread breaks the server (a loaded machine): which request's load arrives
    first must not decide whether another one is answered."""
    server = own_redis_server()
    server.client().set(b"block", b"payload")
    first_seen = threading.Event()

    def slow_kill() -> None:
        first_seen.set()
        threading.Event().wait(0.5)  # the proxy's thread is preempted before the kill lands
        server.kill()

    proxy = FaultyProxy(server.port, "kill", kill=slow_kill)
    first, second = (redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=5,
                                 retry=Retry(NoBackoff(), 0)) for _ in range(2))
    try:
        assert second.ping()  # connected through the proxy before the first load
        loads = threading.Thread(target=lambda: _swallow(first.getrange, b"block", 0, -1),
                                 daemon=True)
        loads.start()
        assert first_seen.wait(10)
        with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
            second.getrange(b"block", 0, -1)
        loads.join(10)
    finally:
        proxy.stop()
        first.close()
        second.close()


def _swallow(call, *args) -> None:
    try:
        call(*args)
    except redis.RedisError:
        pass


def test_restart_with_persistence_keeps_serving_through_stale_connections(tiny_llama,
                                                                          own_redis_server):
    server = own_redis_server()
    prefill(tiny_llama, server.url, [PROMPT_A, PROMPT_B])
    llm = make_llm(tiny_llama, redis_transfer(server.url, "kv_consumer"))
    assert greedy_token_ids(llm, [PROMPT_A], MAX_TOKENS) == baseline(tiny_llama, [PROMPT_A])
    assert llm.stats["prompt_tokens_external"] == 64
    server.client().save()  # the dump survives the restart; pooled connections do not
    server.stop()
    server.start(keep_port=True)
    assert len(stored_keys(server)) == 7
    assert greedy_token_ids(llm, [PROMPT_B], MAX_TOKENS) == baseline(tiny_llama, [PROMPT_B])
    assert llm.stats["prompt_tokens_external"] == 64 + 48
    assert llm.stats["kv_load_failed_blocks"] == 0


# ----- configuration -----------------------------------------------------------------------
BAD_CONFIGS = {
    "url-scheme": ({"url": "http://127.0.0.1:6379"}, r"\['url'\] must be a redis://"),
    "url-not-a-string": ({"url": 6379}, r"\['url'\] must be a redis://"),
    "ttl": ({"ttl_s": 0}, r"\['ttl_s'\] must be None or a number of seconds > 0, got 0"),
    "timeout": ({"timeout_s": "5"}, r"\['timeout_s'\] must be a number of seconds > 0"),
    "max-connections": ({"max_connections": 0}, r"\['max_connections'\] must be an integer >= 1"),
    "key-prefix": ({"key_prefix": 7}, r"\['key_prefix'\] must be a string, got 7"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_is_a_value_error_naming_the_field(tiny_llama, case):
    extra, message = BAD_CONFIGS[case]
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_llama, KVTransferConfig("RedisConnector", "kv_both", extra))


def test_bad_url_error_hides_the_password(tiny_llama):
    with pytest.raises(ValueError) as error:
        make_llm(tiny_llama, KVTransferConfig("RedisConnector", "kv_both",
                                              {"url": "http://user:hunter2@host:1/0"}))
    assert "hunter2" not in str(error.value) and "***" in str(error.value)


# ----- the reference scenario against Redis ------------------------------------------------
@pytest.mark.slow
def test_scenario_runs_against_redis(tmp_path, own_redis_server):
    from conftest import build_tiny_model

    from kvrecover import scenario

    model = build_tiny_model(tmp_path / "model", seed=4, max_position_embeddings=4096)
    server = own_redis_server(password="scenario-pw")
    environment = {**os.environ, "KVRECOVER_REDIS_PASSWORD": "scenario-pw",
                   "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "kvrecover", "scenario", "--model", str(model), "--device", "cpu",
         "--workdir", str(tmp_path / "work"), "--store", server.url],
        capture_output=True, text=True, timeout=1200, env=environment)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    assert not (tmp_path / "work" / scenario.STORAGE_DIR).exists()  # the KV went to Redis
    assert len(stored_keys(server)) > 0
    baseline_stats = json.loads((tmp_path / "work" / "decode_output.stats.json").read_text())
    assert baseline_stats["prompt_tokens_external"] > 0
    for stem in ("sync_decode_recovered_output", "async_decode_recovered_output"):
        stats = json.loads((tmp_path / "work" / f"{stem}.stats.json").read_text())
        assert stats["kv_load_recovered_requests"] > 0 and stats["kv_load_failed_blocks"] > 0


def test_missing_redis_server_skips_but_fails_in_ci(monkeypatch):
    import shutil

    from redis_helpers import require_redis_server

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="redis-server is not installed"):
        require_redis_server()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require_redis_server()


def test_an_oversized_value_is_rejected_without_reading_it_whole(tiny_llama, redis_server):
    prefill(tiny_llama, redis_server.url, [PROMPT_A, PROMPT_B])
    client = redis_server.client()
    llm = make_llm(tiny_llama, redis_transfer(redis_server.url, "kv_consumer"))
    store = llm.engine.model_runner.connector.store
    victim = sorted(stored_keys(redis_server))[0]
    client.set(victim, b"\x00" * (64 << 20))  # 64 MiB planted under a block's key
    key = bytes.fromhex(victim.decode().rsplit(":", 1)[1])
    (result,) = store.read_many([key])
    assert "larger than" in str(result)
    # The engine recovers from it like from any bad block.
    assert greedy_token_ids(llm, [PROMPT_A, PROMPT_B], MAX_TOKENS) == baseline(
        tiny_llama, [PROMPT_A, PROMPT_B])
    assert llm.stats["kv_load_failed_blocks"] >= 1
    assert llm.stats["kv_load_recovered_requests"] >= 1


def test_reads_ask_for_at_most_one_byte_more_than_an_entry(tiny_llama, redis_server,
                                                           monkeypatch):
    prefill(tiny_llama, redis_server.url, [PROMPT_B])
    llm = make_llm(tiny_llama, redis_transfer(redis_server.url, "kv_consumer"))
    store = llm.engine.model_runner.connector.store
    requested = []
    pipeline_class = type(store.client.pipeline())
    original = pipeline_class.getrange

    def spy(self, key, start, end):
        requested.append(end - start + 1)
        return original(self, key, start, end)

    monkeypatch.setattr(pipeline_class, "getrange", spy)
    assert greedy_token_ids(llm, [PROMPT_B], MAX_TOKENS) == baseline(tiny_llama, [PROMPT_B])
    assert requested == [store.entry_nbytes + 1] * 3


@pytest.mark.slow
def test_the_readme_example_scripts_share_kv_through_redis(tiny_llama, own_redis_server,
                                                           tmp_path):
    server = own_redis_server(password="example-pw")
    prompts = ["the quick brown fox " * 12 + "jumps", "hello, my name is " * 10 + "kv"]
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    environment = {**os.environ, "KVRECOVER_REDIS_PASSWORD": "example-pw",
                   "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    common = ["--storage", server.url, "--model", str(tiny_llama), "--device", "cpu",
              "--prompts-file", str(prompts_file)]

    def example(script: str, *args: str) -> str:
        result = subprocess.run(
            [sys.executable, str(REPO / "examples" / "disaggregated" / script), *common, *args],
            capture_output=True, text=True, timeout=300, env=environment)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "example-pw" not in result.stdout + result.stderr
        return result.stdout

    assert "in Redis" in example("prefill.py")
    lines = [json.loads(line) for line in example("decode.py", "--max-tokens", "6", "--json")
             .splitlines() if line.startswith("{")]
    results, stats = lines[:-1], lines[-1]["stats"]
    reference = make_llm(tiny_llama).generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    assert [r["token_ids"] for r in results] == [o.outputs[0].token_ids for o in reference]
    assert stats["prompt_tokens_external"] == sum(
        (len(o.prompt_token_ids) - 1) // 16 * 16 for o in reference)
    assert stats["kv_load_failed_blocks"] == 0


def connected_clients(server, admin) -> int:
    """Clients of `server` other than the test's own `admin` client."""
    return admin.info("clients")["connected_clients"] - 1


def wait_for_clients(server, admin, want: int, tries: int = 200) -> int:
    """Poll (bounded: `tries` x 10 ms) until the server counts `want` other clients."""
    for _ in range(tries):
        count = connected_clients(server, admin)
        if count == want:
            return count
        threading.Event().wait(0.01)
    return count


def test_llm_close_shuts_the_redis_pools_down(tiny_llama, own_redis_server):
    server = own_redis_server()
    admin = server.client()
    llm = make_llm(tiny_llama, redis_transfer(server.url, "kv_both"))
    run(llm, [PROMPT_A])  # lookups, saves: both roles' pools hold connections
    assert connected_clients(server, admin) >= 2
    connectors = [llm.engine.scheduler.connector, llm.engine.model_runner.connector]
    assert all(isinstance(c, RedisConnector) for c in connectors)
    llm.close()
    assert wait_for_clients(server, admin, 0) == 0
    for connector in connectors:
        connector.shutdown()  # idempotent
    assert connected_clients(server, admin) == 0

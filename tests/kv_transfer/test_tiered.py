"""TieredConnector: a local folder in front of Redis, falling through block by block.

A block that one tier lost is loaded from the next one (no recompute, identical
output, the fall-through in the per-tier stats); a block every tier lost is
recomputed, and only from that block on.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from conftest import greedy_token_ids
from redis_helpers import FaultyProxy

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.kv_transfer.stores.block_store import SUFFIX

VOCAB = 384
MAX_TOKENS = 4
PROMPT_A = [random.Random(11).randrange(2, VOCAB) for _ in range(70)]  # 4 full blocks
PROMPT_B = [random.Random(12).randrange(2, VOCAB) for _ in range(50)]  # 3 full blocks
PROMPT_C = [random.Random(13).randrange(2, VOCAB) for _ in range(40)]  # 2, never stored


def tier(name: str, extra: dict, **options) -> dict:
    return {"kv_connector": name, "kv_connector_extra_config": extra, **options}


def folder_tier(path: Path, **options) -> dict:
    return tier("SharedStorageConnector", {"shared_storage_path": str(path)}, **options)


def redis_tier(url: str, **options) -> dict:
    return tier("RedisConnector", {"url": url, "timeout_s": 5.0}, **options)


def tiered(tiers: list[dict], role: str = "kv_both", policy: str = "recompute",
           name: str = "TieredConnector", **extra) -> KVTransferConfig:
    return KVTransferConfig(name, role, {"connectors": tiers, **extra},
                            kv_load_failure_policy=policy)


def make_llm(model: Path, transfer: KVTransferConfig | None = None) -> LLM:
    return LLM(str(model), device="cpu", block_size=16, max_num_batched_tokens=64,
               num_kv_blocks=256, kv_transfer_config=transfer)


def baseline(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return greedy_token_ids(make_llm(model), prompts, MAX_TOKENS)


def store_block_by_block(model: Path, transfer: KVTransferConfig, prompt: list[int],
                         server) -> list[str]:
    """Store `prompt`'s full blocks one prefill at a time; their hex keys in chain order."""
    keys: list[str] = []
    for end in range(16, len(prompt) + 1, 16):
        before = set(server.client().keys("*"))
        greedy_token_ids(make_llm(model, transfer), [prompt[:end]], 1)
        (new_key,) = set(server.client().keys("*")) - before
        keys.append(new_key.decode().rsplit(":", 1)[1])
    return keys


def folder_entry(root: Path, hex_key: str) -> Path:
    (path,) = root.glob(f"*/{hex_key[:2]}/{hex_key}{SUFFIX}")
    return path


def corrupt_file(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    path.write_bytes(bytes(raw))


def corrupt_redis(server, hex_key: str) -> None:
    client = server.client()
    (key,) = client.keys(f"*:{hex_key}")
    offset = client.strlen(key) // 2
    client.setrange(key, offset, bytes([client.getrange(key, offset, offset)[0] ^ 0x5A]))


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_blocks_lost_in_the_first_tier_load_from_the_second(tiny_llama, tmp_path, redis_server,
                                                            async_load):
    tiers = [folder_tier(tmp_path), redis_tier(redis_server.url)]
    keys_a = store_block_by_block(tiny_llama, tiered(tiers, "kv_producer"), PROMPT_A, redis_server)
    greedy_token_ids(make_llm(tiny_llama, tiered(tiers, "kv_producer")), [PROMPT_B], 1)
    corrupt_file(folder_entry(tmp_path, keys_a[1]))  # found at lookup, bad at load
    folder_entry(tmp_path, keys_a[3]).unlink()  # the lookup finds it in Redis only

    llm = make_llm(tiny_llama, tiered(tiers, async_load=async_load, name="MultiConnector"))
    prompts = [PROMPT_A, PROMPT_B]
    assert greedy_token_ids(llm, prompts, MAX_TOKENS) == baseline(tiny_llama, prompts)
    stats = llm.stats
    assert stats["prompt_tokens_external"] == 64 + 48  # nothing recomputed
    assert stats["prompt_tokens_computed"] == 6 + 2
    assert stats["kv_load_failed_blocks"] == 0 and stats["kv_load_recovered_requests"] == 0
    assert stats["kv_tier0_hit_blocks"] == 3 + 3 and stats["kv_tier1_hit_blocks"] == 1
    assert stats["kv_tier0_failed_blocks"] == stats["kv_tier0_fallen_through_blocks"] == 1
    assert stats["kv_tier0_loaded_blocks"] == 2 + 3
    assert stats["kv_tier1_loaded_blocks"] == 2 and stats["kv_tier1_failed_blocks"] == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_block_lost_in_every_tier_recomputes_only_from_it(tiny_llama, tmp_path, redis_server,
                                                          async_load, policy):
    tiers = [folder_tier(tmp_path), redis_tier(redis_server.url)]
    keys_a = store_block_by_block(tiny_llama, tiered(tiers, "kv_producer"), PROMPT_A, redis_server)
    greedy_token_ids(make_llm(tiny_llama, tiered(tiers, "kv_producer")), [PROMPT_B], 1)
    corrupt_file(folder_entry(tmp_path, keys_a[1]))
    corrupt_redis(redis_server, keys_a[1])

    llm = make_llm(tiny_llama, tiered(tiers, "kv_consumer", policy, async_load=async_load))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in (PROMPT_A, PROMPT_B)], params)
    expected = baseline(tiny_llama, [PROMPT_A, PROMPT_B])
    stats = llm.stats
    assert outputs[1].outputs[0].token_ids == expected[1]
    assert stats["kv_tier0_fallen_through_blocks"] >= 1 and stats["kv_tier1_failed_blocks"] >= 1
    if policy == "fail":
        assert outputs[0].outputs[0].finish_reason == "error"
        assert outputs[0].outputs[0].token_ids == []
        assert stats["kv_load_failed_requests"] == 1
        return
    assert outputs[0].outputs[0].token_ids == expected[0]
    # Block 0 of A loaded; blocks 1-3 (from the lost one on) and A's last tokens computed
    # (a sync load also computed A's 6 tail tokens in the step that found the loss).
    assert stats["prompt_tokens_external"] == 16 + 48
    assert stats["prompt_tokens_computed"] == (70 - 16) + 2 + (0 if async_load else 6)
    assert stats["kv_load_recovered_requests"] >= 1


def test_redis_dying_mid_load_falls_back_to_the_folder(tiny_llama, tmp_path, own_redis_server):
    server = own_redis_server()
    stored = [PROMPT_A, PROMPT_B]
    prompts = [*stored, PROMPT_C]
    tiers = [redis_tier(server.url), folder_tier(tmp_path)]
    greedy_token_ids(make_llm(tiny_llama, tiered(tiers, "kv_producer")), stored, 1)
    proxy = FaultyProxy(server.port, "kill", kill=server.kill)
    try:
        llm = make_llm(tiny_llama, tiered([redis_tier(proxy.url), folder_tier(tmp_path)]))
        assert greedy_token_ids(llm, prompts, MAX_TOKENS) == baseline(tiny_llama, prompts)
    finally:
        proxy.stop()
    assert proxy.triggered.is_set()
    stats = llm.stats
    assert stats["prompt_tokens_external"] == 64 + 48 and stats["kv_load_failed_blocks"] == 0
    assert stats["kv_tier0_fallen_through_blocks"] == 4 + 3
    assert stats["kv_tier1_loaded_blocks"] == 4 + 3
    # C's blocks, computed here, went into the folder; their saves to Redis are counted failed.
    assert stats["kv_tier0_save_failed_blocks"] == stats["kv_save_failed_blocks"] == 2
    assert stats["kv_tier1_saved_blocks"] == 2


def test_saves_go_to_the_tiers_marked_save(tiny_llama, tmp_path, redis_server):
    tiers = [folder_tier(tmp_path / "local", save=False), redis_tier(redis_server.url, save=True)]
    llm = make_llm(tiny_llama, tiered(tiers, "kv_producer"))
    greedy_token_ids(llm, [PROMPT_A], 1)
    assert not any((tmp_path / "local").rglob(f"*{SUFFIX}"))
    assert len(redis_server.client().keys("*")) == 4
    assert llm.stats["kv_tier1_saved_blocks"] == 4 and llm.stats["kv_tier0_saved_blocks"] == 0

    unmarked = [folder_tier(tmp_path / "local"), redis_tier(redis_server.url)]
    llm = make_llm(tiny_llama, tiered(unmarked, "kv_producer"))
    greedy_token_ids(llm, [PROMPT_A], 1)
    assert len(list((tmp_path / "local").rglob(f"*{SUFFIX}"))) == 4
    # Redis already held them: each tier writes only what it lacks.
    assert llm.stats["kv_tier0_saved_blocks"] == 4 and llm.stats["kv_tier1_saved_blocks"] == 0


def test_tier_role_defaults_to_the_outer_one_and_can_differ(tiny_llama, tmp_path, redis_server):
    # A consumer-only folder tier is never written; the producer Redis tier is never read.
    tiers = [folder_tier(tmp_path, kv_role="kv_consumer"),
             redis_tier(redis_server.url, kv_role="kv_producer")]
    llm = make_llm(tiny_llama, tiered(tiers))
    greedy_token_ids(llm, [PROMPT_A], 1)
    assert not any(tmp_path.rglob(f"*{SUFFIX}"))
    assert len(redis_server.client().keys("*")) == 4
    llm = make_llm(tiny_llama, tiered(tiers))
    assert greedy_token_ids(llm, [PROMPT_A], MAX_TOKENS) == baseline(tiny_llama, [PROMPT_A])
    assert llm.stats["prompt_tokens_external"] == 0


BAD_CONFIGS = {
    "no-connectors": ({}, r"needs kv_connector_extra_config\['connectors'\]: a non-empty list"),
    "empty": ({"connectors": []}, r"a non-empty list"),
    "not-a-dict": ({"connectors": ["RedisConnector"]},
                   r"connectors\[0\] must be a dict with a 'kv_connector' name"),
    "unknown-key": ({"connectors": [{"kv_connector": "RedisConnector", "svae": True}]},
                    r"unknown connectors\[0\] key 'svae'; did you mean 'save'\?"),
    "save-not-bool": ({"connectors": [{"kv_connector": "RedisConnector", "save": "yes"}]},
                      r"connectors\[0\]\['save'\] must be True or False"),
    "not-a-store": ({"connectors": [{"kv_connector": "FaultInjectionConnector"}]},
                    r"connectors\[0\] \(FaultInjectionConnector\): FaultInjectionConnector is "
                    r"not a block-store connector"),
    "inner-error": ({"connectors": [{"kv_connector": "SharedStorageConnector",
                                     "kv_connector_extra_config": {"shared_storage_path": "x"}},
                                    {"kv_connector": "RedisConnector",
                                     "kv_connector_extra_config": {"timeout_s": -1}}]},
                    r"connectors\[1\] \(RedisConnector\): kv_connector_extra_config"
                    r"\['timeout_s'\] must be a number of seconds > 0"),
    "inner-bad-role": ({"connectors": [{"kv_connector": "RedisConnector", "kv_role": "x"}]},
                       r"connectors\[0\]: kv_role must be one of"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_is_a_value_error_naming_the_field(tiny_llama, case):
    extra, message = BAD_CONFIGS[case]
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_llama, KVTransferConfig("TieredConnector", "kv_both", extra))


def test_llm_close_shuts_every_tier_down(tiny_llama, tmp_path, own_redis_server):
    """LLM.close() reaches each tier: the Redis tier's pool lets its connections go."""
    server = own_redis_server()
    admin = server.client()
    transfer = tiered([folder_tier(tmp_path / "kv"), redis_tier(server.url)], async_load=True)
    llm = make_llm(tiny_llama, transfer)
    greedy_token_ids(llm, [PROMPT_A], 1)
    assert admin.info("clients")["connected_clients"] > 1
    worker = llm.engine.model_runner.connector
    llm.close()
    for _ in range(200):  # the server notices closed sockets within a few ms
        if admin.info("clients")["connected_clients"] == 1:
            break
        threading.Event().wait(0.01)
    assert admin.info("clients")["connected_clients"] == 1
    worker.shutdown()  # idempotent

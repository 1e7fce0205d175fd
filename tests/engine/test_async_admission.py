"""When requests whose KV loaded asynchronously are admitted: as soon as the worker can
tell their loads finished, and together when they finish together.

The loads here are ordered with events (bounded waits), never with sleeps, and every
assertion counts engine steps or compares token ids exactly.
"""

from __future__ import annotations

import threading

from conftest import (
    KV_PROMPTS,
    copy_store,
    greedy_token_ids,
    make_kv_llm,
    no_connector_ids,
    random_prompt,
    storage_transfer,
)

from kvrecover import SamplingParams
from kvrecover.kv_transfer.stores.shared_storage import SharedStorageConnector

WAIT_S = 20.0  # bound of every wait below; reached only if the engine never gets there


class LateLoadConnector(SharedStorageConnector):
    """Request "slow" (its load started first) finishes reading only while request
    "fast"'s blocks are being installed, as a load that completes during another's
    copy (or upload) does."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.release_slow = threading.Event()
        self.timed_out = False

    def _read_async(self, transfer, cancelled):
        blocks = super()._read_async(transfer, cancelled)
        if transfer.request_id == "slow" and not self.release_slow.wait(WAIT_S):
            self.timed_out = True
        return blocks

    def _install(self, transfer, blocks) -> None:
        if transfer.request_id == "fast":
            self.release_slow.set()
            slow = self._async_loads.get("slow")
            if slow is not None:
                slow.future.exception(timeout=WAIT_S)  # waits until its read has returned
        super()._install(transfer, blocks)


def test_a_load_finishing_during_another_install_is_admitted_with_it(tiny_llama,
                                                                     pristine_store, tmp_path):
    copy_store(pristine_store, tmp_path / "store")
    kv = storage_transfer(tmp_path / "store", "kv_consumer", "LateLoadConnector",
                          module_path=__name__, async_load=True)
    llm = make_kv_llm(tiny_llama, kv)
    engine = llm.engine
    prompts = {"slow": KV_PROMPTS[0], "fast": KV_PROMPTS[1]}
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    first_step: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished() and steps < 10_000:
        steps += 1
        for output in engine.step():
            first_step.setdefault(output.request_id, steps)
            tokens[output.request_id] = output.outputs[0].token_ids
    assert not engine.model_runner.connector.timed_out
    assert llm.stats["prompt_tokens_external"] > 0  # both really loaded
    assert llm.stats["kv_load_failed_blocks"] == 0
    # Both loads were done when the worker reported "fast": one prefill step for both.
    assert first_step["slow"] == first_step["fast"]
    expected = no_connector_ids(tiny_llama, list(prompts.values()))
    assert [tokens["slow"], tokens["fast"]] == [ids[:3] for ids in expected]


class GatedLoadConnector(SharedStorageConnector):
    """Request "loaded" finishes reading only once the test opens `gate`."""

    gate = threading.Event()  # set per test (the engine builds the connector)

    def _read_async(self, transfer, cancelled):
        blocks = super()._read_async(transfer, cancelled)
        if transfer.request_id == "loaded":
            type(self).gate.wait(WAIT_S)
        return blocks


def test_a_load_reported_by_an_overlapped_step_joins_the_very_next_step(tiny_llama,
                                                                        pristine_store, tmp_path):
    """While another request decodes on the overlapped path, the step after the one whose
    connector hooks reported the load finished must already run the loaded request (it
    used to launch one more decode without it)."""
    copy_store(pristine_store, tmp_path / "store")
    GatedLoadConnector.gate = threading.Event()
    kv = storage_transfer(tmp_path / "store", "kv_consumer", "GatedLoadConnector",
                          module_path=__name__, async_load=True)
    llm = make_kv_llm(tiny_llama, kv)
    engine, runner = llm.engine, llm.engine.model_runner
    runner.eager_overlap = True
    ran: list[tuple[list[str], set[str]]] = []  # per step run: its requests, loads reported
    execute, launch = runner.execute, runner.launch_decode

    def logged_execute(scheduler_output):
        output = execute(scheduler_output)
        ran.append(([s.request_id for s in scheduler_output.scheduled], output.finished_recving))
        return output

    def logged_launch(scheduler_output, previous=None):
        pending = launch(scheduler_output, previous)
        ran.append(([s.request_id for s in scheduler_output.scheduled],
                    pending.finished_recving))
        return pending

    runner.execute, runner.launch_decode = logged_execute, logged_launch
    decoder_prompt = random_prompt(20, seed=7)  # not in the store
    engine.add_request("decoder", decoder_prompt,
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished() and steps < 10_000:
        steps += 1
        if steps == 3:
            engine.add_request("loaded", KV_PROMPTS[0],
                               SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        if steps == 8:
            GatedLoadConnector.gate.set()
        for output in engine.step():
            tokens[output.request_id] = output.outputs[0].token_ids
    GatedLoadConnector.gate.set()
    reported = [i for i, (_, loads) in enumerate(ran) if "loaded" in loads]
    assert len(reported) == 1 and reported[0] + 1 < len(ran)
    assert "decoder" in ran[reported[0]][0], "the load was not reported by a decode step"
    assert llm.stats["overlapped_steps"] > 10 and llm.stats["prompt_tokens_external"] > 0
    assert "loaded" in ran[reported[0] + 1][0]
    decoded, loaded = greedy_token_ids(make_kv_llm(tiny_llama), [decoder_prompt, KV_PROMPTS[0]], 40)
    assert tokens == {"decoder": decoded, "loaded": loaded[:3]}

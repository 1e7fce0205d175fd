"""A NIXL producer in its own process, for the P2P tests.

    python nixl_producer.py MODEL PORT LEASE_S PROMPTS_JSON [STORE [ENGINE_JSON]]

Prefills each prompt (max_tokens 1), prints a line "REF <json>" per prompt with its
`kv_transfer_params`, then keeps the engine stepping (serving pulls and releases) until
stdin closes or 60 s pass, and prints "HELD N": the prompts whose blocks
are still kept (a hybrid's first "STATES N": the recurrent states still kept); a line
"COUNT" on stdin prints those counts at once and goes on. With
STORE, a folder (not empty): a TieredConnector that serves the pulls
and saves the prompts' blocks into that shared-storage store too. ENGINE_JSON: more
engine arguments (e.g. max_num_batched_tokens, tensor_parallel_size: rank r then serves
PORT + r; "state_interval_blocks" goes to the tiered producer's KVTransferConfig, "nixl" is
more of the NixlConnector's settings, e.g. max_held_states; "used": true first prefills and
frees a prompt filling all blocks but one, not kept, as on a producer that has served
before: its free blocks then come back in the order freed, a request's tail first).
"""

from __future__ import annotations

import json
import select
import sys
import time

from kvrecover import LLM, KVTransferConfig, SamplingParams


def main() -> None:
    model, port, lease_s, prompts = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), \
        json.loads(sys.argv[4])
    engine_args = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    interval = engine_args.pop("state_interval_blocks", None)
    used = engine_args.pop("used", False)
    nixl = {"side_channel_port": port, "lease_s": lease_s, **engine_args.pop("nixl", {})}
    transfer = KVTransferConfig("NixlConnector", "kv_producer", nixl)
    if len(sys.argv) > 5 and sys.argv[5]:
        transfer = KVTransferConfig("TieredConnector", "kv_producer", {"connectors": [
            {"kv_connector": "NixlConnector", "kv_connector_extra_config": nixl},
            {"kv_connector": "SharedStorageConnector",
             "kv_connector_extra_config": {"shared_storage_path": sys.argv[5]}}]},
            **({} if interval is None else {"state_interval_blocks": interval}))
    engine_args = {"device": "cpu", "block_size": 8, "num_kv_blocks": 128, **engine_args}
    llm = LLM(model, kv_transfer_config=transfer, **engine_args)
    if used:  # every block but the null one and one spare, freed tail first
        length = (engine_args["num_kv_blocks"] - 2) * engine_args["block_size"]
        not_kept = SamplingParams(temperature=0, max_tokens=1)
        not_kept.kv_transfer_params = {"do_remote_decode": False}
        llm.generate([{"prompt_token_ids": [7 + i % 90 for i in range(length)]}], not_kept)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=1))
    for output in outputs:
        print("REF", json.dumps(output.kv_transfer_params), flush=True)
    engine = llm.engine
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if engine.has_unfinished():
            engine.step()
        idle = not engine.has_unfinished() or engine.awaits_only_sends()  # no busy loop
        if select.select([sys.stdin], [], [], 0.01 if idle else 0)[0]:
            line = sys.stdin.readline()
            if not line:
                break  # stdin closed: the test is done
            if line.strip() == "COUNT":
                print_counts(engine)
    if engine.has_unfinished():
        engine.step()  # frees what a release that came with the close let go
    print_counts(engine)
    llm.close()


def print_counts(engine) -> None:
    """"STATES N" (a hybrid's kept recurrent states) and "HELD N" (prompts kept)."""
    connector = engine.model_runner.connector  # rank 0's at tensor_parallel_size > 1
    front = getattr(connector, "front", None)  # a TieredConnector's NixlConnector
    producer = (connector if front is None else front.connector).producer
    states = producer.held_states
    if states is not None:  # a hybrid's kept recurrent states
        print("STATES", len(states), flush=True)
    print("HELD", len(engine.scheduler.kv_loads.sends.holds), flush=True)


if __name__ == "__main__":
    main()

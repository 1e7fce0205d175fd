"""Decode instance: load the stored KV and decode; optionally make the first load fail."""

import argparse
import json
import logging
from pathlib import Path

from kvrecover import LLM, KVTransferConfig, SamplingParams

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: built-in)")
    parser.add_argument("--simulate-failure", action="store_true", help="fail the first KV load")
    parser.add_argument("--async-load", action="store_true", help="load KV asynchronously")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    with open("prefill_output.txt", encoding="utf-8") as handle:
        prompts = [json.loads(line) for line in handle if line.strip()]
    extra = {"shared_storage_path": "local_storage", "async_load": args.async_load}
    if args.simulate_failure:
        transfer = KVTransferConfig(
            kv_connector="LoadRecoveryExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_connector_module_path=str(HERE / "load_recovery_example_connector.py"),
            kv_load_failure_policy="recompute",
        )
        out_file = "async_decode_recovered_output.txt" if args.async_load else "sync_decode_recovered_output.txt"
    else:
        transfer = KVTransferConfig("SharedStorageConnector", "kv_both", extra)
        out_file = "decode_output.txt"

    llm = LLM(args.model, max_num_batched_tokens=64, max_num_seqs=16, kv_transfer_config=transfer)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, top_p=0.95, max_tokens=10))
    with open(out_file, "w", encoding="utf-8") as handle:
        for output in outputs:
            completion = output.outputs[0]
            handle.write(f"Prompt: {output.prompt!r}\nGenerated text: {completion.text!r}\n"
                         f"Token ids: {completion.token_ids}\n{'-' * 30}\n")
            print(f"...{output.prompt[-30:]!r} -> {completion.text!r}")
    print(f"wrote {out_file}; stats: {llm.stats}")


if __name__ == "__main__":
    main()

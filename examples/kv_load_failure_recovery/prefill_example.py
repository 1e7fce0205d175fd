"""Prefill instance: compute the prompts' KV cache and store it in ./local_storage."""

import argparse
import json

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.scenario import reference_prompts  # 1000-word and 500-word shared prefixes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: built-in)")
    args = parser.parse_args()
    llm = LLM(
        args.model,
        kv_transfer_config=KVTransferConfig(
            kv_connector="SharedStorageConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": "local_storage"},
        ),
    )
    outputs = llm.generate(reference_prompts(), SamplingParams(temperature=0, max_tokens=1))
    with open("prefill_output.txt", "w", encoding="utf-8") as handle:
        for output in outputs:
            # One JSON string per line: a generated newline cannot split a prompt.
            handle.write(json.dumps(output.prompt + output.outputs[0].text) + "\n")
    print(f"stored KV for {len(outputs)} prompts; stats: {llm.stats}")


if __name__ == "__main__":
    main()

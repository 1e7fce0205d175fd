"""Decode instance of disaggregated serving: load the stored KV cache and generate.

Run `prefill.py` first with the same --storage and prompts. Every full prompt
block found in the store is loaded and verified instead of computed (only the
tail of each prompt runs through the model); a missing or damaged block is
recomputed, so the output is the same either way: greedy token ids equal those
of an engine that never saw the store.

    python examples/disaggregated/decode.py --storage /tmp/kv_store [--model DIR] [--json]
    python examples/disaggregated/decode.py --storage redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prefill import add_common_flags, is_redis, load_prompts, make_llm, transfer_config

from kvrecover import SamplingParams
from kvrecover.kv_transfer.redis.store import redact_url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_flags(parser)
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens (default: 16)")
    parser.add_argument("--async-load", action="store_true",
                        help="load KV in a background thread while the request waits")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per prompt, then one with the stats")
    args = parser.parse_args()
    if not is_redis(args.storage) and not Path(args.storage).is_dir():
        sys.exit(f"{args.storage} does not exist: run prefill.py with --storage {args.storage}")
    prompts = load_prompts(args.prompts_file)
    # Load only: this instance never writes to the store.
    transfer = transfer_config(args.storage, "kv_consumer", async_load=args.async_load)
    llm = make_llm(args, transfer)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    stats = llm.stats
    for output in outputs:
        completion = output.outputs[0]
        if args.json:
            print(json.dumps({"prompt": output.prompt, "prompt_token_ids": output.prompt_token_ids,
                              "token_ids": completion.token_ids, "text": completion.text}))
        else:
            print(f"...{output.prompt[-40:]!r} -> {completion.text!r}")
            print(f"    token ids: {completion.token_ids}")
    if args.json:
        print(json.dumps({"stats": stats}))
    else:
        total = stats["prompt_tokens_external"] + stats["prompt_tokens_computed"]
        print(f"prompt tokens: {stats['prompt_tokens_external']} loaded from "
              f"{redact_url(args.storage)}, "
              f"{stats['prefix_cache_hit_tokens']} reused from the local prefix cache, "
              f"{stats['prompt_tokens_computed']} computed (of {total}); "
              f"{stats['kv_load_failed_blocks']} blocks failed to load and were recomputed")


if __name__ == "__main__":
    main()

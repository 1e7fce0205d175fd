"""Prefill instance of disaggregated serving: compute the prompts' KV cache and store it.

Every full block of every prompt lands in the store given by --storage: a
folder (one verified file per block) or a Redis URL (one verified value per
block; the password comes from the URL or KVRECOVER_REDIS_PASSWORD). Run
`decode.py` afterwards, in another process (or on another machine that sees
the folder or reaches the server), with the same --storage and prompts.

    python examples/disaggregated/prefill.py --storage /tmp/kv_store [--model DIR]
    python examples/disaggregated/prefill.py --storage redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.config import add_engine_flags, engine_args_from_namespace
from kvrecover.scenario import reference_prompts


def load_prompts(prompts_file: Path | None) -> list[str]:
    """Prompts from a JSON list of strings (.json) or a text file (one per line), else built-in."""
    if prompts_file is None:
        # The reference prompts, shorter: two pairs share a prefix, so decode reuses blocks.
        return reference_prompts(long_words=300, short_words=150)
    text = Path(prompts_file).read_text(encoding="utf-8")
    if str(prompts_file).endswith(".json"):
        prompts = json.loads(text)
        if not (isinstance(prompts, list) and all(isinstance(p, str) for p in prompts)):
            raise SystemExit(f"{prompts_file}: expected a JSON list of strings")
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SystemExit(f"{prompts_file}: no prompts")
    return prompts


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """Flags both instances take; they must agree on model, storage, prompts and block
    size. Every engine option is a flag too (`--model`, `--device`, `--block-size`, ...)."""
    parser.add_argument("--storage", default="kv_store",
                        help="KV store shared by prefill and decode: a folder, or a Redis URL "
                             "(redis://host:port/db, unix:///path.sock) (default: ./kv_store)")
    parser.add_argument("--prompts-file", type=Path, default=None,
                        help="JSON list of strings (.json) or one prompt per line "
                             "(default: four built-in prompts)")
    add_engine_flags(parser, skip=("kv_transfer_config",))


def make_llm(args: argparse.Namespace, transfer: KVTransferConfig) -> LLM:
    """The engine the flags describe, with this instance's connector."""
    return LLM.from_engine_args(
        replace(engine_args_from_namespace(args), kv_transfer_config=transfer))


def is_redis(storage: str) -> bool:
    """Whether --storage names a Redis server rather than a folder."""
    return storage.startswith(("redis://", "rediss://", "unix://", "valkey://", "valkeys://"))


def transfer_config(storage: str, role: str, **extra) -> KVTransferConfig:
    """The connector for --storage: RedisConnector for a URL, else the folder connector."""
    if is_redis(storage):
        return KVTransferConfig("RedisConnector", role, {"url": storage, **extra})
    return KVTransferConfig("SharedStorageConnector", role,
                            {"shared_storage_path": storage, **extra})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_flags(parser)
    args = parser.parse_args()
    prompts = load_prompts(args.prompts_file)
    transfer = transfer_config(args.storage, "kv_producer")  # save only: never loads KV
    llm = make_llm(args, transfer)
    # One token is enough: the point is the prompt's KV, which is saved as it is computed.
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    stats = llm.stats
    where = "Redis" if is_redis(args.storage) else args.storage
    if not is_redis(args.storage):
        where += f" ({sum(1 for _ in Path(args.storage).rglob('*.kvblock'))} block files)"
    print(f"stored the KV of {len(prompts)} prompts ({stats['prompt_tokens_computed']} prompt "
          f"tokens) in {where}")
    if stats["kv_save_failed_blocks"]:
        print(f"warning: {stats['kv_save_failed_blocks']} blocks could not be saved")


if __name__ == "__main__":
    main()

"""Shared fixtures: tiny random-weight checkpoints built on the fly, a HF reference, and a
store holding their KV for the storage, fingerprint and fault tests."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from redis_helpers import RedisServer

CUDA = torch.cuda.is_available()
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cuda" if CUDA else "cpu"  # where the Triton tests' tensors live
# The marks of a Triton kernel test module: `gpu`, run on CUDA or under the interpreter.
TRITON_TESTS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or TRITON_INTERPRET), reason="needs CUDA (or TRITON_INTERPRET=1)"),
]

if TRITON_INTERPRET:  # kernels with runtime loop bounds, NumPy 2.4
    from kvrecover.ops.triton.interpreter_compat import patch_scalar_index

    patch_scalar_index()

CORPUS = (
    "the quick brown fox jumps over the lazy dog. hello, my name is kv. "
    "the capital of france is paris and the capital of china is beijing. "
    "disaggregated serving splits prefill from decode; blocks fail, we recompute. "
) * 20


def build_tokenizer(folder: Path, vocab_size: int) -> None:
    """Train a small byte-level BPE tokenizer and save it HF-style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([CORPUS], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": True,
            }
        )
    )


def build_tiny_model(folder: Path, *, seed: int = 0, adjust=None, **overrides) -> Path:
    """Save a random-weight tiny checkpoint (Llama by default) with a tokenizer;
    `adjust(model)` (optional) edits the random weights before they are saved."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    model_type = overrides.pop("model_type", "llama")
    settings = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Larger-than-default weights give peaked, non-degenerate logits (and, for the
        # stacked expert weights of MoE models, distinct experts).
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.08)
        if adjust is not None:
            adjust(model)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder, settings["vocab_size"])
    return folder


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """Llama with GQA, llama3 rope scaling and tied embeddings."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_llama"),
        rope_scaling=LLAMA3_ROPE,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="session")
def tiny_llama_untied(tmp_path_factory) -> Path:
    """Plain Llama, untied embeddings, explicit head_dim."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama_untied"), seed=1, head_dim=32)


# Tiny mixture-of-experts checkpoints: 8 experts, 2 per token, so that routing differs
# between tokens. Qwen3-MoE: renormalised top-k, one dense layer (mlp_only_layers).
MOE_CHECKPOINTS = {
    "tiny_mixtral": dict(model_type="mixtral", seed=7, num_local_experts=8,
                         num_experts_per_tok=2, sliding_window=None),
    "tiny_qwen3_moe": dict(model_type="qwen3_moe", seed=8, num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1],
                           head_dim=32),
}


def gpt_oss_vectors(model) -> None:
    """Sinks that weigh in the softmax and non-zero biases (Hugging Face's init leaves
    attention biases at zero and sinks and router biases near it, where a kernel that
    ignored them would still pass)."""
    for name, param in model.named_parameters():
        if name.endswith(".sinks"):
            param.normal_(0, 1.0)
        elif param.dim() == 1 and "norm" not in name:
            param.normal_(0, 0.1)


# gpt-oss: 8 experts, top-2, layers sliding (24 tokens) / full / sliding, YaRN over 64
# positions (factor 4: most frequencies interpolated), a clamp that bites (limit 1).
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64,
                "rope_theta": 150000.0}
MOE_CHECKPOINTS["tiny_gpt_oss"] = dict(
    model_type="gpt_oss", seed=12, num_local_experts=8, num_experts_per_tok=2, head_dim=16,
    sliding_window=24, swiglu_limit=1.0, rope_parameters=GPT_OSS_ROPE, adjust=gpt_oss_vectors)


# Windowed families with a window of 24 tokens (as tiny_gpt_oss's), for the recovery and
# scheduling tests of rule 8: build_tiny_model(folder, **WINDOWED_CHECKPOINTS[name]).
WINDOWED_CHECKPOINTS = {
    "mistral": dict(model_type="mistral", seed=7, sliding_window=24),
    "gemma2": dict(model_type="gemma2", seed=9, sliding_window=24, head_dim=16,
                   query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, tie_word_embeddings=True, num_hidden_layers=4),
    "gemma3": dict(model_type="gemma3_text", seed=13, sliding_window=24, head_dim=16,
                   num_hidden_layers=4, query_pre_attn_scalar=24, rope_local_base_freq=500.0,
                   tie_word_embeddings=True,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                "sliding_attention"]),
}


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory) -> Path:
    """gpt-oss: biased attention with sinks, alternating windows, YaRN, clamped experts."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_gpt_oss"),
                            **MOE_CHECKPOINTS["tiny_gpt_oss"])


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory) -> Path:
    """Mixtral: 8 experts of intermediate_size 128, top-2, every layer sparse."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_mixtral"),
                            **MOE_CHECKPOINTS["tiny_mixtral"])


@pytest.fixture(scope="session")
def tiny_mixtral_fused(tiny_mixtral, tmp_path_factory) -> Path:
    """tiny_mixtral saved with the fused expert tensors transformers holds in memory
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`, `mlp.gate`)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    folder = tmp_path_factory.mktemp("mixtral_fused")
    save_file(state, str(folder / "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_mixtral / name).read_bytes())
    return folder


def break_stored_file(path: Path, kind: str) -> None:
    """Make a stored entry `kind` "missing" (deleted) or corrupt (its last byte flipped:
    the payload's checksum no longer matches)."""
    if kind == "missing":
        path.unlink()
        return
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    """Qwen3-MoE: 8 experts of 48, top-2 renormalised, layer 1 dense, q/k norms."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"),
                            **MOE_CHECKPOINTS["tiny_qwen3_moe"])


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: a plain greedy loop over HF's forward with its KV cache (no EOS stop)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            input_ids = torch.tensor([prompt])
            past = None
            generated: list[int] = []
            for _ in range(max_new_tokens):
                out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = int(out.logits[0, -1].argmax())
                generated.append(token)
                input_ids = torch.tensor([[token]])
            results.append(generated)
    return results


def random_prompts(count: int, lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Seeded random token-id prompts of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, vocab_size, (lengths[i % len(lengths)],), generator=generator).tolist()
        for i in range(count)
    ]


@pytest.fixture(autouse=True)
def one_thread_for_tiny_models(request):
    """Tiny models run faster on one thread: intra-op parallelism only adds barriers
    (and on a busy machine those barriers cost seconds). Slow (default-model) tests
    keep every thread."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def greedy_token_ids(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy, EOS-ignoring generation of token-id prompts; every request runs to length."""
    from kvrecover import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


def simulate_full_disk(monkeypatch, module, bytes_before_failure: int) -> None:
    """Make files that `module` opens for writing accept `bytes_before_failure` bytes of
    a write (through `open` or `os.writev`), then fail with ENOSPC, as a disk filling up
    midway would."""
    import builtins
    import errno
    import os

    real_open = builtins.open

    class FullDisk:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            self.handle.write(bytes(data)[:bytes_before_failure])
            raise OSError(errno.ENOSPC, "No space left on device")

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        return FullDisk(handle) if "w" in mode else handle

    class FullDiskOS:
        """`module.os`, whose writev stops with ENOSPC like the file writes above."""

        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def writev(fd, buffers):
            os.write(fd, b"".join(bytes(b) for b in buffers)[:bytes_before_failure])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module, "open", open_on_a_full_disk, raising=False)
    if hasattr(module, "os"):
        monkeypatch.setattr(module, "os", FullDiskOS())


# ----- a store of stored KV, shared by the storage, fingerprint and fault tests ----------
KV_VOCAB = 384  # the tiny models above
KV_BLOCK = 16
KV_MAX_TOKENS = 4
# Three unrelated prompts: 4, 5 and 3 full blocks, all loadable (the last token is not).
KV_PROMPT_LENGTHS = (70, 93, 50)


def random_prompt(length: int, seed: int) -> list[int]:
    """A seeded prompt of token ids that the tiny models accept."""
    rng = random.Random(seed)
    return [rng.randrange(2, KV_VOCAB) for _ in range(length)]


KV_PROMPTS = [random_prompt(n, seed=100 + i) for i, n in enumerate(KV_PROMPT_LENGTHS)]
KV_LOADABLE = [(n - 1) // KV_BLOCK for n in KV_PROMPT_LENGTHS]


def make_layout(dtype: torch.dtype = torch.float32, **overrides):
    """A small KVCacheLayout for store tests: 2 layers, block 4, 2 KV heads, head dim 8."""
    from kvrecover.kv_layout import KVCacheLayout

    settings = dict(model_identity="test-model", dtype=dtype, block_size=4, num_layers=2,
                    num_kv_heads=2, head_dim=8)
    settings.update(overrides)
    return KVCacheLayout(**settings)


def require_nixl() -> None:
    """Skip the calling NIXL test (or module) without the nixl package (nixl-cu12, or
    nixl-cu13 on a CUDA 13 machine), except under CI (CI=true), where that is a failure:
    requirements.txt pins nixl-cu12."""
    if importlib.util.find_spec("nixl_cu12") is None and \
            importlib.util.find_spec("nixl_cu13") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("nixl_cu12 is not installed but CI=true: requirements.txt pins "
                        "nixl-cu12 (scripts/bootstrap.sh installs it)", pytrace=False)
        pytest.skip("nixl_cu12 is not installed (pip install -r requirements.txt)",
                    allow_module_level=True)


def random_block(store, seed: int) -> torch.Tensor:
    """A seeded random block of the store's layout."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(store.block_shape, generator=generator).to(store.layout.dtype)


def rewrite_header(path: Path, **changes) -> None:
    """Rewrite header fields (`BlockHeader` names) and re-seal the header checksum: a
    forged, self-consistent header."""
    import dataclasses

    from kvrecover.kv_transfer.stores.block_store import HEADER, PREFIX_SIZE, BlockHeader

    raw = bytearray(path.read_bytes())
    header = dataclasses.replace(BlockHeader(*HEADER.unpack_from(raw, 0)), **changes)
    raw[:PREFIX_SIZE] = header.pack()
    path.write_bytes(bytes(raw))


def storage_transfer(store: Path, role: str = "kv_both", connector: str = "SharedStorageConnector",
                     **extra):
    """A KVTransferConfig for a shared-storage store (`module_path` picks a user's module)."""
    from kvrecover import KVTransferConfig

    module_path = extra.pop("module_path", None)
    return KVTransferConfig(connector, role, {"shared_storage_path": str(store), **extra},
                            kv_connector_module_path=module_path)


def make_kv_llm(model: Path, kv=None, **engine):
    """A small CPU engine (block size KV_BLOCK, 128 KV blocks) with an optional connector."""
    from kvrecover import LLM

    settings = dict(device="cpu", block_size=KV_BLOCK, max_num_batched_tokens=64,
                    num_kv_blocks=128)
    settings.update(engine)
    return LLM(str(model), kv_transfer_config=kv, **settings)


def kv_generate(llm, prompts: list[list[int]], max_tokens: int = KV_MAX_TOKENS) -> list[list[int]]:
    """Greedy token ids of the prompts."""
    return greedy_token_ids(llm, prompts, max_tokens)


@functools.cache
def _no_connector_ids(model: str, prompts: tuple[tuple[int, ...], ...],
                      engine: tuple) -> list[list[int]]:
    return kv_generate(make_kv_llm(Path(model), **dict(engine)), [list(p) for p in prompts])


def no_connector_ids(model: Path, prompts: list[list[int]] = KV_PROMPTS, **engine) -> list[list[int]]:
    """Token ids of an engine without a connector: what every decode must return (cached)."""
    return _no_connector_ids(str(model), tuple(map(tuple, prompts)), tuple(sorted(engine.items())))


def block_files(root: Path) -> list[Path]:
    """Every stored block file under a store root."""
    from kvrecover.kv_transfer.stores.block_store import SUFFIX

    return sorted(root.rglob(f"*{SUFFIX}"))


@pytest.fixture(scope="session")
def pristine_store(tiny_llama, tmp_path_factory) -> tuple[Path, list[list[Path]]]:
    """A store holding tiny_llama's KV of KV_PROMPTS, and each prompt's block files in
    chain order. Copy it (`copy_store`) before changing anything."""
    from kvrecover.kv_layout import update_block_hashes
    from kvrecover.kv_transfer.stores.block_store import BlockStore

    root = tmp_path_factory.mktemp("pristine_store")
    llm = make_kv_llm(tiny_llama, storage_transfer(root, "kv_producer"))
    kv_generate(llm, KV_PROMPTS, max_tokens=1)
    store = BlockStore(root, llm.engine.layout)
    chains = []
    for prompt in KV_PROMPTS:
        keys: list[bytes] = []
        update_block_hashes(keys, prompt, KV_BLOCK)
        chains.append([store.path(key) for key in keys])
    assert sorted(p for chain in chains for p in chain) == block_files(root)
    return root, chains


def copy_store(pristine: tuple[Path, list[list[Path]]], target: Path) -> list[list[Path]]:
    """Copy a store to `target`; returns the copied block files per prompt, in chain order."""
    root, chains = pristine
    shutil.copytree(root, target)
    return [[target / path.relative_to(root) for path in chain] for chain in chains]


@pytest.fixture(autouse=True, scope="session")
def private_checkpoint_digest_cache(tmp_path_factory):
    """Engines built by the tests cache checkpoint digests in a session folder, not in the
    user's cache (test checkpoints are temporary; tests/models/test_fingerprint.py tests
    the cache)."""
    import kvrecover.models.fingerprint as fingerprint

    folder = tmp_path_factory.mktemp("digest_cache")
    patch = pytest.MonkeyPatch()
    patch.setattr(fingerprint, "cache_root", lambda: folder)
    yield folder
    patch.undo()


# ----- a private redis-server (tests/kv_transfer/test_redis_connector.py, test_tiered.py) ---
@pytest.fixture(scope="session")
def redis_session_server():
    # Imported here so that suites without redis-py installed (the GPU machine) still load.
    from redis_helpers import RedisServer, require_redis_server

    require_redis_server()
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def redis_server(redis_session_server) -> RedisServer:
    """The session's redis-server, emptied for this test."""
    if redis_session_server.process is None or redis_session_server.process.poll() is not None:
        redis_session_server.start()
    redis_session_server.client().flushall()
    return redis_session_server


@pytest.fixture
def own_redis_server():
    """A redis-server of this test alone (to kill, restart or password-protect)."""
    from redis_helpers import RedisServer, require_redis_server

    require_redis_server()
    servers: list[RedisServer] = []

    def start(password: str | None = None) -> RedisServer:
        servers.append(RedisServer(password).start())
        return servers[-1]

    yield start
    for server in servers:
        server.cleanup()

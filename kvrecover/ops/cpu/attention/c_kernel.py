"""Batch-invariant paged attention on the CPU through our C kernel (`ops/cpu/csrc/paged_attention.c`).

The kernel computes each (query token, KV head) alone, reading that token's
keys 0..position straight from the paged cache in increasing order with float32
accumulation and an exact two-pass softmax, so a query's bits are the same in a
full prefill, a chunk, a decode step or any batch (see the C file). A step's
items are shared by `torch.get_num_threads()` OpenMP threads, torch's own (the
library is built with -fopenmp and so uses the libgomp torch loaded), which take
items from one atomic counter; ctypes releases the GIL. Which thread computes an
item changes no bit. Where the kernel cannot be built, `ops.cpu.attention.invariant_cpu_attention`
returns the torch implementation (`torch_tiles`) instead.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvrecover.ops.interface import RotaryKernel
from kvrecover.ops.reference.attention_metadata import (
    AttentionMetadata,
    PerStepPlan,
    write_step_kv,
)
from kvrecover.ops.reference.rotary import RotateThenAttend, reference_rotary

KEY_ROWS_PER_THREAD = 16384  # (query token, KV head, key) triples worth one more thread
# A tile's rows (its tokens x the query heads of one KV head) share each key and value
# load; KVR_MAX_TILE_ROWS_ANY in the C file bounds them.
MAX_TILE_ROWS, MAX_TILE_TOKENS = 64, 16
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_VECTOR_HEAD_DIM, MAX_VECTOR_GROUP = 256, 16  # KVR_MAX_DIM, KVR_MAX_GROUP in the C file


class KvrAttentionArgs(ctypes.Structure):
    """The C kernel's argument record (`KvrAttentionArgs` in paged_attention.c)."""

    _fields_ = [
        ("query", ctypes.c_void_p),
        ("query_token_stride", ctypes.c_int64),
        ("query_head_stride", ctypes.c_int64),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("token_request", ctypes.c_void_p),
        ("token_position", ctypes.c_void_p),
        ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("window", ctypes.c_int32),  # 0: no sliding window
        ("softcap", ctypes.c_float),  # 0: no soft-capping
        ("sinks", ctypes.c_void_p),  # [Hq] float32 sink logits; NULL: none
        ("tile_first_token", ctypes.c_void_p),  # [tiles] int32
        ("tile_tokens", ctypes.c_void_p),  # [tiles] int32
    ]


@dataclass
class StepPlan:
    """Per-step kernel inputs, built once and shared by every layer of the step."""

    block_tables: torch.Tensor  # [B, stride] int32, contiguous
    token_request: torch.Tensor  # [T] int32
    token_position: torch.Tensor  # [T] int32
    tile_first_token: torch.Tensor  # [tiles] int32: consecutive tokens of one request
    tile_tokens: torch.Tensor  # [tiles] int32
    num_items: int  # (tile, KV head) pairs
    threads: int  # threads that take items
    grain: int  # items a thread takes at a time


class NativeInvariantAttention(RotateThenAttend):
    """Paged attention whose per-query bits do not depend on batch, chunking or threads;
    `attend` rotates with `rotate` (the backend's rotary op) first."""

    name = "cpu_native"

    def __init__(
        self, library: ctypes.CDLL, num_threads: int | None = None,
        rotate: RotaryKernel = reference_rotary,
    ) -> None:
        super().__init__(rotate)
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"num_threads must be None or an integer >= 1, got {num_threads!r}")
        self._kernel = library.kvr_paged_attention
        self._kernel.argtypes = [ctypes.POINTER(KvrAttentionArgs), ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int]
        self._kernel.restype = ctypes.c_int
        self.vector_path = bool(library.kvr_vector_path())
        self._tiles_supported = library.kvr_tiles_supported
        self._tiles_supported.argtypes = [ctypes.c_int, ctypes.c_int]
        self._tiles_supported.restype = ctypes.c_int
        self.num_threads = num_threads  # None: torch.get_num_threads() at each step
        self._plans: PerStepPlan[StepPlan] = PerStepPlan()

    def vectorized(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether this build runs these head shapes on its AVX-512 path (else the scalar
        one, several times slower than SDPA)."""
        return (self.vector_path and head_dim % 16 == 0 and head_dim <= MAX_VECTOR_HEAD_DIM
                and num_heads // num_kv_heads <= MAX_VECTOR_GROUP)

    def tiled(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether this build runs a prefill's tokens in query tiles for `dtype` and
        `head_dim` (float32; bf16 with AVX512-BF16 and head_dim % 32 == 0): 2-3x the speed
        of SDPA in float32 (bench/bench_cpu_attention.py); else token by token."""
        return dtype in DTYPE_CODES and bool(self._tiles_supported(DTYPE_CODES[dtype], head_dim))

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int | None = None, softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend (over the last `window`
        positions only, unless None: the kernel never reads the keys before it; scores
        soft-capped at `softcap`, unless None; each head's softmax with its `sinks`
        logit, unless None); returns [T, Hq, D]."""
        check_kernel_inputs(query, key, kv_cache)
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        write_step_kv(kv_cache, meta.slot_mapping, key, value)
        if query.stride(-1) != 1:
            query = query.contiguous()
        plan = self._plans.get(meta, build_step_plan, meta, num_kv_heads,
                               self.num_threads or torch.get_num_threads(),
                               num_heads // num_kv_heads)
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype)
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()  # the kernel reads [Hq] floats
            if sinks.shape != (num_heads,):
                raise ValueError(f"sinks must hold one logit per query head ({num_heads}), "
                                 f"got shape {tuple(sinks.shape)}")
        args = KvrAttentionArgs(
            query.data_ptr(), query.stride(0), query.stride(1),
            kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), out.data_ptr(),
            plan.block_tables.data_ptr(), plan.block_tables.stride(0),
            plan.token_request.data_ptr(), plan.token_position.data_ptr(),
            num_heads, num_kv_heads, head_dim, kv_cache.shape[2], DTYPE_CODES[query.dtype], scale,
            window or 0, softcap or 0.0, None if sinks is None else sinks.data_ptr(),
            plan.tile_first_token.data_ptr(), plan.tile_tokens.data_ptr(),
        )
        code = self._kernel(ctypes.byref(args), plan.num_items, plan.grain, plan.threads)
        if code:
            raise RuntimeError(f"paged attention kernel failed with code {code}")
        return out


def check_kernel_inputs(query: torch.Tensor, key: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """What the C kernel reads: a ValueError that says what to change for anything else."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    if query.dtype != kv_cache.dtype or query.dtype not in DTYPE_CODES:
        raise ValueError(f"query dtype {query.dtype} must equal the cache dtype "
                         f"{kv_cache.dtype}, one of {list(DTYPE_CODES)}")
    if not kv_cache.is_contiguous():  # the kernel computes slot offsets itself
        raise ValueError(f"kv_cache must be contiguous, got strides {kv_cache.stride()}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")


def build_step_plan(meta: AttentionMetadata, num_kv_heads: int, threads: int,
                    group: int = 1) -> StepPlan:
    """Each token's request and position, the step's tiles (a request's tokens in runs
    of up to `MAX_TILE_ROWS // group`, `group` query heads per KV head) and how threads
    share the step's items."""
    query_lens = torch.tensor(meta.query_lens)
    seq_lens = torch.tensor(meta.seq_lens)
    num_tokens = int(query_lens.sum())
    token_request = torch.repeat_interleave(torch.arange(len(meta.query_lens)), query_lens)
    first_row = torch.cumsum(query_lens, 0) - query_lens
    row_in_request = torch.arange(num_tokens) - first_row[token_request]
    token_position = (seq_lens - query_lens)[token_request] + row_in_request
    tile_first_token, tile_tokens = step_tiles(meta.query_lens, group)
    num_items = len(tile_tokens) * num_kv_heads
    # A parallel region costs microseconds: small steps (decodes over short contexts)
    # run on the calling thread alone.
    key_rows = int((token_position + 1).sum()) * num_kv_heads
    threads = max(1, min(threads, num_items, key_rows // KEY_ROWS_PER_THREAD))
    return StepPlan(
        block_tables=meta.block_tables.to(device="cpu", dtype=torch.int32).contiguous(),
        token_request=token_request.to(torch.int32),
        token_position=token_position.to(torch.int32),
        tile_first_token=torch.tensor(tile_first_token, dtype=torch.int32),
        tile_tokens=torch.tensor(tile_tokens, dtype=torch.int32),
        num_items=num_items,
        threads=threads,
        # Small grains balance a step whose items grow with position, or a thread
        # the OS deschedules; each take is one atomic add.
        grain=max(1, num_items // (16 * threads)),
    )


def step_tiles(query_lens: list[int], group: int) -> tuple[list[int], list[int]]:
    """Each tile's first token and token count: every request's tokens in consecutive
    runs of at most `min(MAX_TILE_TOKENS, MAX_TILE_ROWS // group)` (a decode: one)."""
    size = max(1, min(MAX_TILE_TOKENS, MAX_TILE_ROWS // group))
    firsts: list[int] = []
    counts: list[int] = []
    row = 0
    for query_len in query_lens:
        for start in range(0, query_len, size):
            firsts.append(row + start)
            counts.append(min(size, query_len - start))
        row += query_len
    return firsts, counts

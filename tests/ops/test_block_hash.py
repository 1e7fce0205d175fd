"""The Triton fold64 kernel (`ops/triton/block_hash.py`) gives the torch version's and the
plain-Python reference's checksums (`kv_transfer/p2p/checksums.py`), for staged views
and cache tensors alike, over pieces longer than one loop iteration and ragged ones.
On CUDA, or on the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from conftest import TRITON_DEVICE, TRITON_TESTS

from kvrecover.kv_transfer.p2p.checksums import fold64_reference

pytestmark = TRITON_TESTS


def test_the_kernel_is_the_reference_on_caches_and_staged_views():
    from kvrecover.ops.triton.block_hash import WORDS_PER_ITERATION, fold64_partials

    generator = torch.Generator().manual_seed(5)
    num_caches, num_blocks = 3, 6
    for half in (16, 4 * WORDS_PER_ITERATION + 12):  # under one iteration, and ragged past four
        caches = [torch.randint(0, 256, (2, num_blocks, half), generator=generator,
                                dtype=torch.uint8).to(TRITON_DEVICE) for _ in range(num_caches)]
        caches[0][1, 2].fill_(0xFF)  # all-ones words: the sign and carries of int64 maths
        ids = [5, 0, 2]
        expected = [fold64_reference(b"".join(caches[c][side, b].cpu().numpy().tobytes()
                                              for side in range(2) for c in range(num_caches)),
                                     half) for b in ids]
        index = torch.tensor(ids, device=TRITON_DEVICE)
        got = [v & ((1 << 64) - 1) for v in fold64_partials(caches, index).tolist()]
        assert got == expected, half
        # The same blocks staged (side, cache, block): strided views of one buffer.
        staged = torch.stack([torch.stack([c[side, ids] for c in caches])
                              for side in range(2)])  # (2, caches, 3, half)
        views = [staged[:, c] for c in range(num_caches)]
        local = torch.arange(3, device=TRITON_DEVICE)
        assert [v & ((1 << 64) - 1) for v in fold64_partials(views, local).tolist()] == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the dispatch to the kernel is CUDA's")
def test_a_gpu_cache_is_checked_by_the_kernel_as_the_cpu_checks_it():
    from kvrecover.kv_transfer.p2p.checksums import fold64_checksums

    generator = torch.Generator().manual_seed(6)
    sides = [torch.randint(0, 256, (2, 40, 4096), generator=generator, dtype=torch.uint8)
             for _ in range(4)]
    ids = list(range(39, -1, -3))
    assert fold64_checksums([s.cuda() for s in sides], ids) == fold64_checksums(sides, ids)

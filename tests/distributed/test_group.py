"""DistributedGroup's collectives over real gloo groups (one thread per rank, in this
process): sums and gathers in rank order, and with `fixed_order` (batch_invariant) an
all-reduce whose bits for a row do not depend on how many rows travel with it."""

from __future__ import annotations

import threading

import pytest
import torch

from kvrecover.distributed.group import DistributedGroup, create_process_group
from kvrecover.distributed.rendezvous import join_store, open_store


def run_ranks(size: int, work, *, fixed_order: bool) -> list:
    """`work(group)` on every rank of a fresh gloo group of `size`; the results by rank."""
    store = open_store(None, timeout_s=30)
    results: list = [None] * size
    errors: list = []

    def rank_main(rank: int) -> None:
        try:
            client = store if rank == 0 else join_store(store.port, 30)
            group = DistributedGroup(
                create_process_group(client, rank, size, torch.device("cpu"), 30), rank, size,
                fixed_order=fixed_order)
            results[rank] = work(group)
            group.shutdown()
        except BaseException as error:  # surfaced in the test thread
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


def rank_rows(rank: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(rows, 300, generator=generator) * 10 ** rank).to(dtype)


@pytest.mark.parametrize("fixed_order", [False, True])
def test_all_reduce_sums_and_gather_concatenates_in_rank_order(fixed_order):
    def work(group):
        tensor = rank_rows(group.rank, 4, torch.float32)
        return group.all_reduce(tensor.clone()), group.gather_to_first(tensor)

    results = run_ranks(2, work, fixed_order=fixed_order)
    parts = [rank_rows(rank, 4, torch.float32) for rank in range(2)]
    for reduced, _ in results:
        assert torch.equal(reduced, parts[0] + parts[1])
    assert torch.equal(results[0][1], torch.cat(parts, dim=-1))
    assert results[1][1] is None


def test_a_fixed_order_all_reduce_gives_a_row_the_same_bits_in_any_batch():
    def work(group):
        batch = rank_rows(group.rank, 64, torch.bfloat16)
        return group.all_reduce(batch.clone()), group.all_reduce(batch[5:6].clone())

    results = run_ranks(3, work, fixed_order=True)
    parts = [rank_rows(rank, 64, torch.bfloat16) for rank in range(3)]
    in_rank_order = (parts[0] + parts[1]) + parts[2]
    for whole, alone in results:
        assert torch.equal(whole, in_rank_order)
        assert torch.equal(whole[5:6], alone)

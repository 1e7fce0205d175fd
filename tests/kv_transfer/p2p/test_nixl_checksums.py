"""The block checksums of a pull (`p2p/checksums.py`): fold64, the GPU's default, is what
its plain-Python definition says on every device (it leans on int64 arithmetic wrapping),
sees every one-word change and every swap of two different words, and does not depend
on how the blocks are batched; an unknown algorithm is refused."""

from __future__ import annotations

import pytest
import torch

from kvrecover.kv_transfer.p2p.checksums import (
    checksum_blocks,
    default_algorithm,
    fold64_checksums,
    fold64_reference,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_sides(num_caches: int, num_blocks: int, half: int, seed: int,
                 device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, num_blocks, half), generator=generator,
                          dtype=torch.uint8).to(device) for _ in range(num_caches)]


def block_bytes(sides: list[torch.Tensor], block_id: int) -> bytes:
    return b"".join(sides[c][side, block_id].cpu().numpy().tobytes()
                    for side in range(2) for c in range(len(sides)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_caches,half", [(1, 4), (3, 16), (2, 6), (4, 4096)])
def test_fold64_is_its_reference_on_every_device(device, num_caches, half):
    sides = random_sides(num_caches, 5, half, seed=half, device=device)
    # Words of all ones and all zeros too: the sign bit and carries of the int64 maths.
    sides[0][0, 1].fill_(0xFF)
    sides[-1][1, 2].zero_()
    ids = [4, 1, 2, 0]
    assert fold64_checksums(sides, ids) == [
        fold64_reference(block_bytes(sides, b), half) for b in ids]


@pytest.mark.parametrize("device", DEVICES)
def test_fold64_sees_every_one_word_change_and_a_swap(device):
    sides = random_sides(2, 1, 8, seed=1, device=device)
    clean = fold64_checksums(sides, [0])[0]
    for c in range(2):
        for side in range(2):
            for byte in range(8):
                for bit in (0, 7):
                    changed = [s.clone() for s in sides]
                    changed[c][side, 0, byte] ^= 1 << bit
                    assert fold64_checksums(changed, [0])[0] != clean, (c, side, byte, bit)
    swapped = [s.clone() for s in sides]
    swapped[0][0, 0, :4], swapped[1][1, 0, 4:] = sides[1][1, 0, 4:], sides[0][0, 0, :4]
    assert not torch.equal(sides[0][0, 0, :4], sides[1][1, 0, 4:])
    assert fold64_checksums(swapped, [0])[0] != clean
    # Two blocks of the same bytes in other positions of the cache hash alike.
    twice = [torch.cat([s, s], dim=1) for s in sides]
    assert fold64_checksums(twice, [0, 1]) == [clean, clean]


@pytest.mark.parametrize("device", DEVICES)
def test_the_checksums_do_not_depend_on_how_blocks_are_batched_nor_where(device):
    sides = random_sides(3, 9, 32, seed=2)
    on_device = [side.to(device) for side in sides]
    for algorithm in ("xxh3", "fold64"):
        whole = checksum_blocks(algorithm, sides, range(9))
        assert [checksum_blocks(algorithm, sides, [b])[0] for b in range(9)] == whole
        assert checksum_blocks(algorithm, sides, []) == []
        assert checksum_blocks(algorithm, on_device, [8, 3]) == [whole[8], whole[3]]
        assert len(set(whole)) == 9


def test_an_unknown_algorithm_is_refused_and_the_cache_picks_the_default():
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        checksum_blocks("md5", random_sides(1, 1, 4, seed=3), [0])
    assert default_algorithm(torch.zeros(1)) == "xxh3"

from __future__ import annotations

import random

import pytest

from kvstrata.store.allocator import ALIGNMENT, OffsetAllocator


def test_alignment_and_exhaustion():
    a = OffsetAllocator(1024)
    offs = [a.allocate(1) for _ in range(16)]
    assert offs == [i * ALIGNMENT for i in range(16)]
    assert a.allocate(1) is None
    assert a.used_bytes == 1024 and a.free_bytes == 0


def test_best_fit_picks_smallest_hole():
    a = OffsetAllocator(64 * 10)
    blocks = [a.allocate(64) for _ in range(10)]
    a.free(blocks[1])  # hole of 64
    a.free(blocks[4])
    a.free(blocks[5])  # hole of 128
    assert a.allocate(64) == blocks[1]
    assert a.allocate(100) == blocks[4]


def test_coalescing_restores_one_block():
    a = OffsetAllocator(1 << 16)
    offs = [a.allocate(1000) for _ in range(50)]
    random.Random(1).shuffle(offs)
    for o in offs[:25]:
        a.free(o)
    assert a.fragmentation > 0
    for o in offs[25:]:
        a.free(o)
    assert a.free_bytes == a.capacity and a.largest_free == a.capacity
    assert a.fragmentation == 0.0
    assert a.stats()["free_blocks"] == 1


def test_fragmentation_stat():
    a = OffsetAllocator(64 * 4)
    b = [a.allocate(64) for _ in range(4)]
    a.free(b[0])
    a.free(b[2])
    assert a.free_bytes == 128 and a.largest_free == 64
    assert a.fragmentation == pytest.approx(0.5)
    assert a.allocate(128) is None  # free bytes are enough, contiguous space is not


def test_random_against_model():
    rng = random.Random(7)
    a = OffsetAllocator(1 << 20)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            assert a.free(off) == live.pop(off)
        else:
            size = rng.randint(1, 20000)
            off = a.allocate(size)
            if off is None:
                continue
            assert off % ALIGNMENT == 0 and off + size <= a.capacity
            for o, s in live.items():  # no overlap with any live block
                assert off + size <= o or o + s <= off
            live[off] = a.block_size(off)
        assert a.used_bytes == sum(live.values())
    for off in list(live):
        a.free(off)
    assert a.largest_free == a.capacity


def test_bad_input():
    with pytest.raises(ValueError, match="capacity"):
        OffsetAllocator(0)
    a = OffsetAllocator(4096)
    with pytest.raises(ValueError, match="offset"):
        a.free(64)


def test_allocate_run_is_consecutive_blocks_freed_one_by_one():
    a = OffsetAllocator(4096)
    offs = a.allocate_run([100, 64, 1])
    assert offs == [0, 128, 192] and a.used_bytes == 256
    assert [a.block_size(o) for o in offs] == [128, 64, 64]
    a.free(128)
    assert a.allocate(64) == 128  # the hole is reused alone
    for o in offs:
        a.free(o)
    assert a.free_bytes == 4096 and a.stats()["free_blocks"] == 1  # coalesced back into one range
    assert a.allocate_run([4000, 200]) is None and a.free_bytes == 4096  # nothing taken when it does not fit


def test_free_many_leaves_the_same_free_list_as_one_free_per_block():
    """Blocks side by side go back as one range; the result equals freeing them one at a time."""
    rng = random.Random(7)
    for trial in range(20):
        a, b = OffsetAllocator(1 << 16), OffsetAllocator(1 << 16)
        sizes = [rng.randrange(1, 700) for _ in range(40)]
        offs_a = [a.allocate(n) for n in sizes]
        offs_b = [b.allocate(n) for n in sizes]
        assert offs_a == offs_b
        gone = rng.sample(offs_a, rng.randrange(0, 40))
        for off in gone[: len(gone) // 3]:  # some free neighbours first
            a.free(off)
            b.free(off)
        batch = gone[len(gone) // 3 :]
        rng.shuffle(batch)
        assert a.free_many(batch) == sum(b.free(off) for off in batch)
        assert a.stats() == b.stats() and a._sizes == b._sizes and a._by_start == b._by_start, trial
    with pytest.raises(ValueError, match="offset"):
        a.free_many([12345, 0, 64, 128])  # a bad offset raises as free does


def test_free_many_of_a_run_makes_one_free_block():
    a = OffsetAllocator(1 << 12)
    offs = a.allocate_run([64] * 8)
    a.free_many(offs)
    assert a.stats()["free_blocks"] == 1 and a.free_bytes == a.capacity

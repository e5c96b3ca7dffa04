"""Values larger than a DRAM segment once the segments mapped fill the tier: whole segments are emptied (their objects
evicted or spilled) and retired, their memory given back, so the value gets a segment of its own; what cannot go
(leases) is never touched, and a refusal says why."""

from __future__ import annotations

import pytest

from kvstrata.errors import CapacityError
from kvstrata.store import ObjectStore
from kvstrata.store.tiers.memory import MemoryTier

KB, MB = 1024, 1 << 20


def _value(i: int, size: int) -> bytes:
    return bytes([i % 251 + 1]) * size


def _filled(store: ObjectStore, n: int, size: int = 900 * KB, **kw) -> list[str]:
    """``n`` values of ``size`` bytes: one per 1 MiB segment, so that ``n`` segments are mapped."""
    keys = [f"small/{i}" for i in range(n)]
    for i, key in enumerate(keys):
        store.put(key, _value(i, size), **kw)
    return keys


def _memory(store: ObjectStore) -> dict:
    return store.stats()["tiers"]["memory"]


def test_a_value_larger_than_a_segment_fits_a_fully_mapped_tier_by_spilling_whole_segments(tmp_path, make_config):
    s = ObjectStore(make_config(tmp_path, memory=4 * MB, segment=1 * MB))
    try:
        keys = _filled(s, 4)
        assert _memory(s)["mapped"] == 4 * MB  # every byte of the tier is in 1 MiB segments now
        big = _value(200, 3 * MB // 2)  # 1.5 MiB: needs a 2 MiB segment of its own
        s.put("big", big)
        mem = _memory(s)
        assert mem["retired_segments"] == 2 and mem["mapped"] <= 4 * MB
        assert s.get_bytes("big") == big
        # the objects of the emptied segments were spilled, not lost: each reads back exactly
        for i, key in enumerate(keys):
            assert s.get_bytes(key) == _value(i, 900 * KB)
        assert s.stats()["spills"] >= 2
    finally:
        s.close()


def test_evictable_objects_go_and_the_tier_keeps_working_through_many_rounds(make_config):
    s = ObjectStore(make_config(memory=4 * MB, segment=1 * MB))
    try:
        for round_ in range(6):  # small values map segments, a large one empties them (or one it had), again and again
            _filled(s, 4, write_mode="evictable")
            big = _value(round_, 3 * MB // 2)
            s.put(f"big/{round_}", big, write_mode="evictable")
            assert s.get_bytes(f"big/{round_}") == big
            mem = _memory(s)
            assert mem["mapped"] <= 4 * MB and mem["used"] <= mem["mapped"]
        assert _memory(s)["retired_segments"] >= 2
    finally:
        s.close()


def test_empty_segments_are_retired_with_nothing_evicted(make_config):
    s = ObjectStore(make_config(memory=4 * MB, segment=1 * MB))
    try:
        keys = _filled(s, 4)
        s.delete(keys)
        s.put("big", _value(7, 3 * MB))  # 3 MiB of the 4: three segments must go
        assert s.get_bytes("big") == _value(7, 3 * MB)
        assert _memory(s)["retired_segments"] >= 3
        assert s.stats()["evictions"] == 0 and s.stats()["spills"] == 0
    finally:
        s.close()


def test_a_leased_object_keeps_its_segment_and_the_others_make_the_room(tmp_path, make_config):
    s = ObjectStore(make_config(tmp_path, memory=4 * MB, segment=1 * MB))
    try:
        keys = _filled(s, 4)
        lease = s.acquire(keys[0], owner="reader")
        view = s.buffer(lease.location)
        s.put("big", _value(9, 3 * MB // 2))
        assert lease.location.segment not in s.retired_segments
        assert bytes(view) == _value(0, 900 * KB)  # the reader's bytes never moved
        s.release(lease.lease_id)
        assert s.get_bytes("big") == _value(9, 3 * MB // 2)
        for i, key in enumerate(keys):
            assert s.get_bytes(key) == _value(i, 900 * KB)
    finally:
        s.close()


def test_a_value_that_only_leased_segments_could_make_room_for_is_refused_and_nothing_moves(make_config):
    s = ObjectStore(make_config(memory=4 * MB, segment=1 * MB))
    try:
        keys = _filled(s, 4, write_mode="evictable")
        leases = [s.acquire(key, owner="reader") for key in keys[:3]]  # only one segment could go: 2 are needed
        with pytest.raises(CapacityError, match="larger than a segment"):
            s.put("big", _value(3, 3 * MB // 2))
        assert s.stats()["evictions"] == 0  # no object dropped for a room that could not be made
        assert _memory(s)["retired_segments"] == 0
        for i, key in enumerate(keys):
            assert s.get_bytes(key) == _value(i, 900 * KB)
        for lease in leases:
            s.release(lease.lease_id)
        s.put("big", _value(3, 3 * MB // 2))  # the leases are back: now it fits
        assert s.get_bytes("big") == _value(3, 3 * MB // 2)
    finally:
        s.close()


def test_a_value_larger_than_the_tier_is_still_refused_up_front(make_config):
    s = ObjectStore(make_config(memory=4 * MB, segment=1 * MB))
    try:
        with pytest.raises(CapacityError, match="does not fit the memory tier"):
            s.put("huge", b"x" * (4 * MB + 1))
        s.put("whole", _value(1, 4 * MB))  # the whole tier, in one segment of its own, is fine
        assert s.get_bytes("whole") == _value(1, 4 * MB)
    finally:
        s.close()


def _shmem_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


def test_a_retired_segment_gives_its_memory_back_and_allocates_nothing():
    tier = MemoryTier(8 * MB, segment_bytes=4 * MB, hugepages="off", numa_node=None)
    try:
        first = tier.allocate(MB)
        second = tier.allocate(4 * MB)  # a second 4 MiB segment: the tier is fully mapped
        assert second.segment == 1 and tier.mapped == 8 * MB
        tier.free(first)
        before = _shmem_kib()
        assert tier.retire_empty(4 * MB) == 4 * MB
        assert tier.retired == [0]
        assert before - _shmem_kib() >= 4 * 1024 - 64  # its pages went back to the kernel
        assert tier.mapped == 4 * MB and tier.stats()["segments"] == 1
        tier.free(second)
        loc = tier.allocate(6 * MB)  # needs 6 of the 8 MiB: segment 1 goes as well, a new one comes
        assert loc.segment == 2 and tier.retired == [0, 1] and tier.mapped == 6 * MB
        assert all(tier.allocate(KB).segment == 3 for _ in range(3))  # small ones: a new segment, never 0 or 1
    finally:
        tier.close()


def test_retire_empty_retires_nothing_when_the_empty_segments_are_not_enough():
    tier = MemoryTier(8 * MB, segment_bytes=2 * MB, hugepages="off", numa_node=None)
    try:
        held = [tier.allocate(2 * MB) for _ in range(4)]
        tier.free(held[0])
        assert tier.retire_empty(4 * MB) == 0  # one empty segment of the two needed: keep it
        assert tier.retired == [] and tier.mapped == 8 * MB
    finally:
        tier.close()


@pytest.mark.gpu
def test_a_retired_segment_is_unregistered_from_cuda_and_the_hbm_tier_loads_the_large_value():
    import torch

    from kvstrata.store import StoreConfig

    s = ObjectStore(StoreConfig(memory_bytes=8 * MB, segment_bytes=2 * MB, gpu_bytes=8 * MB, numa_node=None))
    try:
        for i in range(4):
            s.put(f"small/{i}", _value(i, 2 * MB - 64 * KB), write_mode="evictable")
        assert s.stats()["tiers"]["gpu"]["host_registered"] == 8 * MB  # every DRAM segment page-locked
        s.put("big", _value(5, 5 * MB), write_mode="evictable")  # three segments retired, a 6 MiB one mapped
        assert len(s.retired_segments) == 3
        assert s.stats()["tiers"]["gpu"]["host_registered"] == 8 * MB  # 3 x 2 MiB unregistered, 6 MiB registered
        lease = s.acquire_device("big", owner=1)
        assert torch.equal(
            s.device_tensor(lease.location).cpu(), torch.frombuffer(_value(5, 5 * MB), dtype=torch.uint8)
        )
        s.release(lease.lease_id)
    finally:
        s.close()


def test_segments_are_emptied_only_as_far_as_the_ssd_takes_their_objects_together(tmp_path, make_config):
    """Each victim fitted the SSD alone, so two segments' worth were spilled into a 1 MiB SSD tier: 1.8 MB on disk,
    its reserved count negative for good."""
    s = ObjectStore(make_config(tmp_path, memory=4 * MB, segment=1 * MB, disk=1 * MB))
    try:
        keys = _filled(s, 4)
        with pytest.raises(CapacityError, match="larger than a segment"):
            s.put("big", _value(5, 3 * MB // 2))  # two segments to empty: their 1.8 MB do not fit the SSD
        disk = s.stats()["tiers"]["disk"]
        assert disk["used"] <= disk["capacity"] and disk["reserved"] >= 0
        for i, key in enumerate(keys):
            assert s.get_bytes(key) == _value(i, 900 * KB)
    finally:
        s.close()


def test_a_large_value_waits_for_writes_in_progress_rather_than_be_refused(make_config):
    """Unsealed creates keep their segments from being emptied for milliseconds: the large value was refused at once."""
    import threading
    import time

    s = ObjectStore(make_config(memory=4 * MB, segment=1 * MB))
    try:
        s.put("old", _value(1, 900 * KB), write_mode="evictable")
        for key in ("w/0", "w/1", "w/2"):  # three segments held by writes in progress
            s.create(key, 900 * KB, owner="writer", write_mode="evictable")
        sealer = threading.Timer(0.3, lambda: s.seal("w/0", owner="writer"))  # one lands: its segment may go then
        sealer.start()
        began = time.monotonic()
        s.put("big", _value(2, 3 * MB // 2), write_mode="evictable")
        assert time.monotonic() - began >= 0.25
        assert s.get_bytes("big") == _value(2, 3 * MB // 2)
        sealer.join()
    finally:
        s.close()


def test_a_value_of_nearly_the_whole_tier_fits_when_its_rounded_segment_would_not(make_config):
    """Its own segment is rounded up to whole huge pages (2 MiB): 4.5 MiB of a 5 MiB tier asked for 6 MiB."""
    s = ObjectStore(make_config(memory=5 * MB, segment=1 * MB))
    try:
        s.put("most", _value(3, 9 * MB // 2))
        assert s.get_bytes("most") == _value(3, 9 * MB // 2)
    finally:
        s.close()


def test_a_segment_not_yet_announced_is_not_retired():
    """A segment whose listeners (CUDA page-locking it) still run would be page-locked after it was retired."""
    tier = MemoryTier(8 * MB, segment_bytes=4 * MB, hugepages="off", numa_node=None)
    try:
        assert tier.allocate(4 * MB).segment == 0  # segment 0 full
        tier.free(tier.allocate(MB))  # segment 1 mapped, empty
        tier.retirable = lambda index: index < 1  # segment 1 still being announced
        assert tier.retire_empty(4 * MB) == 0 and tier.retired == []
        tier.retirable = lambda index: True  # announced
        assert tier.retire_empty(4 * MB) == 4 * MB and tier.retired == [1]
    finally:
        tier.close()


def test_large_values_beside_small_writers_are_never_refused(make_config):
    """Threads writing small values hold blocks while they copy: 7-59% of large puts were refused (session 36 audit)."""
    import random
    import threading
    import time

    s = ObjectStore(make_config(memory=8 * MB, segment=1 * MB))
    stop = time.monotonic() + 1.5
    refused, stored = [], [0]

    def small(seed):
        rnd = random.Random(seed)
        while time.monotonic() < stop:
            s.put(f"s{seed}/{rnd.randint(0, 200)}", b"s" * rnd.randint(1, 200 * KB), write_mode="evictable")

    def large():
        rnd = random.Random(7)
        while time.monotonic() < stop:
            try:
                s.put("big", b"B" * rnd.randint(MB + 1, 3 * MB), write_mode="evictable")
                stored[0] += 1
            except CapacityError as exc:
                refused.append(exc)

    threads = [threading.Thread(target=large)] + [threading.Thread(target=small, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert stored[0] > 10 and not refused, (stored, refused[:1])
    finally:
        s.close()

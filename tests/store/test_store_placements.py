"""The placement table (kvstrata.store.placements): what the store writes into it, and when it stops naming a
placement. Readers only take it as advice (their copies are checked against leases: tests/test_client_device.py);
these tests pin down that the advice is right when it is given, and withdrawn when it goes stale."""

from __future__ import annotations

import time

import pytest

from kvstrata.store import ObjectStore
from kvstrata.store.placements import BUCKETS, PlacementHints, PlacementTable, key_hash

KB = 1024


@pytest.fixture
def table():
    t = PlacementTable()
    yield t
    t.close()


@pytest.fixture
def store_with(make_config):
    """``store_with(table)``: a small DRAM-only store writing ``table``; closed after the test."""
    made = []

    def make(table: PlacementTable) -> ObjectStore:
        s = ObjectStore(make_config())
        s.publish_placements(table)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _attached(table: PlacementTable) -> PlacementHints:
    """A reader's view of ``table``, as a client maps it (same pages, another mapping)."""
    import os

    from kvstrata.memory.shm import SharedSegment

    return PlacementHints(SharedSegment.attach(os.dup(table.fd), table.segment.nbytes))


def _where(lease) -> tuple:
    loc = lease.location
    return (loc.segment, loc.offset, loc.size, lease.placement)


def _colliding(key: str) -> str:
    """Another key in the same bucket as ``key``."""
    bucket = key_hash(key)[0]
    for i in range(50 * BUCKETS):
        other = f"other/{i}"
        if key_hash(other)[0] == bucket:
            return other
    raise AssertionError("no collision found")


def test_sealed_objects_are_named_with_the_placement_their_leases_carry(table, store_with):
    s = store_with(table)
    hints = _attached(table)
    s.put("a", b"A" * 3000)
    s.put_many([("b", b"B" * 100), ("c", b"C" * 5000)])
    leases = s.acquire_many(["a", "b", "c"], owner="r")
    assert hints.lookup(["a", "b", "c", "missing"]) == [*map(_where, leases), None]
    assert len({lease.placement for lease in leases}) == 3  # one placement per version
    s.release_many([lease.lease_id for lease in leases])
    s.put("a", b"a" * 3000)  # rewritten (maybe in place): a new placement, even at the same offset
    new = s.acquire("a", owner="r")
    assert new.placement != leases[0].placement and hints.lookup(["a"]) == [_where(new)]
    s.release(new.lease_id)
    hints.close()


def test_a_landing_commit_is_named_once_it_settles_and_a_rewrite_keeps_the_new_name(table, store_with):
    # The placements of a commit sent before its copies landed appear when it settles (published before the seal's
    # loop, under the same lock): never before the writer's word, and the leases taken then carry them. A rewrite of
    # a key whose old version is still leased names the new version (the old one's withdrawal leaves it).
    from kvstrata.store.allocator import ALIGNMENT
    from kvstrata.store.tiers.base import Location

    s = store_with(table)
    hints = _attached(table)
    s.put("k0", b"old" * 100)
    pinned = s.acquire("k0", owner="r")  # the old version stays leased while the new one seals
    loc = s.reserve("w", 1 << 20)
    items, offset = [], loc.offset
    for i in range(4):
        s.buffer(Location(loc.segment, offset, 300))[:] = bytes([i]) * 300
        items.append((f"k{i}", 300, offset))
        offset += -(-300 // ALIGNMENT) * ALIGNMENT  # items side by side from the head, as a writer carves them
    word = [None]
    assert s.commit("w", items, landed=lambda: word[0]) == [None] * 4
    keys = [it[0] for it in items]
    assert hints.lookup(keys) == [_where(pinned), None, None, None]  # not landed: the old version's name only
    word[0] = True
    s.settle()
    leases = s.acquire_many(keys, owner="r")
    assert hints.lookup(keys) == list(map(_where, leases))
    assert leases[0].placement != pinned.placement
    s.release(pinned.lease_id)
    assert hints.lookup(keys[:1]) == [_where(leases[0])]
    s.release_many([lease.lease_id for lease in leases])
    hints.close()


def test_deleted_and_expired_keys_are_withdrawn(table, store_with):
    s = store_with(table)
    hints = _attached(table)
    s.put_many([("d", b"d" * 100), ("t", b"t" * 100), ("keep", b"k" * 100)])
    lease = s.acquire("d", owner="r")  # a reader still pins the deleted version: its bytes stay, its entry goes
    s.delete(["d"])
    assert hints.lookup(["d"]) == [None]  # at once
    s.expire(["t"], 0.01)
    time.sleep(0.05)
    assert s.exists(["t"]) == [False]
    # an expired key's entry goes when the store's background pass removes it (every flush interval; a loaded
    # machine can make that later than 50 ms)
    deadline = time.monotonic() + 5
    while hints.lookup(["t"]) != [None] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hints.lookup(["d", "t"]) == [None, None] and hints.lookup(["keep"])[0] is not None
    s.release(lease.lease_id)
    hints.close()


def test_spilled_object_is_withdrawn_and_comes_back_as_a_new_placement(tmp_path, make_config):
    table = PlacementTable()
    s = ObjectStore(make_config(tmp_path, memory=1 << 20, segment=1 << 20))
    s.publish_placements(table)
    hints = _attached(table)
    named = {}
    for i in range(16):  # 1.6 MiB in a 1 MiB tier: the oldest are spilled to SSD
        s.put(f"m{i}", bytes([i]) * (100 * KB))
        named[f"m{i}"] = hints.lookup([f"m{i}"])[0]
    assert s.stats()["spills"] > 0 and None not in named.values()
    gone = [k for k in named if hints.lookup([k]) == [None]]  # their DRAM bytes went: no longer pointed at
    assert gone and len(gone) <= s.stats()["spills"]
    again = s.acquire(gone[0], owner="r")  # promoted back: same version, new bytes, new placement
    assert again.placement != named[gone[0]][3] and hints.lookup([gone[0]]) == [_where(again)]
    assert bytes(s.buffer(again.location)) == bytes([int(gone[0][1:])]) * (100 * KB)
    s.release(again.lease_id)
    hints.close()
    s.close()
    table.close()


def test_a_key_sharing_a_bucket_is_not_found_and_mutable_objects_are_never_named(table, store_with):
    s = store_with(table)
    hints = _attached(table)
    other = _colliding("x")
    s.put("x", b"x" * 10)
    s.put(other, b"o" * 10)  # the bucket is the later key's now
    assert hints.lookup(["x"]) == [None] and hints.lookup([other])[0] is not None
    s.delete(["x"])  # withdrawing a key whose bucket another key took leaves that key's entry alone
    assert hints.lookup([other])[0] is not None
    s.buffer(s.create("mut", 10, owner="w"))[:] = b"m" * 10
    s.publish("mut", owner="w")  # mutable: its bytes may change under a copy, so never advised
    assert hints.lookup(["mut"]) == [None]
    hints.close()


def test_a_closed_table_answers_nothing_and_takes_no_writes(table, store_with):
    hints = _attached(table)
    hints.close()
    assert hints.lookup(["a", "b"]) == [None, None]
    s = store_with(table)
    s.publish_placements(None)
    s.put("a", b"a")  # the store no longer writes the table
    fresh = _attached(table)
    assert fresh.lookup(["a"]) == [None]
    fresh.close()

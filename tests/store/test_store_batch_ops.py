"""The engine's batch paths (one critical section for many keys) answer exactly like their per-key twins."""

from __future__ import annotations

import itertools
import time

import pytest

from kvstrata.errors import CapacityError, KeyExists, KeyNotFound, Timeout
from kvstrata.store import WriteMode


def test_create_many_then_seal_many(store):
    store.put("exists", b"old")
    locs = store.create_many(
        [("a", 10), ("exists", 4), ("", 3), ("b", 0), ("huge", 1 << 40), ("a2", 7)], owner=1, nx=True
    )
    assert isinstance(locs[1], KeyExists) and isinstance(locs[2], ValueError) and isinstance(locs[4], CapacityError)
    for i, n in ((0, 10), (3, 0), (5, 7)):
        assert locs[i].size == n
    store.buffer(locs[0])[:] = b"0123456789"
    res = store.seal_many(["a", "never-created", "b", "a2"], owner=1)
    assert res[0] is None and isinstance(res[1], KeyNotFound) and res[2] is None and res[3] is None
    assert store.get_bytes("a") == b"0123456789" and store.get_bytes("b") == b"" and store.get_bytes("exists") == b"old"
    assert isinstance(store.seal_many(["a"], owner=1)[0], KeyNotFound)  # sealed once only
    assert store.stats()["creates_in_progress"] == 0


def test_seal_many_of_another_owner_is_refused(store):
    (_loc,) = store.create_many([("mine", 3)], owner=1)
    assert isinstance(store.seal_many(["mine"], owner=2)[0], KeyNotFound)
    assert store.exists(["mine"]) == [False]
    store.release_owner(1)
    assert store.stats()["creates_in_progress"] == 0


def test_seal_many_write_through_reaches_the_disk(dstore):
    dstore.create_many([("wt", 5)], owner=1, write_mode=WriteMode.WRITE_THROUGH)
    assert dstore.seal_many(["wt"], owner=1) == [None]
    assert dstore.get_bytes("wt") == b"\0" * 5
    assert dstore.stats()["tiers"]["disk"]["used"] > 0


def test_acquire_many_mixes_resident_missing_and_expired(store):
    store.put("r1", b"one")
    store.put("r2", b"two")
    store.put("short", b"ttl", ttl=0.05)
    time.sleep(0.1)
    out = store.acquire_many(["r1", "missing", "short", "r2", "r1"], owner=7)
    assert out[0].key == "r1" and out[3].key == "r2" and out[4].key == "r1"
    assert isinstance(out[1], KeyNotFound) and isinstance(out[2], KeyNotFound)
    assert out[0].lease_id != out[4].lease_id and store.stats()["leases"] == 3
    store.delete(["r1"])  # leased: the bytes stay until both leases go
    assert bytes(store.buffer(out[0].location)) == b"one"
    store.release_many([out[0].lease_id, out[3].lease_id, out[4].lease_id, out[4].lease_id, 12345])
    assert store.stats()["leases"] == 0


def test_acquire_many_waits_for_missing_keys_within_the_timeout(store):
    store.put("here", b"x")
    t0 = time.monotonic()
    out = store.acquire_many(["here", "late"], owner=1, timeout=0.1)
    assert out[0].key == "here" and isinstance(out[1], Timeout)
    assert time.monotonic() - t0 >= 0.09
    store.release_owner(1)
    assert store.stats()["leases"] == 0


def test_create_many_carves_a_batch_side_by_side_each_freed_on_its_own(store):
    used = store.stats()["tiers"]["memory"]["used"]
    locs = store.create_many([(f"run/{i}", 100 + i) for i in range(5)], owner=1)
    assert len({loc.segment for loc in locs}) == 1
    for a, b in itertools.pairwise(locs):
        assert b.offset == a.offset + ((a.size + 63) // 64) * 64  # back to back, 64-byte aligned
    assert store.seal_many([f"run/{i}" for i in range(5)], owner=1) == [None] * 5
    assert store.delete(["run/1", "run/3"]) == [True, True]  # each object is its own allocation
    assert store.get_bytes("run/2", timeout=0) == bytes(102)
    store.delete(["run/0", "run/2", "run/4"])
    assert store.stats()["tiers"]["memory"]["used"] == used


def test_create_many_same_key_twice_nx_and_not(store):
    locs = store.create_many([("dup", 8), ("dup", 8)], owner=1, nx=True)
    assert not isinstance(locs[0], BaseException) and isinstance(locs[1], KeyExists)
    assert store.seal_many(["dup"], owner=1) == [None]
    used = store.stats()["tiers"]["memory"]["used"]
    locs = store.create_many([("twice", 8), ("twice", 16)], owner=1)  # the first stays open: the second is refused
    assert locs[0].size == 8 and isinstance(locs[1], KeyExists) and "still open" in str(locs[1])
    assert store.stats()["creates_in_progress"] == 1
    assert store.seal_many(["twice", "twice"], owner=1)[1].__class__ is KeyNotFound
    assert store.sizes(["twice"]) == [8] and store.stats()["creates_in_progress"] == 0
    store.delete(["twice"])
    assert store.stats()["tiers"]["memory"]["used"] == used  # the refused create's bytes went back too


def test_create_many_owner_gone_aborts_all_and_frees(store):
    used = store.stats()["tiers"]["memory"]["used"]
    store.create_many([(f"gone/{i}", 1000) for i in range(4)], owner="dead")
    store.release_owner("dead")
    assert store.stats()["creates_in_progress"] == 0 and store.exists([f"gone/{i}" for i in range(4)]) == [False] * 4
    assert store.stats()["tiers"]["memory"]["used"] == used


def test_batch_of_plain_keys_replaces_visible_versions_and_wakes_waiters(store):
    """The one-pass batch paths (distinct ASCII keys): replaced versions stay under their leases, a
    reader waiting for a key wakes at the batch's seal, zero-size objects own no bytes."""
    import threading

    used = store.stats()["tiers"]["memory"]["used"]
    keys = [f"plain/{i}" for i in range(12)]
    store.put_many([(k, b"old") for k in keys[:6]])
    held = store.acquire_many(keys[:2], owner="reader")
    got = []
    waiter = threading.Thread(target=lambda: got.append(store.acquire("plain/11", owner="w", timeout=5)))
    waiter.start()
    sizes = [0 if i % 5 == 0 else 10 + i for i in range(12)]
    locs = store.create_many(list(zip(keys, sizes)), owner=1)
    assert [loc.size for loc in locs] == sizes and locs[0].segment == locs[0].offset == 0
    for k, loc in zip(keys, locs):
        store.buffer(loc)[:] = k.encode().ljust(loc.size, b"-")[: loc.size]
    assert store.exists(keys) == [True] * 6 + [False] * 6  # nothing visible before the seal
    assert store.seal_many(keys, owner=1) == [None] * 12
    waiter.join(5)
    assert got and got[0].size == sizes[11]
    for k, n in zip(keys, sizes):
        assert store.get_bytes(k) == k.encode().ljust(n, b"-")[:n]
    assert [bytes(store.buffer(lease.location)) for lease in held] == [b"old", b"old"]  # pinned old versions
    store.release_owner("reader")
    store.release_owner("w")
    store.delete(keys)
    assert store.stats()["tiers"]["memory"]["used"] == used and store.stats()["leases"] == 0


def test_batch_of_plain_keys_second_create_nx_ttl_and_write_back(dstore):
    keys = [f"p/{i}" for i in range(5)]
    first = dstore.create_many([(k, 100) for k in keys], owner=1)
    again = dstore.create_many([(k, 200) for k in keys], owner=1)  # refused: the first creates are still open
    assert all(isinstance(r, KeyExists) for r in again) and all(loc.size == 100 for loc in first)
    assert all(isinstance(r, KeyExists) for r in dstore.create_many([(k, 8) for k in keys], owner=2, nx=True))
    assert dstore.seal_many(keys, owner=1) == [None] * 5 and dstore.stats()["creates_in_progress"] == 0
    assert dstore.sizes(keys) == [100] * 5
    short = [f"ttl/{i}" for i in range(3)]
    dstore.create_many([(k, 4) for k in short], owner=1, ttl=0.05)
    assert dstore.seal_many(short, owner=1) == [None] * 3
    time.sleep(0.1)
    assert dstore.exists(short) == [False] * 3
    wb = [f"wb/{i}" for i in range(3)]
    dstore.create_many([(k, 64) for k in wb], owner=1, write_mode=WriteMode.WRITE_BACK)
    assert dstore.seal_many(wb, owner=1) == [None] * 3
    dstore.flush()
    assert dstore.stats()["dirty"] == 0 and dstore.stats()["tiers"]["disk"]["used"] > 0


def test_a_large_delete_or_expire_holds_the_lock_chunk_by_chunk_and_answers_every_key(store, monkeypatch):
    from kvstrata.store import engine

    monkeypatch.setattr(engine, "LOCK_CHUNK", 16)
    keys = [f"chunked/{i}" for i in range(50)]
    store.put_many([(k, b"v") for k in keys[::2]])  # every other key exists
    store.put("chunked/late", b"x", ttl=0.001)
    time.sleep(0.01)  # expired: answered False by both calls, as one key at a time would be
    holds = []
    real = store._lock

    class Counting:  # the store's lock, counting its holds: another client's request can come between two
        def __enter__(self):
            real.acquire()
            holds.append(1)

        def __exit__(self, *exc):
            real.release()

    store._lock = Counting()
    try:
        assert store.expire([*keys, "chunked/late"], 60) == [i % 2 == 0 for i in range(50)] + [False]
        assert len(holds) == 4  # 51 keys, 16 per hold
        assert store.delete([*keys, "chunked/late"]) == [i % 2 == 0 for i in range(50)] + [False]
        assert len(holds) == 8
    finally:
        store._lock = real
    assert store.exists(keys) == [False] * 50
    assert store.stats()["tiers"]["memory"]["used"] == 0  # every block given back


def test_put_many_writes_runs_of_small_values_per_lock_hold_with_per_key_results(store, monkeypatch):
    from kvstrata.store import batch, writes

    monkeypatch.setattr(batch, "PUT_CHUNK", 8)
    store.put_many([("pm/old-same", b"o" * 100), ("pm/old-other", b"o" * 10), ("pm/taken", b"t")])
    items = [(f"pm/{i}", bytes([i]) * (i * 37 % 300)) for i in range(20)]  # sizes 0..299, a zero among them
    items += [
        ("pm/old-same", b"n" * 100),  # rewritten in place (same block size)
        ("pm/old-other", b"n" * 5000),  # a new block
        ("pm/big", b"b" * (writes._SMALL + 1)),  # past a small value: put's own path
        ("pm/3", b"again"),  # a key twice in one batch: the later one stands
        ("", b"x"),  # a bad key: the whole call raises, before anything is written
    ]
    with pytest.raises(ValueError, match="items"):
        store.put_many(items)  # bad arguments: raised before anything is written
    assert store.exists(["pm/0", "pm/old-same"]) == [False, True] and store.get_bytes("pm/old-same") == b"o" * 100
    items.pop()
    holds = []
    real = store._lock

    class Counting:
        def __enter__(self):
            real.acquire()
            holds.append(1)

        def __exit__(self, *exc):
            real.release()

        def acquire(self, *a):  # (the allocator's wait for room lets the lock go this way)
            return real.acquire(*a)

        def release(self):
            real.release()

    store._lock = Counting()
    try:
        assert store.put_many(items) == [None] * len(items)
    finally:
        store._lock = real
    assert len(holds) <= 10  # 23 small values 8 per hold, the big one's own holds: not one hold per key
    expect = dict(items)
    for key, value in expect.items():
        assert store.get_bytes(key) == value
    # write-once: the keys present are refused, their blocks never taken; the others written
    res = store.put_many([("pm/1", b"x"), ("pm/new", b"y" * 70), ("pm/taken", b"z"), ("pm/new2", b"w")], nx=True)
    assert res[1] is None and res[3] is None and isinstance(res[0], KeyExists) and isinstance(res[2], KeyExists)
    assert store.get_bytes("pm/1") == expect["pm/1"] and store.get_bytes("pm/new") == b"y" * 70
    keys = [*expect, "pm/taken", "pm/new", "pm/new2"]
    store.delete(keys)
    assert store.stats()["tiers"]["memory"]["used"] == 0  # every block given back, refused keys' included


def test_put_many_of_more_than_free_memory_evicts_as_single_puts_do(store):
    # No free range holds the run's blocks at once: each value is put on its own, evicting older ones.
    capacity = store.stats()["tiers"]["memory"]["capacity"]
    n = capacity // 4096 + 64
    res = store.put_many([(f"ev/{i}", b"e" * 4000) for i in range(n)], write_mode="evictable")
    assert res == [None] * n
    assert store.get_bytes(f"ev/{n - 1}") == b"e" * 4000 and store.stats()["evictions"] > 0


def test_put_many_cut_short_by_an_unexpected_error_gives_back_the_blocks_no_value_took(store, monkeypatch):
    real, calls = store._put_small_at_locked, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a bug")
        real(*args)

    monkeypatch.setattr(store, "_put_small_at_locked", failing)
    with pytest.raises(RuntimeError, match="a bug"):
        store.put_many([(f"cut/{i}", b"c" * 100) for i in range(10)])
    assert store.exists([f"cut/{i}" for i in range(10)]) == [True, True] + [False] * 8
    store.delete(["cut/0", "cut/1"])
    assert store.stats()["tiers"]["memory"]["used"] == 128  # the failed value's block alone (it could be in use)

"""A small put that replaces an unleased version of the same block size writes into its block.

What must hold either way: a leased old version keeps its bytes, the sizes and the memory tier's
accounting are right, TTL, nx, write modes and eviction treat the new version as new.
"""

from __future__ import annotations

import threading

import pytest

from kvstrata.errors import KeyExists, KeyNotFound
from kvstrata.store import ObjectStore, WriteMode


def _loc(store: ObjectStore, key: str):
    lease = store.acquire(key, owner="probe")
    store.release(lease.lease_id)
    return lease.location


def _used(store: ObjectStore) -> int:
    return store.stats()["tiers"]["memory"]["used"]


def test_same_block_size_reuses_the_block_and_keeps_accounting(store):
    store.put("k", b"a" * 4096)
    before, used = _loc(store, "k"), _used(store)
    store.put("k", b"b" * 4096)
    after = _loc(store, "k")
    assert (after.segment, after.offset) == (before.segment, before.offset)
    assert store.get_bytes("k") == b"b" * 4096 and _used(store) == used
    # a different size in the same 64-byte block: the size is the new one, no old byte shows
    store.put("k", b"c" * 4040)
    assert store.get_bytes("k") == b"c" * 4040 and store.sizes(["k"]) == [4040]
    assert store.read("k", 4010, 30) == b"c" * 30 and _used(store) == used
    store.put("k", b"d" * 4096)
    assert store.get_bytes("k") == b"d" * 4096 and _loc(store, "k").offset == before.offset
    assert store.stats()["objects"] == 1


def test_other_block_size_moves_and_frees_the_old_block(store):
    store.put("k", b"a" * 4096)
    store.put("k", b"b" * 4160)  # one 64-byte unit more
    assert store.get_bytes("k") == b"b" * 4160 and _used(store) == 4160
    store.put("k", b"c" * 10)
    assert store.get_bytes("k") == b"c" * 10 and _used(store) == 64
    store.put("k", b"")
    assert store.get_bytes("k") == b"" and _used(store) == 0
    store.put("k", b"e" * 64)  # from an empty value (which owns no block)
    assert store.get_bytes("k") == b"e" * 64 and _used(store) == 64


def test_a_leased_old_version_is_never_written_over(store):
    store.put("k", b"old!" * 1024)
    lease = store.acquire("k", owner=1)
    store.put("k", b"new!" * 1024)
    assert bytes(store.buffer(lease.location)) == b"old!" * 1024
    assert store.get_bytes("k") == b"new!" * 1024 and _loc(store, "k").offset != lease.location.offset
    assert _used(store) == 2 * 4096
    store.release(lease.lease_id)
    assert _used(store) == 4096
    store.put("k", b"3rd!" * 1024)  # unleased now: in place again
    assert store.get_bytes("k") == b"3rd!" * 1024 and _used(store) == 4096


def test_ttl_and_nx_see_a_new_version(store):
    import time

    store.put("k", b"x" * 100, ttl=0.15)
    store.put("k", b"y" * 100)  # no TTL: the old deadline must not expire the new version
    time.sleep(0.3)
    assert store.get_bytes("k") == b"y" * 100
    store.put("k", b"z" * 100, ttl=0.1)
    time.sleep(0.25)
    with pytest.raises(KeyNotFound):
        store.get_bytes("k")
    store.put("n", b"1" * 100)
    with pytest.raises(KeyExists):
        store.put("n", b"2" * 100, nx=True)
    assert store.get_bytes("n") == b"1" * 100


def test_published_version_is_replaced_immutable(store):
    loc = store.create("p", 256, owner=1)
    store.buffer(loc)[:] = b"m" * 256
    store.publish("p", owner=1)
    store.put("p", b"i" * 256)
    lease = store.acquire("p", owner=2)
    assert not lease.mutable and bytes(store.buffer(lease.location)) == b"i" * 256
    store.release(lease.lease_id)


def test_evictable_replace_stays_evictable_and_counted(make_config):
    s = ObjectStore(make_config(memory=1 << 20, segment=1 << 20))
    try:
        s.put("e", b"a" * 4096, write_mode=WriteMode.EVICTABLE)
        s.put("e", b"b" * 4096, write_mode=WriteMode.EVICTABLE)
        for i in range(300):  # past the watermark: the clock must still find (and count) "e"
            s.put(f"fill{i}", b"f" * 4096, write_mode=WriteMode.EVICTABLE)
        st = s.stats()
        assert st["evictions"] >= 1 and st["tiers"]["memory"]["used"] <= 1 << 20
        assert st["tiers"]["memory"]["used"] == 4096 * st["objects"]
    finally:
        s.close()


def test_write_back_and_write_through_versions_replaced_in_place(tmp_path, make_config):
    s = ObjectStore(make_config(tmp_path))
    s.put("wb", b"1" * 4096, write_mode="write_back")
    s.put("wb", b"2" * 4096, write_mode="write_back")
    s.put("wt", b"3" * 4096, write_mode="write_through")
    s.put("wt", b"4" * 4096)  # memory only now: the SSD copy of the old version must go
    s.flush()
    assert s.get_bytes("wb") == b"2" * 4096 and s.get_bytes("wt") == b"4" * 4096
    s.close()
    s = ObjectStore(make_config(tmp_path))  # what a restart finds on SSD
    try:
        assert s.get_bytes("wb") == b"2" * 4096
        assert s.exists(["wt"]) == [False]
    finally:
        s.close()


def test_readers_never_see_a_mix_of_two_versions(store):
    a, b = b"a" * 4096, b"b" * 4096
    store.put("k", a)
    stop = threading.Event()
    bad: list[bytes] = []

    def read() -> None:
        while not stop.is_set():
            got = store.get_bytes("k")
            if got not in (a, b):
                bad.append(got)

    t = threading.Thread(target=read)
    t.start()
    try:
        for i in range(3000):
            store.put("k", a if i % 2 else b)
    finally:
        stop.set()
        t.join()
    assert not bad

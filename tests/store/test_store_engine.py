"""Object lifecycle, batch results, waiters, TTL, refcounts, leases and bad input."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kvstrata.errors import CapacityError, ClosedError, KeyExists, KeyNotFound, Timeout
from kvstrata.store import Lease, Location, ObjectStore, StoreConfig, WriteMode


def test_put_get_replace_and_empty(store):
    store.put("a", b"one")
    assert store.get_bytes("a") == b"one"
    store.put("a", b"second value")
    assert store.get_bytes("a") == b"second value"
    store.put("empty", b"")
    assert store.get_bytes("empty") == b"" and store.sizes(["empty", "a", "nope"]) == [0, 12, None]
    store.put("np", np.arange(10, dtype=np.float32).reshape(2, 5))
    assert store.get_bytes("np") == np.arange(10, dtype=np.float32).tobytes()
    t = torch.arange(6, dtype=torch.bfloat16)
    store.put("t", t)
    assert store.get_bytes("t") == t.view(torch.uint8).numpy().tobytes()


def test_create_fill_seal_zero_copy(store):
    loc = store.create("obj", 1000, owner="c1")
    assert isinstance(loc, Location) and loc.size == 1000 and loc.offset % 64 == 0
    assert store.exists(["obj"]) == [False]  # invisible until sealed
    seg = store.segments[loc.segment]
    seg.buffer[loc.offset : loc.offset + 1000] = bytes(range(250)) * 4
    store.seal("obj", owner="c1")
    lease = store.acquire("obj", owner="c2")
    assert isinstance(lease, Lease) and not lease.mutable and lease.size == 1000
    assert bytes(store.buffer(lease.location)) == bytes(range(250)) * 4
    store.release(lease.lease_id)
    store.release(lease.lease_id)  # idempotent
    with pytest.raises(KeyNotFound):
        store.seal("obj", owner="c1")  # nothing pending any more


def test_publish_is_mutable_and_replaceable(store):
    loc = store.create("m", 4, owner=1)
    store.buffer(loc)[:] = b"abcd"
    store.publish("m", owner=1)
    lease = store.acquire("m", owner=2)
    assert lease.mutable
    store.buffer(lease.location)[:1] = b"z"
    store.release(lease.lease_id)
    assert store.get_bytes("m") == b"zbcd"
    store.put("m", b"new")
    assert store.get_bytes("m") == b"new"


def test_abort_and_release_owner_free_space(store):
    used0 = store.stats()["tiers"]["memory"]["used"]
    store.create("x", 5000, owner="dead")
    store.create("y", 5000, owner="dead")
    store.put("z", b"z" * 100)
    held = store.acquire("z", owner="dead")
    store.abort("x", owner="dead")
    store.release_owner("dead")
    st = store.stats()
    assert st["creates_in_progress"] == 0 and st["leases"] == 0
    assert store.exists(["x", "y", "z"]) == [False, False, True]
    store.release(held.lease_id)
    store.delete(["z"])
    assert store.stats()["tiers"]["memory"]["used"] == used0


def test_nx_and_in_progress_create(store):
    store.put("k", b"1")
    with pytest.raises(KeyExists):
        store.put("k", b"2", nx=True)
    assert store.get_bytes("k") == b"1"
    store.create("pending", 10, owner=1)
    with pytest.raises(KeyExists):
        store.create("pending", 10, owner=2, nx=True)
    store.put("fresh", b"ok", nx=True)
    assert store.get_bytes("fresh") == b"ok"


def test_reader_keeps_old_version_across_replace_and_delete(store):
    store.put("v", b"old!" * 100)
    lease = store.acquire("v", owner=1)
    store.put("v", b"new!" * 100)
    assert bytes(store.buffer(lease.location)) == b"old!" * 100
    assert store.delete(["v", "v"]) == [True, False]
    # the old bytes stay until the lease goes, and nothing can be allocated over them
    store.put("other", b"x" * 400)
    assert bytes(store.buffer(lease.location)) == b"old!" * 100
    used = store.stats()["tiers"]["memory"]["used"]
    store.release(lease.lease_id)
    assert store.stats()["tiers"]["memory"]["used"] == used - 448


def test_batch_results_per_key(store):
    store.put("a", b"1")
    store.put("b", b"22")
    res = store.acquire_many(["a", "missing", "b"], owner=1)
    assert isinstance(res[0], Lease) and isinstance(res[1], KeyNotFound) and isinstance(res[2], Lease)
    for r in (res[0], res[2]):
        store.release(r.lease_id)
    assert store.exists(["a", "missing", "b"]) == [True, False, True]
    assert store.exists("a") == [True]  # a single key is a batch of one
    assert store.delete(["a", "missing"]) == [True, False]


def test_waiter_wakes_on_seal(make_config):
    store = ObjectStore(make_config())
    got: list = []

    def reader():
        t0 = time.monotonic()
        got.append(store.get_bytes("late", timeout=5.0))
        got.append(time.monotonic() - t0)

    th = threading.Thread(target=reader)
    th.start()
    time.sleep(0.05)
    store.put("late", b"here")
    th.join(5)
    assert got[0] == b"here" and 0.04 <= got[1] < 2.0
    t0 = time.monotonic()
    with pytest.raises(Timeout):
        store.acquire("never", owner=1, timeout=0.1)
    assert 0.09 <= time.monotonic() - t0 < 1.0
    with pytest.raises(KeyNotFound):
        store.acquire("never", owner=1, timeout=0)
    store.close()


def test_close_wakes_waiters_with_closed_error(make_config):
    store = ObjectStore(make_config())
    errors: list = []

    def reader():
        try:
            store.acquire("never", owner=1, timeout=10)
        except ClosedError as exc:
            errors.append(exc)

    th = threading.Thread(target=reader)
    th.start()
    time.sleep(0.05)
    store.close()
    th.join(5)
    assert len(errors) == 1
    with pytest.raises(ClosedError):
        store.put("a", b"x")
    store.close()


def test_close_from_several_threads_at_once_closes_once(make_config, monkeypatch):
    store = ObjectStore(make_config())
    store.put("a", b"x")
    closed = []
    real = store._mem.close
    monkeypatch.setattr(store._mem, "close", lambda: closed.append(1) or real())
    start = threading.Barrier(4)
    failures: list = []

    def closer():
        start.wait()
        try:
            store.close()
        except Exception as exc:  # pragma: no cover - the failure this test is about
            failures.append(exc)

    threads = [threading.Thread(target=closer) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert not failures and closed == [1]  # the segments unmapped once
    with pytest.raises(ClosedError):
        store.put("b", b"x")


def test_ttl_expiry_lazy_and_sweeper(store):
    # Deadlines of a second, not a few ms: what is checked before them must come before them on a loaded machine too
    store.put("short", b"x", ttl=1.0)
    store.put("forever0", b"x", ttl=0)
    store.put("foreverN", b"x", ttl=None)
    store.put("later", b"x")
    assert store.expire(["later", "missing"], 1.0) == [True, False]
    assert store.exists(["short", "later"]) == [True, True]
    time.sleep(1.1)
    assert store.exists(["short", "later", "forever0", "foreverN"]) == [False, False, True, True]
    with pytest.raises(KeyNotFound):
        store.get_bytes("short")
    store.put("swept", b"y" * 1000, ttl=0.02)
    # the background sweeper frees it without any access (within a flush interval; later on a loaded machine)
    deadline = time.monotonic() + 5
    while store.stats()["objects"] > 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    st = store.stats()
    assert st["expired"] >= 3 and st["objects"] == 2
    assert store.expire(["forever0"], 1.0) == [True]
    assert store.expire(["forever0"], None) == [True]  # back to forever
    time.sleep(1.1)
    assert store.exists(["forever0"]) == [True]


def test_refcounts_delete_at_zero(store):
    store.put("r", b"x")
    assert store.incref(["r", "missing"]) == [1, 0]
    assert store.incref(["r"]) == [2]
    store.put("r", b"replaced")  # the count belongs to the key
    assert store.refcount("r") == 2
    assert store.decref(["r"]) == [1]
    assert store.exists(["r"]) == [True]
    assert store.decref(["r", "missing"]) == [0, 0]
    assert store.exists(["r"]) == [False] and store.refcount("r") == 0


def test_partial_read(store):
    store.put("p", bytes(range(200)))
    assert store.read("p", 10, 5) == bytes(range(10, 15))
    assert store.read("p", 200, 0) == b""
    with pytest.raises(ValueError, match="outside"):
        store.read("p", 190, 20)
    with pytest.raises(ValueError, match="offset"):
        store.read("p", -1, 2)
    big = bytes(range(256)) * 1024  # above the copy-under-lock threshold
    store.put("big", big)
    assert store.read("big", 1000, 100_000) == big[1000:101_000]


def test_capacity_errors_name_sizes(make_config):
    s = ObjectStore(make_config(memory=2 << 20, segment=1 << 20))
    with pytest.raises(CapacityError, match=str(3 << 20)):
        s.put("huge", bytes(3 << 20))
    s.put("a", bytes(1 << 20))  # a whole segment
    lease = s.acquire("a", owner=1)
    s.put("b", bytes(1 << 20))
    lease2 = s.acquire("b", owner=1)
    with pytest.raises(CapacityError, match="no room"):
        s.put("c", b"x")  # everything is leased; nothing may go
    assert s.get_bytes("a") == bytes(1 << 20)  # existing data intact
    s.release(lease.lease_id)
    s.release(lease2.lease_id)
    s.close()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s: s.put("", b"x"), "key"),
        (lambda s: s.put("k" * 1025, b"x"), "key"),
        (lambda s: s.put("é" * 600, b"x"), "key"),
        (lambda s: s.put("\ud800", b"x"), "key"),
        (lambda s: s.put(b"bytes-key", b"x"), "key"),
        (lambda s: s.put("k", 12), "data"),
        (lambda s: s.put("k", np.ones((4, 4))[:, ::2]), "data"),
        (lambda s: s.put("k", b"x", ttl=-1), "ttl"),
        (lambda s: s.put("k", b"x", write_mode="sometimes"), "write_mode"),
        (lambda s: s.put("k", b"x", write_mode=WriteMode.WRITE_THROUGH), "write_mode"),
        (lambda s: s.create("k", -5, owner=1), "size"),
        (lambda s: s.acquire("k", owner=1, timeout=-1), "timeout"),
        (lambda s: s.exists(["a", 3]), "keys"),
        (lambda s: s.delete(5), "keys"),
    ],
)
def test_bad_input_names_argument_and_writes_nothing(store, call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(store)
    assert store.exists(["k"]) == [False] and store.stats()["tiers"]["memory"]["used"] == 0


def test_config_validation():
    with pytest.raises(ValueError, match="memory_bytes"):
        StoreConfig(memory_bytes=0)
    with pytest.raises(ValueError, match="low_watermark"):
        StoreConfig(memory_bytes=1 << 20, high_watermark=0.5, low_watermark=0.6)
    with pytest.raises(ValueError, match="disk_bytes"):
        StoreConfig(memory_bytes=1 << 20, disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="numa_node"):
        StoreConfig(memory_bytes=1 << 20, numa_node=-2)
    with pytest.raises(ValueError, match="bogus"):
        StoreConfig.from_mapping({"memory_bytes": 1 << 20, "bogus": 1})
    cfg = StoreConfig.from_mapping({"memory_bytes": 1 << 20, "high_watermark": 0.7, "low_watermark": 0.5})
    assert cfg.high_watermark == 0.7


def test_segment_growth_notifies_listener(make_config):
    s = ObjectStore(make_config(memory=4 << 20, segment=1 << 20))
    seen = []
    s.add_segment_listener(seen.append)
    assert len(s.segments) == 1
    for i in range(3):
        s.put(f"k{i}", bytes(900 << 10))
    assert len(s.segments) == 3 and seen == s.segments[1:]
    st = s.stats()["tiers"]["memory"]
    assert st["segments"] == 3 and st["mapped"] == 3 << 20
    s.close()


def test_write_once_batches_report_per_key(store):
    assert store.put_many([("a", b"1"), ("b", b"22")], nx=True) == [None, None]
    res = store.put_many([("a", b"changed"), ("c", b"333"), ("huge", bytes(8 << 20))], nx=True)
    assert isinstance(res[0], KeyExists) and res[1] is None and isinstance(res[2], CapacityError)
    assert store.get_bytes("a") == b"1" and store.get_bytes("c") == b"333"
    locs = store.create_many([("x", 10), ("a", 5), ("y", 0)], owner="w", nx=True)
    assert isinstance(locs[0], Location) and isinstance(locs[1], KeyExists) and locs[2].size == 0
    store.buffer(locs[0])[:] = b"0123456789"
    sealed = store.seal_many(["x", "a", "y"], owner="w")
    assert sealed[0] is None and isinstance(sealed[1], KeyNotFound) and sealed[2] is None
    assert store.get_bytes("x") == b"0123456789" and store.get_bytes("y") == b""
    with pytest.raises(ValueError, match="items"):
        store.put_many([("ok", b"1"), (3, b"2")])
    with pytest.raises(TypeError, match="data"):
        store.put_many([("ok", b"1"), ("bad", 5)])
    with pytest.raises(ValueError, match="write_mode"):
        store.put_many([("ok", b"1")], write_mode="write_through")
    assert store.exists(["ok"]) == [False]  # bad input: nothing written

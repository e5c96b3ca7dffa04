"""Write reservations: the allocator's split, the engine's reserve/commit, the worker's handlers, and
``mset_d2h`` laying its objects out in the client's reservation (CPU tensors: the same planning, carving
and requests as CUDA ones)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import kvstrata
import kvstrata.ops.tensor_runs
from _stages import PLANNER_IDS, PLANNERS, _Stream, batch_call, batches_of, copies_pending, fake_gpu, stages_of
from kv_helpers import worker_fixtures
from kvstrata.client import device, device_calls
from kvstrata.client.reservation import CALLS_AHEAD, FLOOR_BYTES, WriteReservation
from kvstrata.errors import CapacityError, InvalidType, KeyExists, KvstrataError, ProtocolError
from kvstrata.ops.copy_engine import CopyEngineError
from kvstrata.server import protocol as P
from kvstrata.store import ObjectStore, StoreConfig
from kvstrata.store.allocator import ALIGNMENT, OffsetAllocator
from kvstrata.store.tiers.base import Location

MEMORY = 64 << 20
SEGMENT = 16 << 20


def _store(memory=4 << 20, segment=1 << 20):
    return ObjectStore(
        StoreConfig(memory_bytes=memory, segment_bytes=segment, numa_node=None, hugepages="off", disk_bytes=0)
    )


def _used(store):
    return store.stats()["tiers"]["memory"]["used"]


# ------------------------------------------------------------------------------------ allocator split
def test_split_makes_two_blocks_freed_on_their_own():
    a = OffsetAllocator(1 << 20)
    off = a.allocate(4096)
    assert a.split(off, 100) == off + 128  # rounded up to ALIGNMENT
    assert a.block_size(off) == 128 and a.block_size(off + 128) == 4096 - 128
    assert a.used_bytes == 4096  # nothing freed or added by a split
    a.free(off + 128)
    assert a.used_bytes == 128
    assert a.allocate(4096 - 128) == off + 128  # the freed tail is reusable on its own
    a.free(off)
    a.free(off + 128)
    assert a.used_bytes == 0 and a.largest_free == a.capacity  # all coalesced back


def test_split_of_the_whole_block_or_bad_arguments():
    a = OffsetAllocator(1 << 20)
    off = a.allocate(256)
    assert a.split(off, 200) is None and a.block_size(off) == 256  # the whole block: nothing to cut
    for bad, match in ((0, "first_size"), (-1, "first_size"), (257, "first_size"), (True, "first_size")):
        with pytest.raises(ValueError, match=match):
            a.split(off, bad)
    with pytest.raises(ValueError, match="offset"):
        a.split(off + 64, 64)  # not a block's start
    assert a.block_size(off) == 256


def test_split_many_carves_pieces_side_by_side_and_keeps_the_rest_a_block():
    a = OffsetAllocator(1 << 20)
    off = a.allocate(4096)
    assert a.split_many(off, [100, 64, 1]) == [off, off + 128, off + 192]  # each rounded up to ALIGNMENT
    assert [a.block_size(o) for o in (off, off + 128, off + 192, off + 256)] == [128, 64, 64, 4096 - 256]
    assert a.used_bytes == 4096
    for o in (off + 128, off, off + 256, off + 192):  # each piece and the rest freed on its own
        a.free(o)
    assert a.used_bytes == 0 and a.largest_free == a.capacity
    off = a.allocate(256)
    assert a.split_many(off, [64, 192]) == [off, off + 64]  # the pieces take it all: no rest
    assert a.block_size(off + 64) == 192 and a.used_bytes == 256
    assert a.split_many(off + 64, []) == [] and a.block_size(off + 64) == 192


def test_split_many_refuses_bad_input_and_changes_nothing():
    a = OffsetAllocator(1 << 20)
    off = a.allocate(256)
    for bad, match in (([64, 0], "sizes"), ([-64], "sizes"), ([True], "sizes"), ([64.0], "sizes"), ([128, 129], "256")):
        with pytest.raises(ValueError, match=match):
            a.split_many(off, bad)
        assert a.block_size(off) == 256 and a.stats()["allocated_blocks"] == 1
    with pytest.raises(ValueError, match="offset"):
        a.split_many(off + 64, [64])


# ------------------------------------------------------------------------------------ engine
def test_carve_and_commit_makes_sealed_objects_at_their_places():
    with _store() as s:
        loc = s.reserve("me", 1 << 16)
        assert loc.size == 1 << 16 and s.stats()["reserved_bytes"] == 1 << 16 and _used(s) == 1 << 16
        assert s.exists(["a"]) == [False]  # a reservation is never visible
        head = loc.offset
        items = []
        for key, value in (("a", b"hello"), ("e", b""), ("b", bytes(range(200)))):
            s.buffer(Location(loc.segment, head, len(value)))[:] = value
            items.append((key, len(value), head))
            head += -(-len(value) // ALIGNMENT) * ALIGNMENT
        assert s.commit("me", items) == [None, None, None]
        assert s.get_bytes("a") == b"hello" and s.get_bytes("e") == b"" and s.get_bytes("b") == bytes(range(200))
        left = s.reservation("me")
        assert left == Location(loc.segment, head, loc.offset + loc.size - head)
        assert s.stats()["reserved_bytes"] == left.size and s.stats()["carved"] == 3
        s.delete(["a", "b", "e"])  # each object is its own block
        assert _used(s) == left.size
        s.release_owner("me")
        assert _used(s) == 0 and s.stats()["reserved_bytes"] == 0 and s.reservation("me") is None


def test_refused_key_frees_its_piece_and_the_others_stand():
    with _store() as s:
        s.put("old", b"first")
        loc = s.reserve("me", 4096)
        items = [("new1", 64, loc.offset), ("old", 64, loc.offset + 64), ("", 10, loc.offset + 128)]
        items.append(("new2", 64, loc.offset + 192))
        res = s.commit("me", items, nx=True)
        assert res[0] is None and isinstance(res[1], KeyExists) and isinstance(res[2], ValueError) and res[3] is None
        assert s.get_bytes("old") == b"first"
        # the refused pieces went back: used = old's 64 + two objects + the reservation's rest
        assert _used(s) == 64 + 2 * 64 + (4096 - 256)
        assert s.reservation("me").offset == loc.offset + 256  # the head moved past every carved piece


def test_a_key_the_caller_refuses_frees_its_piece_with_or_without_landing():
    # (a cluster worker refuses keys not its own in a commit routed by another member list: Worker.not_owned)
    refusal = KvstrataError("not this worker's")

    def refuse(key):
        return refusal if key.startswith("theirs") else None

    for landed in (None, lambda: True):
        with _store() as s:
            loc = s.reserve("me", 4096)
            items = [("mine", 64, loc.offset), ("theirs", 64, loc.offset + 64), ("mine2", 64, loc.offset + 128)]
            assert s.commit("me", items, refuse=refuse, landed=landed) == [None, refusal, None]
            s.cut_landings("me")
            assert s.exists(["mine", "theirs", "mine2"]) == [True, False, True]
            assert _used(s) == 2 * 64 + (4096 - 192)  # the refused piece went back, the head moved past it


def test_offset_mismatch_is_refused_from_that_item_on_and_nothing_is_carved():
    with _store() as s:
        loc = s.reserve("me", 4096)
        res = s.commit("me", [("a", 10, loc.offset), ("b", 10, loc.offset + 128), ("c", 10, loc.offset + 64)])
        assert res[0] is None and isinstance(res[1], ProtocolError) and "head" in str(res[1])
        assert isinstance(res[2], ProtocolError) and "items[1]" in str(res[2])
        assert s.exists(["a", "b", "c"]) == [True, False, False]
        assert s.reservation("me").offset == loc.offset + 64
        for bad in ([("x", 8192, loc.offset + 64)], [("x", -1, loc.offset + 64)], [("x", 1)], ["x"]):
            (r,) = s.commit("me", bad)
            assert isinstance(r, (ProtocolError, ValueError, TypeError)), bad
        assert s.reservation("me").offset == loc.offset + 64  # still where it was
        (r,) = s.commit("nobody", [("x", 1, 0)])
        assert isinstance(r, ProtocolError) and "no write reservation" in str(r)
        assert s.commit("me", [("x", 1, loc.offset + 64)]) == [None]


def test_commit_replacing_keys_frees_the_old_blocks_but_not_a_leased_one():
    with _store() as s:
        for k in ("a", "b", "c", "d", "e"):
            s.put(k, b"x" * 100)
        lease = s.acquire("c", owner="reader")
        s.expire(["d"], 60)
        loc = s.reserve("me", 4096)
        items = [(k, 64, loc.offset + 64 * i) for i, k in enumerate("abcde")]
        for i, (_k, _, o) in enumerate(items):
            s.buffer(Location(loc.segment, o, 64))[:] = bytes([i]) * 64
        assert s.commit("me", items) == [None] * 5
        assert [s.get_bytes(k) for k in "abcde"] == [bytes([i]) * 64 for i in range(5)]
        # the four unleased old versions went back; c's old bytes stay under its reader's lease
        assert _used(s) == 4096 + 128
        assert bytes(s.buffer(lease.location)) == b"x" * 100
        assert s.sizes(["d"]) == [64] and s.exists(["d"]) == [True]  # a new version: the old TTL is gone
        s.release(lease.lease_id)
        assert _used(s) == 4096


def test_commit_nx_refuses_a_key_repeated_in_the_batch_and_bad_sizes_stop_the_carving():
    with _store() as s:
        loc = s.reserve("me", 4096)
        res = s.commit("me", [("k", 8, loc.offset), ("k", 8, loc.offset + 64), ("j", 8, loc.offset + 128)], nx=True)
        assert res[0] is None and isinstance(res[1], KeyExists) and res[2] is None
        assert s.reservation("me").offset == loc.offset + 192
        for bad in ((True, "size"), (8.0, "size"), (-8, "size")):
            (r, r2) = s.commit("me", [("x", bad[0], loc.offset + 192), ("y", 8, loc.offset + 256)])
            assert isinstance(r, ValueError) and "items[0].size" in str(r)
            assert isinstance(r2, ProtocolError) and "items[1]" in str(r2)
        (r,) = s.commit("me", [("x", 8, loc.offset + 192.0)])
        assert isinstance(r, ValueError) and "items[0].offset" in str(r)
        (r,) = s.commit("me", [(b"x", 8, loc.offset + 192)])
        assert isinstance(r, ValueError) and "items[0]" in str(r)
        assert s.reservation("me").offset == loc.offset + 256  # the bad key's piece was carved, then freed
        assert s.exists(["x", "y"]) == [False, False]


def test_batch_delete_and_seal_many_free_replaced_blocks_and_count_expired():
    with _store() as s:
        for k in "abcdef":
            s.put(k, b"v" * 64)
        s.expire(["f"], 1e-9)
        time.sleep(0.01)
        assert s.delete(["a", "b", "zz", "f", "a"]) == [True, True, False, False, False]
        assert s.stats()["expired"] >= 1
        assert s.exists(list("abcdef")) == [False, False, True, True, True, False]
        s.create_many([("c", 64), ("d", 64), ("n", 0)], owner="me")
        assert s.seal_many(["c", "d", "n", "c", ""], owner="me")[:3] == [None, None, None]
        assert _used(s) == 3 * 64  # c and d replaced, their old blocks back; e stands
        assert s.delete(["c", "d", "e", "n"]) == [True, True, True, True] and _used(s) == 0


def test_a_new_reservation_replaces_the_old_and_frees_its_rest():
    with _store() as s:
        first = s.reserve("me", 8192)
        assert s.commit("me", [("a", 100, first.offset)]) == [None]
        second = s.reserve("me", 4096)
        assert s.stats()["reserved_bytes"] == 4096 and _used(s) == 128 + 4096  # a's block stays, the old rest went
        assert s.reservation("me") == second  # the freed rest may be what it reuses
        assert s.commit("me", [("b", 10, second.offset)]) == [None]
        s.reserve("me", 0)  # only drops it
        assert s.reservation("me") is None and s.stats()["reserved_bytes"] == 0 and s.stats()["reservations"] == 2


def test_a_reservation_is_capped_and_one_larger_than_free_memory_is_refused():
    with _store(memory=4 << 20, segment=1 << 20) as s:
        loc = s.reserve("me", 1 << 30)
        assert loc.size == (4 << 20) // 8  # capped: at most a segment and an eighth of the tier
        for i in range(3):
            s.reserve(f"o{i}", 1 << 20)  # other owners' reservations may not be evicted
        for i in range(4):  # one beside each reservation: no segment has room for another one
            s.put(f"leased{i}", b"x" * (400 << 10))
            s.acquire(f"leased{i}", owner="reader")  # leased: not evictable either
        with pytest.raises(CapacityError, match="no room"):
            s.reserve("late", 1 << 20)
        assert s.reservation("late") is None


def test_all_reservations_together_hold_at_most_half_the_tier():
    with _store(memory=4 << 20, segment=1 << 20) as s:
        for i in range(4):
            assert s.reserve(f"w{i}", 1 << 20).size == 512 << 10  # an eighth each: half the tier in all
        with pytest.raises(CapacityError, match="reservations hold 1/2 of the memory tier"):
            s.reserve("w4", 4096)
        assert s.reservation("w4") is None
        s.reserve("w0", 4096)  # w0's replaced: its rest is room again
        assert s.reserve("w4", 1 << 20).size == (512 << 10) - 4096
        assert s.stats()["reserved_bytes"] == 2 << 20
        s.put("obj", b"x" * (1 << 20))  # the other half stays for objects


def test_commit_seals_like_create_waiters_ttl_and_write_through(tmp_path):
    config = StoreConfig(
        memory_bytes=4 << 20, segment_bytes=1 << 20, numa_node=None, hugepages="off",
        disk_dir=str(tmp_path / "ssd"), disk_bytes=16 << 20,
    )  # fmt: skip
    with ObjectStore(config) as s:
        loc = s.reserve("me", 4096)
        s.buffer(Location(loc.segment, loc.offset, 3))[:] = b"abc"
        import threading

        got = []
        waiter = threading.Thread(target=lambda: got.append(s.get_bytes("w", timeout=10)))
        waiter.start()
        time.sleep(0.05)
        assert s.commit("me", [("w", 3, loc.offset)], ttl=60, write_mode="write_through") == [None]
        waiter.join(10)
        assert got == [b"abc"]
        assert s._objects["w"].on_disk and s._objects["w"].expires > time.monotonic()
    with ObjectStore(config) as s:  # written through: there after a restart
        assert s.get_bytes("w") == b"abc"


# ------------------------------------------------------------------------------------ worker
worker, kv = worker_fixtures("resv-worker", memory=MEMORY, segment=SEGMENT)


def _lists(n, sizes=(1000, 24, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 255, (s,), generator=g, dtype=torch.uint8) for s in sizes] for _ in range(n)]


def _poisoned(lists):
    return [[torch.full_like(t, 0xAB) for t in ts] for ts in lists]


def test_handlers_reserve_commit_and_bad_input_keep_the_worker_serving(worker):
    with kvstrata.connect(worker.address) as kv:
        b = kv._backend
        opts = {"ttl": None, "nx": True, "mode": "memory"}
        kv.delete(["h/a", "h/b"])
        loc = b.reserve_finish(b.reserve_start(1 << 20))
        assert loc.size == 1 << 20
        b.view(type(loc)(loc.segment, loc.offset, 4))[:] = b"data"
        res, head = b.commit_finish(b.commit_start([("h/a", 4, loc.offset)], opts))
        assert res == [None] and head == loc.offset + 64 and kv.get("h/a") == b"data"
        res, head = b.commit_finish(b.commit_start([("h/b", 4, loc.offset)], opts))  # not the head any more
        assert isinstance(res[0], ProtocolError) and head == loc.offset + 64
        for bad in ({"op": "commit", "items": "nope"}, {"op": "reserve", "size": -1}, {"op": "reserve", "size": "x"}):
            with pytest.raises((KvstrataError, ValueError, TypeError)):
                b.request(bad)
        res, _ = b.commit_finish(b.commit_start([["h/b", "4", 0], ["h/c"]], opts))
        assert all(isinstance(r, (TypeError, ValueError, ProtocolError)) for r in res)
        assert kv.exists(["h/a", "h/b"]) == [True, False] and kv.get("h/a") == b"data"
        kv.delete(["h/a"])


def test_commits_and_acquires_in_columns_and_bad_columns_keep_the_worker_serving(worker):
    # The worker's hello says "columns": a commit's sizes and offsets, and an acquire's reply's integers, go as int64
    # bytes (protocol.int_column); an older client's lists still work, and a bad column is refused as a whole.
    with kvstrata.connect(worker.address) as kv:
        b = kv._backend
        assert b.columns
        kv.delete(["col/a", "col/b"])
        loc = b.reserve_finish(b.reserve_start(1 << 20))
        b.view(type(loc)(loc.segment, loc.offset, 4))[:] = b"cols"
        at = loc.offset
        msg = {"op": "commit", "keys": ["col/a"], "sizes": P.int_column([4]), "offsets": P.int_column([at]), "nx": True}
        assert b.request(msg)["head"] == at + ALIGNMENT and kv.get("col/a") == b"cols"
        for bad, name in (
            ({"sizes": P.int_column([4, 4])}, "sizes"),
            ({"sizes": b"abc"}, "sizes"),
            ({"offsets": [at + ALIGNMENT]}, "offsets"),
            ({"keys": "col/b"}, "keys"),
        ):
            one = {"keys": ["col/b"], "sizes": P.int_column([4]), "offsets": P.int_column([at + ALIGNMENT])}
            with pytest.raises(InvalidType, match=name):
                b.request({"op": "commit", **one, **bad})
        got = b.request({"op": "acquire", "keys": ["col/a", "col/none"], "cols": 1})
        ids = P.column_ints(got["ids"], 2, "ids")
        assert P.column_ints(got["locs"], 6, "locs")[2] == 4 and ids[1] == 0 and got["errs"][0][0] == 1
        plain = b.request({"op": "acquire", "keys": ["col/a"]})  # an older client's: lists
        assert type(plain["ids"]) is list and plain["locs"][2] == 4
        b.release(ids[:1] + plain["ids"])
        assert kv.exists(["col/a", "col/b"]) == [True, False] and kv.get("col/a") == b"cols"
        kv.delete(["col/a"])


_HOLDER = """
import sys, time, kvstrata
kv = kvstrata.connect(sys.argv[1])
b = kv._backend
loc = b.reserve_finish(b.reserve_start(1 << 20))
open(sys.argv[2], "w").write(str(loc.size))
time.sleep(60)
"""


def test_a_client_killed_with_a_reservation_gives_it_back(worker, tmp_path):
    ready = tmp_path / "ready"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath("src"), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, worker.address, str(ready)], env=env)
    try:
        with kvstrata.connect(worker.address) as kv:
            deadline = time.monotonic() + 30
            while not ready.exists() or not ready.read_text():
                assert time.monotonic() < deadline and child.poll() is None, "holder never got its reservation"
                time.sleep(0.02)
            assert kv.stats()["reserved_bytes"] >= 1 << 20
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
            deadline = time.monotonic() + 10
            while kv.stats()["clients"] > 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert kv.stats()["reserved_bytes"] == 0  # (this client holds none: it made no device call)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# ------------------------------------------------------------------------------------ mset_d2h
def _lands(kv):
    """Whether ``kv`` commits stages ahead of their copies (the worker watches the lane for the word they landed)."""
    return getattr(kv._backend, "_lane", None) is not None


def _commits(kv, batches):
    """The commit requests a reserved call of ``batches`` copy batches may send, each batch's copies still in flight
    when looked at: one per mark (the first MARK_FROM_BATCH batches share one), or, where it commits ahead of copies,
    one for them all (when the worker has read the previous call's word that its copies landed: it nearly always
    has)."""
    marks = max(1, batches - device_calls.MARK_FROM_BATCH + 1)
    return [["commit"] * marks, ["commit"]] if _lands(kv) and marks > 1 else [["commit"] * marks]


def _count_calls(monkeypatch, backend):
    calls = []
    for name in ("mcreate", "mseal", "commit", "reserve"):
        real = getattr(backend, f"{name}_start")
        monkeypatch.setattr(
            backend, f"{name}_start", lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw)
        )
    return calls


def test_mset_d2h_lays_later_calls_out_in_the_reservation(kv, monkeypatch):
    monkeypatch.setattr(device, "stages", stages_of(3))  # the first call's, created by the worker
    batches_of(monkeypatch, 3, 71005)  # the later calls', laid out in the reservation
    copies_pending(monkeypatch)
    calls = _count_calls(monkeypatch, kv._backend)
    srcs = [_lists(7, sizes=(70000, 5, 1000), seed=r) for r in range(3)]
    keys = [[f"rv/{r}/{i}" for i in range(7)] for r in range(3)]
    kv.delete([k for ks in keys for k in ks])
    assert kv.mset_d2h(keys[0], srcs[0]) == [None] * 7
    assert calls == ["mcreate"] * 3 + ["mseal"] * 3 + ["reserve"]  # the first call ever asks for one
    carved = kv.stats()["carved"]
    for r in (1, 2):
        calls.clear()
        assert kv.mset_d2h(keys[r], srcs[r]) == [None] * 7
        # no create, no seal, no refill: the reservation holds it
        assert calls in _commits(kv, 3)
    assert kv.stats()["carved"] == carved + 14
    for r in range(3):
        dst = _poisoned(srcs[r])
        assert kv.mget_h2d(keys[r], dst) == [None] * 7
        assert all(torch.equal(a, b) for s, d in zip(srcs[r], dst) for a, b in zip(s, d))
        assert kv.get(keys[r][4]) == b"".join(t.numpy().tobytes() for t in srcs[r][4])
    res = kv.mset_d2h([*keys[1][:2], "rv/new"], _lists(3, seed=9))  # write-once, the reserved way too
    assert isinstance(res[0], KeyExists) and isinstance(res[1], KeyExists) and res[2] is None
    dst = _poisoned(srcs[1][:2])
    assert kv.mget_h2d(keys[1][:2], dst) == [None, None]
    assert all(torch.equal(a, b) for s, d in zip(srcs[1][:2], dst) for a, b in zip(s, d))
    assert kv.stats()["creates_in_progress"] == 0
    kv.delete([k for ks in keys for k in ks] + ["rv/new"])


def test_batches_whose_copies_landed_are_committed_in_one_request(kv, monkeypatch):
    batches_of(monkeypatch, 3, 1027)
    keys = [f"rv-one/{i}" for i in range(7)]
    kv.delete(keys)
    assert kv.mset_d2h(["rv-one/warm"], _lists(1)) == [None]  # now a reservation is held
    calls = _count_calls(monkeypatch, kv._backend)
    src = _lists(7, seed=5)
    assert kv.mset_d2h(keys, src) == [None] * 7
    assert calls == ["commit"]  # three batches, all landed (CPU copies) by the time the first is committed
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 7
    assert all(torch.equal(a, b) for s, d in zip(src, dst) for a, b in zip(s, d))
    kv.delete([*keys, "rv-one/warm"])


def test_a_bad_tensor_mid_call_leaves_nothing_visible_and_the_next_call_carves(kv, monkeypatch):
    batches_of(monkeypatch, 2, 1027)
    copies_pending(monkeypatch)
    keys = [f"rv-bad/{i}" for i in range(6)]
    kv.delete(keys)
    assert kv.mset_d2h(["rv-bad/warm"], _lists(1)) == [None]  # now a reservation is held
    reserved = kv.stats()["reserved_bytes"]
    assert reserved > 0
    lists = _lists(6)
    lists[3] = [torch.zeros(4, 4).t()]  # the second batch's: the first batch is laid out and copied by then
    with pytest.raises(ValueError, match=r"tensor_lists\[3\]\[0\]"):
        kv.mset_d2h(keys, lists)
    assert kv.exists(keys) == [False] * 6 and kv.stats()["reserved_bytes"] == reserved
    calls = _count_calls(monkeypatch, kv._backend)
    src = _lists(6, seed=3)
    assert kv.mset_d2h(keys, src) == [None] * 6
    assert calls in _commits(kv, 3)  # the rewound head: the worker agrees, nothing refused
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 6
    assert all(torch.equal(a, b) for s, d in zip(src, dst) for a, b in zip(s, d))
    kv.delete([*keys, "rv-bad/warm"])


@pytest.mark.parametrize("native", PLANNERS, ids=PLANNER_IDS)
@pytest.mark.parametrize("sizes", [(70000, 5, 1000), (4096,), (64, 0, 16)])
def test_under_a_gpu_a_reserved_write_lays_out_alike_with_either_planner(kv, monkeypatch, native, sizes):
    keys = [f"rv-gpu/{i}" for i in range(20)]
    kv.delete(keys)
    assert kv.mset_d2h(["rv-gpu/warm"], _lists(1)) == [None]  # now a reservation is held
    batches, _, passes = fake_gpu(monkeypatch, native)
    calls = _count_calls(monkeypatch, kv._backend)
    carved = kv.stats()["carved"]
    src = _lists(20, sizes=sizes, seed=len(sizes))
    assert kv.mset_d2h(keys, src) == [None] * 20
    assert calls[-1] == "commit" and set(calls) == {"commit"}  # laid out in the reservation, no create
    assert kv.stats()["carved"] == carved + 20
    assert sum(batches) == 20 * sum(1 for size in sizes if size)  # a run per tensor with bytes, each copied once
    assert batches.bindings == (0 if native == "copies" else len(batches))  # a native pass queued its own copies
    for key, ts in zip(keys, src):
        assert kv.get(key) == b"".join(t.numpy().tobytes() for t in ts)
    if native:
        assert passes and passes[-1][1] == kvstrata.ops.tensor_runs.DONE
    kv.delete([*keys, "rv-gpu/warm"])


@pytest.mark.parametrize("native", PLANNERS, ids=PLANNER_IDS)
def test_under_a_gpu_a_bad_tensor_mid_write_leaves_nothing_visible_with_either_planner(kv, monkeypatch, native):
    keys = [f"rv-gpu-bad/{i}" for i in range(30)]
    kv.delete(keys)
    assert kv.mset_d2h(["rv-gpu-bad/warm"], _lists(1)) == [None]
    reserved = kv.stats()["reserved_bytes"]
    _, _, passes = fake_gpu(monkeypatch, native)
    copies_pending(monkeypatch)
    lists = _lists(30, sizes=(512,))
    lists[21] = [torch.zeros(4, 4).t()]  # past two batches: their keys are laid out and copied by then
    with pytest.raises(ValueError, match=r"^tensor_lists\[21\]\[0\]: tensor must be contiguous"):
        kv.mset_d2h(keys, lists)
    assert kv.exists(keys) == [False] * 30 and kv.stats()["reserved_bytes"] == reserved
    if native:
        assert passes[-1][1] == kvstrata.ops.tensor_runs.PYTHON_PATH  # the loop took key 21 and named it
    src = _lists(30, sizes=(512,), seed=4)
    assert kv.mset_d2h(keys, src) == [None] * 30  # the rewound head: the next call carves again
    for key, ts in zip(keys, src):
        assert kv.get(key) == ts[0].numpy().tobytes()
    kv.delete([*keys, "rv-gpu-bad/warm"])


@pytest.mark.parametrize("native", PLANNERS, ids=PLANNER_IDS)
@pytest.mark.parametrize("case", ["not-a-str", "empty", "fewer-lists", "more-lists"])
def test_under_a_gpu_bad_keys_or_a_wrong_count_raise_clearly_and_leave_nothing(kv, monkeypatch, native, case):
    # A list of keys is checked once the first batch is queued (the copies into the reservation create nothing): a
    # bad key still raises its clear error, with nothing stored and the reservation as it was. (A wrong count of
    # tensor lists once raised a bare IndexError here, or stored the keys, where a reservation was held.)
    keys = [f"rv-gpu-keys/{i}" for i in range(30)]
    kv.delete(keys)
    assert kv.mset_d2h(["rv-gpu-keys/warm"], _lists(1)) == [None]
    reserved = kv.stats()["reserved_bytes"]
    fake_gpu(monkeypatch, native)
    copies_pending(monkeypatch)
    lists, bad = _lists(30, sizes=(512,)), list(keys)
    if case == "not-a-str":
        bad[25], exc, match = 7, TypeError, r"^keys\[25\]: must be a str, got int"
    elif case == "empty":
        bad[25], exc, match = "", ValueError, r"^keys\[25\]: must not be empty"
    elif case == "fewer-lists":
        lists, exc, match = lists[:29], ValueError, r"one list of tensors per key \(30 keys, got 29\)"
    else:
        lists, exc, match = [*lists, []], ValueError, r"one list of tensors per key \(30 keys, got 31\)"
    with pytest.raises(exc, match=match):
        kv.mset_d2h(bad, lists)
    assert kv.exists(keys) == [False] * 30 and kv.stats()["reserved_bytes"] == reserved
    src = _lists(30, sizes=(512,), seed=5)
    assert kv.mset_d2h(keys, src) == [None] * 30  # the next call carves where the bad one began
    for key, ts in zip(keys, src):
        assert kv.get(key) == ts[0].numpy().tobytes()
    kv.delete([*keys, "rv-gpu-keys/warm"])


def test_under_a_gpu_a_batch_the_driver_refuses_mid_write_leaves_nothing_visible(kv, monkeypatch):
    keys = [f"rv-gpu-refused/{i}" for i in range(30)]
    kv.delete(keys)
    assert kv.mset_d2h(["rv-gpu-refused/warm"], _lists(1)) == [None]
    reserved = kv.stats()["reserved_bytes"]
    batches, _, passes = fake_gpu(monkeypatch, "copies")
    copies_pending(monkeypatch)
    alive, address = batch_call(batches, fail_at=8)  # the first batch's two calls go (2 + 6 runs), the next is refused
    monkeypatch.setattr(
        device, "native_copies", lambda *args: (torch.device("cuda", 0), _Stream(), (address, 13000, 1))
    )
    with pytest.raises(CopyEngineError, match="cuMemcpyBatchAsync failed"):
        kv.mset_d2h(keys, _lists(30, sizes=(512,)))
    assert batches == [2, 6] and passes[0][1] == kvstrata.ops.tensor_runs.CUT
    assert kv.exists(keys) == [False] * 30 and kv.stats()["reserved_bytes"] == reserved  # nothing shown, head rewound
    del alive
    fake_gpu(monkeypatch, "copies")
    src = _lists(30, sizes=(512,), seed=5)
    assert kv.mset_d2h(keys, src) == [None] * 30  # the next call carves the same bytes again
    for key, ts in zip(keys, src):
        assert kv.get(key) == ts[0].numpy().tobytes()
    kv.delete([*keys, "rv-gpu-refused/warm"])


def test_a_failed_copy_in_a_reserved_stage_leaves_nothing_behind(kv, monkeypatch):
    keys = ["rv-fail/a", "rv-fail/b"]
    kv.delete(keys)
    kv.mset_d2h(["rv-fail/warm"], _lists(1))
    monkeypatch.setattr(device, "enqueue", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("simulated")))
    with pytest.raises(RuntimeError, match="simulated"):
        kv.mset_d2h(keys, _lists(2))
    monkeypatch.undo()
    assert kv.exists(keys) == [False, False] and kv.stats()["creates_in_progress"] == 0
    assert kv.mset_d2h(keys, _lists(2)) == [None, None]
    kv.delete([*keys, "rv-fail/warm"])


def test_a_call_larger_than_the_rest_mixes_reserved_and_created_stages(kv, monkeypatch):
    monkeypatch.setattr(device, "stages", stages_of(2))
    kv.mset_d2h(["rv-mix/warm"], _lists(1))  # asks for a reservation
    kv.mset_d2h(["rv-mix/warm2"], _lists(1))  # takes it
    rest = kv._reservation.remaining
    size = rest // 3 + 1  # two keys fit, the third one's stage does not
    keys = [f"rv-mix/{i}" for i in range(4)]
    kv.delete(keys)
    calls = _count_calls(monkeypatch, kv._backend)
    src = [[torch.full((size,), i, dtype=torch.uint8)] for i in range(4)]
    assert kv.mset_d2h(keys, src) == [None] * 4
    assert calls == ["mcreate", "commit", "mseal", "reserve"]  # the first stage laid out, the second created
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 4
    assert all(torch.equal(s[0], d[0]) for s, d in zip(src, dst))
    kv.delete([*keys, "rv-mix/warm", "rv-mix/warm2"])


def test_reservations_off_and_concurrent_calls_take_the_create_path(worker, monkeypatch):
    with kvstrata.connect(worker.address, reserve_bytes=0) as kv:
        calls = _count_calls(monkeypatch, kv._backend)
        for r in range(2):
            assert kv.mset_d2h([f"rv-off/{r}"], _lists(1)) == [None]
        assert "reserve" not in calls and "commit" not in calls
        lists = [_lists(3, seed=40 + r) for r in range(3)]
        futs = [kv.async_mset_d2h([f"rv-off/a{r}/{i}" for i in range(3)], lists[r]) for r in range(3)]
        assert [f.result(30) for f in futs] == [[None] * 3] * 3  # async calls too, through creates and seals
        assert "reserve" not in calls and "commit" not in calls
        for r in range(3):
            _read_back(kv, [f"rv-off/a{r}/{i}" for i in range(3)], lists[r])
        kv.delete([f"rv-off/a{r}/{i}" for r in range(3) for i in range(3)])
        # None held by anyone: an earlier test's client, closed just before, lets go of its own once the worker
        # sees it leave (its session ends on its own thread), which may come a moment after this call.
        deadline = time.monotonic() + 10
        while kv.stats()["reserved_bytes"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert kv.stats()["reserved_bytes"] == 0
        kv.delete(["rv-off/0", "rv-off/1"])
    with pytest.raises(ValueError, match="reserve_bytes"):
        kvstrata.connect(worker.address, reserve_bytes=-1)
    with kvstrata.connect(worker.address) as kv:
        kv.mset_d2h(["rv-conc/warm"], _lists(1))
        futs = [kv.async_mset_d2h([f"rv-conc/{t}/{i}" for i in range(5)], _lists(5, seed=t)) for t in range(6)]
        assert all(f.result(60) == [None] * 5 for f in futs)
        for t in range(6):
            dst = _poisoned(_lists(5, seed=t))
            assert kv.mget_h2d([f"rv-conc/{t}/{i}" for i in range(5)], dst) == [None] * 5
            assert all(torch.equal(a, b) for s, d in zip(_lists(5, seed=t), dst) for a, b in zip(s, d))
        assert kv.stats()["creates_in_progress"] == 0
        kv.delete([f"rv-conc/{t}/{i}" for t in range(6) for i in range(5)] + ["rv-conc/warm"])


# ------------------------------------------------------------------------- the async calls' chain
class _FakeBackend:
    """``reserve_start`` / ``reserve_finish`` of a worker granting what is asked at a fresh place."""

    def __init__(self):
        self.asked = []

    def reserve_start(self, nbytes):
        self.asked.append(nbytes)
        return nbytes

    def reserve_finish(self, token):
        return Location(0, 1 << 20, token)


def test_a_chain_carves_on_and_only_its_last_holder_asks_for_a_new_reservation():
    b = _FakeBackend()
    r = WriteReservation(1 << 20)
    assert r.take(b) and r.remaining == 0
    r.give(b, None, 4096)  # none held yet: a plain call asks for one (room for CALLS_AHEAD such calls, the floor)
    assert b.asked == [min(max(CALLS_AHEAD * 4096, FLOOR_BYTES), 1 << 20)]
    assert r.take(b, chain_bytes=4096) and r.remaining == 1 << 20  # read the reply: a chain's first call
    first = r.carve([4096])
    assert r.take(b, chain_bytes=4096)  # carves on while the first call's commits are still to come
    second = r.carve([4000, 96])
    assert second[0].offset == first[0].offset + 4096 and second[1].offset == second[0].offset + 4032
    assert not r.take(b)  # a plain call never joins a chain: it takes the create path
    r.give(b, first[0].offset + 4096, 4096, (first[0].offset, first[0].offset + 4096))  # committed where carved
    assert r.head == second[1].offset + 128  # the local head stands while a later call holds it
    r.give(b, r.head, 4096, (second[0].offset, r.head))
    assert r.take(b) and r.head == second[1].offset + 128
    r.give(b, r.head, 4096)


def test_a_chained_call_waits_for_the_chain_when_the_rest_is_too_small_and_a_lost_head_is_forgotten():
    b = _FakeBackend()
    r = WriteReservation(8192)
    assert r.take(b)
    r.give(b, None, 4096)
    assert r.take(b, chain_bytes=4096)
    r.carve([4096])
    assert r.take(b, chain_bytes=4096)
    r.carve([4096])
    got = []
    waiter = threading.Thread(target=lambda: got.append(r.take(b, chain_bytes=4096)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # no room left: it waits for the chain to end
    r.give(b, 1 << 20, 4096, (1 << 20, (1 << 20) + 4096))  # the first call's commits left the head elsewhere
    r.give(b, 1 << 20, 4096, ((1 << 20) + 4096, (1 << 20) + 8192))  # the last holder forgets it and asks anew
    waiter.join(5)
    assert got == [True] and b.asked[-1] == 8192 and r.remaining == 8192 and r.head == 1 << 20
    assert r.take(b, chain_bytes=4096)  # a chain again, from the new reservation
    start = r.head
    r.carve([4096])
    r.give(b, start, 4096, (start, r.head))  # committed nothing (it failed), the last to carve: rewound
    assert r.head == start and not r._lost
    r.give(b, r.head, 4096, (r.head, r.head))
    with pytest.raises(ValueError, match="reserve_bytes"):
        WriteReservation(-1)


def _gate_completions(kv):
    """Hold the client's completion thread until the returned event is set."""
    gate = threading.Event()
    started = threading.Event()
    kv._single("_completer", "kvstrata-complete").submit(lambda: started.set() or gate.wait(30))
    assert started.wait(10)
    return gate


def _issued(kv):
    """Wait until the client's issuing thread has issued every async call made so far."""
    kv._single("_issuer", "kvstrata-issue").submit(lambda: None).result(30)


def _calls_input(kv, prefix, calls, seed):
    """Tensors and fresh keys for ``calls`` calls of 5 keys each."""
    srcs = [_lists(5, seed=seed + r) for r in range(calls)]
    keys = [[f"{prefix}/{r}/{i}" for i in range(5)] for r in range(calls)]
    kv.delete([k for ks in keys for k in ks])
    return srcs, keys


def _read_back(kv, keys, src):
    """Assert that ``keys`` hold ``src``'s bytes, read into poisoned tensors."""
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * len(keys)
    assert all(torch.equal(a, b) for s, d in zip(src, dst) for a, b in zip(s, d))


def test_async_mset_d2h_calls_carve_one_after_another_before_earlier_ones_commit(kv, monkeypatch):
    monkeypatch.setattr(device, "stages", stages_of(2))
    batches_of(monkeypatch, 2, 1027)
    copies_pending(monkeypatch)
    kv.mset_d2h(["rv-chain/warm"], _lists(1))  # asks for a reservation
    calls = _count_calls(monkeypatch, kv._backend)
    srcs, keys = _calls_input(kv, "rv-chain", 4, seed=10)
    gate = _gate_completions(kv)
    futs = [kv.async_mset_d2h(keys[r], srcs[r]) for r in range(4)]
    _issued(kv)
    # every call laid out in the reservation and its copies queued; none committed yet
    assert calls == [] and kv._reservation._holders == 4 and not any(f.done() for f in futs)
    gate.set()
    assert [f.result(30) for f in futs] == [[None] * 5] * 4
    # no create, no seal, no refill; per call one commit per mark, and each call's 3 batches share one mark
    # (device_calls.MARK_FROM_BATCH), committed as it lands or ahead of its copies
    assert device_calls.MARK_FROM_BATCH == 3 and calls == ["commit"] * 4
    for r in range(4):
        _read_back(kv, keys[r], srcs[r])
    assert kv._reservation._holders == 0 and kv.stats()["creates_in_progress"] == 0
    assert kv.mset_d2h(["rv-chain/after"], _lists(1)) == [None] and calls.count("mcreate") == 0
    kv.delete([k for ks in keys for k in ks] + ["rv-chain/warm", "rv-chain/after"])


def test_a_chained_call_that_does_not_fit_waits_for_the_chain_then_takes_a_new_reservation(worker, monkeypatch):
    per_call = 5 * ALIGNMENT * 17  # 5 keys of 1,027 bytes, each rounded to 1,088
    with kvstrata.connect(worker.address, reserve_bytes=2 * per_call) as kv:
        kv.mset_d2h(["rv-wait/warm"], _lists(1))  # asks for two calls' room
        calls = _count_calls(monkeypatch, kv._backend)
        srcs, keys = _calls_input(kv, "rv-wait", 3, seed=20)
        gate = _gate_completions(kv)
        futs = [kv.async_mset_d2h(keys[r], srcs[r]) for r in range(3)]
        deadline = time.monotonic() + 10
        while kv._reservation._holders < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        # the third call waits for the first two to commit: a new reservation would free where they are copied
        assert kv._reservation._holders == 2 and calls == [] and not futs[2].done()
        gate.set()
        assert [f.result(30) for f in futs] == [[None] * 5] * 3
        assert "mcreate" not in calls and calls.count("reserve") >= 1
        for r in range(3):
            _read_back(kv, keys[r], srcs[r])
        kv.delete([k for ks in keys for k in ks] + ["rv-wait/warm"])


def test_a_bad_call_in_a_chain_fails_alone_and_a_failed_commit_stores_nothing_wrong(kv, monkeypatch):
    monkeypatch.setattr(device, "stages", stages_of(2))
    batches_of(monkeypatch, 2, 1027)
    copies_pending(monkeypatch)
    kv.mset_d2h(["rv-cbad/warm"], _lists(1))
    srcs, keys = _calls_input(kv, "rv-cbad", 4, seed=30)
    bad = [list(ts) for ts in srcs[1]]
    bad[3] = [torch.zeros(4, 4).t()]  # the second batch's: the first is carved and copied by then
    gate = _gate_completions(kv)
    futs = [kv.async_mset_d2h(keys[0], srcs[0]), kv.async_mset_d2h(keys[1], bad), kv.async_mset_d2h(keys[2], srcs[2])]
    _issued(kv)
    gate.set()
    assert futs[0].result(30) == [None] * 5 and futs[2].result(30) == [None] * 5
    with pytest.raises(ValueError, match=r"tensor_lists\[3\]\[0\]"):
        futs[1].result(30)
    assert kv.exists(keys[1]) == [False] * 5
    for r in (0, 2):
        _read_back(kv, keys[r], srcs[r])
    # A call whose commits fail after later calls carved on: those report errors, none stores wrong bytes, and
    # the chain after them starts from a new reservation.
    real = kv._backend.commit_start
    failing = {"left": 1}

    def commit_start(items, *a, **kw):
        if failing["left"]:
            failing["left"] -= 1
            raise KvstrataError("simulated lost commit")
        return real(items, *a, **kw)

    monkeypatch.setattr(kv._backend, "commit_start", commit_start)
    keys3 = [f"rv-cbad/late/{i}" for i in range(5)]
    kv.delete(keys3)
    gate = _gate_completions(kv)
    futs = [kv.async_mset_d2h(keys[3], srcs[3]), kv.async_mset_d2h(keys3, srcs[0])]
    _issued(kv)
    gate.set()
    with pytest.raises(KvstrataError, match="simulated"):
        futs[0].result(30)
    later = futs[1].result(30)
    assert kv.exists(keys[3]) == [False] * 5 and kv.exists(keys3) == [False] * 5
    assert all(isinstance(r, KvstrataError) and "earlier async_mset_d2h" in str(r) for r in later)
    assert kv._reservation._holders == 0
    again = [f"rv-cbad/again/{i}" for i in range(5)]
    kv.delete(again)
    assert kv.async_mset_d2h(again, srcs[2]).result(30) == [None] * 5
    _read_back(kv, again, srcs[2])
    assert kv.stats()["creates_in_progress"] == 0
    kv.delete([k for ks in keys for k in ks] + keys3 + again + ["rv-cbad/warm"])


@pytest.mark.gpu
def test_cuda_mset_d2h_takes_the_reserved_path_exact_with_key_exists(kv, monkeypatch):
    """24 x 256 KiB from the GPU: two stages (4 + 2 MiB), laid out in the reservation from the second call on,
    copied on the client's copy stream and committed once each stage's event completed."""
    n = 24
    calls = _count_calls(monkeypatch, kv._backend)
    srcs = [
        [[torch.randint(0, 255, (256 << 10,), dtype=torch.uint8, device="cuda")] for _ in range(n)] for _ in range(3)
    ]
    keys = [[f"gpu-rv/{r}/{i}" for i in range(n)] for r in range(3)]
    kv.delete([k for ks in keys for k in ks])
    n_stages = len(list(device.stages(n, srcs[0])))
    assert n_stages >= 2
    assert kv.mset_d2h(keys[0], srcs[0]) == [None] * n
    for r in (1, 2):
        calls.clear()
        if r == 2:
            assert kv.mset_d2h([keys[2][n - 1]], [srcs[0][0]]) == [None]  # already there in the tail
            calls.clear()
        res = kv.mset_d2h(keys[r], srcs[r])
        # one commit per stage at most: stages whose copies all landed by then share one
        assert "mcreate" not in calls and 1 <= calls.count("commit") <= n_stages
        if r == 2:
            assert isinstance(res[n - 1], KeyExists) and res[: n - 1] == [None] * (n - 1)
        else:
            assert res == [None] * n
    for r in range(3):
        dst = [[torch.full_like(t, 0xAB) for t in ts] for ts in srcs[r]]
        assert kv.mget_h2d(keys[r], dst) == [None] * n
        torch.cuda.synchronize()
        for i in range(n):
            want = srcs[0][0] if (r, i) == (2, n - 1) else srcs[r][i]
            assert torch.equal(want[0], dst[i][0])
    assert kv.stats()["creates_in_progress"] == 0
    kv.delete([k for ks in keys for k in ks])


def test_a_steady_writer_asks_for_a_reservation_once_in_calls_ahead_calls():
    # Each call that finds its reservation used up reads the reserve's reply before its first copy: a writer of
    # equal calls asks once for CALLS_AHEAD of them (the floor aside), not every other call.
    b = _FakeBackend()
    call = 32 << 20
    r = WriteReservation(1 << 30)
    reads = 0
    for _ in range(4 * CALLS_AHEAD):
        pending = r._pending is not None
        assert r.take(b)
        reads += pending
        assert r.carve([call]) is not None or r.remaining == 0
        r.give(b, r.head, call)
    assert b.asked == [CALLS_AHEAD * call] * 4 and reads == 4

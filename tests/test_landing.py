"""A commit sent before its copies landed (``"landing"``): the worker answers it at once, and its objects become
visible exactly when the client says, in the lane page, that the bytes are there (kvstrata.server.lane,
kvstrata.store.reservations): never before, and for every request after. The paths: landed, failed
(cancelled), a reader waiting for the key, the client killed before and right after saying so, bad input, the
store alone, and ``mset_d2h`` committing its later stages that way while their copies are in flight (a CPU
stand-in for the CUDA event)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import kvstrata
from _stages import batches_of
from kvstrata.client import device
from kvstrata.errors import KeyExists, KvstrataError
from kvstrata.server import lane as L

sys.path.insert(0, str(Path(__file__).parent))
from test_worker_e2e import start_worker, stop

pytestmark = pytest.mark.skipif(not L.supported(), reason="the lane (which carries the landing word) is x86-64 only")

OPTS = {"ttl": None, "nx": True, "mode": "memory"}


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    proc, address = start_worker(tmp_path_factory.mktemp("landing"))
    yield address
    log = stop(proc)
    assert proc.returncode == 0, log


def _reserve(kv, nbytes=1 << 20):
    b = kv._backend
    loc = b.reserve_finish(b.reserve_start(nbytes))
    assert b.can_land and loc.size >= nbytes
    return b, loc


def test_the_objects_appear_exactly_when_the_client_says_its_copies_landed(worker):
    with kvstrata.connect(worker) as a, kvstrata.connect(worker) as other:
        a.delete(["land/a"])
        b, loc = _reserve(a)
        token = b.commit_start([("land/a", 5, loc.offset)], OPTS, landing=True)
        res, head = b.commit_finish(token)  # answered at once: the item is carved, its key taken
        assert res == [None] and head == loc.offset + 64
        assert other.exists(["land/a"]) == [False] and a.exists(["land/a"]) == [False]
        b.view(type(loc)(loc.segment, loc.offset, 5))[:] = b"bytes"  # "the copy", after the commit went
        time.sleep(0.02)
        assert other.exists(["land/a"]) == [False]  # nothing visible before the word
        assert isinstance(other.mset_d2h(["land/a"], [[torch.zeros(3, dtype=torch.uint8)]])[0], KeyExists)
        b.land(token)
        assert other.get("land/a") == b"bytes" and a.get("land/a") == b"bytes"  # the very next request sees it
        a.delete(["land/a"])


def test_failed_copies_free_the_objects_they_never_showed(worker):
    with kvstrata.connect(worker) as kv:
        kv.delete(["land/c1", "land/c2"])
        b, loc = _reserve(kv)
        used = kv.stats()["tiers"]["memory"]["used"]
        token = b.commit_start([("land/c1", 8, loc.offset), ("land/c2", 8, loc.offset + 64)], OPTS, landing=True)
        assert b.commit_finish(token) == ([None, None], loc.offset + 128)
        b.land(token, ok=False)
        assert kv.exists(["land/c1", "land/c2"]) == [False, False]
        assert kv.stats()["tiers"]["memory"]["used"] == used - 128  # their pieces freed, the rest still reserved
        assert kv.mset_d2h(["land/c1"], [[torch.ones(3, dtype=torch.uint8)]]) == [None]  # the key is free again
        assert kv.get("land/c1") == b"\x01\x01\x01"
        kv.delete(["land/c1"])


def test_no_new_landing_word_is_written_before_the_worker_read_the_last(worker):
    # A word written for a later commit answers for every earlier one: a client that wrote "cancelled" and then,
    # before the worker read it, "landed" for its next call's commit would show the cancelled objects. So a
    # client commits ahead of its copies only once the worker has read the words of every such commit before.
    with kvstrata.connect(worker) as kv:
        b, loc = _reserve(kv)
        assert b.can_land
        token = b.commit_start([("land/h", 1, loc.offset)], OPTS, landing=True)
        assert b.commit_finish(token)[0] == [None]  # answered: waiting for its word
        assert not b.can_land  # a call now would commit after its copies
        b.land(token, ok=False)
        deadline = time.monotonic() + 10
        while not b.can_land:  # the worker's thread for this client reads the word promptly
            assert time.monotonic() < deadline, "the worker never read the landing word"
        assert b._lane.settled() == token[0] and kv.exists(["land/h"]) == [False]


def test_a_landing_commit_needs_a_tag(worker):
    with kvstrata.connect(worker) as kv:
        with pytest.raises(ValueError, match="landing"):
            kv._backend.request({"op": "commit", "items": [], "landing": True})  # untagged: cannot be told
        assert kv.set("land/ok", b"x") is None and kv.get("land/ok") == b"x"


def test_a_reader_waiting_for_the_key_gets_it_when_the_word_comes(worker):
    with kvstrata.connect(worker) as kv, kvstrata.connect(worker) as reader:
        kv.delete(["land/w"])
        b, loc = _reserve(kv)
        token = b.commit_start([("land/w", 2, loc.offset)], OPTS, landing=True)
        b.view(type(loc)(loc.segment, loc.offset, 2))[:] = b"ok"
        got = []
        t = threading.Thread(target=lambda: got.append(reader.get("land/w", timeout=30)))
        t.start()
        time.sleep(0.05)
        assert not got  # waiting: the object is not there yet
        t0 = time.monotonic()
        b.land(token)  # the writer's connection thread watches the word and wakes the waiter
        t.join(10)
        assert got == [b"ok"] and time.monotonic() - t0 < 5
        assert b.commit_finish(token)[0] == [None]
        kv.delete(["land/w"])


def test_commits_of_a_different_write_mode_are_refused_per_item(worker):
    with kvstrata.connect(worker) as kv:
        b, loc = _reserve(kv)
        opts = dict(OPTS, mode="write_through")
        res, _ = b.commit_finish(b.commit_start([("land/wt", 4, loc.offset)], opts, landing=True))
        assert isinstance(res[0], ValueError) and "memory" in str(res[0])
        assert kv.exists(["land/wt"]) == [False] and kv.stats()["creates_in_progress"] == 0


def test_a_landing_commits_keys_are_read_from_kept_leases_once_shown_but_never_with_a_ttl(worker):
    # The validity's no-TTL set learns a landing commit's keys as they land (Validity.shown, under the store's lock): a
    # reader keeps its lease then; never for a commit with a TTL, which the engine ends with no change kept leases see.
    with kvstrata.connect(worker) as kv, kvstrata.connect(worker) as reader:
        kv.delete(["land/nottl", "land/ttl"])
        b, loc = _reserve(kv)
        head = loc.offset
        for key, ttl in (("land/nottl", None), ("land/ttl", 1.5)):  # (its reads must come first, loaded or not)
            b.view(type(loc)(loc.segment, head, 3))[:] = key[-3:].encode()
            token = b.commit_start([(key, 3, head)], dict(OPTS, ttl=ttl), landing=True)
            res, head = b.commit_finish(token)
            assert res == [None] and reader.exists([key]) == [False]
            b.land(token)
            assert reader.get(key) == key[-3:].encode() and reader.get(key) == key[-3:].encode()
        assert reader._backend._local.lookup("land/nottl") is not None  # the second get was a local read
        assert reader._backend._local.lookup("land/ttl") is None
        time.sleep(1.6)  # its TTL ran from the landing
        assert reader.exists(["land/nottl", "land/ttl"]) == [True, False]
        kv.delete(["land/nottl"])


def test_the_store_alone_shows_a_landing_commit_to_operations_after_the_word():
    from kvstrata.store import ObjectStore, StoreConfig

    store = ObjectStore(StoreConfig(memory_bytes=4 << 20, segment_bytes=1 << 20, numa_node=None, hugepages="off"))
    try:
        word = [None]
        loc = store.reserve("w", 4096)
        store.buffer(type(loc)(loc.segment, loc.offset, 3))[:] = b"abc"
        assert store.commit("w", [("s/k", 3, loc.offset)], nx=True, landed=lambda: word[0]) == [None]
        assert store.exists(["s/k"]) == [False] and store.settle("w") is True
        with pytest.raises(KeyExists):
            store.create("s/k", 1, nx=True, owner="other")
        assert store._lock is store._settling_lock  # every operation settles first while one waits
        word[0] = True
        assert store.get_bytes("s/k") == b"abc" and store.settle() is False
        assert store._lock is store._plain_lock  # and none pays for it once none waits
        loc = store.reservation("w")
        assert store.commit("w", [("s/gone", 3, loc.offset)], landed=lambda: None) == [None]
        store.release_owner("w")  # the writer went away before saying so: never shown, freed
        assert store.exists(["s/gone"]) == [False] and store.stats()["reserved_bytes"] == 0
    finally:
        store.close()


def test_a_landing_commit_that_replaces_a_version_written_meanwhile_is_seen_by_readers_that_kept_a_lease(worker):
    # A plain set of the key while a write-once commit of it waits for its word (a set does not wait for creates):
    # a reader keeps a lease on the set's version; the commit's object replaces it when the word comes, and the
    # reader's next get must see that, not serve its kept lease of the version no longer there.
    with kvstrata.connect(worker) as a, kvstrata.connect(worker) as b, kvstrata.connect(worker) as c:
        a.delete(["land/race"])
        backend, loc = _reserve(a)
        token = backend.commit_start([("land/race", 3, loc.offset)], OPTS, landing=True)
        assert backend.commit_finish(token)[0] == [None]
        b.set("land/race", b"bbb")
        assert c.get("land/race") == b"bbb" and c.get("land/race") == b"bbb"  # the second from its kept lease
        assert c._backend._local.lookup("land/race") is not None
        backend.view(type(loc)(loc.segment, loc.offset, 3))[:] = b"aaa"
        backend.land(token)
        assert b.exists(["land/race"]) == [True]  # a request after the word: the commit is settled by then
        assert c.get("land/race") == b"aaa" and b.get("land/race") == b"aaa"
        a.delete(["land/race"])


def test_a_landing_commits_objects_are_made_when_it_lands_with_its_ttl_from_then_and_freed_if_it_fails():
    from kvstrata.store import ObjectStore, StoreConfig

    store = ObjectStore(StoreConfig(memory_bytes=4 << 20, segment_bytes=1 << 20, numa_node=None, hugepages="off"))
    try:
        loc = store.reserve("w", 4096)
        word = [None]
        items = [("t/a", 3, loc.offset), ("t/b", 0, loc.offset + 64), ("t/c", 70, loc.offset + 64)]
        assert store.commit("w", items, nx=True, ttl=0.3, landed=lambda: word[0]) == [None] * 3
        # the keys are taken while it waits: a second write-once commit of one is refused, its piece freed
        loc2 = store.reservation("w")
        assert isinstance(store.commit("w", [("t/a", 5, loc2.offset)], nx=True)[0], KeyExists)
        time.sleep(0.35)  # longer than the TTL: it runs from the landing, not from the commit
        word[0] = True
        assert store.exists(["t/a", "t/b", "t/c"]) == [True] * 3 and store.sizes(["t/b", "t/c"]) == [0, 70]
        time.sleep(0.35)
        assert store.exists(["t/a", "t/b", "t/c"]) == [False] * 3  # expired
        # a commit that fails: never shown, its pieces freed, its keys free again
        loc3 = store.reservation("w")
        used = store.stats()["tiers"]["memory"]["used"]
        word = [None]
        items = [("t/d", 100, loc3.offset), ("t/e", 100, loc3.offset + 128)]
        assert store.commit("w", items, nx=True, landed=lambda: word[0]) == [None, None]
        word[0] = False
        assert store.exists(["t/d", "t/e"]) == [False, False] and store.settle() is False
        assert store.stats()["tiers"]["memory"]["used"] == used - 256  # both pieces freed
        loc4 = store.reservation("w")
        assert store.commit("w", [("t/d", 4, loc4.offset)], nx=True) == [None]  # free again
        assert store.stats()["creates_in_progress"] == 0
    finally:
        store.close()


def test_a_landing_commit_is_cut_off_the_reservation_after_its_answer_in_order_or_when_anything_needs_it():
    # The commit only checks its items and takes their keys; their pieces are cut off the reservation's block (and
    # their versions given) by cut_landings (the worker's, right after its answer) or by whatever needs the block:
    # a later plain commit, a new reservation, the landing itself. Every way cuts the owner's commits in order.
    from kvstrata.store import ObjectStore, StoreConfig

    store = ObjectStore(StoreConfig(memory_bytes=4 << 20, segment_bytes=1 << 20, numa_node=None, hugepages="off"))
    try:
        word = [None]
        loc = store.reserve("w", 1 << 16)
        used = store.stats()["tiers"]["memory"]["used"]

        def commit(keys, landed=True, nx=True):
            at = store.reservation("w").offset
            items = []
            for key in keys:
                store.buffer(type(loc)(loc.segment, at, 3))[:] = key[-3:].encode()
                items.append((key, 3, at))
                at += 64
            return store.commit("w", items, nx=nx, landed=(lambda: word[0]) if landed else None)

        assert commit(["c/a01", "c/a02"]) == [None, None] and commit(["c/b01"]) == [None]
        assert store._uncut == 2 and store.exists(["c/a01", "c/b01"]) == [False, False]
        assert len(store._creating) == 3  # taken, not made
        assert commit(["c/c01"], landed=False) == [None]  # a plain commit: the two before it are cut first
        assert store._uncut == 0 and store.get_bytes("c/c01") == b"c01"
        assert store.exists(["c/a01", "c/b01"]) == [False, False]  # cut, not shown: their copies did not land
        assert commit(["c/d01"]) == [None] and store._uncut == 1
        loc = store.reserve("w", 1 << 16)  # the old reservation's rest is freed after this commit's piece is cut
        assert store._uncut == 0
        refused = commit(["c/a01"])  # every key refused (taken while waiting): no landing, its piece freed
        assert isinstance(refused[0], KeyExists) and store._uncut == 0 and len(store._landings) == 3
        word[0] = True
        assert [store.get_bytes(k) for k in ("c/a01", "c/a02", "c/b01", "c/d01")] == [b"a01", b"a02", b"b01", b"d01"]
        assert store.settle() is False and not store._creating
        store.delete(["c/a01", "c/a02", "c/b01", "c/c01", "c/d01"])
        store.reserve("w", 0)
        assert store.stats()["tiers"]["memory"]["used"] == used - (1 << 16)  # every piece and reservation freed
        # a commit whose word came before the worker cut it: its landing cuts it, then shows it
        loc = store.reserve("w", 1 << 16)
        assert commit(["c/e01"]) == [None] and store._uncut == 0 and store.get_bytes("c/e01") == b"e01"
    finally:
        store.close()


def test_a_worker_over_a_shared_store_takes_its_validity_hook_back_when_it_stops(tmp_path):
    from kvstrata.server import Worker, WorkerConfig
    from kvstrata.store import ObjectStore, StoreConfig

    store = ObjectStore(StoreConfig(memory_bytes=4 << 20, segment_bytes=1 << 20, numa_node=None, hugepages="off"))
    try:
        worker = Worker(WorkerConfig(socket=str(tmp_path / "kv.sock"), memory=4 << 20, disk_dir=""), store=store)
        worker.start()
        assert store._visibility is not None
        worker.stop()
        assert store._visibility is None  # the worker's validity table is closed: never bumped again
        # the store goes on: a commit that replaces a version lands without it
        store.put("shared/k", b"old")
        loc = store.reserve("w", 4096)
        store.buffer(type(loc)(loc.segment, loc.offset, 3))[:] = b"new"
        word = [None]
        assert store.commit("w", [("shared/k", 3, loc.offset)], landed=lambda: word[0]) == [None]
        word[0] = True
        assert store.get_bytes("shared/k") == b"new"
    finally:
        store.close()


_HOLDER = """
import sys, time, kvstrata
kv = kvstrata.connect(sys.argv[1])
b = kv._backend
loc = b.reserve_finish(b.reserve_start(1 << 20))
b.view(type(loc)(loc.segment, loc.offset, 4))[:] = b"kept"
token = b.commit_start([(sys.argv[3], 4, loc.offset)], {"ttl": None, "nx": True, "mode": "memory"}, landing=True)
b.commit_finish(token)
if sys.argv[4] == "land":
    b.land(token)
open(sys.argv[2], "w").write("sent")
time.sleep(60)
"""


@pytest.mark.parametrize("said", ["land", "nothing"])
def test_a_client_killed_after_its_commit_keeps_what_it_said_landed(worker, tmp_path, said):
    ready, key = tmp_path / "ready", f"land/killed/{said}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath("src"), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, worker, str(ready), key, said], env=env)
    try:
        with kvstrata.connect(worker) as kv:
            deadline = time.monotonic() + 30
            while not ready.exists() or not ready.read_text():
                assert time.monotonic() < deadline and child.poll() is None, "the holder never sent its commit"
                time.sleep(0.02)
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
            deadline = time.monotonic() + 10
            while kv.stats()["clients"] > 1:
                assert time.monotonic() < deadline, "the worker never let go of the killed client"
                time.sleep(0.02)
            if said == "land":  # acknowledged to its writer: it stands after the writer is gone
                assert kv.get(key) == b"kept"
                kv.delete([key])
            else:
                assert kv.exists([key]) == [False]
            assert kv.stats()["reserved_bytes"] == 0 and kv.stats()["creates_in_progress"] == 0
            kv.set("land/after", b"still serving")
            assert kv.get("land/after") == b"still serving"
            kv.delete(["land/after"])
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


class _Event:
    """A stand-in for a stage's CUDA event: still landing when first asked, then landed (or failed)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        if self.fail:
            raise RuntimeError("simulated copy failure")


def _lists(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 255, (100 + i,), generator=g, dtype=torch.uint8)] for i in range(n)]


def _reads_back(reader, keys, src) -> bool:
    """Whether ``reader``'s ``mget_h2d`` of ``keys`` gives back exactly ``src`` (one tensor per key)."""
    out = [[torch.zeros_like(t[0])] for t in src]
    return reader.mget_h2d(keys, out) == [None] * len(keys) and all(torch.equal(a[0], b[0]) for a, b in zip(src, out))


def test_mset_d2h_sends_one_commit_ahead_of_its_copies(worker, monkeypatch):
    with kvstrata.connect(worker) as kv:
        assert kv.mset_d2h(["land/warm"], _lists(1, 0)) == [None]  # now a reservation is held
        sent = []
        real = kv._backend.commit_start
        monkeypatch.setattr(
            kv._backend, "commit_start", lambda *a, **kw: sent.append(kw.get("landing", False)) or real(*a, **kw)
        )
        monkeypatch.setattr(device, "mark", lambda stream: _Event())
        batches_of(monkeypatch, 2, 100)
        keys = [f"land/m/{i}" for i in range(5)]
        src = _lists(5, 1)
        assert kv.mset_d2h(keys, src) == [None] * 5
        # three batches, each one's copies "in flight" when looked at: all three go at once in one commit ahead of
        # their copies, shown when this process said they landed
        assert sent == [True]
        assert _reads_back(kv, keys, src)
        kv.delete([*keys, "land/warm"])


def test_a_longer_mset_d2h_commits_every_stage_once_its_copies_are_queued(worker, monkeypatch):
    # Five batches: their copies are all queued first, then one commit for every key goes ahead of them; nothing
    # shows before this process says the bytes landed, and everything does once the call returned.
    with kvstrata.connect(worker) as kv, kvstrata.connect(worker) as other:
        assert kv.mset_d2h(["land/warm4"], _lists(1, 0)) == [None]
        backend = kv._backend
        order = []
        real_commit, real_enqueue, real_land = backend.commit_start, device.enqueue, backend.land
        keys = [f"land/long/{i}" for i in range(9)]

        def landing(token, ok=True):
            order.append("land")
            assert other.exists(keys) == [False] * 9  # the commit went ahead of the word: nothing shows yet
            real_land(token, ok)

        monkeypatch.setattr(
            backend, "commit_start", lambda *a, **kw: order.append(("commit", len(a[0]))) or real_commit(*a, **kw)
        )
        monkeypatch.setattr(device, "enqueue", lambda *a, **kw: order.append("copies") or real_enqueue(*a, **kw))
        monkeypatch.setattr(backend, "land", landing)
        monkeypatch.setattr(device, "mark", lambda stream: _Event())
        batches_of(monkeypatch, 2, 100)
        src = _lists(9, 6)
        assert kv.mset_d2h(keys, src) == [None] * 9
        assert order == [*["copies"] * 5, ("commit", 9), "land"]
        assert other.exists(keys) == [True] * 9
        monkeypatch.undo()
        assert _reads_back(other, keys, src)
        kv.delete([*keys, "land/warm4"])


def test_a_call_that_uses_up_its_reservation_asks_for_the_next_while_its_copies_move(worker, monkeypatch):
    # A reservation of 2 KiB holds one call of nine ~128-byte objects, not two: each call asks for the next one
    # right after its commit ahead (before its landing word, not at its end), once, and the next call carves from
    # it with no create.
    with kvstrata.connect(worker, reserve_bytes=2048) as kv:
        assert kv.mset_d2h(["land/renew/warm"], _lists(1, 0)) == [None]  # created; a reservation asked for
        backend = kv._backend
        order = []
        for name in ("commit_start", "reserve_start", "land", "mcreate_start"):
            real = getattr(backend, name)
            monkeypatch.setattr(
                backend, name, lambda *a, _real=real, _name=name, **kw: order.append(_name) or _real(*a, **kw)
            )
        monkeypatch.setattr(device, "mark", lambda stream: _Event())
        batches_of(monkeypatch, 2, 100)
        calls = [([f"land/renew/{c}/{i}" for i in range(9)], _lists(9, 10 + c)) for c in range(3)]
        for keys, src in calls:
            assert kv.mset_d2h(keys, src) == [None] * 9
        assert order == ["commit_start", "reserve_start", "land"] * 3
        monkeypatch.undo()
        for keys, src in calls:
            assert _reads_back(kv, keys, src)
            kv.delete(keys)
        kv.delete(["land/renew/warm"])


def test_a_call_that_may_not_land_at_first_commits_the_rest_ahead_once_it_may(worker, monkeypatch):
    # As a chained async call whose predecessor's landing word the worker has not read yet: the first mark's keys (the
    # first three batches') are committed once their bytes are in, and the rest, in one commit ahead of their copies,
    # as soon as the word is read.
    with kvstrata.connect(worker) as kv, kvstrata.connect(worker) as other:
        assert kv.mset_d2h(["land/late/warm"], _lists(1, 0)) == [None]
        backend = kv._backend
        looks = []  # can_land: not at the first look, then as the lane says
        real_can_land = type(backend).can_land.fget

        def can_land(b):
            looks.append(1)
            return len(looks) > 1 and real_can_land(b)

        monkeypatch.setattr(type(backend), "can_land", property(can_land))
        sent = []
        real = backend.commit_start
        monkeypatch.setattr(
            backend,
            "commit_start",
            lambda *a, **kw: sent.append((len(a[0]), kw.get("landing", False))) or real(*a, **kw),
        )
        monkeypatch.setattr(device, "mark", lambda stream: _Event())
        batches_of(monkeypatch, 2, 100)
        keys = [f"land/late/{i}" for i in range(9)]
        src = _lists(9, 8)
        assert kv.mset_d2h(keys, src) == [None] * 9  # batches of 2, 2, 2, 2, 1 keys; marks of 6, 2, 1
        assert sent == [(6, False), (3, True)]
        assert other.exists(keys) == [True] * 9
        monkeypatch.undo()
        assert _reads_back(other, keys, src)
        kv.delete([*keys, "land/late/warm"])


def test_mset_d2h_whose_last_copies_fail_shows_none_of_them_and_the_next_call_works(worker, monkeypatch):
    with kvstrata.connect(worker) as kv:
        assert kv.mset_d2h(["land/warm2"], _lists(1, 0)) == [None]
        events = iter([_Event(), _Event(fail=True)])  # the first three batches' mark, the fourth's
        monkeypatch.setattr(device, "mark", lambda stream: next(events))
        batches_of(monkeypatch, 1, 100)
        keys = [f"land/f/{i}" for i in range(4)]
        first = _lists(4, 2)
        with pytest.raises(RuntimeError, match="simulated copy failure"):
            kv.mset_d2h(keys, first)  # the fourth batch's copies fail: the commit ahead of all four never shows
        monkeypatch.undo()
        # the objects committed ahead of their copies never became visible, and nothing is left half-made
        assert kv.exists(keys) == [False] * 4 and kv.stats()["creates_in_progress"] == 0
        src = _lists(4, 3)
        assert kv.mset_d2h(keys, src) == [None] * 4  # the reservation's head is where the worker says
        assert _reads_back(kv, keys, src)
        with pytest.raises(KvstrataError):
            kv.get("land/f/none")
        kv.delete([*keys, "land/warm2"])


def test_mset_d2h_interrupted_right_after_sending_a_commit_ahead_leaves_no_key_taken(worker, monkeypatch):
    # A KeyboardInterrupt landing in commit_start after its request went out (the caller never got the token):
    # the call still tells the worker that every commit sent ahead failed, so those keys are free at once, on
    # this same connection, instead of taken until the client disconnects.
    with kvstrata.connect(worker) as kv:
        assert kv.mset_d2h(["land/warm3"], _lists(1, 0)) == [None]
        backend = kv._backend
        real = backend.commit_start
        landing_sent = []

        def interrupted(*a, **kw):
            token = real(*a, **kw)
            if kw.get("landing"):
                landing_sent.append(token)
                if len(landing_sent) == 1:
                    raise KeyboardInterrupt
            return token

        monkeypatch.setattr(backend, "commit_start", interrupted)
        monkeypatch.setattr(device, "mark", lambda stream: _Event())
        batches_of(monkeypatch, 2, 100)
        keys = [f"land/i/{i}" for i in range(5)]
        with pytest.raises(KeyboardInterrupt):
            kv.mset_d2h(keys, _lists(5, 4))
        monkeypatch.undo()
        assert len(landing_sent) == 1
        # the one commit ahead of every stage's copies never shows
        assert kv.exists(keys) == [False] * 5
        src = _lists(5, 5)
        assert kv.mset_d2h(keys, src) == [None] * 5  # free again: no KeyExists, no wait for a disconnect
        assert _reads_back(kv, keys, src)
        assert kv.stats()["creates_in_progress"] == 0
        kv.delete([*keys, "land/warm3"])


def test_a_store_closed_with_a_commit_waiting_drops_it_quietly():
    from kvstrata.store import ObjectStore, StoreConfig

    store = ObjectStore(StoreConfig(memory_bytes=4 << 20, segment_bytes=1 << 20, numa_node=None, hugepages="off"))
    loc = store.reserve("w", 4096)
    assert store.commit("w", [("s/closed", 3, loc.offset)], landed=lambda: None) == [None]
    store.close()
    assert store.settle("w") is False and store._lock is store._plain_lock


_READER = """
import sys, time, kvstrata
kv = kvstrata.connect(sys.argv[1])
n, size, end = int(sys.argv[2]), int(sys.argv[3]), time.monotonic() + float(sys.argv[4])
print("ready", flush=True)
seen = bad = 0
for i in range(n):  # each key in turn, asked for again and again until it is there
    while time.monotonic() < end:
        try:
            v = kv.get(f"land/race/{i}")
        except kvstrata.KeyNotFound:
            continue
        seen += 1
        bad += v != bytes([i % 251 + 1]) * size
        break
print(seen, bad, flush=True)
"""


def test_a_reader_in_another_process_never_sees_bytes_before_the_word(worker, tmp_path):
    # The writer commits each object ahead of its "copy" (it fills the bytes only after the worker answered),
    # then says it landed; a reader asking for each key from its own process, again and again, must find it
    # whole. (Checked to fail when the objects show at the commit instead of at the word.)
    n, size = 60, 8192
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath("src"), os.environ.get("PYTHONPATH", "")]))
    with kvstrata.connect(worker) as kv:
        kv.delete([f"land/race/{i}" for i in range(n)])
        reader = subprocess.Popen(
            [sys.executable, "-c", _READER, worker, str(n), str(size), "60"], env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            assert reader.stdout.readline().strip() == "ready"
            b, loc = _reserve(kv, n * size)
            for i in range(n):
                at = loc.offset + i * size
                token = b.commit_start([(f"land/race/{i}", size, at)], OPTS, landing=True)
                assert b.commit_finish(token)[0] == [None]
                view = b.view(type(loc)(loc.segment, at, size))
                view[: size // 2] = bytes([i % 251 + 1]) * (size // 2)  # half the "copy"...
                time.sleep(0.002)  # ...while the reader asks...
                view[size // 2 :] = bytes([i % 251 + 1]) * (size // 2)  # ...then the rest
                b.land(token)
            out, _ = reader.communicate(timeout=90)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
        seen, bad = map(int, out.split())
        assert (seen, bad) == (n, 0)
        kv.delete([f"land/race/{i}" for i in range(n)])

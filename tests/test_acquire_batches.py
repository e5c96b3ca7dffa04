"""Batch leases (``acquire``): per-key results, the reply's checks, and the local-read entries made later."""

from __future__ import annotations

import os
import time

import pytest

import kvstrata
from kv_helpers import worker_config
from kvstrata.client import local_reads
from kvstrata.client._shared import Loc
from kvstrata.errors import ConnectionLost, KeyNotFound, ProtocolError
from kvstrata.server import Worker


@pytest.fixture
def worker(tmp_path):
    with Worker(worker_config(tmp_path, memory=32 << 20, segment=32 << 20)).start() as w:
        yield w


def _leased(worker) -> int:
    return len(worker.store._leases)


def _settled(kv) -> None:
    """A round trip: every one-way release sent before it has been handled."""
    kv.exists(["no/such/key"])


def _wait_leased(worker, n: int) -> None:
    deadline = time.monotonic() + 10
    while _leased(worker) != n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _leased(worker) == n


def test_a_missing_key_in_the_middle_and_a_key_twice_keep_their_slots(worker):
    with kvstrata.connect(worker.address) as kv:
        b = kv._backend
        kv.mset({"b/0": b"zero", "b/2": b"two"})
        keys = ["b/0", "b/missing", "b/2", "b/0"]
        out = b.acquire_finish(b.acquire_start(keys, 0, cache="fit", carry=False))
        assert isinstance(out[1], KeyNotFound) and "b/missing" in str(out[1])
        assert [bytes(b.view(out[i].location)) for i in (0, 2, 3)] == [b"zero", b"two", b"zero"]
        assert out[0].lease_id != out[3].lease_id and not any(out[i].mutable for i in (0, 2, 3))
        assert _leased(worker) == 3
        kv._release_leases([out[i].lease_id for i in (0, 2, 3)])
        _settled(kv)
        # The cache keeps one lease per key (b/0's second), the others went back.
        assert _leased(worker) == 2 and len(b._local._entries) == 2
        before = worker.counters["requests"]
        again = b.acquire_finish(b.acquire_start(["b/2", "b/0"], 0, cache="fit"))
        assert worker.counters["requests"] == before  # served by the local-read cache
        assert [x.lease_id for x in again] == [out[2].lease_id, out[3].lease_id]
        kv._release_leases([x.lease_id for x in again])
        _settled(kv)
        assert _leased(worker) == 2
    _wait_leased(worker, 0)  # a client gone: the worker lets go of what its cache held


def test_leases_are_judged_at_once_and_entered_at_settle(worker):
    with kvstrata.connect(worker.address) as kv:
        b = kv._backend
        keys = [f"s/{i}" for i in range(5)]
        kv.mset({k: k.encode() for k in keys})
        out = b.acquire_finish(b.acquire_start(keys, 0, cache="fit", carry=False))
        assert len(b._local._entries) == 0 and len(b._local) == 1  # left for later
        for lease in out:  # the views go first, as a finalizer gives them back: the cache still holds them
            b.defer_release(lease.lease_id)
        _settled(kv)
        assert _leased(worker) == 5
        b._local.max_entries = 3  # the cache keeps the first three ("fit": none pushed out)
        b.settle()
        assert list(b._local._entries) == keys[:3]
        _settled(kv)  # the two refused go back with the next message
        assert _leased(worker) == 3
        before = worker.counters["requests"]
        got = b.acquire_finish(b.acquire_start(keys[:3], 0, cache="fit"))
        assert worker.counters["requests"] == before
        assert [bytes(b.view(x.location)) for x in got] == [k.encode() for k in keys[:3]]
        kv._release_leases([x.lease_id for x in got])
        kv.mset({k: b"new" for k in keys})  # rewritten: the next read is cold again, the old leases go back
        cold = b.acquire(keys, 0, cache="fit")
        assert [bytes(b.view(x.location)) for x in cold] == [b"new"] * 5
        kv._release_leases([x.lease_id for x in cold])
        _settled(kv)
        assert _leased(worker) == 3 and len(b._local._entries) == 3


def test_a_change_during_the_request_keeps_no_lease(worker, monkeypatch):
    with kvstrata.connect(worker.address) as kv, kvstrata.connect(worker.address) as other:
        b = kv._backend
        kv.mset({"c/0": b"0", "c/1": b"1"})
        token = b.acquire_start(["c/0", "c/1"], 0, cache="fit")
        other.set("c/unrelated", b"x")  # the generation moves before the reply is judged
        out = b.acquire_finish(token)
        assert len(b._local) == 0 and b._holders == {out[0].lease_id: 1, out[1].lease_id: 1}
        kv._release_leases([x.lease_id for x in out])
        _settled(kv)
        assert _leased(worker) == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"locs": [0, 0, 1], "flags": [0]},  # no ids
        {"ids": [7], "locs": [0, 0], "flags": [0]},  # a short location
        {"ids": [7, 8], "locs": [0, 0, 1, 0, 0, 1], "flags": [0, 0]},  # two answers for one key
        {"ids": [7], "locs": [0, 0, 1], "flags": []},
        {"ids": [7], "locs": [0, 0, 1], "flags": [0], "errs": [[5, "KeyNotFound", "x"]]},  # no such key
        {"ids": [7], "locs": [0, 0, 1], "flags": [2], "errs": [[0, "KeyNotFound", "x"]]},  # refused and leased
        {"ids": [7], "locs": [0, 0, 1], "flags": [0], "errs": "KeyNotFound"},
        {"ids": [7], "locs": [0, 0, 1], "flags": [0], "errs": [[0, "KeyNotFound"]]},
        {"ids": "7", "locs": [0, 0, 1], "flags": [0]},
        {"ids": [7], "locs": [0, 0, 1], "flags": ["2"]},
    ],
)
def test_a_malformed_acquire_reply_is_a_protocol_error_and_ends_the_connection(worker, monkeypatch, bad):
    with kvstrata.connect(worker.address) as kv:
        kv.set("m/k", b"v")
        b = kv._backend
        token = b.acquire_start(["m/k"], 0)
        real = b.tagged_reply
        monkeypatch.setattr(b, "tagged_reply", lambda *a: (real(*a), bad)[1])
        with pytest.raises(ProtocolError, match="acquire of 1 keys"):
            b.acquire_finish(token)
        with pytest.raises(ConnectionLost):
            kv.get("m/other")
        _wait_leased(worker, 0)  # the real lease went back with the connection


def test_add_columns_later_then_settle():
    from kvstrata.memory.shm import SharedSegment
    from kvstrata.server.validity import SLOTS_OFFSET, TABLE_BYTES, Validity

    table = Validity()
    try:
        local = local_reads.LocalReads(SharedSegment.attach(os.dup(table.fd), TABLE_BYTES), slots_offset=SLOTS_OFFSET)
        g = local.generation()
        locs = [Loc(0, 0, 10), Loc(0, 10, 10), Loc(0, 20, 10)]
        assert local.add_columns(["a", "b", "a"], [1, 2, 3], locs, [5, 6, 5 + 8192], g, later=True) == []
        assert len(local) == 1 and local.entries(["a"]) == [None]  # not entered yet
        local.settle()
        assert [e[0] for e in local.entries(["a", "b"])] == [3, 2]  # the key named twice keeps its last lease
        assert local.stale() == [1] and local._bytes == 20
        with table.change(["unrelated"]):  # judged after a change: refused at once, nothing left for later
            pass
        assert local.add_columns(["c"], [4], [Loc(0, 30, 10)], [7], g, later=True) == [4]
        assert local.clear() == [3, 2] and len(local) == 0
        local.close()
    finally:
        table.close()

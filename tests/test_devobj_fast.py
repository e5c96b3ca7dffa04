"""The fast read paths of device objects on CPU: reads from kept records checked by the broker's
generation page, futures settled at copy end with completions sent after, export/import caches."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from kv_helpers import FakeReduce
from kvstrata import errors
from kvstrata._proc import pid_alive
from kvstrata.devobj import DeviceBroker, DeviceObjectConfig, DeviceObjects, InprocBrokerLink, api, ipc

CFG = DeviceObjectConfig(allow_cpu=True, poll_seconds=0.05, chunk_bytes=4096)
WAIT = 10.0


@pytest.fixture
def broker():
    return DeviceBroker()


@pytest.fixture
def make(broker):
    made = []

    def _make() -> DeviceObjects:
        c = DeviceObjects(InprocBrokerLink(broker), device="cpu", config=CFG)
        made.append(c)
        return c

    yield _make
    for c in made:
        c.close()


def _get(c, keys, shapes, timeout=WAIT):
    dst = [[torch.full(s, 7.0)] for s in shapes]
    futs = c.dev_mget(keys, dst, timeout=timeout)
    return [f.result(WAIT) if f.exception(WAIT) is None else f.exception() for f in futs], dst


def test_second_mget_skips_the_broker_and_is_exact(make, broker, monkeypatch):
    a, b = make(), make()
    src = [[torch.randn(5)], [torch.randn(3)]]
    assert a.dev_mset(["x", "y"], src) == [None, None]
    got, dst = _get(b, ["x", "y"], [(5,), (3,)])
    assert got == [None, None] and b.cached_reads == 0
    b._flush_done()  # the first read's completions (sent by the thread that settled them): not this read's
    calls = []
    real = broker.handle
    monkeypatch.setattr(broker, "handle", lambda c, op, *a, **k: (calls.append(op), real(c, op, *a, **k))[1])
    got, dst = _get(b, ["x", "y"], [(5,), (3,)])
    assert got == [None, None] and b.cached_reads == 2
    assert [op for op in calls if op != "wait_events"] == []  # no request at all
    assert all(torch.equal(d[0], s[0]) for d, s in zip(dst, src))


def test_cached_record_with_other_shape_asks_the_broker(make):
    a, b = make(), make()
    a.dev_mset(["x"], [[torch.randn(4)]])
    _get(b, ["x"], [(4,)])
    (exc,), _ = _get(b, ["x"], [(5,)])
    assert isinstance(exc, ValueError) and "tensor 0" in str(exc)


def test_delete_and_reregister_is_seen_by_the_next_read(make, broker):
    a, b = make(), make()
    old, new = torch.randn(6), torch.randn(6)
    a.dev_mset(["k"], [[old]])
    _get(b, ["k"], [(6,)])
    _drained(broker)
    assert a.dev_delete(["k"]) == [None]
    (exc,), _ = _get(b, ["k"], [(6,)], timeout=0)
    assert isinstance(exc, errors.KeyNotFound | errors.Timeout)
    a.dev_mset(["k"], [[new]])
    (r,), dst = _get(b, ["k"], [(6,)])
    assert r is None and torch.equal(dst[0][0], new)


def _drained(broker):
    deadline = time.monotonic() + WAIT
    while broker.snapshot()["transfers"] and time.monotonic() < deadline:  # completions are sent after settling
        time.sleep(0.005)


def test_delete_during_a_cached_copy_redoes_it_through_the_broker(make, broker, monkeypatch):
    """The seqlock: the generation moved while the copy ran, so the copy is not trusted."""
    a, b = make(), make()
    old, new = torch.randn(8), torch.randn(8)
    a.dev_mset(["k"], [[old]])
    _get(b, ["k"], [(8,)])
    _drained(broker)
    real = api.DeviceObjects._enqueue_batch
    fired = []

    def racing(self, items, fail):
        out = real(self, items, fail)
        if self is b and not fired:  # the owner deletes, rewrites and registers again mid-copy
            fired.append(1)
            assert a.dev_delete(["k"]) == [None]
            a.dev_mset(["k"], [[new]])
        return out

    monkeypatch.setattr(api.DeviceObjects, "_enqueue_batch", racing)
    # Only the generation may tell: in one process the released export would be noticed as well.
    monkeypatch.setattr(api.DeviceObjects, "_lost_owners", lambda self, recs: set())
    before = b.cached_reads
    (r,), dst = _get(b, ["k"], [(8,)])
    assert fired and r is None and torch.equal(dst[0][0], new)
    assert b.cached_reads == before  # the stale copy was not counted as a read


def test_owner_close_invalidates_cached_reads(make):
    a, b = make(), make()
    a.dev_mset(["k"], [[torch.randn(3)]])
    _get(b, ["k"], [(3,)])
    a.close()
    (exc,), _ = _get(b, ["k"], [(3,)], timeout=0)
    assert isinstance(exc, errors.KeyNotFound | errors.Timeout)


def test_owner_found_dead_after_copy_is_never_done(make, monkeypatch):
    """The generation did not move (the broker has not noticed yet), but the owner's process is gone."""
    a, b = make(), make()
    a.dev_mset(["k"], [[torch.randn(3)]])
    _get(b, ["k"], [(3,)])
    owner = a.link.client_id
    monkeypatch.setattr(api.DeviceObjects, "_lost_owners", lambda self, recs: {owner})
    (exc,), _ = _get(b, ["k"], [(3,)])
    assert isinstance(exc, errors.ServerError) and "went away" in str(exc)


def test_lost_owners_sees_dead_and_zombie_processes(make):
    b = make()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + WAIT
    while pid_alive(zombie.pid) and time.monotonic() < deadline:  # exited, not reaped: a zombie
        time.sleep(0.01)
    try:
        recs = [
            {"owner": "dead", "pid": gone.pid, "node_id": "elsewhere"},
            {"owner": "zombie", "pid": zombie.pid, "node_id": "elsewhere"},
            {"owner": "live", "pid": os.getppid(), "node_id": "elsewhere"},
            {"owner": "local", "pid": os.getpid(), "node_id": CFG.node_id, "local": "no-such-token"},
        ]
        assert b._lost_owners(recs) == {"dead", "zombie", "local"}
    finally:
        zombie.wait()


def test_completion_reaches_the_broker_before_the_next_request(make, broker):
    a, b = make(), make()
    for i in range(20):
        (pf,) = a.dev_publish(["k"], [[torch.full((4,), float(i))]])
        dst = [torch.zeros(4)]
        b.dev_subscribe(["k"], [dst], timeout=WAIT)[0].result(WAIT)
        assert torch.equal(dst[0], torch.full((4,), float(i)))
        pf.result(WAIT)  # the publisher is released only once the broker learned of the receive
    # b re-publishes the key it just received: its completion went out before this request
    (pf,) = a.dev_publish(["j"], [[torch.ones(4)]])
    dst = [torch.zeros(4)]
    b.dev_subscribe(["j"], [dst], timeout=WAIT)[0].result(WAIT)
    (again,) = b.dev_publish(["j"], [dst])
    assert not again.done()  # registered (a KeyExists would have settled it at once)
    pf.result(WAIT)
    assert broker.snapshot()["objects"]["j"]["owner"] == b.link.client_id
    _drained(broker)
    assert broker.snapshot()["transfers"] == 0


@pytest.mark.parametrize("where", ["queued", "sent with a poll the broker has not read"])
def test_close_reports_finished_receives(make, broker, monkeypatch, where):
    a, b = make(), make()
    monkeypatch.setattr(api.DeviceObjects, "_notify_done", lambda self: None)  # nothing sends on its own
    real_take = api.DeviceObjects._take_done

    def take_nothing(self):  # polls carry nothing; "sent": taken as if a poll carried them, never read
        if where != "queued":
            real_take(self)
        return []

    monkeypatch.setattr(api.DeviceObjects, "_take_done", take_nothing)
    (pf,) = a.dev_publish(["k"], [[torch.ones(2)]])
    b.dev_subscribe(["k"], [[torch.zeros(2)]], timeout=WAIT)[0].result(WAIT)
    assert not pf.done()
    b.close()
    assert pf.exception(WAIT) is None  # received, not returned to the broker by b's goodbye


def test_broker_generation_moves_only_when_registered_objects_go():
    b = DeviceBroker()
    for c in ("o", "r"):
        b.handle(c, "hello", {"info": {"pid": 1, "node_id": "n"}})
    item = {"key": "k", "tensors": [{"shape": [1], "dtype": "int8", "nbytes": 1}], "handles": [], "local": "t"}
    gen = b.generation_counter.value
    b.handle("o", "mset", {"items": [item]})
    b.handle("o", "publish", {"items": [dict(item, key="p")]})
    b.handle("r", "subscribe", {"keys": ["p"]})
    r = b.handle("r", "mget", {"keys": ["k"], "known": [None]})["results"][0]
    assert r["transfer"]["record"]["obj"] and b.generation_counter.value == gen
    lean = b.handle("r", "mget", {"keys": ["k"], "known": [r["transfer"]["record"]["obj"]]})["results"][0]
    assert "record" not in lean["transfer"] and lean["transfer"]["obj"] == r["transfer"]["record"]["obj"]
    b.handle("o", "delete", {"keys": ["k"]})
    assert b.generation_counter.value == gen + 1
    b.handle("o", "mset", {"items": [dict(item, key="m")]})
    b.owner_gone("o")
    assert b.generation_counter.value == gen + 2


def test_generation_page_through_a_worker(tmp_path):
    import kvstrata
    from kvstrata.server.config import WorkerConfig
    from kvstrata.server.worker import Worker

    w = Worker(WorkerConfig(socket=str(tmp_path / "kv.sock"), memory=16 << 20, disk_dir="")).start()
    try:
        a, b = kvstrata.connect(w.address), kvstrata.connect(w.address)
        _, ob = (c.device_objects(device="cpu", config=CFG) for c in (a, b))
        assert ob._gen is not None and ob._gen.value == w.devobj_broker.generation_counter.value
        src = [torch.randn(16)]
        a.dev_mset(["k"], [src])
        for _ in range(3):
            dst = [torch.zeros(16)]
            b.dev_mget(["k"], [dst], timeout=WAIT)[0].result(WAIT)
            assert torch.equal(dst[0], src[0])
        assert ob.cached_reads == 2
        a.dev_delete(["k"])
        assert ob._gen.value == w.devobj_broker.generation_counter.value
        assert isinstance(b.dev_mget(["k"], [[torch.zeros(16)]], timeout=0)[0].exception(WAIT), errors.Timeout)
        a.close(), b.close()
    finally:
        w.stop()


def test_export_cache_one_export_per_storage_and_never_a_stale_one():
    red = FakeReduce()
    cache = ipc.ExportCache(reduce=red)
    t = torch.arange(64, dtype=torch.float32)
    e1, e2 = cache.export(t), cache.export(t[8:])
    assert red.calls == 1 and e1["handle"] == e2["handle"]
    assert (e2["offset"], e2["size"]) == (8, [56]) and (e1["offset"], e1["size"]) == (0, [64])
    ptr = t.data_ptr()
    del t, e1, e2
    reused = [torch.empty(64, dtype=torch.float32) for _ in range(8)]  # likely one at the freed address
    exports = [cache.export(x) for x in reused]
    assert red.calls == 9 and len({e["handle"] for e in exports}) == 8
    assert ptr  # whether or not an address was reused, no storage got another's export
    reused[0].untyped_storage().resize_(512)  # same storage object, new memory: a new export too
    cache.export(reused[0])
    assert red.calls == 10


def test_import_cache_opens_each_allocation_once_and_views_records(monkeypatch):
    monkeypatch.setattr(ipc, "local_index", lambda uuid: 0)
    backing = {b"H": torch.arange(64, dtype=torch.uint8)}
    opened = []

    def open_storage(blob, device):
        opened.append((blob["handle"], blob["storage_bytes"]))
        return backing[blob["handle"]][: blob["storage_bytes"]]

    cache = ipc.ImportCache(open_storage=open_storage)

    def rec(obj, offset, n, dtype="int32", storage_bytes=64):
        blob = {"handle": b"H", "storage_offset": 0, "storage_bytes": storage_bytes, "offset": offset, "size": [n]}
        sp = {"shape": [n], "dtype": dtype, "nbytes": n * 4}
        return {"obj": obj, "key": f"k{obj}", "device": {"uuid": "u"}, "handles": [blob], "tensors": [sp]}

    (v1,) = cache.tensors("p", rec(1, 2, 4))
    (v2,) = cache.tensors("p", rec(2, 0, 3))
    (again,) = cache.tensors("p", rec(6, 2, 4))  # the same buffer published again: the same view, made once
    assert len(opened) == 1 and again is v1
    assert torch.equal(v1, backing[b"H"][8:24].view(torch.int32)) and torch.equal(
        v2, backing[b"H"][:12].view(torch.int32)
    )
    cache.tensors("p", rec(3, 0, 2, storage_bytes=32))  # same handle and offset, another block size: reopened
    assert len(opened) == 2
    cache.drop_handles("p", rec(3, 0, 2)["handles"], obj=3)
    cache.tensors("p", rec(4, 0, 2))
    assert len(opened) == 3
    with pytest.raises(ValueError, match="outside"):
        cache.tensors("p", rec(5, 15, 2))


def test_wait_event_sleeps_most_of_the_expected_time_then_polls_finely():
    from kvstrata.devobj.debug import MAX_POLL_SLEEP, wait_event

    now = [0.0]
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        now[0] += s

    class Ev:
        def query(self):
            return now[0] >= 0.01

    wait_event(Ev(), 1.0, "copy", expected=0.009, clock=lambda: now[0], sleep=sleep)
    assert sleeps[0] == pytest.approx(0.0081) and max(sleeps[1:]) <= MAX_POLL_SLEEP
    assert now[0] < 0.01 + 2 * MAX_POLL_SLEEP


def test_concurrent_cached_reads_stay_exact(make):
    a = make()
    readers = [make() for _ in range(3)]
    src = [[torch.randn(32)] for _ in range(8)]
    keys = [f"k{i}" for i in range(8)]
    a.dev_mset(keys, src)
    bad = []

    def run(c):
        for _ in range(20):
            dst = [[torch.zeros(32)] for _ in keys]
            for f in c.dev_mget(keys, dst, timeout=WAIT):
                f.result(WAIT)
            bad.extend(k for k, d, s in zip(keys, dst, src) if not torch.equal(d[0], s[0]))

    ts = [threading.Thread(target=run, args=(c,)) for c in readers]
    for t in ts:
        t.start()
    for t in ts:
        t.join(WAIT * 3)
    assert not bad and all(c.cached_reads > 0 for c in readers)


def test_copy_rates_guess_nothing_until_seen_then_the_fastest_with_margin():
    from kvstrata.devobj.debug import CopyRates

    rates = CopyRates(margin=0.8)
    path = (("gpu-a",), 1)
    assert rates.expected(path, 1 << 30) == 0.0  # unknown path: poll only, never oversleep
    rates.observe(path, 1 << 30, 0.004)
    rates.observe(path, 1 << 30, 0.002)  # the fastest seen wins
    rates.observe(path, 1 << 30, 0.003)
    assert rates.expected(path, 1 << 30) == pytest.approx(0.0016)
    rates.observe(path, 4096, 1e-9)  # a small copy measures latency, not the link: ignored
    assert rates.expected(path, 1 << 30) == pytest.approx(0.0016)
    assert rates.expected((("gpu-b",), 1), 1 << 30) == 0.0

"""The 4 KiB hand-off's fast paths: cached per-view exports, shared record parts, polling futures, small pulls."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, TimeoutError

import pytest
import torch

from kv_helpers import FakeReduce
from kvstrata.devobj import (
    DeviceBroker,
    DeviceObjectConfig,
    DeviceObjects,
    InprocBrokerLink,
    futures,
    ipc,
    publish,
    receive,
)

CFG = DeviceObjectConfig(allow_cpu=True)
WAIT = 10.0


def test_export_cache_returns_one_dict_per_view_and_a_new_one_for_new_geometry():
    red = FakeReduce()
    cache = ipc.ExportCache(reduce=red)
    t = torch.arange(64, dtype=torch.float32)
    a, b = cache.export(t), cache.export(t)
    assert a is b and red.calls == 1  # the same view again: the same dict, nothing rebuilt
    v = t.view(8, 8)[2:]
    c, d = cache.export(v), cache.export(t.view(8, 8)[2:])  # another tensor object, same view geometry
    assert c is d and c is not a and red.calls == 1
    assert (c["size"], c["stride"], c["offset"]) == ([6, 8], [8, 1], 16) and c["handle"] == a["handle"]
    assert (a["size"], a["stride"], a["offset"]) == ([64], [1], 0)
    t.untyped_storage().resize_(512)  # same storage object, new memory: a new export, no cached view of the old
    e = cache.export(t[:64])
    assert red.calls == 2 and e["handle"] != a["handle"] and e["size"] == [64]


def test_export_cache_bounds_the_views_of_one_storage():
    cache = ipc.ExportCache(reduce=FakeReduce())
    t = torch.zeros(4 * ipc.MAX_VIEWS, dtype=torch.uint8)
    blobs = [cache.export(t[i:]) for i in range(2 * ipc.MAX_VIEWS)]
    assert [b["offset"] for b in blobs] == list(range(2 * ipc.MAX_VIEWS))
    assert len(cache._entries[t.untyped_storage()._cdata][4]) <= ipc.MAX_VIEWS


def test_published_records_share_parts_and_stay_exact(monkeypatch):
    """Items of a re-published tensor share their specs, exports and device dicts; the broker and the reader
    never change them (a second hand-off of the same buffer reads the right bytes)."""
    cache = ipc.ExportCache(reduce=FakeReduce())
    monkeypatch.setattr(publish, "export_tensor", cache.export)
    broker = DeviceBroker()
    a = DeviceObjects(InprocBrokerLink(broker), device="cpu", config=CFG)
    b = DeviceObjects(InprocBrokerLink(broker), device="cpu", config=CFG)
    try:
        src = torch.arange(1024, dtype=torch.int32)
        ready = (publish._SharedEvent(None), [])
        (i1, o1), (i2, o2) = a._export("x", [src], "publish", ready), a._export("y", [src], "publish", ready)
        assert i1["tensors"] is i2["tensors"] and i1["handles"][0] is i2["handles"][0] and i1["device"] is i2["device"]
        assert i1["local"] != i2["local"] and i1["pid"] == i2["pid"]
        frozen = repr((i1["tensors"], i1["handles"], i1["device"]))
        for o in (o1, o2):
            a._free(o)
        for k in range(3):
            dst = torch.full((1024,), -1, dtype=torch.int32)
            fut = b.dev_subscribe([f"k{k}"], [[dst]], timeout=WAIT)[0]
            pub = a.dev_publish([f"k{k}"], [[src]])[0]
            fut.result(WAIT)
            pub.result(WAIT)
            assert torch.equal(dst, src)
        assert repr((i1["tensors"], i1["handles"], i1["device"])) == frozen
        assert a._device_info() is not a._device_record() and a._device_info() == a._device_record()
    finally:
        a.close()
        b.close()


@pytest.fixture(params=[0.0, 2e-3], ids=["no-spin", "spin"])
def spin(request):
    old = futures.set_result_spin(request.param)
    yield request.param
    futures.set_result_spin(old)


def _later(delay, fn, *args):
    t = threading.Timer(delay, fn, args)
    t.start()
    return t


def _once_inside(fut, fn, *args) -> threading.Thread:
    """``fn(*args)`` on another thread once a thread waits in ``fut.result()`` (not after a fixed delay, which a
    loaded machine can make too short)."""

    def run():
        deadline = time.monotonic() + WAIT
        while not fut._inside and time.monotonic() < deadline:
            time.sleep(0.0005)
        fn(*args)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_spin_future_result_exception_and_callbacks(spin):
    f = futures.SpinFuture()
    seen = []
    f.add_done_callback(lambda x: seen.append(x.result()))
    assert f.set_running_or_notify_cancel()
    _later(0.005, f.set_result, 42).join()
    assert f.result(WAIT) == 42 and f.exception(WAIT) is None and seen == [42]
    g = futures.SpinFuture()
    _later(0.005, g.set_exception, KeyError("gone"))
    with pytest.raises(KeyError):
        g.result(WAIT)
    assert isinstance(g.exception(0), KeyError)


def test_spin_future_times_out_pending_and_running(spin):
    for running in (False, True):
        f = futures.SpinFuture()
        if running:
            f.set_running_or_notify_cancel()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            f.result(0.05)
        with pytest.raises(TimeoutError):
            f.exception(0.0)
        assert 0.04 <= time.monotonic() - t0 < 2.0
        f.set_result(None)  # still settles normally after a waiter gave up
        assert f.result(0) is None


def test_spin_future_cancel_wakes_a_waiter(spin):
    f = futures.SpinFuture()
    _later(0.01, f.cancel)
    with pytest.raises(CancelledError):
        f.result(WAIT)
    assert f.cancelled()


def test_spin_future_waiter_wakes_at_running_then_polls(monkeypatch):
    """A waiter asleep on a pending future is woken when it starts running (the match), then polls until done."""
    old = futures.set_result_spin(0.02)  # per phase: the first ends while the future is still pending
    try:
        f = futures.SpinFuture()
        polls = []
        real = futures._pause
        monkeypatch.setattr(futures, "_pause", lambda: (polls.append(f.running()), real()))
        out = []
        waiter = threading.Thread(target=lambda: out.append(f.result(WAIT)))
        waiter.start()
        deadline = time.monotonic() + WAIT  # its first polling phase (20 ms) ends, then it sleeps
        while f._watchers != 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not out and f._watchers == 1  # asleep until the future runs
        n_before = len(polls)
        assert f.set_running_or_notify_cancel()
        deadline = time.monotonic() + WAIT
        while len(polls) == n_before and time.monotonic() < deadline:
            time.sleep(0.001)
        assert any(polls[n_before:])  # it woke at the match and polls a running future
        f.set_result("done")
        waiter.join(WAIT)
        assert out == ["done"] and f._watchers == 0
    finally:
        futures.set_result_spin(old)


def test_spin_restores_the_thread_timer_slack():
    if futures._PRCTL is None:
        pytest.skip("no prctl here")
    before = futures._PRCTL(futures._PR_GET_TIMERSLACK, 0, 0, 0, 0)
    f = futures.SpinFuture()
    assert not f._spin(time.monotonic(), 0.002, None)  # polled the whole budget, not done
    assert futures._PRCTL(futures._PR_GET_TIMERSLACK, 0, 0, 0, 0) == before
    f.set_result(1)
    assert f._spin(time.monotonic(), 0.002, None)


def test_handoff_waits_for_the_waiter_to_come_out(spin):
    if not spin:  # not polling: a plain future's wait, nothing to hand over
        f = futures.SpinFuture()
        _later(0.01, f.set_result, 1)
        assert f.result(WAIT) == 1 and f._inside == 0 and f._out is None and f.handoff(0.0)
        return
    f = futures.SpinFuture()
    assert f.handoff(0.0)  # nobody waits: at once
    out = []
    waiter = threading.Thread(target=lambda: out.append(f.result(WAIT)))
    waiter.start()
    deadline = time.monotonic() + WAIT
    while not f._inside and time.monotonic() < deadline:
        time.sleep(0.001)
    f.set_result(5)
    assert f.handoff(WAIT) and out == [5]  # the waiter came out before handoff returned
    waiter.join(WAIT)
    g = futures.SpinFuture()
    timed_out = []

    def stuck_wait():
        try:
            g.exception(1.5)  # a waiter that does not come out in time (still inside when handoff looks, loaded or not)
        except TimeoutError:
            timed_out.append(True)

    stuck = threading.Thread(target=stuck_wait)
    stuck.start()
    while not g._inside and time.monotonic() < deadline:
        time.sleep(0.001)
    t0 = time.monotonic()
    assert not g.handoff(0.01)  # bounded: gives up after its timeout
    assert time.monotonic() - t0 < 1.0  # not after the waiter's 1.5 s
    stuck.join(WAIT)
    assert timed_out == [True] and g._inside == 0


def test_result_spin_settings(monkeypatch):
    monkeypatch.setenv("KVSTRATA_DEVOBJ_RESULT_SPIN_US", "150")
    assert futures.result_spin_seconds() == pytest.approx(150e-6)
    monkeypatch.setenv("KVSTRATA_DEVOBJ_RESULT_SPIN_US", "bogus")
    monkeypatch.setattr(futures.os, "sched_getaffinity", lambda pid: set(range(2)))
    assert futures.result_spin_seconds() == 0.0  # a small host never polls
    monkeypatch.setattr(futures.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert futures.result_spin_seconds() == pytest.approx(futures.RESULT_SPIN_US * 1e-6)
    with pytest.raises(ValueError, match="seconds"):
        futures.set_result_spin(-1)


def test_receive_futures_spin_and_deliver(spin):
    broker = DeviceBroker()
    a = DeviceObjects(InprocBrokerLink(broker), device="cpu", config=CFG)
    b = DeviceObjects(InprocBrokerLink(broker), device="cpu", config=CFG)
    try:
        src = torch.arange(4096, dtype=torch.uint8)
        dst = torch.zeros(4096, dtype=torch.uint8)
        fut = b.dev_subscribe(["lat"], [[dst]], timeout=WAIT)[0]
        assert isinstance(fut, futures.SpinFuture)
        _later(0.01, a.dev_publish, ["lat"], [[src]])
        assert fut.result(WAIT) is None and torch.equal(dst, src)
        late = b.dev_subscribe(["never"], [[dst]], timeout=0.05)[0]
        assert type(late.exception(WAIT)).__name__ == "Timeout"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("event_spin_us", ["", "2000"])
def test_hand_offs_through_a_worker_with_polling_waiters(tmp_path, monkeypatch, event_spin_us):
    """Through a worker (two connections per client), with receive futures polling and the hand-off on: the
    event thread hands the GIL to each woken receiver right after sending its next poll, and every byte lands."""
    from kvstrata.devobj.service import WorkerBrokerLink
    from kvstrata.server.config import WorkerConfig
    from kvstrata.server.worker import Worker

    monkeypatch.setenv("KVSTRATA_DEVOBJ_EVENT_SPIN_US", event_spin_us)
    monkeypatch.setenv("KVSTRATA_DEVOBJ_LEAD", "0")  # the event thread settles every receive (no leading waiter)
    old = futures.set_result_spin(2e-3)
    w = Worker(WorkerConfig(socket=str(tmp_path / "kv.sock"), memory=16 << 20, disk_dir="")).start()
    made = []
    try:
        for _ in range(2):
            link = WorkerBrokerLink(w.address)
            made.append((DeviceObjects(link, device="cpu", config=CFG), link))
        (a, _), (b, blink) = made
        assert blink.on_poll_sent == b._poll_sent
        handed = []
        real = b._poll_sent
        monkeypatch.setattr(b, "_poll_sent", lambda: (handed.append(len(b._handoffs)), real()))
        blink.on_poll_sent = b._poll_sent
        for i in range(20):
            src = torch.full((1024,), i, dtype=torch.int32)
            dst = torch.full((1024,), -1, dtype=torch.int32)
            fut = b.dev_subscribe([f"k{i}"], [[dst]], timeout=WAIT)[0]
            # Published from another thread once this one waits in result(): a hand-off is for a waiter inside it.
            # (Published from here, on a busy 2-core machine the event thread could settle all 20 receives before
            # this thread got back to result(), and none was handed off; 5 ms later, the same when this thread
            # was later than that every time.)
            pubs: list = []
            publisher = _once_inside(fut, lambda k, t, out: out.extend(a.dev_publish([k], [[t]])), f"k{i}", src, pubs)
            assert fut.result(WAIT) is None and torch.equal(dst, src)
            publisher.join(WAIT)
            pubs[0].result(WAIT)  # the completion reached the broker: the publisher's tensors were released
        deadline = time.monotonic() + WAIT
        while b._handoffs and time.monotonic() < deadline:  # the last ones go with the poll after the last receive
            time.sleep(0.001)
        assert any(handed) and not b._handoffs
    finally:
        futures.set_result_spin(old)
        for c, link in made:
            c.close()
            link.close()
        w.stop()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "devices", [pytest.param((0, 0), id="gpu0"), pytest.param((0, 1), id="gpu0-gpu1", marks=pytest.mark.multigpu)]
)
@pytest.mark.parametrize("nbytes", [4096, receive.PULL_MAX_BYTES, receive.PULL_MAX_BYTES + 4096])
def test_small_receives_pulled_after_the_callers_work_exact(devices, nbytes):
    """Batches up to PULL_MAX_BYTES are pulled on the receiver's own stream, larger ones pushed by the source's
    GPU: both exact, after the work queued on the caller's stream at the call, nothing outside the buffers touched."""
    if torch.cuda.device_count() <= max(devices):
        pytest.skip(f"needs {max(devices) + 1} GPUs")
    broker = DeviceBroker()
    a = DeviceObjects(InprocBrokerLink(broker), device=devices[0])
    b = DeviceObjects(InprocBrokerLink(broker), device=devices[1])
    try:
        g = torch.Generator().manual_seed(nbytes)
        src = [
            torch.randint(0, 255, (nbytes - 41,), generator=g, dtype=torch.uint8).to(devices[0]),
            torch.randint(-128, 127, (41,), generator=g, dtype=torch.int8).to(devices[0]),
        ]
        before = [x.cpu() for x in src]
        whole = torch.full((nbytes + 128,), 7, dtype=torch.uint8, device=devices[1])  # 64 guard bytes each side
        dst = [whole[64 : 64 + nbytes - 41], whole[64 + nbytes - 41 : 64 + nbytes].view(torch.int8)]
        s = torch.cuda.Stream(devices[1])
        with torch.cuda.device(devices[1]), torch.cuda.stream(s):
            torch.cuda._sleep(50_000_000)  # the caller's stream is busy, then writes the buffers itself
            whole[64 : 64 + nbytes].fill_(9)
            (fut,) = b.dev_subscribe(["k"], [dst], timeout=WAIT)
        (pub,) = a.dev_publish(["k"], [src])
        fut.result(WAIT)
        pub.result(WAIT)
        torch.cuda.synchronize(devices[1])
        assert all(torch.equal(d.cpu(), x) for d, x in zip(dst, before)), "copied before the caller's work or wrong"
        assert bool((whole[:64] == 7).all()) and bool((whole[64 + nbytes :] == 7).all()), "guard bytes touched"
        assert all(torch.equal(x.cpu(), y) for x, y in zip(src, before)), "source changed"
    finally:
        a.close()
        b.close()

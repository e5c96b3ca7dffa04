"""The Client API, run twice: on an embedded store and against a worker over a Unix socket."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest
import torch

import kvstrata
from kv_helpers import client_for, held_back, wait_until, worker_fixtures
from kvstrata.errors import (
    CapacityError,
    ClosedError,
    ConnectionLost,
    InvalidType,
    InvalidValue,
    KeyExists,
    KeyNotFound,
    KvstrataError,
    ServerError,
    Timeout,
)
from kvstrata.server import Worker, WorkerConfig
from kvstrata.server.protocol import INLINE_MAX

MEMORY = 32 << 20


worker, kv = worker_fixtures("worker", memory=MEMORY, segment=8 << 20)


def _stats(kv):
    return kv.stats()


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"x",
        bytearray(b"abc"),
        memoryview(b"0123456789")[2:8],
        np.arange(1000, dtype=np.float32),
        np.zeros((0, 3)),
        torch.arange(77, dtype=torch.bfloat16),
        torch.tensor(3.5),
        bytes(range(256)) * (INLINE_MAX // 256 + 3),  # over the inline limit: through shared memory
        np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8),
    ],
    ids=["empty", "one", "bytearray", "memoryview", "numpy", "numpy-empty", "bf16", "scalar", "over-inline", "3MiB"],
)
def test_set_get_roundtrip(kv, value):
    expected = (
        value.numpy().tobytes()
        if isinstance(value, torch.Tensor) and value.dtype != torch.bfloat16
        else value.view(torch.int16).numpy().tobytes()
        if isinstance(value, torch.Tensor)
        else bytes(value)
        if not isinstance(value, np.ndarray)
        else value.tobytes()
    )
    kv.set("k0", value)
    assert kv.get("k0") == expected
    assert kv.size("k0") == len(expected)
    assert kv.mget(["k0"]) == [expected]


def test_replace_and_nx(kv):
    kv.set("k1", b"first")
    kv.set("k1", b"second")
    assert kv.get("k1") == b"second"
    with pytest.raises(KeyExists):
        kv.set("k1", b"third", nx=True)
    assert kv.get("k1") == b"second"
    big = b"B" * (INLINE_MAX * 2)
    kv.set("k1", big)
    with pytest.raises(KeyExists):
        kv.set("k1", big, nx=True)
    assert kv.get("k1") == big


def test_missing_keys_and_batches(kv):
    kv.delete(["k2", "k3"])
    with pytest.raises(KeyNotFound):
        kv.get("k2")
    results = kv.mset({"k2": b"two", "k3": b"3" * (INLINE_MAX + 1)})
    assert results == [None, None]
    got = kv.mget(["k2", "missing-key", "k3"])
    assert got[0] == b"two" and isinstance(got[1], KeyNotFound) and got[2] == b"3" * (INLINE_MAX + 1)
    assert kv.exists(["k2", "missing-key"]) == [True, False]
    assert kv.exists("k2") is True
    assert kv.size(["k2", "missing-key"]) == [3, None]
    assert kv.delete(["k2", "missing-key"]) == [True, False]
    assert kv.exists("k2") is False
    res = kv.mset([("k4", b"a"), ("k4", b"b")], nx=True)  # the second write of one key in a batch is refused
    assert res[0] is None and isinstance(res[1], KeyExists)


def test_exists_100k_keys(kv):
    kv.set("k5", b"v")
    keys = [f"nope-{i}" for i in range(99_999)] + ["k5"]
    t0 = time.perf_counter()
    res = kv.exists(keys)
    assert len(res) == 100_000 and res[-1] is True and not any(res[:-1])
    assert time.perf_counter() - t0 < 10
    with pytest.raises(ValueError, match="100000"):
        kv.exists([*keys, "one-more"])


def test_partial_read(kv):
    data = bytes(range(256)) * 1000
    kv.set("k6", data)
    assert kv.read("k6", 1000, 500) == data[1000:1500]
    assert kv.read("k6", len(data) - 1, 1) == data[-1:]
    with pytest.raises(ValueError):
        kv.read("k6", len(data) - 10, 11)


def test_get_waits_for_a_late_key(kv):
    kv.delete("late")
    timer = threading.Timer(0.3, lambda: writer.set("late", b"arrived"))
    writer = kv if kv.embedded else kvstrata.connect(kv.address)
    t0 = time.monotonic()
    timer.start()
    try:
        assert kv.get("late", timeout=5) == b"arrived"
        assert 0.25 < time.monotonic() - t0 < 4
    finally:
        timer.join()
        if writer is not kv:
            writer.close()
    t0 = time.monotonic()
    with pytest.raises(Timeout):
        kv.get("never-there", timeout=0.3)
    assert 0.28 < time.monotonic() - t0 < 3
    with pytest.raises(KeyNotFound):
        kv.get("never-there")


def test_ttl_and_expire(kv):
    kv.set("ttl", b"short", ttl=1.0)  # (a second: the get must come before it on a loaded machine too)
    assert kv.get("ttl") == b"short"
    time.sleep(1.3)
    assert kv.exists("ttl") is False
    kv.set("ttl", b"again")
    assert kv.expire(["ttl", "missing-key"], 0.2) == [True, False]
    time.sleep(0.5)
    assert kv.exists("ttl") is False


def test_create_seal_publish_abort(kv):
    arr = np.arange(4096, dtype=np.float32)
    with kv.create("obj", arr.nbytes) as buf:
        assert not kv.exists("obj")  # not visible before seal
        buf.numpy(np.float32)[:] = arr
    assert kv.get("obj") == arr.tobytes()
    with pytest.raises(RuntimeError), kv.create("obj", 8) as buf:
        buf.write(b"partial!")
        raise RuntimeError("writer failed")
    assert kv.get("obj") == arr.tobytes()  # the aborted write left the old version
    buf = kv.create("obj", 4)
    buf.tensor()[:] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    buf.publish()
    assert kv.get("obj") == bytes([1, 2, 3, 4])
    with pytest.raises(ClosedError):
        buf.memoryview()
    with kv.create("empty", 0):
        pass
    assert kv.get("empty") == b""


def test_a_second_create_of_a_key_waits_for_the_first_buffer(kv):
    """A create of a key while this client's earlier buffer for it is open is refused (KeyExists): replacing it would
    free memory that buffer still writes into (another object's, later)."""
    first = kv.create("twice", 4096)
    first.write(b"a" * 4096)
    with pytest.raises(KeyExists, match="still open"):
        kv.create("twice", 4096)
    got = kv.mset({"twice": b"b" * (INLINE_MAX + 1), "other": b"c" * (INLINE_MAX + 1)})
    # Through a worker a large value is created in shared memory (refused here); embedded it is put, which frees no
    # open create (the first buffer's seal, later, wins).
    assert (got[0] is None or isinstance(got[0], KeyExists)) and got[1] is None
    kv.set("victim", b"v" * 4096)
    first.write(b"A" * 4096)  # still its own bytes
    first.seal()
    assert kv.get("twice") == b"A" * 4096 and kv.get("victim") == b"v" * 4096
    with kv.create("twice", 3) as again:  # sealed: the key can be created again
        again.write(b"xyz")
    assert kv.get("twice") == b"xyz"
    dropped = kv.create("gone", 8)
    del dropped  # dropped unsealed: aborted on the next call, after which the key is free
    gc.collect()
    with kv.create("gone", 2) as buf:
        buf.write(b"ok")
    assert kv.get("gone") == b"ok"
    kv.delete(["twice", "victim", "other", "gone"])


def test_zero_copy_buffers_hold_leases(kv):
    arr = np.random.default_rng(1).random(100_000)
    kv.set("arr", arr)
    before = _stats(kv)["leases"]
    bufs = kv.get_buffers(["arr", "missing-key"])
    assert isinstance(bufs[1], KeyNotFound)
    view = bufs[0]
    np.testing.assert_array_equal(view.numpy(np.float64), arr)
    assert torch.equal(view.tensor(torch.float64), torch.from_numpy(arr))
    assert not view.numpy().flags.writeable
    assert _stats(kv)["leases"] == before + 1
    kv.delete("arr")  # the reader keeps its bytes until it releases them
    np.testing.assert_array_equal(view.numpy(np.float64), arr)
    view.release()
    view.release()
    with pytest.raises(ClosedError):
        view.numpy()
    kv.set("arr", b"z" * 100)
    with kv.get_buffers("arr")[0] as b:
        assert bytes(b) == b"z" * 100
    kv.get_buffers("arr")  # dropped at once: the lease goes with garbage collection
    gc.collect()
    kv.exists("arr")  # a remote client hands deferred releases over on its next request
    # What is left is the local-read cache's own lease on "arr" (remote clients): it lets later views skip the worker
    cached = len(getattr(kv._backend, "_local", None) or ())
    assert cached <= 1
    assert _stats(kv)["leases"] == before + cached
    kv.delete("arr")
    kv.exists("arr")  # the change makes the cache give its lease back with this request
    assert _stats(kv)["leases"] == before


def test_refcounts(kv):
    kv.set("k7", b"counted")
    assert kv.incref("k7") == 1
    assert kv.incref(["k7"]) == [2]
    assert kv.refcount("k7") == 2
    assert kv.decref("k7") == 1
    assert kv.exists("k7")
    assert kv.decref("k7") == 0
    assert not kv.exists("k7")


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool]


def test_mset_d2h_mget_h2d_cpu(kv):
    g = torch.Generator().manual_seed(0)
    kv.delete(["d0", "d1", "d2"])
    lists = [
        [
            torch.randint(0, 2, (3, 5), generator=g).to(dt)
            if dt == torch.bool
            else (torch.randn(7, 3, generator=g) * 50).to(dt)
            for dt in DTYPES
        ],
        [torch.randn(257, generator=g)],
        [torch.empty(0)],
    ]
    assert kv.mset_d2h(["d0", "d1", "d2"], lists) == [None, None, None]
    again = kv.mset_d2h(["d1", "k-new-x"], [[torch.zeros(257)], [torch.ones(2)]])
    assert isinstance(again[0], KeyExists) and again[1] is None  # write-once: d1 untouched
    kv.delete("k-new-x")
    out = [[torch.full_like(t, 0) for t in ts] for ts in lists]
    res = kv.mget_h2d(["d0", "d1", "d2"], out)
    assert res == [None, None, None]
    for src, dst in zip(lists, out):
        for a, b in zip(src, dst):
            assert torch.equal(a, b)
    bad = kv.mget_h2d(["d1", "missing-key"], [[torch.empty(256)], [torch.empty(1)]])
    assert isinstance(bad[0], ValueError) and isinstance(bad[1], KeyNotFound)
    fut = kv.async_mget_h2d(["d1"], [[torch.empty(257)]])
    assert fut.result(timeout=10) == [None]
    fut = kv.async_mset_d2h(["d1"], [[torch.empty(1)]])
    assert isinstance(fut.result(timeout=10)[0], KeyExists)
    kv.delete(["d0", "d1", "d2"])  # their keys changed: leases the local-read cache kept go back with the next request
    assert _stats(kv)["leases"] == 0


def test_async_mget_h2d_calls_in_flight_fill_every_tensor_and_give_their_leases_back(kv):
    # One thread queues each call's copies and a completion thread waits for them: calls overlap.
    g = torch.Generator().manual_seed(3)
    keys = [f"am/{i}" for i in range(16)]
    src = [[torch.randn(1000 + i, generator=g)] for i in range(16)]
    assert kv.mset_d2h(keys, src) == [None] * 16
    dsts = [[[torch.zeros_like(t[0])] for t in src] for _ in range(8)]
    futs = [kv.async_mget_h2d(keys[c:] + keys[:c], d[c:] + d[:c]) for c, d in enumerate(dsts)]
    for c, fut in enumerate(futs):
        assert fut.result(timeout=30) == [None] * 16, c
    assert all(torch.equal(a[0], b[0]) for d in dsts for a, b in zip(src, d))
    # A call refused whole (a tensor list too short) fails its Future alone; the next call is served.
    bad = kv.async_mget_h2d(keys, dsts[0][:3])
    with pytest.raises(ValueError, match="tensor_lists"):
        bad.result(timeout=30)
    part = kv.async_mget_h2d([keys[0], "am/missing"], [dsts[1][0], [torch.empty(1)]])
    got = part.result(timeout=30)
    assert got[0] is None and isinstance(got[1], KeyNotFound)
    kv.delete(keys)
    assert _stats(kv)["leases"] == 0


def test_async_mget_h2d_settles_its_future_when_giving_the_leases_back_fails(kv, monkeypatch):
    # The connection lost between the copies and the release: the Future fails as mget_h2d would raise, never hangs.
    keys = [f"ar/{i}" for i in range(4)]
    assert kv.mset_d2h(keys, [[torch.ones(8)] for _ in keys]) == [None] * 4
    kv.delete(keys)  # no local-read entry keeps a lease: the call's leases all go back at its end
    assert kv.mset_d2h(keys, [[torch.ones(8)] for _ in keys]) == [None] * 4

    def lost(ids):
        raise ConnectionLost("lost connection to the worker while sending")

    monkeypatch.setattr(kv, "_release_leases", lost)
    fut = kv.async_mget_h2d(keys, [[torch.zeros(8)] for _ in keys])
    with pytest.raises(ConnectionLost):
        fut.result(timeout=30)
    monkeypatch.undo()
    assert kv.async_mget_h2d(keys, [[torch.zeros(8)] for _ in keys]).result(timeout=30) == [None] * 4
    kv.delete(keys)


@pytest.mark.parametrize("mode", ["embedded", "unix"])
def test_async_mget_h2d_waiting_calls_can_be_cancelled_and_close_settles_every_call(mode, worker):
    kv = client_for(mode, worker, memory=MEMORY, segment=8 << 20)
    # A worker client's waiting get holds its connection: the key comes from another client there.
    writer = kv if mode == "embedded" else kvstrata.connect(worker.address, timeout=5)
    try:
        out = [[torch.zeros(64)] for _ in range(3)]
        # The first call waits for a key not written yet, holding up the calls after it: a queued one can be cancelled.
        waiting = [kv.async_mget_h2d(["ac/late"], [out[i]], timeout=20) for i in range(2)]
        queued = kv.async_mget_h2d(["ac/late"], [out[2]], timeout=20)
        assert queued.cancel()
        time.sleep(0.05)
        assert writer.mset_d2h(["ac/late"], [[torch.arange(64.0)]]) == [None]
        assert [f.result(timeout=30) for f in waiting] == [[None], [None]]
        assert torch.equal(out[0][0], torch.arange(64.0)) and torch.equal(out[1][0], torch.arange(64.0))
        assert queued.cancelled() and not out[2][0].any()
        more = [kv.async_mget_h2d(["ac/late"], [[torch.zeros(64)]]) for _ in range(6)]
    finally:
        kv.close()
        if writer is not kv:
            writer.delete("ac/late")
            writer.close()
    for fut in more:  # served, or refused because the client closed: never left pending
        assert fut.done()
        assert fut.exception() is None or isinstance(fut.exception(), ClosedError)


@pytest.mark.parametrize("mode", ["embedded", "unix"])
def test_async_calls_still_queued_when_close_begins_are_refused_not_left_running(mode, worker, monkeypatch):
    """A queued async call that the issuing thread starts once close() has begun raises ClosedError into its Future.
    (Its check for a worker over TCP, ``_b().shm``, raised that ClosedError outside the Future, on the thread,
    and left the Future running for good.)"""
    kv = client_for(mode, worker, memory=MEMORY, segment=8 << 20)
    assert kv.mset_d2h(["aq/there"], [[torch.ones(8)]]) == [None]
    started, go = held_back(monkeypatch, kv, "_mget_h2d_queue")
    first = kv.async_mget_h2d(["aq/there"], [[torch.zeros(8)]])
    assert started.wait(10)  # the issuing thread is in the first call: the calls below stay queued
    queued = [kv.async_mset_d2h(["aq/new"], [[torch.ones(8)]]), kv.async_mget_h2d(["aq/there"], [[torch.zeros(8)]])]
    closer = threading.Thread(target=kv.close)
    closer.start()
    try:
        assert wait_until(lambda: kv._closed, 10)
    finally:
        go.set()
        closer.join(30)
    assert not closer.is_alive()
    assert first.done() and (first.exception() is None or isinstance(first.exception(), ClosedError))
    for fut in queued:
        assert fut.done(), fut
        assert isinstance(fut.exception(), ClosedError)


@pytest.mark.gpu
def test_mset_d2h_mget_h2d_cuda(kv):
    g = torch.Generator(device="cuda").manual_seed(0)
    keys = [f"cuda-{i}" for i in range(64)]
    kv.delete(keys)
    src = [[torch.randn(1 << 15, device="cuda", generator=g), torch.randn(3, 5, device="cuda").half()] for _ in keys]
    assert kv.mset_d2h(keys, src) == [None] * 64
    dst = [[torch.full_like(t, float("nan")) for t in ts] for ts in src]
    stream = torch.cuda.Stream()
    assert kv.mget_h2d(keys, dst, stream=stream) == [None] * 64
    torch.cuda.synchronize()
    for a, b in zip(src, dst):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    host = kv.get(keys[5])
    assert host == src[5][0].cpu().numpy().tobytes() + src[5][1].cpu().numpy().tobytes()
    dst2 = [[torch.empty_like(t) for t in ts] for ts in src]
    assert kv.async_mget_h2d(keys, dst2).result() == [None] * 64
    assert all(torch.equal(x, y) for a, b in zip(src, dst2) for x, y in zip(a, b))
    kv.delete(keys)


@pytest.mark.gpu
def test_async_mget_h2d_cuda_calls_in_flight_follow_the_callers_stream(kv):
    # Each call's copies wait for the caller's stream as it was at the call (here: a long sleep, then a fill of
    # the destinations that the copies must overwrite); result() waits for the copies on the device.
    g = torch.Generator(device="cuda").manual_seed(1)
    keys = [f"amc/{i}" for i in range(32)]
    kv.delete(keys)
    src = [[torch.randn(1 << 16, device="cuda", generator=g)] for _ in keys]
    assert kv.mset_d2h(keys, src) == [None] * 32
    dsts = [[[torch.empty_like(t[0])] for t in src] for _ in range(6)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        for d in dsts:
            for t in d:
                t[0].fill_(7.0)
        futs = [kv.async_mget_h2d(keys, d) for d in dsts]
    done = threading.Event()
    futs[-1].add_done_callback(lambda f: done.set())
    assert [f.result() for f in futs] == [[None] * 32] * 6
    assert done.wait(10)
    torch.cuda.synchronize()
    assert all(torch.equal(a[0], b[0]) for d in dsts for a, b in zip(src, d))
    kv.delete(keys)
    assert _stats(kv)["leases"] == 0


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda kv: kv.set("", b"v"), ValueError, "key"),
        (lambda kv: kv.set("x" * 1025, b"v"), ValueError, "key"),
        (lambda kv: kv.set(b"bytes-key", b"v"), TypeError, "key"),
        (lambda kv: kv.set("k", "a str"), TypeError, "value"),
        (lambda kv: kv.set("k", 12), TypeError, "value"),
        (lambda kv: kv.set("k", np.arange(10)[::2]), ValueError, "contiguous"),
        (lambda kv: kv.set("k", torch.arange(10)[::2]), ValueError, "contiguous"),
        (lambda kv: kv.set("k", b"v", write_mode="sometimes"), ValueError, "write_mode"),
        (lambda kv: kv.set("k", b"v", ttl=-1), ValueError, "ttl"),
        (lambda kv: kv.get("k", timeout="soon"), TypeError, "timeout"),
        (lambda kv: kv.exists(["ok", 3]), TypeError, r"keys\[1\]"),
        (lambda kv: kv.create("k", -1), ValueError, "size"),
        (lambda kv: kv.mget_h2d(["a", "b"], [[torch.empty(1)]]), ValueError, "tensor_lists"),
        (lambda kv: kv.set("k", b"x" * (MEMORY + 1)), CapacityError, None),
        (lambda kv: kv.create("k", MEMORY * 4), CapacityError, None),
    ],
)
def test_bad_input_raises_clear_errors(kv, call, exc, match):
    with pytest.raises(exc, match=match) as raised:
        call(kv)
    # A kvstrata error either way (through the worker too): a bad argument is also the builtin class it names.
    assert isinstance(raised.value, KvstrataError)
    if exc in (ValueError, TypeError):
        assert isinstance(raised.value, {ValueError: InvalidValue, TypeError: InvalidType}[exc])
    kv.set("k0", b"still serving")
    assert kv.get("k0") == b"still serving"


def test_closed_client(kv):
    kv.close()
    kv.close()
    for call in (lambda: kv.get("k0"), lambda: kv.set("k0", b"v"), lambda: kv.exists(["k0"]), kv.stats):
        with pytest.raises(ClosedError):
            call()


def test_a_disconnected_clients_session_is_freed_by_reference_counting(worker):
    """A worker may go a long time between collections of cycles (few objects outlive a request), so what a client
    held (its session, connection and socket objects, its lane's bookkeeping) must go when it disconnects, not wait
    for one."""
    import weakref

    gc.collect()
    gc.disable()
    try:
        before = set(worker._sessions)  # (another test's client may still be going away)
        with kvstrata.connect(worker.address) as kv:
            kv.set("session-freed", b"v" * 10_000)
            assert kv.get("session-freed") == b"v" * 10_000
            kv.delete("session-freed")
            (session,) = [s for owner, s in worker._sessions.items() if owner not in before]
            refs = [weakref.ref(session), weakref.ref(session.conn)]
            del session
        deadline = time.monotonic() + 10
        while any(r() is not None for r in refs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


def test_generate_key(kv):
    keys = {kv.generate_key("sess/") for _ in range(1000)}
    assert len(keys) == 1000 and all(k.startswith("sess/") for k in keys)


def test_unknown_op_is_refused_and_connection_survives(worker):
    with kvstrata.connect(worker.address) as kv:
        with pytest.raises(ServerError, match="unknown request"):
            kv._backend.request({"op": "format-disk"})
        with pytest.raises((ValueError, TypeError)):
            kv._backend.request({"op": "get", "key": 42})
        kv.set("k0", b"fine")
        assert kv.get("k0") == b"fine"


def test_more_new_segments_than_one_message_can_carry(tmp_path):
    config = WorkerConfig.load(
        {
            "socket": str(tmp_path / "s.sock"),
            "memory": "192MiB",
            "segment_size": "2MiB",
            "disk_dir": "",
            "numa_node": "none",
        },
        environ={},
    )
    with Worker(config).start() as w, kvstrata.connect(w.address) as reader, kvstrata.connect(w.address) as writer:
        values = {f"seg-{i}": bytes([i]) * (1536 << 10) for i in range(70)}  # one per 2 MiB segment
        assert writer.mset(values) == [None] * 70
        assert len(w.store.segments) >= 70
        assert reader.mget(list(values)) == list(values.values())


def test_dropped_unsealed_buffer_is_aborted(kv):
    kv.delete("k-drop")
    kv.create("k-drop", 1000).write(b"half")  # dropped without seal: never becomes visible
    gc.collect()
    assert kv.exists("k-drop") is False
    assert _stats(kv)["creates_in_progress"] == 0
    kv.set("k-drop", b"fresh", nx=True)
    assert kv.get("k-drop") == b"fresh"


def test_tcp_clients_get_everything_inline():
    config = WorkerConfig.load({"socket": "tcp://127.0.0.1:0", "memory": "16MiB", "disk_dir": ""}, environ={})
    with Worker(config).start() as w, kvstrata.connect(w.address) as kv:
        assert w.address.startswith("tcp://127.0.0.1:") and not w.address.endswith(":0")
        big = os.urandom(3 << 20)
        kv.set("over-tcp", big)
        assert kv.get("over-tcp") == big and kv.mget(["over-tcp"]) == [big]
        # views of the values as the reply brought them (no lease, no copy after the socket's read)
        buffers = kv.get_buffers(["over-tcp", "absent", "over-tcp"])
        assert bytes(buffers[0]) == big and isinstance(buffers[1], KeyNotFound) and buffers[2].lease_id is None
        assert buffers[0].memoryview().readonly and buffers[0].numpy()[:4].tobytes() == big[:4]
        assert buffers[2].tensor().numel() == len(big)
        with buffers[0]:
            pass
        assert buffers[0].released and _stats(kv)["leases"] == 0
        with pytest.raises(ClosedError, match="released"):
            buffers[0].memoryview()
        assert kv.get_buffers([]) == []


def test_a_hung_worker_is_reported_not_waited_on_forever(tmp_path):
    from kvstrata.transport import listen

    def mute(conn):  # handshakes, then never answers
        try:
            conn.recv()
            conn.recv()
        except Exception:
            pass

    lst = listen(f"unix://{tmp_path}/mute.sock", mute)
    try:
        kv = kvstrata.connect(lst.address)
        kv._backend.request_timeout = 0.3
        t0 = time.monotonic()
        with pytest.raises(kvstrata.ConnectionLost, match="did not answer"):
            kv.get("k", timeout=0.2)
        assert 0.45 < time.monotonic() - t0 < 3
        with pytest.raises(kvstrata.TransportError):
            kv.exists("k")
        kv.close()
    finally:
        lst.stop()


def test_mset_error_in_one_large_value_leaves_no_open_create(kv, monkeypatch):
    """A key whose bytes fail to land (any exception) reports it in its slot; the batch's other keys
    are sealed, and no create stays open (the failed key can be written again at once)."""
    big = 1 << 20
    backend = kv._b()
    if not backend.shm or big < backend.inline_max:
        pytest.skip("this backend writes every value in one put (no create/seal through shared memory)")
    original = kvstrata.client.Client._write_through_shm

    def flaky(backend, key, loc, view):
        if key == "mset-err/b":
            backend.finish("abort", key)
            raise ValueError("view: simulated copy failure")
        original(backend, key, loc, view)

    monkeypatch.setattr(kvstrata.client.Client, "_write_through_shm", staticmethod(flaky))
    items = {f"mset-err/{k}": bytes([i]) * big for i, k in enumerate("abc")}
    results = kv.mset(items)
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], ValueError)
    assert kv.exists(list(items)) == [True, False, True]
    monkeypatch.undo()
    assert kv.mset({"mset-err/b": b"x" * big}) == [None]
    assert kv.get("mset-err/c") == b"\x02" * big


def test_a_mset_of_many_kib_values_goes_through_shared_memory_and_answers_per_key(kv, monkeypatch):
    """Through a worker, a mset of MSET_SHARED_MIN_KEYS or more keys writes its values of 1 KiB or more through shared
    memory (one create and one seal request for them), its smaller ones inline; fewer keys go inline. Either way the
    results are per key (a write-once key already there refused alone) and the values read back."""
    from kvstrata.client import client as client_module

    backend = kv._b()
    calls: list[str] = []
    for name in ("mput", "mcreate", "mseal"):
        real = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    many = client_module.MSET_SHARED_MIN_KEYS
    keys = [f"mset-shm/{i}" for i in range(many)]
    kv.delete([*keys, "mset-shm/few"])
    kv.set(keys[3], b"already here")
    items = {k: bytes([i]) * (1024 + i) for i, k in enumerate(keys)}
    items["mset-shm/tiny"] = b"t"
    results = kv.mset(items, nx=True)
    assert isinstance(results[3], kvstrata.KeyExists) and results.count(None) == len(items) - 1
    shared = backend.shm and backend.shared_batch_bytes <= 1024
    assert calls == (["mput", "mcreate", "mseal"] if shared else ["mput"])
    calls.clear()
    assert kv.mset({"mset-shm/few": b"f" * 4096}) == [None] and calls == ["mput"]  # one key: inline
    for i, k in enumerate(keys):
        assert kv.get(k) == (b"already here" if i == 3 else bytes([i]) * (1024 + i))
    assert kv.get("mset-shm/tiny") == b"t" and kv.get("mset-shm/few") == b"f" * 4096
    kv.delete([*keys, "mset-shm/few", "mset-shm/tiny"])


def test_a_mget_of_many_keys_reads_shared_memory_per_key_and_gives_every_lease_back(kv, monkeypatch):
    """Through a worker, a mget of MSET_SHARED_MIN_KEYS keys or more leases them and copies each value out of
    shared memory: values of every size, a missing key's error in its slot, a key the worker could not lease (on
    SSD alone, the memory all leased) read its old way; no lease is left held."""
    from kvstrata.client import remote

    backend = kv._b()
    keys = [f"mget-shm/{i}" for i in range(remote.MGET_SHARED_MIN_KEYS + 4)]
    values = {k: bytes([i]) * (i * 997 % 40_000) for i, k in enumerate(keys)}  # 0 B up to ~39 KiB
    kv.delete(keys)
    assert kv.mset(values) == [None] * len(keys)
    ask = [*keys[:5], "mget-shm/missing", *keys[5:]]
    got = kv.mget(ask)
    assert isinstance(got[5], kvstrata.KeyNotFound) and got[:5] + got[6:] == [values[k] for k in keys]
    if kv.embedded or not backend.shm:
        return
    before = kv.stats()["leases"]  # the leases the local-read cache kept from the first call
    assert kv.mget(keys) == [values[k] for k in keys]
    assert kv.stats()["leases"] == before  # every other lease the call took went back
    real = backend.acquire

    def acquire(ks, timeout, **kw):  # the worker found no room to lease keys[2] (as for an object on SSD alone)
        out = real(ks, timeout, **kw)
        backend.release([out[2].lease_id])
        out[2] = kvstrata.CapacityError("simulated: no room to bring it back into memory")
        return out

    monkeypatch.setattr(backend, "acquire", acquire)
    assert kv.mget(keys) == [values[k] for k in keys]
    monkeypatch.undo()
    assert kv.stats()["leases"] == before
    few = kv.mget(keys[: remote.MGET_SHARED_MIN_KEYS - 1])  # fewer keys: the worker copies them into its reply
    assert few == [values[k] for k in keys[: remote.MGET_SHARED_MIN_KEYS - 1]]
    kv.delete(keys)


def test_get_with_timeout_none_waits_until_the_key_exists(kv):
    kv.delete("late-none")
    writer = kv if kv.embedded else kvstrata.connect(kv.address)
    timer = threading.Timer(0.3, lambda: writer.set("late-none", b"here"))
    timer.start()
    try:
        assert kv.get("late-none", timeout=None) == b"here"
        assert kv.mget(["late-none"], timeout=None) == [b"here"]
    finally:
        timer.join()
        if writer is not kv:
            writer.close()

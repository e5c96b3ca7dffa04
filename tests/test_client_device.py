"""mget_h2d / mset_d2h: address runs, cached leases, one batched copy, leases held across it, bad input.

CPU tensors exercise the same planning, leases and round trips as CUDA ones (the copy is a memmove);
the ``gpu`` tests check the copy-engine path and the once-per-segment CUDA registration.
"""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

import kvstrata
from _stages import batches_of, copies_pending, outcomes, stages_of, stream_calls
from kv_helpers import worker_fixtures
from kvstrata.client import batching, device, kept_reads
from kvstrata.errors import KeyExists, KeyNotFound, KvstrataError
from kvstrata.ops.copy_engine import CopyEngineError

MEMORY = 64 << 20


worker, kv = worker_fixtures("dev-worker", memory=MEMORY, segment=16 << 20)


def _lists(n, sizes=(1000, 24, 3), seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 255, (s,), generator=g, dtype=torch.uint8).to(device) for s in sizes] for _ in range(n)]


def _poisoned(lists):
    return [[torch.full_like(t, 0xAB) for t in ts] for ts in lists]


# ------------------------------------------------------------------------------------ planning
def test_plan_merges_runs_that_continue_on_both_sides():
    a = torch.zeros(64, dtype=torch.uint8)
    pieces, sizes, dev = device.check_tensor_lists(2, [[a[:16], a[16:40]], [a[40:64]]])
    assert sizes == [40, 24] and dev is None
    runs = device.new_runs()
    device.plan(pieces[0], 1000, False, runs)
    device.plan(pieces[1], 1040, False, runs)  # the next object continues the first one: one run
    assert runs.host == [(a.data_ptr(), 1000, 64, None)] and runs.device == []
    runs = device.new_runs()
    device.plan(pieces[0], 1000, True, runs)
    device.plan(pieces[1], 5000, True, runs)  # the host side jumps: two runs
    assert runs.host == [(1000, a.data_ptr(), 40, None), (5000, a.data_ptr() + 40, 24, None)]


def test_device_runs_never_span_two_allocations():
    """Adjacent device pieces merge only within one tensor storage and one shared segment."""
    runs = device.new_runs()
    # (ptr, nbytes, on_cuda, tensor, storage address): two storages that happen to touch at 0x1100
    a1, a2 = (0x1000, 0x100, True, None, 0x1000), (0x1100, 0x100, True, None, 0x1000)
    b1 = (0x1200, 0x80, True, None, 0x1200)
    device.plan([a1, a2, b1], 0x9000, True, runs, segment=0)
    assert [(d, s, n) for d, s, n, _ in runs.device] == [(0x9000, 0x1000, 0x200), (0x9200, 0x1200, 0x80)]
    runs = device.new_runs()
    device.plan([a1], 0x9000, False, runs, segment=0)
    device.plan([a2], 0x9100, False, runs, segment=1)  # the next object lies in another segment
    assert len(runs.device) == 2 and len(runs.pieces) == 2


def test_plan_skips_empty_tensors():
    a = torch.zeros(8, dtype=torch.uint8)
    pieces, sizes, _ = device.check_tensor_lists(1, [[a[:0], a, torch.empty(0)]])
    runs = device.new_runs()
    device.plan(pieces[0], 4096, False, runs)
    assert sizes == [8] and runs.host == [(a.data_ptr(), 4096, 8, None)]


@pytest.mark.parametrize(
    "lists, exc, match",
    [
        ([[torch.zeros(2)]], ValueError, "one list of tensors per key"),
        ("ab", TypeError, "tensor_lists"),
        ([torch.zeros(2), [torch.zeros(2)]], TypeError, r"tensor_lists\[0\]"),
        ([[b"bytes"], [torch.zeros(2)]], TypeError, r"tensor_lists\[0\]\[0\]"),
        ([[torch.zeros(2)], [torch.zeros(4, 4).t()]], ValueError, r"tensor_lists\[1\]\[0\].*contiguous"),
        ([[torch.zeros(2)], [torch.zeros(4).to_sparse()]], TypeError, r"tensor_lists\[1\]\[0\].*sparse"),
        ([[torch.zeros(2)], [torch.zeros(4, device="meta")]], TypeError, r"tensor_lists\[1\]\[0\].*meta"),
    ],
    ids=["count", "str", "not-a-list", "not-a-tensor", "strided", "sparse", "meta"],
)
def test_bad_tensor_lists_raise_before_anything_is_written(kv, lists, exc, match):
    keys = ["bad/a", "bad/b"]
    kv.delete(keys)
    with pytest.raises(exc, match=match):
        kv.mset_d2h(keys, lists)
    with pytest.raises(exc, match=match):
        kv.mget_h2d(keys, lists)
    assert kv.exists(keys) == [False, False]
    kv.set("bad/a", b"still serving")
    assert kv.get("bad/a") == b"still serving"


def test_bad_keys_and_timeout(kv):
    with pytest.raises(TypeError, match=r"keys\[1\]"):
        kv.mget_h2d(["a", 3], [[torch.zeros(1)], [torch.zeros(1)]])
    with pytest.raises(ValueError, match="timeout"):
        kv.mget_h2d(["a"], [[torch.zeros(1)]], timeout=-1)
    assert kv.mget_h2d([], []) == [] and kv.mset_d2h([], []) == []


# ------------------------------------------------------------------------------------ round trips and results
def test_roundtrip_many_keys_exact_and_write_once(kv):
    keys = [f"rt/{i}" for i in range(40)]
    kv.delete(keys)
    src = _lists(40, sizes=(4096, 5, 70000))  # inline-sized and shared-memory-sized pieces
    assert kv.mset_d2h(keys, src) == [None] * 40
    again = kv.mset_d2h(keys[:2], _lists(2, sizes=(4096, 5, 70000), seed=9))
    assert all(isinstance(r, KeyExists) for r in again)  # write-once: the first version stays
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 40
    assert all(torch.equal(a, b) for sa, sb in zip(src, dst) for a, b in zip(sa, sb))
    assert kv.get(keys[3]) == b"".join(t.numpy().tobytes() for t in src[3])


def test_a_failed_key_never_hides_the_others(kv):
    kv.delete(["mix/a", "mix/b", "mix/missing"])
    src = _lists(2)
    assert kv.mset_d2h(["mix/a", "mix/b"], src) == [None, None]
    dst = [_poisoned(src)[0], [torch.zeros(3, dtype=torch.uint8)], [torch.zeros(1)]]
    untouched = dst[1][0].clone()
    res = kv.mget_h2d(["mix/a", "mix/b", "mix/missing"], dst)
    assert res[0] is None and isinstance(res[1], ValueError) and isinstance(res[2], KeyNotFound)
    assert "tensor_lists[1]" in str(res[1])
    assert all(torch.equal(a, b) for a, b in zip(src[0], dst[0]))
    assert torch.equal(dst[1][0], untouched)  # a refused key's tensors are not written
    kv.delete(["mix/a", "mix/b"])  # their keys changed: the kept leases go back with the next request
    assert kv.stats()["leases"] == 0  # every lease went back, the failed key's included


def _alone(worker, timeout=10.0):
    """Wait until one client is connected: earlier tests' connections (module-scoped worker) may still be
    handling their last one-way messages, which would count as requests here."""
    deadline = time.monotonic() + timeout
    while len(worker._sessions) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)


def test_cached_keys_cost_no_round_trip(worker):
    with kvstrata.connect(worker.address) as kv:
        _alone(worker)
        keys = [f"hot/{i}" for i in range(16)]
        kv.delete(keys)
        src = _lists(16, sizes=(100000,))
        assert kv.mset_d2h(keys, src) == [None] * 16
        assert kv.exists(keys) == [True] * 16  # shown before the read (see _written_by)
        dst = _poisoned(src)
        assert kv.mget_h2d(keys, dst) == [None] * 16  # leases taken and kept
        before = worker.counters["requests"]
        for _ in range(20):
            dst = _poisoned(src)
            assert kv.mget_h2d(keys, dst) == [None] * 16
            assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
        assert worker.counters["requests"] == before
        with kvstrata.connect(worker.address) as other:  # a change elsewhere: seen at once
            other.delete(keys[0])
            other.mset_d2h([keys[0]], [[torch.ones(100000, dtype=torch.uint8)]])
        _alone(worker)
        dst = _poisoned(src)
        before = worker.counters["requests"]
        assert kv.mget_h2d(keys, dst) == [None] * 16
        assert torch.equal(dst[0][0], torch.ones(100000, dtype=torch.uint8))
        # one round trip for the whole batch, and one one-way message that hands back the stale leases
        # (sent after the copies, so that their release does not delay the new leases; being one-way, the
        # worker may count it a moment after the call returned)
        deadline = time.monotonic() + 5
        while worker.counters["requests"] < before + 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert worker.counters["requests"] == before + 2


def test_a_batch_larger_than_the_cache_keeps_its_first_keys(worker, monkeypatch):
    with kvstrata.connect(worker.address) as kv:
        local = kv._backend._local
        monkeypatch.setattr(local, "max_bytes", 4 * 100000)
        keys = [f"big-batch/{i}" for i in range(10)]
        kv.delete(keys)
        src = _lists(10, sizes=(100000,))
        kv.mset_d2h(keys, src)
        for _ in range(3):
            assert kv.mget_h2d(keys, _poisoned(src)) == [None] * 10
        assert [k for k in keys if k in local._entries] == keys[:4]  # no churn, call after call


def test_the_lease_holds_the_bytes_across_the_batched_copy(kv, monkeypatch):
    """While the copies run, another writer deletes and rewrites every key and fills memory: the
    reader still gets the version it leased, untorn, and every lease goes back afterwards."""
    keys = [f"held/{i}" for i in range(8)]
    kv.delete(keys)
    src = _lists(8, sizes=(200000,))
    assert kv.mset_d2h(keys, src) == [None] * 8
    writer = kv if kv.embedded else kvstrata.connect(kv.address)
    if not kv.embedded:  # copies only after the leases (early copies: test_early_copies_from_wrong_or_stale_...)
        monkeypatch.setattr(kv._backend, "placement_hints", lambda ks: [None] * len(ks))
    real_enqueue = device.enqueue
    fired = []

    def enqueue_with_writer(runs, dev, stream, **kw):
        if not fired:
            fired.append(True)
            writer.delete(keys)  # the bytes are leased: they must not be freed or reused yet
            for i, k in enumerate(keys):
                writer.set(k, bytes([i]) * 200000)
            writer.mset({f"filler/{i}": b"\xff" * 200000 for i in range(40)})
        return real_enqueue(runs, dev, stream, **kw)

    monkeypatch.setattr(device, "enqueue", enqueue_with_writer)
    dst = _poisoned(src)  # keys written, never read: no kept lease, this read leases through the worker
    try:
        assert kv.mget_h2d(keys, dst) == [None] * 8
    finally:
        if writer is not kv:
            writer.close()
    assert fired and all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
    monkeypatch.setattr(device, "enqueue", real_enqueue)
    assert kv.mget_h2d(keys[:1], dst[:1]) == [None]
    assert torch.equal(dst[0][0], torch.zeros(200000, dtype=torch.uint8))  # the new version now
    kv.delete([f"filler/{i}" for i in range(40)])
    kv.delete(keys)  # the kept lease of keys[0] goes back with the next request
    assert kv.stats()["leases"] == 0


def test_a_failed_copy_aborts_every_create(kv, monkeypatch):
    keys = ["abort/a", "abort/b"]
    kv.delete(keys)

    def broken(runs, dev, stream, **kw):
        raise RuntimeError("simulated copy failure")

    monkeypatch.setattr(device, "enqueue", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        kv.mset_d2h(keys, _lists(2))
    monkeypatch.undo()
    assert kv.exists(keys) == [False, False]
    assert kv.stats()["creates_in_progress"] == 0
    assert kv.mset_d2h(keys, _lists(2)) == [None, None]  # writable again at once


def test_registration_is_tried_once_per_segment(kv, monkeypatch):
    calls = []
    monkeypatch.setattr(device, "register_segment", lambda addr, n: calls.append(addr) or False)
    regs = device.Registrations()
    for _ in range(3):
        regs.ensure({0: 0, 1: 0}, lambda i: 4096 * (i + 1), lambda i: 4096)
    assert calls == [4096, 8192]  # refusals are remembered too: no retry per call
    regs.undo()


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["whole", "part"])
def test_cuda_roundtrip_merged_and_registered_once(kv, monkeypatch, cache):
    # 64 x 70,016 bytes is 4.3 MiB, past the local-read cache's 4 MiB (a sixteenth of the worker's memory): it keeps
    # 59 keys' leases, so each later read is a kept part and a staged rest ("part"), or, with a budget raised for
    # the test, kept whole ("whole").
    if cache == "whole" and not kv.embedded:
        monkeypatch.setattr(kv._backend._local, "max_bytes", 8 << 20)
    took = outcomes(monkeypatch, kept_reads)
    keys = [f"gpu-rt/{i}" for i in range(64)]
    kv.delete(keys)
    flat = torch.randint(0, 255, (64 * 70016,), dtype=torch.uint8, device="cuda")
    src = [[flat[i * 70016 : (i + 1) * 70016]] for i in range(64)]  # adjacent on the device
    registered = []
    real = device.register_segment
    monkeypatch.setattr(device, "register_segment", lambda a, n: registered.append(a) or real(a, n))
    batches = []
    from kvstrata.ops import copy_engine

    real_batch = copy_engine.memcpy_raw

    def counting(dsts, srcs, sizes, handle):
        batches.append(len(sizes))
        return real_batch(dsts, srcs, sizes, handle)

    monkeypatch.setattr(copy_engine, "memcpy_raw", counting)
    monkeypatch.setattr(batching, "NATIVE_COPIES", False)  # kept reads' batches counted here too (not the driver's)
    if not kv.embedded:  # one batch per stage: no early copies (they may split a stage whose keys the worker
        # showed only in part by the time the read looked them up; test_cuda_cold_read_copies_early_... has them)
        monkeypatch.setattr(kv._backend, "placement_hints", lambda ks: [None] * len(ks))
    assert kv.mset_d2h(keys, src) == [None] * 64
    # Shown (the landing word read: every lease the first read takes is one the local-read cache keeps), so the
    # second and third reads are kept whole, not a kept part and a staged rest.
    assert kv.exists(keys) == [True] * 64
    out = torch.full_like(flat, 7)
    dst = [[out[i * 70016 : (i + 1) * 70016]] for i in range(64)]
    for _ in range(3):
        out.fill_(7)
        assert kv.mget_h2d(keys, dst) == [None] * 64
        torch.cuda.synchronize()
        assert torch.equal(out, flat)
    assert len(registered) == len(set(registered))  # each segment once, not per call
    per_call = len(list(device.stages(64, src)))  # each stage's adjacent keys merge into one run, one batch
    if kv.embedded:
        assert len(batches) == 4 * per_call and took == [False] * 3 and all(n < 64 for n in batches)
    elif cache == "whole":
        # The second and third reads are kept (one pass: kvstrata.client.kept_reads), their merged runs cut by
        # bytes: 2 MiB, then 4, 8, 16 (4.3 MiB: two batches).
        assert took == [False, True, True]
        assert len(batches) == 2 * per_call + 2 * 2 and all(n < 64 for n in batches)
    else:
        assert took == [False, True, True]  # served in part, the rest staged: the bytes checked above
    assert kv.get(keys[5]) == flat[5 * 70016 : 6 * 70016].cpu().numpy().tobytes()
    kv.delete(keys)


@pytest.mark.gpu
def test_cuda_mixed_with_cpu_tensors_and_a_side_stream(kv):
    keys = ["gpu-mix/a", "gpu-mix/b"]
    kv.delete(keys)
    src = [[torch.randn(1000, device="cuda"), torch.arange(7, dtype=torch.int64)], [torch.randn(3, 5).half().cuda()]]
    assert kv.mset_d2h(keys, src) == [None, None]
    dst = [[torch.full_like(t, 3) for t in ts] for ts in src]
    stream = torch.cuda.Stream()
    torch.cuda.current_stream().synchronize()
    assert kv.mget_h2d(keys, dst, stream=stream) == [None, None]
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for sa, sb in zip(src, dst) for a, b in zip(sa, sb))
    kv.delete(keys)


@pytest.mark.gpu
def test_copies_wait_for_the_callers_pending_work_call_after_call(kv):
    # The copy stream waits for the caller's stream (given, or current) at every call: writes to the sources, and
    # to the destinations, still queued behind ~1 ms of GPU work come before the copies. Several calls: the first
    # of a thread makes its wait event, the later ones record it by its raw handle.
    keys = [f"gpu-order/{i}" for i in range(3)]
    side = torch.cuda.Stream()
    for r in range(4):
        kv.delete(keys)
        given = {"stream": side} if r % 2 else {}
        src = [[torch.empty(1 << 16, dtype=torch.uint8, device="cuda")] for _ in keys]
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time ahead of the writes
            for i, ts in enumerate(src):
                ts[0].fill_(r * 10 + i)
            assert kv.mset_d2h(keys, src, **given) == [None] * 3
        assert [kv.get(k)[:1] for k in keys] == [bytes([r * 10 + i]) for i in range(3)]
        dst = [[torch.empty(1 << 16, dtype=torch.uint8, device="cuda")] for _ in keys]
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)
            for ts in dst:
                ts[0].fill_(255)  # still queued when the call starts: its copies must land after it
            assert kv.mget_h2d(keys, dst, **given) == [None] * 3
        torch.cuda.synchronize()
        assert all(bool((ts[0] == r * 10 + i).all()) for i, ts in enumerate(dst))
    kv.delete(keys)


def test_the_copy_stream_joins_natively_where_the_thread_has_the_context_bound(monkeypatch):
    # start() with CUDA faked: the driver's stream calls are ctypes stand-ins (tests/test_tensor_runs.py's), so what
    # is checked is which calls a start makes: one query where the caller's stream is idle, the thread's event
    # recorded and waited for where it is not, torch's event made first where the thread has none, and the runtime's
    # calls where the thread has not bound the device's context.
    from kvstrata.ops import tensor_runs

    assert tensor_runs.native(wait=True) is not None
    log, made = [], []

    class Side:
        cuda_stream = 22

        def wait_event(self, event):
            log.append(("torch wait", event.cuda_event))

    class Event:
        cuda_event = 8

        def record(self, stream):
            made.append(self)
            log.append(("torch record", stream))

    fake_torch = type("torch", (), {"cuda": type("cuda", (), {"Event": Event})})
    copy_engine = types.SimpleNamespace(
        stream_idle=lambda h: log.append(("runtime query", h)),  # None: not idle
        stream_wait=lambda e, h, side: log.append(("runtime wait", e, h, side)) is None,
        CopyEngineError=CopyEngineError,
    )
    modules = (fake_torch, copy_engine, lambda i: "caller", lambda i: 11, lambda: 0)
    monkeypatch.setattr(device, "_device_modules", lambda: modules)
    monkeypatch.setitem(device._copy_streams, 0, Side())
    monkeypatch.setattr(device, "_wait_events", threading.local())
    monkeypatch.setattr(device, "_bound", threading.local())
    cuda0 = type("device", (), {"index": 0})()
    for query, expected in [
        (0, [("query", 11)]),
        (600, [("query", 11), ("torch record", "caller"), ("torch wait", 8)]),  # no event yet: torch's
        (600, [("query", 11), ("record", 8, 11), ("wait", 22, 8, 0)]),  # then the driver's, on its handle
    ]:
        _alive, calls = stream_calls(log, query=query)
        monkeypatch.setattr(device, "_native_join", lambda calls=calls: (tensor_runs.loaded(), calls))
        device._bound.__dict__[0] = True
        log.clear()
        assert type(device.start(cuda0)) is Side
        assert log == expected
    assert len(made) == 1
    _alive, calls = stream_calls(log, query=600, wait=201)  # the driver refuses the wait: a clear error
    monkeypatch.setattr(device, "_native_join", lambda: (tensor_runs.loaded(), calls))
    with pytest.raises(CopyEngineError, match=r"copy stream's wait for the caller's failed: .*\(201\)"):
        device.start(cuda0)
    del device._bound.__dict__[0]  # a thread with no context bound: the runtime's calls
    log.clear()
    assert type(device.start(cuda0)) is Side
    assert log == [("runtime query", 11), ("runtime wait", 8, 11, 22)]


@pytest.mark.gpu
@pytest.mark.parametrize("native_join", [True, False], ids=["native-join", "cuda-bindings"])
def test_copies_join_the_callers_stream_only_where_it_has_pending_work(kv, monkeypatch, native_join):
    # On the legacy default stream (most callers'): idle, the call finds it so and queues no wait; with work
    # pending, it waits for that work, and the bytes show it. The query and the wait go as one native call of the
    # driver's (a thread with the context bound) or through cuda-bindings' runtime calls.
    from kvstrata.ops import copy_engine, tensor_runs

    idle: list[bool] = []  # what each call's check found
    if native_join:
        assert tensor_runs.native(wait=True) is not None
        module, calls = device._native_join()

        class Watched:
            def join(self, *args):
                got = module.join(*args)
                idle.append(got[0] == tensor_runs.IDLE)
                return got

        monkeypatch.setattr(device, "_native_join", lambda: (Watched(), calls))
    else:
        monkeypatch.setattr(device, "NATIVE_JOIN", False)
        real_idle = copy_engine.stream_idle
        monkeypatch.setattr(copy_engine, "stream_idle", lambda handle: idle.append(real_idle(handle)) or idle[-1])
    keys = [f"gpu-idle-join/{i}" for i in range(3)]
    src = [[torch.full((1 << 16,), i + 1, dtype=torch.uint8, device="cuda")] for i in range(3)]
    dst = [[torch.empty(1 << 16, dtype=torch.uint8, device="cuda")] for _ in keys]
    # The kernels' first launches load their code, which waits for the GPU (the queued sleep would be over by the
    # call: seen on the H200 machine), so each kernel runs once before.
    torch.cuda._sleep(1000)
    dst[0][0].add_(1).fill_(0)
    for r in range(3):
        kv.delete(keys)
        torch.cuda.synchronize()
        idle.clear()
        assert kv.mset_d2h(keys, src) == [None] * 3
        assert kv.mget_h2d(keys, dst) == [None] * 3
        assert idle and all(idle), f"idle, round {r}: {idle}"
        assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst)), f"idle, round {r}"
        idle.clear()
        kv.delete(keys)
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time ahead of the writes: pending when the call looks
        for ts in src:
            ts[0].add_(1)
        assert kv.mset_d2h(keys, src) == [None] * 3
        torch.cuda._sleep(50_000_000)
        for ts in dst:
            ts[0].fill_(0)
        assert kv.mget_h2d(keys, dst) == [None] * 3
        assert idle and not any(idle), f"busy, round {r}: {idle}"
        torch.cuda.synchronize()
        assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst)), f"busy, round {r}"
        assert all(bool((ts[0] == i + r + 2).all()) for i, ts in enumerate(dst))
    kv.delete(keys)


@pytest.mark.gpu
def test_cuda_lease_held_across_the_copy(kv, monkeypatch):
    # One stage for all four keys: the keys are overwritten right after it is queued (in-process, a later
    # stage would lease the new objects, as it should).
    monkeypatch.setattr(device, "FIRST_STAGE_BYTES", 4 << 20)
    keys = [f"gpu-held/{i}" for i in range(4)]
    kv.delete(keys)
    src = [[torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda")] for _ in keys]
    assert kv.mset_d2h(keys, src) == [None] * 4
    writer = kv if kv.embedded else kvstrata.connect(kv.address)
    if not kv.embedded:  # copies only after the leases (early copies: test_cuda_cold_read_copies_early_...)
        monkeypatch.setattr(kv._backend, "placement_hints", lambda ks: [None] * len(ks))
    real_enqueue = device.enqueue

    def enqueue_then_overwrite(runs, dev, stream, **kw):
        real_enqueue(runs, dev, stream, **kw)  # copies enqueued, maybe still running
        writer.delete(keys)
        for k in keys:
            writer.set(k, b"\x00" * (1 << 20))

    monkeypatch.setattr(device, "enqueue", enqueue_then_overwrite)
    dst = [[torch.empty_like(t[0])] for t in src]
    try:
        assert kv.mget_h2d(keys, dst) == [None] * 4
    finally:
        if writer is not kv:
            writer.close()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
    kv.delete(keys)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["unix"], indirect=True)
def test_cuda_cold_read_copies_early_and_redoes_stale_advice(kv, writer, monkeypatch):
    keys = [f"gpu-early/{i}" for i in range(16)]
    kv.delete(keys)
    old = [[torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda")] for _ in keys]
    assert writer.mset_d2h(keys, old) == [None] * 16  # another client's objects: no lease kept here
    backend = kv._backend
    stale = dict(zip(keys, backend.placement_hints(keys)))
    assert None not in stale.values()
    writer.delete(keys[:3])
    new = [[torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda")] for _ in range(3)]
    assert writer.mset_d2h(keys[:3], new) == [None] * 3  # rewritten after the advice below was read
    monkeypatch.setattr(backend, "placement_hints", lambda ks: [stale[k] for k in ks])
    events = _order(monkeypatch, backend)
    dst = [[torch.full_like(t[0], 7)] for t in old]
    assert kv.mget_h2d(keys, dst) == [None] * 16
    torch.cuda.synchronize()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(new + old[3:], dst))
    first_answer = events.index("answer")
    assert first_answer >= 1 and "copies" in events[first_answer:], events  # early copies, then the 3 redone
    kv.delete(keys)


def test_stages_grow_on_a_gpu_call_and_keep_a_cpu_call_whole(monkeypatch):
    mib = 1 << 20
    cpu = [[torch.zeros(4)] for _ in range(20)]
    assert [(st.lo, st.hi) for st in device.stages(20, cpu)] == [(0, 20)]
    assert list(device.stages(0, [])) == []
    # a GPU call of 64 x 1 MiB (check_key stubbed: no GPU here): 4, 6, 9, 13.5, then 16 MiB stages, every key once
    monkeypatch.setattr(device, "check_key", lambda ts, i: ([], mib, "cuda"))
    got = list(device.stages(64, [[]] * 64))
    assert [st.hi - st.lo for st in got] == [4, 6, 9, 14, 16, 15]
    assert [st.lo for st in got] == [0, 4, 10, 19, 33, 49] and all(st.device == "cuda" for st in got)
    assert [len(st.sizes) for st in got] == [4, 6, 9, 14, 16, 15]
    monkeypatch.setattr(device, "check_key", lambda ts, i: ([], 64 * mib if i == 0 else 1, "cuda"))
    assert [(st.lo, st.hi) for st in device.stages(3, [[]] * 3)] == [(0, 1), (1, 3)]  # a big key: a stage alone


def test_stages_check_each_key_only_when_reached():
    good = [torch.zeros(4)]
    lists = [good, good, [torch.zeros(4, 4).t()]]  # the last is not contiguous
    it = device.stages(3, lists)
    with pytest.raises(ValueError, match=r"tensor_lists\[2\]\[0\]"):
        next(it)  # a CPU call is one stage: its check reaches every key
    with pytest.raises(TypeError, match="one list of tensors per key"):
        next(device.stages(1, "abc"))


def test_copy_engine_runs_go_in_batches_and_a_late_refusal_is_not_retried_by_torch(monkeypatch):
    from kvstrata.ops import copy_engine

    calls = []

    def batch(dsts, srcs, sizes, handle):
        assert handle == 77 and len(dsts) == len(srcs) == len(sizes)
        calls.append(len(sizes))
        if fail_at is not None and len(calls) == fail_at:
            raise copy_engine.CopyEngineError("refused")

    class Stream:  # the copy stream start() hands out: its raw handle and device
        cuda_stream, device_index = 77, 0

    monkeypatch.setattr(copy_engine, "memcpy_raw", batch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # no GPU here: the stream's device is current
    runs = [(1000 + i, 2000 + i, 1, None) for i in range(device.BATCH_RUNS * 2 + 3)]
    fail_at = None
    assert device._copy_engine(runs, Stream()) is True
    assert calls == [device.BATCH_RUNS, device.BATCH_RUNS, 3]
    calls.clear()
    assert device._copy_engine(runs, Stream(), device.FIRST_BATCH_RUNS) is True  # a call's first: short head
    head = device.FIRST_BATCH_RUNS
    assert calls == [head, device.BATCH_RUNS, device.BATCH_RUNS, 3 - head] and sum(calls) == len(runs)
    calls.clear()
    fail_at = 1  # nothing queued yet: the caller may fall back to torch copies
    assert device._copy_engine(runs, Stream()) is False
    calls.clear()
    fail_at = 2  # a batch is queued already: a torch re-copy of everything would race it
    with pytest.raises(copy_engine.CopyEngineError):
        device._copy_engine(runs, Stream())


# ----------------------------------------------------------------------------- pipelined mset_d2h
def test_pipelined_mset_d2h_keeps_per_key_results_and_seals_stage_by_stage(kv, monkeypatch):
    keys = [f"pipe/{i}" for i in range(9)]
    kv.delete(keys)
    src = _lists(9, sizes=(70000, 5))
    old = (1, 4, 8)  # already there, in the first, a middle and the last group: left as they are
    assert kv.mset_d2h([keys[i] for i in old], [src[0]] * 3) == [None] * 3
    monkeypatch.setattr(device, "stages", stages_of(3))
    copies_pending(monkeypatch)
    monkeypatch.setattr(kv._reservation, "limit", 0)  # the create path (the reserved one: test_reservations)
    backend = kv._backend
    calls = []
    for name in ("mcreate", "mseal"):
        real = getattr(backend, f"{name}_start")
        monkeypatch.setattr(
            backend, f"{name}_start", lambda *a, _r=real, _n=name: calls.append((_n, len(a[0]))) or _r(*a)
        )
    res = kv.mset_d2h(keys, src)
    assert [i for i, r in enumerate(res) if isinstance(r, KeyExists)] == list(old)
    assert all(r is None for i, r in enumerate(res) if i not in old)
    # one create per stage, then one seal per stage of the keys it created
    assert calls == [("mcreate", 3)] * 3 + [("mseal", 2)] * 3
    monkeypatch.undo()
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 9
    for i in range(9):
        want = src[0] if i in old else src[i]
        assert all(torch.equal(a, b) for a, b in zip(want, dst[i]))
    assert kv.stats()["creates_in_progress"] == 0


def test_pipelined_mset_d2h_aborts_the_unsealed_when_a_seal_fails(kv, monkeypatch):
    keys = [f"pipe-abort/{i}" for i in range(7)]
    kv.delete(keys)
    monkeypatch.setattr(device, "stages", stages_of(3))
    copies_pending(monkeypatch)
    backend = kv._backend
    real = backend.mseal_start
    seals = []

    def mseal_start(batch):
        seals.append(batch)
        if len(seals) == 2:
            raise RuntimeError("simulated loss at the second stage's seal")
        return real(batch)

    monkeypatch.setattr(backend, "mseal_start", mseal_start)
    with pytest.raises(RuntimeError, match="simulated"):
        kv.mset_d2h(keys, _lists(7))
    monkeypatch.undo()
    assert kv.exists(keys) == [True] * 3 + [False] * 4  # the first stage sealed before the failure, the rest aborted
    assert kv.stats()["creates_in_progress"] == 0
    assert kv.mset_d2h(keys[3:], _lists(4)) == [None] * 4  # writable again at once


def test_a_bad_tensor_in_a_later_stage_aborts_what_earlier_stages_created(kv, monkeypatch):
    keys = [f"pipe-bad/{i}" for i in range(7)]
    kv.delete(keys)
    monkeypatch.setattr(device, "stages", stages_of(3))
    lists = _lists(7)
    lists[5] = [torch.zeros(4, 4).t()]  # not contiguous: found when the second stage is reached
    with pytest.raises(ValueError, match=r"tensor_lists\[5\]\[0\]"):
        kv.mset_d2h(keys, lists)
    assert kv.exists(keys) == [False] * 7 and kv.stats()["creates_in_progress"] == 0
    dst = _poisoned(_lists(7))
    bad = [list(d) for d in dst]
    bad[4] = "not a list"
    assert kv.mset_d2h(keys, _lists(7)) == [None] * 7
    with pytest.raises(TypeError, match=r"tensor_lists\[4\]"):
        kv.mget_h2d(keys, bad)
    assert kv.mget_h2d(keys, dst) == [None] * 7  # the failed call left nothing in the way
    assert all(torch.equal(a, b) for want, got in zip(_lists(7), dst) for a, b in zip(want, got))
    kv.delete(keys)


def _count_asks(monkeypatch, backend) -> list[int]:
    """The number of keys of each lease request ``backend`` is asked to send, in order (filled as it goes)."""
    asked: list[int] = []
    real = backend.acquire_start
    monkeypatch.setattr(backend, "acquire_start", lambda ks, *a, **kw: asked.append(len(ks)) or real(ks, *a, **kw))
    return asked


def test_pipelined_mget_h2d_asks_two_groups_up_front_then_the_rest_at_once(kv, monkeypatch):
    keys = [f"pipe-get/{i}" for i in range(9)]
    kv.delete(keys)
    src = _lists(9)
    assert kv.mset_d2h(keys, src) == [None] * 9
    kv.delete([keys[5]])  # a missing key in the middle group: its slot says so, the others are filled
    monkeypatch.setattr(device, "stages", stages_of(2))
    backend = kv._backend
    remote = type(backend).__name__ == "RemoteBackend"
    if remote:  # where the worker's placement table has no advice (test_cold_mget_h2d_copies_... has some)
        monkeypatch.setattr(backend, "placement_hints", lambda ks: [None] * len(ks))
    asked = _count_asks(monkeypatch, backend)
    real_enqueue = device.enqueue
    monkeypatch.setattr(device, "enqueue", lambda *a, **kw: asked.append("copies") or real_enqueue(*a, **kw))
    dst = _poisoned(src)
    res = kv.mget_h2d(keys, dst)
    # Through a worker: the first stage's 2 keys and at once the next up to 4 x 2 (at least 8) in all (the worker
    # reads that request right after its first answer), the first stage's copies as soon as they are leased, then
    # every key left in one request, and the next stages' copies as their leases are in; in-process (no round trip
    # to hide) and where the local-read cache serves the first stage: each stage as it comes.
    asks = [x for x in asked if x != "copies"]
    assert asks == ([2, 6, 1] if remote else [2, 2, 2, 2, 1])
    c = "copies"
    assert asked == ([2, 6, c, 1, c, c, c, c] if remote else [2, c, 2, c, 2, c, 2, c, 1, c])
    monkeypatch.setattr(device, "enqueue", real_enqueue)
    asked.clear()
    assert kv.mget_h2d(keys[:4] + keys[6:], dst[:4] + dst[6:]) == [None] * 7  # kept leases: no worker asked
    assert asked == ([] if remote else [2, 2, 2, 1])  # through a worker, in one pass: kvstrata.client.kept_reads
    assert isinstance(res[5], KeyNotFound) and all(r is None for i, r in enumerate(res) if i != 5)
    for i in range(9):
        if i != 5:
            assert all(torch.equal(a, b) for a, b in zip(src[i], dst[i]))
    assert all(torch.equal(t, torch.full_like(t, 0xAB)) for t in dst[5])  # untouched
    bad = [list(d) for d in dst]
    bad[7] = [torch.zeros(4, 4).t()]  # not contiguous: found at the fourth stage, after every lease came back
    with pytest.raises(ValueError, match=r"tensor_lists\[7\]\[0\]"):
        kv.mget_h2d(keys, bad)
    monkeypatch.undo()
    kv.delete(keys)  # no lease of the failed call is left: the objects go at once
    assert kv.stats()["leases"] == 0 and kv.exists(keys) == [False] * 9


@pytest.fixture
def writer(worker):
    """A second client of the worker: objects another process wrote (the reader never leased them)."""
    other = kvstrata.connect(worker.address, timeout=5)
    yield other
    other.close()


def _written_by(writer, kv, prefix: str, n: int, seed: int):
    """``n`` keys ``prefix/i`` of fresh CPU tensors, written by ``writer`` (``kv`` holds no lease on them)."""
    keys = [f"{prefix}/{i}" for i in range(n)]
    kv.delete(keys)
    src = _lists(n, seed=seed)
    assert writer.mset_d2h(keys, src) == [None] * n
    # The write's objects show once the worker reads its landing word, which it does before its next operation of
    # anyone's. Done here, not during the test's first read: a change during a read's request (this one's seals
    # bump the generation) makes the local-read cache refuse that read's leases, and the test's order with them.
    assert writer.exists(keys) == [True] * n
    return keys, src


def _order(monkeypatch, backend, *, requests: bool = False) -> list[str]:
    """What a device read does, in order: ``"copies"`` queued, ``"answer"`` of the worker read (and with
    ``requests``, ``"request"``: a lease request sent)."""
    events: list[str] = []
    real_enqueue, real_finish, real_send = device.enqueue, backend.acquire_finish, backend.send_tagged
    real_lists = device.copy_lists
    monkeypatch.setattr(device, "enqueue", lambda *a, **kw: events.append("copies") or real_enqueue(*a, **kw))
    monkeypatch.setattr(device, "copy_lists", lambda *a, **kw: events.append("copies") or real_lists(*a, **kw))
    planner = batching.planner()
    if planner is not None:  # a native pass that queues its own copies (kvstrata.ops.tensor_runs.plan_copy)

        def plan_copy(*args, **kwargs):
            got = planner.plan_copy(*args, **kwargs)
            if got[2]:
                events.append("copies")
            return got

        names = ("native", "plan", "lay_out", "lay_out_copy", "CUT", "DONE", "NO_BASE", "PYTHON_PATH", "FULL")
        wrapped = types.SimpleNamespace(plan_copy=plan_copy, **{name: getattr(planner, name) for name in names})
        monkeypatch.setattr(batching, "planner", lambda: wrapped)
    monkeypatch.setattr(backend, "acquire_finish", lambda tok, **kw: events.append("answer") or real_finish(tok, **kw))
    if requests:

        def send(msg, **kw):
            if msg.get("op") == "acquire":
                events.append("request")
            return real_send(msg, **kw)

        monkeypatch.setattr(backend, "send_tagged", send)
    return events


@pytest.mark.parametrize("kv", ["unix"], indirect=True)
def test_cold_mget_h2d_copies_from_the_placement_table_before_its_leases_come_back(kv, writer, monkeypatch):
    keys, src = _written_by(writer, kv, "early", 9, seed=3)
    batches_of(monkeypatch, 2, 1027)
    events = _order(monkeypatch, kv._backend, requests=True)
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 9
    assert all(torch.equal(a, b) for want, got in zip(src, dst) for a, b in zip(want, got))
    # The table placed the first keys: one pass (kvstrata.client.placed_reads), the first two batches' copies before
    # any request, then one request for every key, then the later batches' copies, all before its answer came back.
    # The answer only confirmed them (no copy after it: none had to be redone).
    assert events == ["copies", "copies", "request"] + ["copies"] * 3 + ["answer"], events
    kv.delete(keys)
    assert kv.stats()["leases"] == 0  # every lease the call took went back (or with its cache entry, now)


@pytest.mark.parametrize("kv", ["unix"], indirect=True)
def test_keys_the_table_does_not_place_wait_for_the_one_request_of_a_placed_read(kv, writer, monkeypatch):
    keys, src = _written_by(writer, kv, "unplaced", 9, seed=13)
    backend = kv._backend
    table = backend.placements
    real = table.lookup
    gone = set(keys[4:6])  # not in the table (say, their buckets taken by other keys)
    monkeypatch.setattr(table, "lookup", lambda ks: [None if k in gone else h for k, h in zip(ks, real(ks))])
    batches_of(monkeypatch, 2, 1027)
    events = _order(monkeypatch, backend, requests=True)
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 9
    assert all(torch.equal(a, b) for want, got in zip(src, dst) for a, b in zip(want, got))
    # the placed keys' batches early, the one request after the second; the two unplaced keys once its answer is in
    assert events == ["copies", "copies", "request", "copies", "copies", "answer", "copies"], events
    kv.delete(keys)


@pytest.mark.parametrize("kv", ["unix"], indirect=True)
def test_a_read_kept_in_part_goes_by_the_table_and_copies_each_key_once(kv, writer, monkeypatch):
    keys, src = _written_by(writer, kv, "mixed", 8, seed=14)
    assert kv.mget_h2d(keys[2:], _poisoned(src[2:])) == [None] * 6  # leases kept for all but the first two
    batches_of(monkeypatch, 2, 1027)
    backend = kv._backend
    events = _order(monkeypatch, backend, requests=True)
    copied = []
    real_plan = device.plan
    monkeypatch.setattr(
        device, "plan", lambda pieces, *a, **kw: copied.append(len(pieces)) or real_plan(pieces, *a, **kw)
    )
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 8
    assert all(torch.equal(a, b) for want, got in zip(src, dst) for a, b in zip(want, got))
    # Not every lease kept: the table's advice for every key, one request, its answer confirming every copy.
    assert events == ["copies", "copies", "request", "copies", "copies", "answer"], events
    assert len(copied) == 8  # no key twice
    kv.delete(keys)
    assert kv.stats()["leases"] == 0


@pytest.mark.parametrize("kv", ["unix"], indirect=True)
def test_early_copies_from_wrong_or_stale_advice_are_redone_from_the_lease(kv, writer, monkeypatch):
    keys, old = _written_by(writer, kv, "advice", 8, seed=4)
    backend = kv._backend
    stale = backend.placement_hints(keys)
    assert None not in stale
    writer.delete(keys[:2])
    new = _lists(8, seed=5)
    assert writer.mset_d2h(keys[:2], new[:2]) == [None] * 2  # rewritten since the advice was read
    right = backend.placement_hints(keys)
    seg, off, size, placed = right[2]
    advice = [
        stale[0],  # the old version's place and placement: its bytes may be anything by now
        stale[1],
        (seg, right[3][1], size, placed),  # the right placement at another key's place (a torn bucket)
        (right[3][0], right[3][1], size, right[4][3]),  # another key's place and placement
        (seg, 1 << 40, size, right[4][3]),  # outside every mapped segment: never copied from
        (seg, off, size, 0),  # no placement: ignored
        None,
        right[7],  # right: stands
    ]
    monkeypatch.setattr(backend, "placement_hints", lambda ks: advice[len(keys) - len(ks) :][: len(ks)])
    events = _order(monkeypatch, backend)
    dst = _poisoned(old)
    assert kv.mget_h2d(keys, dst) == [None] * 8  # one stage (CPU tensors): advice for all 8 keys at once
    want = new[:2] + old[2:]
    assert all(torch.equal(a, b) for w, got in zip(want, dst) for a, b in zip(w, got))
    assert events == ["copies", "answer", "copies"]  # the early copies, then the redone ones
    kv.delete(keys)


@pytest.mark.parametrize("kv", ["unix"], indirect=True)
def test_garbage_in_the_placement_table_never_reaches_the_caller(kv, writer, worker, monkeypatch):
    import numpy as np

    from kvstrata.store.placements import key_hash

    keys, src = _written_by(writer, kv, "garbage", 16, seed=7)
    rows = worker.placements._rows  # the worker's own table: every client maps these pages
    rng = np.random.default_rng(0)
    segment = kv._backend.segment_nbytes(0)
    for i, key in enumerate(keys):  # each key's bucket names it, with a random place and placement
        bucket, tag = key_hash(key)
        offset = int(rng.integers(0, segment - 1100))
        rows[bucket] = (tag, offset, sum(t.numel() for t in src[i]), int(rng.integers(1, 1 << 62)))
    events = _order(monkeypatch, kv._backend)
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 16  # every early copy read garbage and was redone from its lease
    assert all(torch.equal(a, b) for want, got in zip(src, dst) for a, b in zip(want, got))
    assert events == ["copies", "answer", "copies"]
    kv.delete(keys)


@pytest.mark.parametrize("kv", ["unix"], indirect=True)
@pytest.mark.parametrize("placed", [None, "not a list", ["x"] * 6, [1, 2]])
def test_a_reply_without_sound_placements_redoes_every_early_copy(kv, writer, monkeypatch, placed):
    keys, src = _written_by(writer, kv, "unsound", 6, seed=8)
    backend = kv._backend
    real = backend.tagged_reply

    def reply(*args):  # an older worker (no "placed"), or one that answers it malformed
        got = real(*args)
        if "ids" in got:
            got.pop("placed", None)
            if placed is not None:
                got["placed"] = placed
        return got

    monkeypatch.setattr(backend, "tagged_reply", reply)
    events = _order(monkeypatch, backend)
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 6
    assert all(torch.equal(a, b) for want, got in zip(src, dst) for a, b in zip(want, got))
    assert events == ["copies", "answer", "copies"]  # nothing confirmed: every key copied again from its lease
    kv.delete(keys)


@pytest.mark.parametrize("kv", ["unix"], indirect=True)
def test_a_key_gone_since_the_advice_was_read_is_reported_missing(kv, writer, monkeypatch):
    keys, src = _written_by(writer, kv, "gone", 4, seed=6)
    backend = kv._backend
    advice = backend.placement_hints(keys)
    writer.delete([keys[1]])
    assert backend.placement_hints([keys[1]]) == [None]  # a deleted key leaves the table at once
    monkeypatch.setattr(backend, "placement_hints", lambda ks: advice)  # a reader that looked just before
    dst = _poisoned(src)
    res = kv.mget_h2d(keys, dst)
    assert isinstance(res[1], KeyNotFound) and [res[0], res[2], res[3]] == [None] * 3
    assert all(torch.equal(a, b) for i in (0, 2, 3) for a, b in zip(src[i], dst[i]))
    kv.delete(keys)
    assert kv.stats()["leases"] == 0


def test_a_waiting_mget_h2d_asks_stage_by_stage_within_its_one_timeout(kv, monkeypatch):
    keys = [f"pipe-wait/{i}" for i in range(6)]
    kv.delete(keys)
    src = _lists(6)
    assert kv.mset_d2h(keys[:5], src[:5]) == [None] * 5  # the last key never comes
    kv.mget_h2d(keys[:5], _poisoned(src[:5]))  # kept leases: the first stage needs no worker
    for k in keys[:5]:  # rewritten: every stage must ask the worker
        kv.delete([k])
    assert kv.mset_d2h(keys[:5], src[:5]) == [None] * 5
    monkeypatch.setattr(device, "stages", stages_of(2))
    backend = kv._backend
    asked = _count_asks(monkeypatch, backend)
    dst = _poisoned(src)
    t0 = time.monotonic()
    res = kv.mget_h2d(keys, dst, timeout=0.3)
    took = time.monotonic() - t0
    assert asked == [2, 2, 2]  # each stage's own, its timeout what is left of the call's
    assert isinstance(res[5], KvstrataError) and res[:5] == [None] * 5
    assert 0.25 <= took < 2.0  # (the call's one 0.3 s, with room for a loaded machine)
    assert all(torch.equal(a, b) for s, d in zip(src[:5], dst[:5]) for a, b in zip(s, d))
    kv.delete(keys)


def test_a_batch_is_carved_side_by_side_and_copies_merge(worker):
    """Objects created by one mcreate lie back to back: one memmove run per contiguous source."""
    with kvstrata.connect(worker.address) as kv:
        keys = [f"side/{i}" for i in range(8)]
        kv.delete(keys)
        buf = torch.arange(8 * 128, dtype=torch.int32)
        src = [[buf[i * 128 : (i + 1) * 128]] for i in range(8)]  # 512 bytes each: whole 64-byte units
        seen = []
        real = device.enqueue
        device_enqueue = lambda runs, dev, s, **kw: seen.append(len(runs.host)) or real(runs, dev, s, **kw)
        try:
            device.enqueue = device_enqueue
            assert kv.mset_d2h(keys, src) == [None] * 8
        finally:
            device.enqueue = real
        assert seen == [1]
        dst = [[torch.zeros(128, dtype=torch.int32)] for _ in range(8)]
        assert kv.mget_h2d(keys, dst) == [None] * 8
        assert torch.equal(torch.cat([d[0] for d in dst]), buf)


@pytest.mark.gpu
def test_cuda_pipelined_mset_d2h_groups_exact_with_key_exists_in_the_tail(kv):
    """64 x 512 KiB from the GPU: four stages (created, copied and sealed stage by stage)."""
    n = 64
    keys = [f"gpu-pipe/{i}" for i in range(n)]
    kv.delete(keys)
    src = [[torch.randint(0, 255, (512 << 10,), dtype=torch.uint8, device="cuda")] for _ in range(n)]
    assert len(list(device.stages(n, src))) > 2
    assert kv.mset_d2h([keys[3], keys[n - 2]], [src[0], src[0]]) == [None, None]
    res = kv.mset_d2h(keys, src)
    assert [i for i, r in enumerate(res) if isinstance(r, KeyExists)] == [3, n - 2]
    assert all(r is None for i, r in enumerate(res) if i not in (3, n - 2))
    dst = [[torch.full_like(t, 0xAB) for t in ts] for ts in src]
    assert kv.mget_h2d(keys, dst) == [None] * n
    torch.cuda.synchronize()
    for i in range(n):
        want = src[0] if i in (3, n - 2) else src[i]
        assert torch.equal(want[0], dst[i][0])
    assert kv.stats()["creates_in_progress"] == 0
    kv.delete(keys)


# ------------------------------------------------------------------------------------- pipelined requests
def test_pipelined_requests_keep_their_replies_across_other_requests(worker):
    """Tagged requests in flight while ordinary ones come and go: each reply reaches its own sender."""
    with kvstrata.connect(worker.address) as kv:
        b = kv._backend
        keys = [f"tagged/{i}" for i in range(6)]
        kv.delete(keys)
        kv.set(keys[1], b"old")
        opts = {"ttl": None, "nx": True, "mode": "memory"}
        first = b.mcreate_start([(keys[0], 3), (keys[1], 3)], opts)
        second = b.mcreate_start([(keys[2], 5)], opts)
        assert kv.exists([keys[1], "tagged/none"]) == [True, False]  # read past both tagged replies
        assert kv.get(keys[1]) == b"old"
        locs = b.mcreate_finish(second)  # out of order: the stash has it
        assert len(locs) == 1 and locs[0].size == 5
        got = b.mcreate_finish(first)
        assert got[0].size == 3 and isinstance(got[1], KeyExists)
        seal = b.mseal_start([keys[0], keys[2], "tagged/never-created"])
        lease = b.acquire_start([keys[1]], 0)
        results = b.mseal_finish(seal)
        assert results[:2] == [None, None] and isinstance(results[2], KvstrataError)
        (one,) = b.acquire_finish(lease)
        assert bytes(b.view(one.location)) == b"old"
        kv._release_leases([one.lease_id])
        assert kv.exists(keys[:3]) == [True] * 3 and b._stash == {}
        kv.delete(keys)


def test_a_thread_waiting_for_a_pipelined_reply_does_not_hold_up_another_threads_sends(worker):
    """An async call's completion thread waits for its commits' answers while the issuing thread sends the next
    call's requests: the reader holds only the connection's reading."""
    import threading

    with kvstrata.connect(worker.address) as kv, kvstrata.connect(worker.address) as writer:
        b = kv._backend
        kv.delete(["tagged/late", "tagged/other"])
        tag = b.send_tagged({"op": "get", "key": "tagged/late", "timeout": 10.0})  # the worker waits for the key
        got: list = []
        reader = threading.Thread(target=lambda: got.append(b.tagged_reply(tag, 10.0)))
        reader.start()
        time.sleep(0.2)  # the reader is blocked on the socket by now
        t0 = time.monotonic()
        b.linger(100)  # one-way
        other = b.send_tagged({"op": "exists", "keys": ["tagged/other"]})
        sent = time.monotonic() - t0
        writer.set("tagged/late", b"here")
        reader.join(10)
        assert sent < 5 and not reader.is_alive()  # (sends held up by the reader would wait its 10 s)
        assert got and got[0]["v"] == b"here"
        assert b.tagged_reply(other)["r"] == [False]
        assert kv.exists(["tagged/late"]) == [True] and b._stash == {} and not b._untagged and not b._untagged_due
        kv.delete(["tagged/late"])


def test_a_refused_pipelined_request_raises_when_collected_and_leaves_the_connection_usable(worker):
    with kvstrata.connect(worker.address) as kv:
        b = kv._backend
        tag = b.send_tagged({"op": "no-such-op"})
        assert kv.exists(["tagged/x"]) == [False]
        with pytest.raises(KvstrataError, match="unknown request"):
            b.tagged_reply(tag)
        kv.set("tagged/x", b"1")
        assert kv.get("tagged/x") == b"1" and b._stash == {}
        kv.delete(["tagged/x"])


def test_a_refused_seal_is_reported_in_its_slot_and_leaves_no_create_open(kv, monkeypatch):
    keys = [f"pipe-refused/{i}" for i in range(5)]
    kv.delete(keys)
    monkeypatch.setattr(device, "stages", stages_of(2))
    backend = kv._backend
    real = backend.mseal_start

    def mseal_start(batch):
        if keys[3] in batch:
            backend.finish("abort", keys[3])  # gone before its seal: the worker refuses that one
        return real(batch)

    monkeypatch.setattr(backend, "mseal_start", mseal_start)
    res = kv.mset_d2h(keys, _lists(5))
    assert [r is None for r in res] == [True, True, True, False, True]
    assert isinstance(res[3], KvstrataError)
    monkeypatch.undo()
    assert kv.exists(keys) == [True, True, True, False, True] and kv.stats()["creates_in_progress"] == 0
    kv.delete(keys)


def test_pipelined_device_calls_and_plain_requests_share_a_client_across_threads(worker, monkeypatch):
    """Tagged replies read by whichever thread reads the connection next still reach their senders."""
    import threading

    monkeypatch.setattr(device, "stages", stages_of(2))
    errors: list[BaseException] = []
    with kvstrata.connect(worker.address) as kv:

        def device_calls(t: int) -> None:
            try:
                for r in range(15):
                    keys = [f"mt/{t}/{r}/{i}" for i in range(7)]
                    src = _lists(7, seed=t * 100 + r)
                    assert kv.mset_d2h(keys, src) == [None] * 7
                    dst = _poisoned(src)
                    assert kv.mget_h2d(keys, dst) == [None] * 7
                    assert all(torch.equal(a, b) for s, d in zip(src, dst) for a, b in zip(s, d))
                    kv.delete(keys)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        def plain_calls() -> None:
            try:
                for r in range(60):
                    kv.set(f"mt/plain/{r}", bytes([r]) * 100)
                    assert kv.get(f"mt/plain/{r}") == bytes([r]) * 100
                    assert kv.exists([f"mt/plain/{r}", "mt/none"]) == [True, False]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=device_calls, args=(t,)) for t in range(2)]
        threads.append(threading.Thread(target=plain_calls))
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not errors, errors
        assert kv._backend._stash == {} and kv.stats()["creates_in_progress"] == 0
        kv.delete([f"mt/plain/{r}" for r in range(60)])

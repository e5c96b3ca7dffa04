"""Pipelined broadcast chains without a GPU: the shared-memory progress counter, the chunk pump (with
fake events and a fake clock), and whole broadcasts between CPU clients of one process: several
receivers, chunk boundaries, a chain that really overlaps, a stalled predecessor (Timeout naming the
key and position), aborts (the sender or a receiver goes away) failing every receiver, and no
progress files left in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
import torch

from kvstrata import errors
from kvstrata.devobj import DeviceBroker, DeviceObjectConfig, DeviceObjects, InprocBrokerLink
from kvstrata.devobj import broadcast as bcast_mod
from kvstrata.devobj.chain import plan_chunks, pump
from kvstrata.devobj.progress import FAILED, PREFIX, SHM_DIR, Progress, sweep_stale

WAIT = 10
CHUNK = 4096
CFG = DeviceObjectConfig(allow_cpu=True, poll_seconds=0.05, chunk_bytes=CHUNK)


def my_progress_files() -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}p{os.getpid()}-")]


@pytest.fixture
def make():
    broker = DeviceBroker()
    made = []

    def _make(name: str, **cfg) -> DeviceObjects:
        c = DeviceObjects(
            InprocBrokerLink(broker, name), device="cpu", config=DeviceObjectConfig(**{**vars(CFG), **cfg})
        )
        made.append(c)
        return c

    _make.broker = broker
    yield _make
    for c in made:
        c.close()
    deadline = time.monotonic() + WAIT  # step threads end and release their counters
    while my_progress_files() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert my_progress_files() == []


# -- progress counter ---------------------------------------------------------------------------------
def test_progress_shared_by_name_and_nothing_left(tmp_path):
    w = Progress.create(tmp_path)
    assert w.value() == 0 and w.name.startswith(f"{PREFIX}p{os.getpid()}-")
    r = Progress.open(w.name, tmp_path)
    assert list(tmp_path.iterdir()) == []  # the reader unlinked the name; both mappings stay
    w.advance(5)
    assert r.value() == 5
    w.fail()
    assert r.value() == FAILED
    r.close()
    w.close()
    w.close()  # idempotent


def test_progress_creator_unlinks_when_never_opened(tmp_path):
    w = Progress.create(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [w.name]
    w.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        Progress.open(w.name, tmp_path)
    with pytest.raises(ValueError, match="progress"):
        Progress.open("../etc/passwd", tmp_path)


def test_stale_progress_of_dead_process_swept(tmp_path):
    p = subprocess.Popen(["true"])
    p.wait()  # reaped: the pid names no process
    stale = tmp_path / f"{PREFIX}p{p.pid}-{'0' * 32}"
    stale.write_bytes(b"\0" * 8)
    live = Progress.create(tmp_path)  # sweeps on create
    assert sorted(x.name for x in tmp_path.iterdir()) == [live.name]
    assert sweep_stale(tmp_path) == 0  # our own is alive
    live.close()


# -- the pump, with fake events -----------------------------------------------------------------------
class FakeEvent:
    def __init__(self, log: list, c: int) -> None:
        self.log, self.c, self.done = log, c, False

    def query(self) -> bool:
        return self.done


def test_pump_enqueues_only_available_and_publishes_only_completed():
    n = 5
    avail = [0]
    events: list[FakeEvent] = []
    published: list[int] = []
    log: list = []
    steps = iter(range(1000))

    def enqueue(c: int) -> FakeEvent:
        assert c < avail[0], "a chunk was copied before the predecessor had it"
        log.append(("enq", c))
        ev = FakeEvent(log, c)
        events.append(ev)
        return ev

    def publish(k: int) -> None:
        assert all(e.done for e in events[:k]), "published a chunk whose copy had not finished"
        published.append(k)

    def tick(_: float) -> None:  # the world moves between polls: predecessor first, then our copies
        i = next(steps)
        if i % 3 == 0 and avail[0] < n:
            avail[0] += 1
        elif i % 3 == 1:
            for e in events:
                if not e.done:
                    e.done = True
                    break

    recycled = []
    pump(
        n,
        enqueue,
        available=lambda: avail[0],
        publish=publish,
        aborted=lambda: None,
        recycle=recycled.append,
        timeout=1.0,
        what="w",
        sleep=tick,
    )
    assert [c for _, c in log] == list(range(n))
    assert published == sorted(set(published)) and published[-1] == n
    assert recycled == events


def test_pump_cpu_copies_complete_at_once_and_available_beyond_plan_is_capped():
    got = []
    pump(3, lambda c: got.append(c), available=lambda: 10, publish=None, aborted=lambda: None, timeout=1, what="w")
    assert got == [0, 1, 2]


def fake_clock():
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += max(s, 1e-3)

    return (lambda: now[0]), sleep


def test_pump_stalled_predecessor_times_out_naming_where():
    clock, sleep = fake_clock()
    with pytest.raises(errors.Timeout, match=r"bcast 'k' at position 2: the predecessor has 1 of 4 chunks"):
        pump(
            4,
            lambda c: None,
            available=lambda: 1,
            publish=None,
            aborted=lambda: None,
            timeout=0.5,
            what="bcast 'k' at position 2",
            clock=clock,
            sleep=sleep,
        )


def test_pump_stuck_copy_times_out():
    clock, sleep = fake_clock()
    with pytest.raises(errors.Timeout, match="copy of chunk 0 of 2 did not finish"):
        pump(
            2,
            lambda c: FakeEvent([], c),
            available=lambda: 2,
            publish=None,
            aborted=lambda: None,
            timeout=0.5,
            what="w",
            clock=clock,
            sleep=sleep,
        )


def test_pump_stops_on_abort_and_on_failed_predecessor():
    with pytest.raises(errors.ClosedError, match="gone"):
        pump(2, lambda c: None, available=lambda: 0, publish=None, aborted=lambda: errors.ClosedError("gone"),
             timeout=5, what="w")  # fmt: skip
    with pytest.raises(errors.ServerError, match="predecessor's copy failed"):
        pump(2, lambda c: None, available=lambda: FAILED, publish=None, aborted=lambda: None, timeout=5, what="w")


def test_plan_chunks_boundaries():
    specs = [{"nbytes": 10}, {"nbytes": 0}, {"nbytes": 8}, {"nbytes": 3}]
    assert plan_chunks(specs, 4) == [(0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 0), (2, 0, 4), (2, 4, 4), (3, 0, 3)]


# -- whole broadcasts between CPU clients ---------------------------------------------------------------
def tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 255, (3 * CHUNK + 5,), generator=g, dtype=torch.uint8),  # odd tail
        torch.randn(7, 3, generator=g),  # smaller than a chunk
        torch.randn(CHUNK // 2, generator=g).to(torch.bfloat16),  # exactly one chunk
        torch.zeros(0, dtype=torch.int32),  # empty
        *[torch.arange(i + 1, dtype=torch.int64) for i in range(12)],  # many small tensors
    ]


def broadcast(make, n: int, key: str = "w", seed: int = 1, **cfg):
    sender = make("sender", **cfg)
    receivers = [make(f"r{i}", **cfg) for i in range(n)]
    src = tensors(seed)
    dsts = [[torch.full_like(t, 7) for t in src] for _ in receivers]
    futs = [r.dev_subscribe([key], [d], timeout=WAIT)[0] for r, d in zip(receivers, dsts)]
    return sender, receivers, src, dsts, futs, sender.dev_broadcast(key, src, receivers=n)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_broadcast_many_receivers_exact(make, n):
    _, receivers, src, dsts, futs, sf = broadcast(make, n)
    keep = [t.clone() for t in src]
    for f in futs:
        f.result(WAIT)
    sf.result(WAIT)
    for d in dsts:
        assert all(torch.equal(a, b) for a, b in zip(d, keep))
    assert all(torch.equal(a, b) for a, b in zip(src, keep))  # the source is untouched
    positions = sorted(e["position"] for r in receivers for e in r.broadcast_log())
    assert positions == list(range(n))
    assert make.broker.snapshot()["objects"] == {}


def test_chain_overlaps_chunk_by_chunk(make, monkeypatch):
    """Position 1 copies its first chunk while position 0 is still copying (not hop by hop)."""
    order: list[tuple[int, int]] = []
    real = bcast_mod.pump

    def slow_first(n, enqueue, **kw):
        pos = int(kw["what"].split("at position ")[1].split()[0])

        def enq(c: int):
            order.append((pos, c))
            if pos == 0:
                time.sleep(0.01)  # position 0's copies are slow: its successor must not wait for all
            return enqueue(c)

        return real(n, enq, **kw)

    monkeypatch.setattr(bcast_mod, "pump", slow_first)
    _, _, src, dsts, futs, sf = broadcast(make, 2)
    for f in [*futs, sf]:
        f.result(WAIT)
    first_of_1 = order.index((1, 0))
    last_of_0 = max(i for i, (p, _) in enumerate(order) if p == 0)
    assert first_of_1 < last_of_0, order
    assert all(torch.equal(a, b) for a, b in zip(dsts[1], src))


def cap_publish(monkeypatch, position: int, cap: int) -> None:
    """The receiver at ``position`` copies everything but tells its successor only ``cap`` chunks."""
    real = bcast_mod.pump

    def capped(n, enqueue, **kw):
        if f"at position {position} " in kw["what"] and kw["publish"] is not None:
            pub = kw["publish"]
            kw["publish"] = lambda k: pub(min(k, cap))
        return real(n, enqueue, **kw)

    monkeypatch.setattr(bcast_mod, "pump", capped)


def test_stalled_predecessor_times_out_and_fails_everyone(make, monkeypatch):
    cap_publish(monkeypatch, position=1, cap=1)
    _, _, _, _, futs, sf = broadcast(make, 3, copy_timeout=0.3)
    with pytest.raises(errors.Timeout, match=r"broadcast of 'w' at position 2 of 3: the predecessor has 1 of"):
        futs[2].result(WAIT)
    for f in futs[:2]:  # they have all the bytes, but the broadcast failed: not reported as done
        with pytest.raises(errors.ServerError, match="Aborted"):
            f.result(WAIT)
    with pytest.raises(errors.ServerError, match="failed"):
        sf.result(WAIT)
    assert make.broker.snapshot()["objects"] == {}


@pytest.mark.parametrize("who", ["sender", "r0", "r2"])
def test_abort_mid_broadcast_fails_every_receiver(make, monkeypatch, who):
    cap_publish(monkeypatch, position=0, cap=1)  # the chain stalls after chunk 0 (long copy_timeout)
    sender, receivers, _, _, futs, sf = broadcast(make, 3)
    time.sleep(0.1)  # every step is polling
    assert not any(f.done() for f in futs)
    t0 = time.monotonic()
    {"sender": sender, "r0": receivers[0], "r2": receivers[2]}[who].close()
    for f in [*futs, sf]:
        with pytest.raises(errors.KvstrataError):
            f.result(WAIT)
    assert time.monotonic() - t0 < 5  # the poll loops saw the abort; nobody waited for copy_timeout
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline and any(t.name.startswith("kvstrata-bcast-") for t in threading.enumerate()):
        time.sleep(0.01)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kvstrata-bcast-")]
    assert make.broker.snapshot()["objects"] == {}


def test_receiver_gone_before_its_step_starts(make):
    """A receiver that leaves after subscribing (before all joined) never breaks the others' later broadcast."""
    sender = make("s")
    r = [make(f"r{i}") for i in range(3)]
    src = tensors(3)
    dsts = [[torch.full_like(t, 7) for t in src] for _ in r]
    f0 = r[0].dev_subscribe(["k"], [dsts[0]], timeout=WAIT)[0]
    r[0].close()
    with pytest.raises(errors.ClosedError):
        f0.result(WAIT)
    futs = [x.dev_subscribe(["k"], [d], timeout=WAIT)[0] for x, d in zip(r[1:], dsts[1:])]
    sf = sender.dev_broadcast("k", src, receivers=2)
    for f in [*futs, sf]:
        f.result(WAIT)
    assert all(torch.equal(a, b) for d in dsts[1:] for a, b in zip(d, src))


# -- GPU-side waits ("stream"): what can be checked without a GPU ---------------------------------------
def test_broadcast_wait_validated_and_cpu_falls_back_to_host(make):
    with pytest.raises(ValueError, match="broadcast_wait"):
        DeviceObjectConfig(broadcast_wait="gpu")
    _, _, src, dsts, futs, sf = broadcast(make, 3, broadcast_wait="stream")  # CPU tensors: host waits
    for f in [*futs, sf]:
        f.result(WAIT)
    assert all(torch.equal(a, b) for d in dsts for a, b in zip(d, src))


def test_progress_device_ptr_registered_once_and_unregistered_on_close(tmp_path):
    from kvstrata.memory import is_registered

    w = Progress.create(tmp_path)
    ptr = w.device_ptr()
    assert w.device_ptr() == ptr and is_registered(ptr, 8)  # without CUDA: the host address, recorded
    w.release_waiters()
    assert w.value() == (1 << 30) - 1
    w.close()
    assert not is_registered(ptr, 8)


def test_gpu_wait_and_write_call_the_driver_with_geq_and_barrier(monkeypatch):
    from kvstrata.devobj import progress

    calls = []

    class FakeDriver:
        def CUstream(self, h):
            return ("stream", h)

        def CUdeviceptr(self, p):
            return p

        def cuStreamWaitValue32(self, *a):
            calls.append(("wait", *a))
            return (0,)

        def cuStreamWriteValue32(self, *a):
            calls.append(("write", *a))
            return (0,)

    monkeypatch.setattr(progress, "_driver", lambda: FakeDriver())
    stream = type("S", (), {"cuda_stream": 1234})()
    progress.gpu_wait(stream, 0x1000, 3)
    progress.gpu_write(stream, 0x2000, 4)
    assert calls == [("wait", ("stream", 1234), 0x1000, 3, 0), ("write", ("stream", 1234), 0x2000, 4, 0)]
    monkeypatch.setattr(FakeDriver, "cuStreamWaitValue32", lambda self, *a: (7,))
    with pytest.raises(RuntimeError, match="cuStreamWaitValue32 failed"):
        progress.gpu_wait(stream, 0x1000, 3)


def test_waiting_chain_step_does_not_hold_back_other_copies(make, monkeypatch):
    """A chain step waits on its predecessor for the whole broadcast: it runs on a thread of its own,
    so the client's copy pool (one thread here) still serves other receives meanwhile."""
    cap_publish(monkeypatch, position=0, cap=1)  # position 1 waits (copy_timeout: 120 s)
    s, r0, r1 = make("s"), make("r0"), make("r1", copy_threads=1)
    src = tensors(5)
    futs = [r.dev_subscribe(["b"], [[torch.full_like(t, 7) for t in src]], timeout=WAIT)[0] for r in (r0, r1)]
    sf = s.dev_broadcast("b", src, receivers=2)
    big = [torch.arange(1 << 19, dtype=torch.int32)]  # 2 MiB: copied on the pool, not inline
    dst = [torch.zeros_like(big[0])]
    s.dev_publish(["other"], [big])
    r1.dev_subscribe(["other"], [dst], timeout=WAIT)[0].result(WAIT)
    assert torch.equal(dst[0], big[0])
    assert not any(f.done() for f in [*futs, sf])  # the broadcast is still waiting
    s.close()
    for f in futs:
        with pytest.raises(errors.KvstrataError):
            f.result(WAIT)

"""Whole broadcasts between CPU clients of one process, with GPUs faked by device uuids: one copying
leader per "GPU" and members that receive exact bytes without copying, a chain of leaders that really
overlaps, a stalled predecessor (Timeout naming the key and position), a failing leader that stops
its members at once, aborts (the sender, a leader or a member goes away) failing every receiver, and
no progress files or step threads left behind."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from kvstrata import errors
from kvstrata.devobj import DeviceBroker, DeviceObjectConfig, DeviceObjects, InprocBrokerLink
from kvstrata.devobj import broadcast as bcast_mod
from kvstrata.devobj.progress import PREFIX, SHM_DIR

WAIT = 10
CHUNK = 4096
CFG = DeviceObjectConfig(allow_cpu=True, poll_seconds=0.05, chunk_bytes=CHUNK)


def my_progress_files() -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}p{os.getpid()}-")]


def bcast_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvstrata-bcast-")]


@pytest.fixture
def make(monkeypatch):
    """``make(name, gpu="A", **config)``: a CPU client whose device the broker sees as fake GPU ``gpu``."""
    broker = DeviceBroker()
    made = []
    gpus: dict[str, str] = {}
    monkeypatch.setattr(
        DeviceObjects, "_device_info", lambda self: {"uuid": gpus[self.link.client_id], "index": -1}, raising=True
    )

    def _make(name: str, gpu: str = "A", **cfg) -> DeviceObjects:
        gpus[name] = f"GPU-{gpu}"
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
    while (my_progress_files() or bcast_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert my_progress_files() == [] and bcast_threads() == []


def tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 255, (3 * CHUNK + 5,), generator=g, dtype=torch.uint8),  # odd tail
        torch.randn(7, 3, generator=g),  # smaller than a chunk
        torch.randn(CHUNK // 2, generator=g).to(torch.bfloat16),  # exactly one chunk
        torch.zeros(0, dtype=torch.int32),  # empty
        *[torch.arange(i + 1, dtype=torch.int64) for i in range(12)],  # many small tensors
    ]


def broadcast(make, layout: str = "A:AAA", key: str = "w", seed: int = 1, **cfg):
    """``layout``: the sender's fake GPU, then each receiver's (``"A:BAB"``: the bench's layout)."""
    s_gpu, r_gpus = layout.split(":")
    sender = make("sender", s_gpu, **cfg)
    receivers = [make(f"r{i}", g, **cfg) for i, g in enumerate(r_gpus)]
    src = tensors(seed)
    dsts = [[torch.full_like(t, 7) for t in src] for _ in receivers]
    futs = [r.dev_subscribe([key], [d], timeout=WAIT)[0] for r, d in zip(receivers, dsts)]
    return sender, receivers, src, dsts, futs, sender.dev_broadcast(key, src, receivers=len(receivers))


def roles(receivers) -> dict[str, tuple[int, str]]:
    return {r.link.client_id: (e["position"], e["role"]) for r in receivers for e in r.broadcast_log()}


@pytest.mark.parametrize("layout", ["A:A", "A:AA", "A:AAAAA", "A:BAB", "A:BBB", "A:CBA", "A:ABCBCA", "A:BCB"])
def test_broadcast_one_leader_per_gpu_members_exact(make, layout):
    _, receivers, src, dsts, futs, sf = broadcast(make, layout)
    keep = [t.clone() for t in src]
    for f in [*futs, sf]:
        f.result(WAIT)
    for d in dsts:
        assert all(torch.equal(a, b) for a, b in zip(d, keep))
    assert all(torch.equal(a, b) for a, b in zip(src, keep))  # the source is untouched
    got = roles(receivers)
    assert sorted(p for p, _ in got.values()) == list(range(len(receivers)))
    gpus = layout.split(":")[1]
    assert sum(role == "leader" for _, role in got.values()) == len(set(gpus))  # one copying process per GPU
    for gpu in set(gpus):  # its leader is the first to arrive there; the sender's GPU comes first
        first = f"r{gpus.index(gpu)}"
        assert got[first][1] == "leader"
    if "A" in gpus:
        assert got[f"r{gpus.index('A')}"][0] == 0
    assert make.broker.snapshot()["objects"] == {}


def test_members_hear_of_chunks_while_the_leader_pulls(make, monkeypatch):
    """The leader's pulls are slow: its member has chunks before the leader pulled the last one."""
    order: list[tuple[str, int]] = []
    real_pump, real_member = bcast_mod.pump, bcast_mod.Member

    def slow_pulls(n, enqueue, **kw):
        if kw.get("fanout") is None:  # the member's watch: nothing to enqueue
            return real_pump(n, enqueue, **kw)

        def enq(c: int):
            order.append(("pull", c))
            time.sleep(0.02)
            return enqueue(c)

        return real_pump(n, enq, **kw)

    def member(position, target, publish, fail, close):
        return real_member(position, target, lambda k: (order.append(("landed", k)), publish(k)), fail, close)

    monkeypatch.setattr(bcast_mod, "pump", slow_pulls)
    monkeypatch.setattr(bcast_mod, "Member", member)
    _, _, src, dsts, futs, sf = broadcast(make, "A:AA")
    for f in [*futs, sf]:
        f.result(WAIT)
    last_pull = max(i for i, (what, _) in enumerate(order) if what == "pull")
    first_landed = next(i for i, (what, _) in enumerate(order) if what == "landed")
    assert first_landed < last_pull, order
    assert max(k for what, k in order if what == "landed") == order[last_pull][1] + 1
    assert all(torch.equal(a, b) for a, b in zip(dsts[1], src))


def test_chain_of_leaders_overlaps_chunk_by_chunk(make, monkeypatch):
    """Three GPUs, none the sender's: GPU C's leader copies its first chunk while GPU B's is still
    copying (it pulls from B's leader, chunk by chunk, not hop by hop)."""
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
    _, _, src, dsts, futs, sf = broadcast(make, "A:BC")
    for f in [*futs, sf]:
        f.result(WAIT)
    first_of_1 = order.index((1, 0))
    last_of_0 = max(i for i, (p, _) in enumerate(order) if p == 0)
    assert first_of_1 < last_of_0, order
    assert all(torch.equal(a, b) for a, b in zip(dsts[1], src))


def wrap_pump(monkeypatch, position: int, **caps) -> None:
    """The receiver at ``position``: ``publish`` / ``available`` capped at ``caps`` chunks, or ``fail_at``
    chunk ``c``: its enqueue raises there."""
    real = bcast_mod.pump

    def wrapped(n, enqueue, **kw):
        if f"at position {position} " in kw["what"]:
            if "publish" in caps and kw["publish"] is not None:
                pub = kw["publish"]
                kw["publish"] = lambda k: pub(min(k, caps["publish"]))
            if "available" in caps:
                avail = kw["available"]
                kw["available"] = lambda: min(avail(), caps["available"])
            if "fail_at" in caps:
                enq = enqueue

                def enqueue(c: int):
                    if c == caps["fail_at"]:
                        raise RuntimeError("injected copy failure")
                    return enq(c)

        return real(n, enqueue, **kw)

    monkeypatch.setattr(bcast_mod, "pump", wrapped)


def test_stalled_predecessor_times_out_and_fails_everyone(make, monkeypatch):
    # r0 on A (from the sender), r1 on B (from the sender too: A is the sender's GPU), r2 on C (from r1)
    wrap_pump(monkeypatch, position=1, publish=1)
    _, _, _, _, futs, sf = broadcast(make, "A:ABC", copy_timeout=0.3)
    with pytest.raises(errors.Timeout, match=r"broadcast of 'w' at position 2 of 3: the predecessor has 1 of"):
        futs[2].result(WAIT)
    for f in futs[:2]:  # they have all the bytes, but the broadcast failed: not reported as done
        with pytest.raises(errors.ServerError, match="Aborted"):
            f.result(WAIT)
    with pytest.raises(errors.ServerError, match="failed"):
        sf.result(WAIT)
    assert make.broker.snapshot()["objects"] == {}


def test_failing_leader_stops_its_members_at_once(make, monkeypatch):
    wrap_pump(monkeypatch, position=1, fail_at=2)  # B's leader (r0 is A's)
    _, _, _, _, futs, sf = broadcast(make, "A:ABBB")
    t0 = time.monotonic()
    with pytest.raises((RuntimeError, errors.ServerError), match="injected"):  # its own error, or the abort
        futs[1].result(WAIT)
    for f in (futs[2], futs[3], sf):  # its members' errors and the sender's name the cause
        with pytest.raises(errors.KvstrataError, match="injected copy failure"):
            f.result(WAIT)
    with pytest.raises(errors.KvstrataError):  # GPU A's leader: aborted (or its source already released)
        futs[0].result(WAIT)
    # The leader drained and wrote FAILED into its members' counters: they did not wait out their bound.
    assert time.monotonic() - t0 < bcast_mod.MEMBER_STOP_WAIT
    assert make.broker.snapshot()["objects"] == {}


@pytest.mark.parametrize("who", ["sender", "r0", "r2", "r1"])
@pytest.mark.parametrize("layout", ["A:AAA", "A:BBB"])
def test_abort_mid_broadcast_fails_every_receiver(make, monkeypatch, who, layout):
    """r0 leads, r1 and r2 are its members; the leader stalls after chunk 0 (long copy_timeout); then one
    goes away: everyone fails soon (a member's departure does not leave its leader waiting)."""
    wrap_pump(monkeypatch, position=0, available=1)
    sender, receivers, _, _, futs, sf = broadcast(make, layout)
    time.sleep(0.1)  # every step is polling
    assert not any(f.done() for f in [*futs, sf])
    t0 = time.monotonic()
    {"sender": sender, "r0": receivers[0], "r1": receivers[1], "r2": receivers[2]}[who].close()
    for f in [*futs, sf]:
        with pytest.raises(errors.KvstrataError):
            f.result(WAIT)
    assert time.monotonic() - t0 < 5  # the poll loops saw the abort; nobody waited for copy_timeout
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline and bcast_threads():
        time.sleep(0.01)
    assert not bcast_threads()
    assert make.broker.snapshot()["objects"] == {}


def test_member_aborted_before_its_leader_attached_it_takes_its_counter_back(make, monkeypatch):
    """The leader never sees the member's export (held back); the member aborts at once (its counter was
    never opened, so nothing can write into its buffers), and the leader fails instead of writing."""
    real = bcast_mod.BroadcastReceiver._on_chain_event
    held: list = []

    def hold(self, want, ev):
        if ev["type"] == "member_ready":
            held.append((self, want, ev))
            return
        real(self, want, ev)

    monkeypatch.setattr(bcast_mod.BroadcastReceiver, "_on_chain_event", hold)
    _, receivers, _, _, futs, sf = broadcast(make, "A:AA")
    deadline = time.monotonic() + WAIT
    while not held and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    receivers[1].close()
    with pytest.raises(errors.ClosedError):
        futs[1].result(WAIT)
    assert time.monotonic() - t0 < bcast_mod.MEMBER_STOP_WAIT
    assert not (SHM_DIR / held[0][2]["member"]["progress"]).exists()  # a late leader cannot open it
    real(*held[0])  # the export arrives late: dropped (the leader's step is over)
    for f in (futs[0], sf):
        with pytest.raises(errors.KvstrataError):
            f.result(WAIT)


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


def test_broadcast_wait_validated_and_cpu_falls_back_to_host(make):
    with pytest.raises(ValueError, match="broadcast_wait"):
        DeviceObjectConfig(broadcast_wait="gpu")
    _, _, src, dsts, futs, sf = broadcast(make, "A:BAB", broadcast_wait="stream")  # CPU tensors: host waits
    for f in [*futs, sf]:
        f.result(WAIT)
    assert all(torch.equal(a, b) for d in dsts for a, b in zip(d, src))


def test_waiting_broadcast_steps_do_not_hold_back_other_copies(make, monkeypatch):
    """A leader waits on its predecessor and a member on its leader for the whole broadcast: both run on
    threads of their own, so the clients' copy pools (one thread here) still serve other receives."""
    wrap_pump(monkeypatch, position=0, available=1)  # r0 leads and stalls; r1, its member, waits
    s, r0, r1 = make("s"), make("r0", copy_threads=1), make("r1", copy_threads=1)
    src = tensors(5)
    futs = [r.dev_subscribe(["b"], [[torch.full_like(t, 7) for t in src]], timeout=WAIT)[0] for r in (r0, r1)]
    sf = s.dev_broadcast("b", src, receivers=2)
    big = [torch.arange(1 << 19, dtype=torch.int32)]  # 2 MiB: copied on the pool, not inline
    for i, r in enumerate((r0, r1)):
        dst = [torch.zeros_like(big[0])]
        s.dev_publish([f"other{i}"], [big])
        r.dev_subscribe([f"other{i}"], [dst], timeout=WAIT)[0].result(WAIT)
        assert torch.equal(dst[0], big[0])
    assert not any(f.done() for f in [*futs, sf])  # the broadcast is still waiting
    s.close()
    for f in futs:
        with pytest.raises(errors.KvstrataError):
            f.result(WAIT)

"""Leader/follower on a device-object client's event connection (kvstrata.devobj.lead), through a real worker
on CPU: the thread waiting in ``result()`` receives and copies its own match; timeouts, cancellation, close,
a subscribe's own timeout, an owner killed mid-hand-off, several waiters and many pairs both ways."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from kvstrata import errors
from kvstrata.devobj import DeviceObjectConfig, DeviceObjects
from kvstrata.devobj.lead import PollRole

CFG = DeviceObjectConfig(allow_cpu=True, poll_seconds=0.2)
WAIT = 20.0


def _who_starts(c: DeviceObjects) -> dict[str, str]:
    """Key -> name of the thread that started its copy (the match's reader)."""
    seen: dict[str, str] = {}
    real = c._start

    def start(t, want):
        seen[t["key"]] = threading.current_thread().name
        return real(t, want)

    c._start = start
    return seen


def _later(delay: float, fn, *args) -> threading.Thread:
    def run():
        time.sleep(delay)
        fn(*args)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _once_leading(c: DeviceObjects, fn, *args) -> threading.Thread:
    """``fn(*args)`` on another thread once this thread leads ``c``'s events (it waits in ``result()``): a fixed
    delay let the event thread read the match first whenever this thread came late into ``result()`` (a loaded
    machine), and copy it itself."""
    me = threading.current_thread()

    def run():
        deadline = time.monotonic() + WAIT
        while c._role.leader() is not me and time.monotonic() < deadline:
            time.sleep(0.001)
        fn(*args)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _who_takes_offers(c: DeviceObjects) -> dict[str, str]:
    """Key -> name of the thread that took its offer (kvstrata.devobj.offers)."""
    seen: dict[str, str] = {}
    real = c._on_offer

    def on_offer(offer):
        seen[offer["k"]] = threading.current_thread().name
        return real(offer)

    c._on_offer = on_offer
    return seen


@pytest.mark.parametrize("offers", [False, True], ids=["match", "offer"])
def test_the_waiter_copies_its_own_match_and_the_owner_is_released(make, offers):
    """The waiter copies its match itself, or the publisher's offer (the match then only confirms it, read by
    whichever thread reads events next)."""
    a, b = make(), make()
    a.send_offers = offers
    assert b._role is not None
    seen = _who_starts(b)
    took = _who_takes_offers(b)
    pubs = []
    for i in range(5):
        src = torch.arange(4096, dtype=torch.uint8) + i
        dst = torch.full((4096,), 7, dtype=torch.uint8)
        fut = b.dev_subscribe([f"k{i}"], [[dst]], timeout=WAIT)[0]
        _once_leading(b, lambda s=src, i=i: pubs.append(a.dev_publish([f"k{i}"], [[s]])[0]))
        assert fut.result(WAIT) is None and torch.equal(dst, src)
    me = threading.current_thread().name
    if offers:
        assert took == {f"k{i}": me for i in range(5)} and b.offers_used == 5
    else:
        assert set(seen.values()) == {me} and not took  # no other thread of b touched a match
    deadline = time.monotonic() + WAIT
    while len(pubs) < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    for p in pubs:
        assert p.result(WAIT) is None  # the completions reached the broker (the event thread's next poll)
    assert b._role.leader() is None  # given back: the event thread reads again


def test_publisher_first_and_no_lead_when_turned_off(make, monkeypatch):
    a, b = make(), make()
    src = torch.arange(64, dtype=torch.int64)
    pub = a.dev_publish(["p"], [[src]])[0]
    dst = torch.zeros(64, dtype=torch.int64)
    assert b.dev_subscribe(["p"], [[dst]], timeout=WAIT)[0].result(WAIT) is None and torch.equal(dst, src)
    assert pub.result(WAIT) is None
    monkeypatch.setenv("KVSTRATA_DEVOBJ_LEAD", "0")
    c = make()
    assert c._role is None
    seen = _who_starts(c)
    fut = c.dev_subscribe(["q"], [[dst]], timeout=WAIT)[0]
    _later(0.03, a.dev_publish, ["q"], [[src + 1]])
    assert fut.result(WAIT) is None and torch.equal(dst, src + 1)
    assert seen["q"] == "kvstrata-devobj-poll"


@pytest.mark.parametrize("publisher_first", [False, True])
def test_completions_reach_the_broker_at_once_either_side_first(make, publisher_first):
    """The publisher's future completes without waiting for the reader's next poll (5 s away here): after a
    led receive the event thread's next poll carries the completion; after one copied inline on the caller's
    thread, the thread reading events is woken to send it."""
    slow = DeviceObjectConfig(allow_cpu=True, poll_seconds=5.0)
    a, b = make(slow), make(slow)
    for i in range(3):
        src = torch.arange(100, dtype=torch.int32) * (i + 1)
        dst = torch.zeros(100, dtype=torch.int32)
        if publisher_first:
            pub = a.dev_publish([f"c{i}"], [[src]])[0]
            fut = b.dev_subscribe([f"c{i}"], [[dst]], timeout=WAIT)[0]
        else:
            fut = b.dev_subscribe([f"c{i}"], [[dst]], timeout=WAIT)[0]
            box = []
            _later(0.02, lambda s=src, i=i, box=box: box.append(a.dev_publish([f"c{i}"], [[s]])[0]))
        assert fut.result(WAIT) is None and torch.equal(dst, src)
        if not publisher_first:
            deadline = time.monotonic() + WAIT
            while not box and time.monotonic() < deadline:
                time.sleep(0.002)
            pub = box[0]
        assert pub.result(2.0) is None  # well before the 5 s poll would have carried it


def test_result_timeout_gives_the_role_back_and_the_match_still_lands(make):
    a, b = make(), make()
    dst = torch.zeros(16)
    fut = b.dev_subscribe(["late"], [[dst]], timeout=WAIT)[0]
    t0 = time.monotonic()
    with pytest.raises(cf.TimeoutError):
        fut.result(0.05)
    assert time.monotonic() - t0 < 2.0
    assert b._role.leader() is None
    src = torch.arange(16, dtype=torch.float32)
    a.dev_publish(["late"], [[src]])
    deadline = time.monotonic() + WAIT
    while not fut.done() and time.monotonic() < deadline:  # nobody in result(): the event thread copies it
        time.sleep(0.005)
    assert fut.result(0) is None and torch.equal(dst, src)


def test_subscribe_timeout_while_leading(make):
    b = make()
    fut = b.dev_subscribe(["never"], [[torch.zeros(4)]], timeout=0.1)[0]
    t0 = time.monotonic()
    with pytest.raises(errors.Timeout):
        fut.result(WAIT)
    assert time.monotonic() - t0 < 5.0


def test_cancel_from_another_thread_wakes_the_leader(make):
    a, b = make(), make()
    dst = torch.full((8,), 7.0)
    fut = b.dev_subscribe(["c"], [[dst]], timeout=WAIT)[0]
    _later(0.05, fut.cancel)
    t0 = time.monotonic()
    with pytest.raises(cf.CancelledError):
        fut.result(WAIT)
    assert time.monotonic() - t0 < 5.0
    a.dev_publish(["c"], [[torch.ones(8)]])  # withdrawn: the object stays for the next subscriber
    other = torch.zeros(8)
    assert b.dev_subscribe(["c"], [[other]], timeout=WAIT)[0].result(WAIT) is None
    assert torch.equal(other, torch.ones(8)) and bool((dst == 7).all())


def test_close_from_another_thread_wakes_the_leader(make):
    b = make()
    fut = b.dev_subscribe(["gone"], [[torch.zeros(4)]])  # no timeout: only the close can end it
    _later(0.05, b.close)
    t0 = time.monotonic()
    with pytest.raises(errors.ClosedError):
        fut[0].result(WAIT)
    assert time.monotonic() - t0 < 5.0


def test_several_waiters_one_leads_all_land(make):
    a, b = make(), make()
    n = 6
    dsts = [torch.full((256,), -1, dtype=torch.int32) for _ in range(n)]
    futs = [b.dev_subscribe([f"w{i}"], [[dsts[i]]], timeout=WAIT)[0] for i in range(n)]
    out: list = [None] * n

    def wait(i):
        try:
            out[i] = futs[i].result(WAIT)
        except BaseException as exc:  # reported below
            out[i] = exc

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(0.02)
    for i in range(n):
        a.dev_publish([f"w{i}"], [[torch.full((256,), i, dtype=torch.int32)]])
    for t in threads:
        t.join(WAIT)
    assert out == [None] * n
    assert all(bool((d == i).all()) for i, d in enumerate(dsts))


def test_many_pairs_both_directions_with_leading_waiters(make):
    """Each client publishes to the other and waits on its own receives from several threads: no deadlock."""
    a, b = make(), make()
    errs: list = []

    def side(me, peer, tag, i):
        try:
            dst = torch.zeros(32, dtype=torch.int64)
            fut = me.dev_subscribe([f"{tag}{i}"], [[dst]], timeout=WAIT)[0]
            peer.dev_publish([f"{'ba'[tag == 'b']}{i}"], [[torch.full((32,), i, dtype=torch.int64)]])
            fut.result(WAIT)
            assert bool((dst == i).all())
        except BaseException as exc:
            errs.append(exc)

    threads = [
        threading.Thread(target=side, args=(me, peer, tag, i))
        for i in range(8)
        for me, peer, tag in ((a, b, "a"), (b, a, "b"))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads) and errs == []


def _owner(address: str, go, ready) -> None:
    import kvstrata

    c = kvstrata.connect(address)
    c.device_objects(device="cpu", config=DeviceObjectConfig(allow_cpu=True))
    go.wait(WAIT)
    c.dev_publish(["doomed"], [[torch.arange(512, dtype=torch.uint8)]])
    ready.set()
    time.sleep(60)  # killed by the test


def test_owner_killed_mid_hand_off_fails_the_leading_waiter(make, worker, monkeypatch):
    # The owner sends no offer (kvstrata.devobj.offers): the copy killing it is the match's, after its publish
    # (an offer's copy could kill it before its publish reached the broker; test_devobj_offers covers that).
    monkeypatch.setenv("KVSTRATA_DEVOBJ_OFFERS", "0")
    ctx = mp.get_context("spawn")
    go, ready = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_owner, args=(worker.address, go, ready), daemon=True)
    p.start()
    try:
        b = make()
        dst = torch.full((512,), 7, dtype=torch.uint8)

        def sources(src, peer, reuse=False):  # the CUDA IPC import's stand-in: the owner dies as we copy
            os.kill(p.pid, signal.SIGKILL)
            p.join(WAIT)
            return [torch.arange(512, dtype=torch.uint8)], []

        b._sources = sources
        seen = _who_starts(b)
        fut = b.dev_subscribe(["doomed"], [[dst]], timeout=WAIT)[0]
        go.set()
        with pytest.raises(errors.KvstrataError, match=r"went away|gone"):
            fut.result(WAIT)  # never reported done: the owner died before the copy was known good
        assert seen["doomed"] == threading.current_thread().name  # the waiter read the match itself
        deadline = time.monotonic() + WAIT
        while "doomed" in worker.devobj_broker.snapshot()["objects"] and time.monotonic() < deadline:
            time.sleep(0.01)  # the worker drops the dead owner's keys once it sees its connection end
        assert "doomed" not in worker.devobj_broker.snapshot()["objects"]
    finally:
        if p.is_alive():
            p.kill()
        p.join(WAIT)


def test_poll_role_hands_over_and_wakes():
    r, w = os.pipe()
    try:
        role = PollRole(r)
        stop = threading.Event()
        assert role.take_for_events(stop.is_set)
        got = []
        t = threading.Thread(target=lambda: got.append(role.take_for_waiter(time.monotonic() + WAIT)))
        t.start()
        assert not role.wait_readable(WAIT)  # the waiter's wish wakes the holder (the connection has no data)
        role.give_back()
        t.join(WAIT)
        assert got == [True] and role.leader() is t
        assert not role.take_for_waiter(time.monotonic() + 0.01)  # one leader at a time
        role.give_back()
        os.write(w, b"x")
        assert role.take_for_events(stop.is_set) and role.wait_readable(0.0, spin=1e-3)
        role.give_back()
        role.close()
        assert not role.take_for_waiter(None)
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "devices", [pytest.param((0, 0), id="gpu0"), pytest.param((0, 1), id="gpu0-gpu1", marks=pytest.mark.multigpu)]
)
def test_gpu_waiter_copies_its_own_match_on_the_clients_gpu(worker, devices):
    """The leading waiter runs the copy (of the match, or of the publisher's offer) with the receiving client's GPU
    current, whatever its own thread's is; exact bytes, nothing outside the destination touched, the source
    unchanged."""
    from kvstrata.devobj.service import WorkerBrokerLink

    src_dev, dst_dev = devices
    if torch.cuda.device_count() <= max(devices):
        pytest.skip(f"needs {max(devices) + 1} GPUs")
    made = []
    try:
        for dev in (src_dev, dst_dev):
            link = WorkerBrokerLink(worker.address)
            made.append((DeviceObjects(link, device=dev), link))
        (a, _), (b, _) = made
        seen, took = _who_starts(b), _who_takes_offers(b)
        torch.cuda.set_device(src_dev)  # this thread's current GPU is the publisher's, not the receiver's
        for i, n in enumerate((4096, 1 << 20, 12345)):
            src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=src_dev)
            keep = src.clone()
            whole = torch.full((n + 512,), 7, dtype=torch.uint8, device=dst_dev)
            fut = b.dev_subscribe([f"g{i}"], [[whole[256 : 256 + n]]], timeout=WAIT)[0]
            _later(0.05, a.dev_publish, [f"g{i}"], [[src]])
            assert fut.result(WAIT) is None
            torch.cuda.synchronize(dst_dev)
            assert torch.equal(whole[256 : 256 + n].cpu(), keep.cpu())
            assert bool((whole[:256] == 7).all()) and bool((whole[256 + n :] == 7).all())
            assert torch.equal(src, keep)
            assert took.get(f"g{i}", seen.get(f"g{i}")) == threading.current_thread().name
            assert torch.cuda.current_device() == src_dev  # the guard gave the thread its GPU back
    finally:
        for c, link in made:
            c.close()
            link.close()


def test_events_after_an_interrupted_dispatch_go_to_the_next_holder(make):
    b = make()
    seen = []
    real = b._dispatch

    def dispatch(ev):
        if ev.get("boom"):
            raise KeyboardInterrupt
        seen.append(ev["n"])

    b._dispatch = dispatch
    evs = [{"type": "x", "n": 0}, {"type": "x", "boom": True}, {"type": "x", "n": 2}, {"type": "x", "n": 3}]
    with pytest.raises(KeyboardInterrupt):
        b._dispatch_all(evs)
    assert seen == [0] and b._leftover == evs[2:]
    b._dispatch = lambda ev: seen.append(ev["n"]) if "n" in ev else real(ev)
    fut = b.dev_subscribe(["after"], [[torch.zeros(4)]], timeout=0.2)[0]
    with pytest.raises(errors.Timeout):  # events keep flowing; the leftovers were dispatched by the next holder
        fut.result(WAIT)
    assert seen == [0, 2, 3] and b._leftover == []


@pytest.mark.parametrize("timeout", [float("nan"), -1.0, float("inf")])
def test_an_odd_result_timeout_leaves_the_event_connection_alone(make, timeout):
    """``result(nan)`` used to reach the leader's select() and end this client's event connection: every other
    receive then failed, and later ones never settled. Now such a timeout gets a plain future's answer."""
    a, b = make(), make()
    (f,) = b.dev_subscribe(["odd"], [[torch.zeros(4)]], timeout=WAIT)
    (g,) = b.dev_subscribe(["other"], [[torch.zeros(4)]], timeout=WAIT)
    if timeout == float("inf"):
        with pytest.raises(OverflowError):
            f.result(timeout)
    else:
        with pytest.raises(cf.TimeoutError):
            f.result(timeout)
    a.dev_publish(["other"], [[torch.ones(4)]])
    assert g.result(WAIT) is None and not b._poll_over
    dst = torch.zeros(4)
    a.dev_publish(["later"], [[torch.full((4,), 3.0)]])
    assert b.dev_subscribe(["later"], [[dst]], timeout=WAIT)[0].result(WAIT) is None and dst[0] == 3
    f.cancel()

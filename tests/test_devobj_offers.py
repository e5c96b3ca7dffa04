"""Direct offers (kvstrata.devobj.offers): the broker's hints of waiting subscribers, a publisher's offer, and a
subscriber that copies it ahead of the match but settles only on a match naming the same export. Through a real
worker on CPU (clients of one process: their exports resolve in-process), plus the table and broker on their own."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time

import pytest
import torch

from kvstrata import errors
from kvstrata.devobj import DeviceBroker, DeviceObjectConfig, DeviceObjects
from kvstrata.devobj._core import LOCAL_EXPORTS, specs_of
from kvstrata.devobj.offers import OFFER_MAX_KEYS, SLOTS, TABLE_BYTES, OfferTable, address, key_hash

CFG = DeviceObjectConfig(allow_cpu=True, poll_seconds=0.2)
WAIT = 20.0


def setup_client(c: DeviceObjects) -> None:
    """(the ``make`` fixture's, in conftest) The subscriber sees every offer before its match: else, on CPU, a race."""
    c.offer_before_request = True


def _waiting_wid(c: DeviceObjects, key: str) -> int:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        with c._lock:
            for wid, want in c._wants.items():
                if want.key == key:
                    return wid
        time.sleep(0.001)
    raise AssertionError(f"no receive of {key!r} waiting")


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


# -- the table ------------------------------------------------------------------------------------
def test_table_hints_one_key_per_slot_and_readers_skip_slots_being_written():
    t = OfferTable(bytearray(TABLE_BYTES))
    assert t.lookup("k") is None
    assert t.put("k", 5, "client-1")
    assert t.lookup("k") == (5, "client-1")
    assert t.lookup("other") is None
    t.clear("k")
    assert t.lookup("k") is None
    # Two keys of one slot: the first holds it; the second gets no hint until it is free.
    slot = key_hash("k") % SLOTS
    twin = next(f"x{i}" for i in range(1_000_000) if key_hash(f"x{i}") % SLOTS == slot)
    assert t.put("k", 6, "c")
    assert not t.put(twin, 7, "c")
    assert t.lookup(twin) is None and t.lookup("k") == (6, "c")
    t.clear(twin)  # not its slot: leaves the other key's hint alone
    assert t.lookup("k") == (6, "c")
    t.clear("k")
    assert t.put(twin, 7, "c") and t.lookup(twin) == (7, "c")
    assert not t.put("long", 1, "c" * 64)  # a client id that does not fit: no hint
    # A slot whose sequence number is odd is being written: no hint read from it.
    words = memoryview(t._bytes).cast("Q")
    words[slot * 8] += 1
    assert t.lookup(twin) is None
    with pytest.raises(ValueError, match="buffer"):
        OfferTable(bytearray(16))


def test_broker_hints_the_first_waiting_subscriber_while_the_key_has_no_object():
    now = [0.0]
    b = DeviceBroker(clock=lambda: now[0])
    for i, c in enumerate(("p", "s1", "s2", "s3", "s4", "s5")):
        b.handle(c, "hello", {"info": {"pid": i + 1, "node_id": "n1", "device": {"uuid": "GPU-a", "index": 0}}})
    table = b._offers
    rec = {"key": "k", "tensors": [{"shape": [4], "dtype": "float32", "nbytes": 16}], "handles": []}
    w1 = b.handle("s1", "subscribe", {"keys": ["k"], "timeout": 5.0})["results"][0]["wid"]
    w2 = b.handle("s2", "subscribe", {"keys": ["k"], "timeout": 1.0})["results"][0]["wid"]
    assert table.lookup("k") == (w1, "s1")  # the first in line
    assert b.snapshot()["offer_hints"] == 1
    b.handle("s3", "mget", {"keys": ["m"], "timeout": 5.0})
    assert table.lookup("m") is None  # reads of registered objects are not offered
    many = [f"many/{i}" for i in range(OFFER_MAX_KEYS + 1)]
    b.handle("s3", "subscribe", {"keys": many, "timeout": 5.0})
    assert all(table.lookup(k) is None for k in many)  # nor subscribes of many keys
    b.handle("p", "publish", {"items": [rec]})
    assert table.lookup("k") is None  # the object is there (claimed by s1): nothing to offer
    tid = b.handle("s1", "wait_events", {"timeout": 0}, 0)["events"][0]["transfer"]["tid"]
    b.handle("s1", "complete", {"tid": tid, "ok": True})
    assert table.lookup("k") == (w2, "s2")  # the object is gone: the next subscriber may be offered one
    now[0] = 2.0  # s2's deadline passed
    b.handle("s2", "wait_events", {"timeout": 0}, 0)
    assert table.lookup("k") is None
    w4 = b.handle("s4", "subscribe", {"keys": ["k"], "timeout": None})["results"][0]["wid"]
    assert table.lookup("k") == (w4, "s4")
    b.handle("s4", "cancel", {"wids": [w4]})
    assert table.lookup("k") is None
    w5 = b.handle("s5", "subscribe", {"keys": ["k"], "timeout": None})["results"][0]["wid"]
    assert table.lookup("k") == (w5, "s5")
    b.owner_gone("s5")
    assert table.lookup("k") is None


# -- offers between clients -----------------------------------------------------------------------
def test_a_waiting_subscriber_copies_the_offer_and_settles_on_its_match(make):
    a, b = make(), make()
    assert a._offer_box is not None and b._offer_box is not None
    for i in range(4):
        dst = torch.zeros(64)
        fut = b.dev_subscribe([f"k{i}"], [[dst]], timeout=WAIT)[0]
        _waiting_wid(b, f"k{i}")
        src = torch.arange(64.0) + i
        pub = a.dev_publish([f"k{i}"], [[src]])[0]
        fut.result(WAIT)
        pub.result(WAIT)  # the publisher is released once the broker heard of the receive
        assert torch.equal(dst, src)
    assert a._offer_box.sent == 4
    assert b.offers_taken == 4 and b.offers_used == 4
    assert b.debug_state()["offers"] == {"box": True, "sent": 0, "refused": 0, "taken": 4, "used": 4}
    assert not b._wants and not b._inflight


def test_offers_sent_after_the_request_race_the_match_and_every_receive_is_whole(make):
    a, b = make(), make()
    a.offer_before_request = False  # the default: the match may reach the subscriber first
    for i in range(20):
        dst = torch.zeros(64)
        fut = b.dev_subscribe([f"r{i}"], [[dst]], timeout=WAIT)[0]
        _waiting_wid(b, f"r{i}")
        src = torch.arange(64.0) * i
        a.dev_publish([f"r{i}"], [[src]])[0].result(WAIT)
        fut.result(WAIT)
        assert torch.equal(dst, src)
    assert b.offers_used <= b.offers_taken <= a._offer_box.sent == 20
    assert not b._wants and not b._inflight


def test_an_offer_the_match_does_not_confirm_is_waited_out_and_the_match_copied(make):
    a, b = make(), make()
    dst = torch.zeros(32)
    fut = b.dev_subscribe(["k"], [[dst]], timeout=WAIT)[0]
    wid = _waiting_wid(b, "k")
    # An offer of an export the broker never matches (stale, forged, or another publisher's that lost).
    forged = torch.full((32,), -1.0)
    LOCAL_EXPORTS["forged-token"] = ([forged], [])
    record = {
        "key": "k",
        "tensors": specs_of([forged]),
        "handles": [],
        "pid": os.getpid(),
        "node_id": CFG.node_id,
        "local": "forged-token",
        "owner": a.link.client_id,
        "transport": "ipc",
        "device": {},
    }
    try:
        assert a._offer_box.send(b.link.client_id, {"w": wid, "k": "k", "r": record})
        _until(lambda: b.offers_taken == 1, "the offer's copy")
        assert torch.equal(dst, forged) and fut.running()  # copied, not settled: cannot be cancelled now
        assert not fut.cancel()
        a._offer = lambda exported: None  # the real publish sends no offer of its own
        src = torch.arange(32.0)
        a.dev_publish(["k"], [[src]])[0].result(WAIT)
        fut.result(WAIT)
        assert torch.equal(dst, src)  # the match's copy, not the offer's
        assert b.offers_used == 0
    finally:
        LOCAL_EXPORTS.pop("forged-token", None)


def test_a_receive_running_on_an_offer_still_times_out(make):
    a, b = make(), make()
    dst = torch.zeros(8)
    fut = b.dev_subscribe(["late"], [[dst]], timeout=0.5)[0]
    wid = _waiting_wid(b, "late")
    src = torch.ones(8)
    LOCAL_EXPORTS["never-published"] = ([src], [])
    record = {"tensors": specs_of([src]), "handles": [], "pid": os.getpid(), "node_id": CFG.node_id}
    record.update(local="never-published", owner=a.link.client_id, transport="ipc", device={})
    try:
        a._offer_box.send(b.link.client_id, {"w": wid, "k": "late", "r": record})
        with pytest.raises(errors.Timeout):
            fut.result(WAIT)  # no publish reached the broker: the offer alone never completes a receive
        assert b.offers_taken == 1 and b.offers_used == 0
        assert not fut._offered and not b._wants
    finally:
        LOCAL_EXPORTS.pop("never-published", None)


def test_offers_of_other_shapes_or_unknown_receives_and_bad_datagrams_are_ignored(make):
    a, b = make(), make()
    dst = torch.zeros(8)
    fut = b.dev_subscribe(["k"], [[dst]], timeout=WAIT)[0]
    _waiting_wid(b, "k")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendto(b"\xc1 not msgpack", address(b.link.client_id))
    s.sendto(b"\x93\x01\x02\x03", address(b.link.client_id))  # msgpack, not an offer
    s.close()
    record = {"tensors": specs_of([torch.zeros(8)]), "handles": [], "pid": os.getpid(), "local": "none"}
    a._offer_box.send(b.link.client_id, {"w": 999_999, "k": "k", "r": dict(record, owner="x")})  # no such receive
    _until(lambda: b._offer_box.refused == 2, "the bad datagrams")
    with pytest.raises(ValueError, match="tensor"):
        a.dev_publish(["k"], [[torch.zeros(16)]])  # offered, not taken (other shape): the broker says why
        fut.result(WAIT)
    assert b.offers_taken == 0
    # and the client still works
    dst2 = torch.zeros(4)
    f2 = b.dev_subscribe(["k2"], [[dst2]], timeout=WAIT)[0]
    _waiting_wid(b, "k2")
    a.dev_publish(["k2"], [[torch.ones(4)]])[0].result(WAIT)
    f2.result(WAIT)
    assert torch.equal(dst2, torch.ones(4)) and b.offers_used == 1


def test_no_offers_for_many_keys_or_when_turned_off(make, monkeypatch):
    a, b = make(), make()
    n = OFFER_MAX_KEYS + 1
    dsts = [torch.zeros(4) for _ in range(n)]
    futs = b.dev_subscribe([f"m{i}" for i in range(n)], [[d] for d in dsts], timeout=WAIT)
    _waiting_wid(b, f"m{n - 1}")
    a.dev_publish([f"m{i}" for i in range(n)], [[torch.full((4,), float(i))] for i in range(n)])
    for i, f in enumerate(futs):
        f.result(WAIT)
        assert bool((dsts[i] == i).all())
    assert a._offer_box.sent == 0 and b.offers_taken == 0
    monkeypatch.setenv("KVSTRATA_DEVOBJ_OFFERS", "0")
    c = make()
    assert c._offer_box is None
    dst = torch.zeros(4)
    f = b.dev_subscribe(["off"], [[dst]], timeout=WAIT)[0]
    _waiting_wid(b, "off")
    c.dev_publish(["off"], [[torch.ones(4)]])[0].result(WAIT)
    f.result(WAIT)
    assert torch.equal(dst, torch.ones(4)) and b.offers_taken == 0


def _owner(address: str, go, published) -> None:
    import kvstrata

    c = kvstrata.connect(address)
    c.device_objects(device="cpu", config=DeviceObjectConfig(allow_cpu=True)).offer_before_request = True
    go.wait(WAIT)
    c.dev_publish(["doomed"], [[torch.arange(512, dtype=torch.uint8)]])
    published.set()
    time.sleep(60)  # killed by the test


def test_owner_killed_while_its_offer_is_copied_fails_the_receive(make, worker):
    ctx = mp.get_context("spawn")
    go, published = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_owner, args=(worker.address, go, published), daemon=True)
    p.start()
    try:
        b = make()
        dst = torch.full((512,), 7, dtype=torch.uint8)

        def sources(src, peer, reuse=False):  # the CUDA IPC import's stand-in: the owner dies as we copy
            if p.is_alive():
                published.wait(WAIT)
                os.kill(p.pid, signal.SIGKILL)
                p.join(WAIT)
            return [torch.arange(512, dtype=torch.uint8)], []

        b._sources = sources
        fut = b.dev_subscribe(["doomed"], [[dst]], timeout=WAIT)[0]
        _waiting_wid(b, "doomed")
        go.set()
        with pytest.raises(errors.KvstrataError, match=r"went away|gone"):
            fut.result(WAIT)  # never reported done: the owner died before the copy was known good
        assert b.offers_taken == 1
    finally:
        if p.is_alive():
            p.kill()
        p.join(WAIT)


def _gpu_owner(address: str, device: int, n: int, ctl) -> None:
    import kvstrata

    torch.cuda.set_device(device)
    c = kvstrata.connect(address)
    dev = c.device_objects(device=device)
    for _ in range(n):
        i = ctl["req"].get(timeout=WAIT)
        src = torch.full((1024,), i, dtype=torch.int32, device=device)
        (f,) = c.dev_publish([f"g{i}"], [[src]])
        f.result(WAIT)  # released: the reader's receive reached the broker
    ctl["sent"].put(dev._offer_box.sent)
    c.close()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "devices", [pytest.param((0, 0), id="gpu0"), pytest.param((0, 1), id="gpu0-gpu1", marks=pytest.mark.multigpu)]
)
def test_hand_offs_between_processes_use_offers_and_deliver_whole(worker, devices):
    """Two processes on GPUs: every subscriber-first hand-off delivers the publisher's bytes, and the receiver
    copies offers (most, or all: an offer sent after the publish may lose to the match, then it is not used)."""
    import kvstrata

    n = 30
    ctx = mp.get_context("spawn")
    ctl = {"req": ctx.Queue(), "sent": ctx.Queue()}
    p = ctx.Process(target=_gpu_owner, args=(worker.address, devices[0], n, ctl), daemon=True)
    p.start()
    c = kvstrata.connect(worker.address)
    try:
        torch.cuda.set_device(devices[1])
        dev = c.device_objects(device=devices[1])
        for i in range(n):
            dst = torch.full((1024,), -1, dtype=torch.int32, device=devices[1])
            (f,) = c.dev_subscribe([f"g{i}"], [[dst]], timeout=WAIT)
            _waiting_wid(dev, f"g{i}")
            ctl["req"].put(i)
            f.result(WAIT)
            assert bool((dst == i).all()), f"hand-off {i}: wrong bytes"
        sent = ctl["sent"].get(timeout=WAIT)
        assert sent == n and 0 < dev.offers_used <= dev.offers_taken <= n
    finally:
        c.close()
        p.join(WAIT)
        if p.is_alive():
            p.kill()

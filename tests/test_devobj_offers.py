"""Direct offers (kvstrata.devobj.offers): the broker's hints of waiting subscribers, a publisher's offer, a
subscriber whose receive takes it (done once its copy ended), and the broker's reconciliation: a match naming the
taken export completes, another object is handed back whole, and a publish whose receive no longer waits is held
until that receive's client says whether it took the offer. Through a real worker on CPU (clients of one process:
their exports resolve in-process), plus the table and broker on their own."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from concurrent.futures import Future

import msgpack
import pytest
import torch

from kvstrata import errors
from kvstrata.devobj import DeviceBroker, DeviceObjectConfig, DeviceObjects
from kvstrata.devobj._core import LOCAL_EXPORTS, specs_of
from kvstrata.devobj.offers import OFFER_MAX_KEYS, SLOTS, TABLE_BYTES, OfferBox, OfferTable, address, key_hash

CFG = DeviceObjectConfig(allow_cpu=True, poll_seconds=0.2)
WAIT = 20.0


def _waiting_wid(c: DeviceObjects, key: str) -> int:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        with c._lock:
            for wid, want in c._wants.items():
                if want.key == key:
                    return wid
        time.sleep(0.001)
    raise AssertionError(f"no receive of {key!r} waiting")


def _hand_off(a: DeviceObjects, b: DeviceObjects, key: str, src: torch.Tensor) -> torch.Tensor:
    """``b`` subscribes to ``key`` and waits; ``a`` publishes ``src``; both finish. What ``b`` received."""
    dst = torch.zeros_like(src)
    fut = b.dev_subscribe([key], [[dst]], timeout=WAIT)[0]
    _waiting_wid(b, key)
    a.dev_publish([key], [[src]])[0].result(WAIT)
    fut.result(WAIT)
    return dst


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


def test_box_packs_a_buffers_shared_fields_once_and_never_serves_a_stale_pack():
    tx, rx = OfferBox("test-tx-box"), OfferBox("test-rx-box")
    try:
        specs, dev = [{"shape": [4], "dtype": "uint8", "nbytes": 4}], {"uuid": "GPU-a", "index": 0}
        h1, h2 = {"handle": b"a" * 64}, {"handle": b"b" * 64}
        item = {"key": "k", "tensors": specs, "handles": [h1], "events": [], "device": dev, "node_id": "n",
                "pid": 7, "transport": "ipc", "owner": "o", "local": "t1"}  # fmt: skip
        got = []
        for handles, pid, local in (([h1], 7, "t1"), ([h1], 7, "t2"), ([h2], 7, "t3"), ([h1], 8, "t4")):
            assert tx.send("test-rx-box", 3, "k", dict(item, handles=handles, pid=pid, local=local))
        _until(lambda: got.extend(rx.take()) or len(got) == 4, "the offers")
        assert [(o["r"]["handles"][0]["handle"][:1], o["r"]["pid"], o["r"]["local"]) for o in got] == [
            (b"a", 7, "t1"), (b"a", 7, "t2"), (b"b", 7, "t3"), (b"a", 8, "t4")]  # fmt: skip
        # the second offer reused the first's pack; the fourth, another process's, re-packed the first's entry
        assert len(tx._packed_cache) == 2 and len(rx._unpacked) == 3
        assert all(o["w"] == 3 and o["k"] == "k" and o["r"]["owner"] == "o" for o in got)
        for local in ("t5", "t6"):
            assert tx.send("test-rx-box", 4, "k", dict(item, local=local))
        _until(lambda: len(rx.take(first=True)) == 1, "the first of two offers")  # one at a time when asked
        assert [o["r"]["local"] for o in rx.take()] == ["t6"] and rx.take() == []
    finally:
        tx.close()
        rx.close()


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


# -- the broker's side of offers whose receive no longer waits ---------------------------------------
def _broker(*clients: str) -> tuple[DeviceBroker, list[float]]:
    now = [0.0]
    b = DeviceBroker(clock=lambda: now[0])
    for i, c in enumerate(clients):
        b.handle(c, "hello", {"info": {"pid": i + 1, "node_id": "n1", "device": {"uuid": "GPU-a", "index": 0}}})
    return b, now


def _item(key: str, local: str, **extra) -> dict:
    return {"key": key, "tensors": [{"shape": [4], "dtype": "float32", "nbytes": 16}], "handles": [], "pid": 9,
            "local": local, **extra}  # fmt: skip


def _events(b: DeviceBroker, client: str) -> list[dict]:
    return b.handle(client, "wait_events", {"timeout": 0}, 0)["events"]


def test_broker_asks_a_timed_out_receive_whether_it_took_the_offer_and_holds_the_object_meanwhile():
    b, now = _broker("p", "s", "v")
    wid = b.handle("s", "subscribe", {"keys": ["k"], "timeout": 1.0})["results"][0]["wid"]
    now[0] = 2.0
    assert _events(b, "s")[0]["type"] == "timeout"  # the receive took the offer meanwhile, and ignores this
    r = b.handle("p", "publish", {"items": [_item("k", "t1", offered=["s", wid])]})["results"][0]
    assert r["ok"]
    (ask,) = _events(b, "s")
    assert ask["type"] == "offer_fate" and ask["wid"] == wid and ask["export"] == ["p", 9, "t1"]
    assert b.snapshot()["objects"]["k"]["state"] == "offered"
    b.handle("v", "subscribe", {"keys": ["k"], "timeout": None})  # nobody else gets it while its fate is open
    assert _events(b, "v") == []
    b.handle("s", "offer_fate", {"obj": r["obj"], "key": "k", "took": True})
    assert _events(b, "p") == [{"type": "released", "key": "k", "obj": r["obj"], "reason": "received"}]
    assert "k" not in b.snapshot()["objects"] and _events(b, "v") == []  # taken: never delivered twice
    assert b.handle("s", "offer_fate", {"obj": r["obj"], "key": "k", "took": False})["stale"]  # repeats: ignored
    with pytest.raises(ValueError, match="unknown"):
        b.handle("s", "offer_fates", {})
    bad = b.handle("s", "offer_fate", {"obj": "x", "took": 1})
    assert bad["error"] == "BadRequest"


def test_broker_gives_an_offer_not_taken_to_the_next_receive_and_a_gone_client_took_nothing():
    b, now = _broker("p", "s", "v", "x")
    wid = b.handle("s", "subscribe", {"keys": ["k"], "timeout": 1.0})["results"][0]["wid"]
    now[0] = 2.0
    _events(b, "s")
    obj = b.handle("p", "publish", {"items": [_item("k", "t1", offered=["s", wid])]})["results"][0]["obj"]
    b.handle("v", "subscribe", {"keys": ["k"], "timeout": None})
    assert b.handle("x", "offer_fate", {"obj": obj, "key": "k", "took": False})["error"] == "NotOwner"
    b.handle("s", "offer_fate", {"obj": obj, "key": "k", "took": False})
    (m,) = _events(b, "v")
    assert m["type"] == "matched" and m["transfer"]["record"]["obj"] == obj  # whole, to the next in line
    # The client an offer went to goes away before it answers: it took nothing.
    wid = b.handle("s", "subscribe", {"keys": ["k2"], "timeout": 1.0})["results"][0]["wid"]
    now[0] = 4.0
    _events(b, "s")
    b.handle("p", "publish", {"items": [_item("k2", "t2", offered=["s", wid])]})
    b.handle("v", "subscribe", {"keys": ["k2"], "timeout": None})
    b.owner_gone("s")
    assert [e["type"] for e in _events(b, "v")] == ["matched"]
    # Offered to a client that is gone already: registered as usual. A malformed offered: ignored.
    b.handle("p", "publish", {"items": [_item("k3", "t3", offered=["nobody", 1]), _item("k4", "t4", offered=7)]})
    assert {"k3", "k4"} <= set(b.snapshot()["objects"])


def test_broker_keeps_a_publish_aside_while_its_key_has_another_object_until_its_fate_is_known():
    b, _ = _broker("p", "q", "s", "v")
    wid = b.handle("s", "subscribe", {"keys": ["k"], "timeout": None})["results"][0]["wid"]
    # q's object comes first and is matched with s, which has taken p's offer already: s hands q's back.
    q = b.handle("q", "publish", {"items": [_item("k", "tq")]})["results"][0]["obj"]
    (m,) = _events(b, "s")
    b.handle("s", "complete", {"tid": m["transfer"]["tid"], "ok": False, "error": "took an offer"})
    r = b.handle("p", "publish", {"items": [_item("k", "tp", offered=["s", wid])]})["results"][0]
    assert r["ok"] and b.snapshot()["side_objects"] == 1
    assert [e["type"] for e in _events(b, "s")] == ["error", "offer_fate"]  # the hand-back's error, then the ask
    b.handle("s", "offer_fate", {"obj": r["obj"], "key": "k", "took": True})
    assert _events(b, "p") == [{"type": "released", "key": "k", "obj": r["obj"], "reason": "received"}]
    assert b.snapshot()["side_objects"] == 0
    m = b.handle("v", "subscribe", {"keys": ["k"], "timeout": None})["results"][0]
    assert m["status"] == "matched" and m["transfer"]["record"]["obj"] == q  # q's object, whole, for the next
    # Not taken, the key having another object: that publish fails as any second publish of a key does.
    w2 = b.handle("s", "subscribe", {"keys": ["k"], "timeout": None})["results"][0]["wid"]
    r2 = b.handle("p", "publish", {"items": [_item("k", "tp2", offered=["s", w2])]})["results"][0]
    b.handle("s", "offer_fate", {"obj": r2["obj"], "key": "k", "took": False})
    assert _events(b, "p")[-1] == {"type": "released", "key": "k", "obj": r2["obj"], "reason": "exists"}
    # A taken side object drops its receive still queued behind the key's object (no event comes for it).
    r3 = b.handle("p", "publish", {"items": [_item("k", "tp3", offered=["s", w2])]})["results"][0]
    b.handle("s", "offer_fate", {"obj": r3["obj"], "key": "k", "took": True})
    assert b.snapshot()["waiters"] == 0
    # Its client gone before answering: the side object's publish fails (KeyExists), the publisher gone: dropped.
    w3 = b.handle("v", "subscribe", {"keys": ["k"], "timeout": None})["results"][0]["wid"]
    r4 = b.handle("p", "publish", {"items": [_item("k", "tp4", offered=["v", w3])]})["results"][0]
    b.owner_gone("v")
    assert _events(b, "p")[-1]["reason"] == "exists" and b.snapshot()["side_objects"] == 0
    w4 = b.handle("s", "subscribe", {"keys": ["k"], "timeout": None})["results"][0]["wid"]
    b.handle("p", "publish", {"items": [_item("k", "tp5", offered=["s", w4])]})
    b.owner_gone("p")
    assert b.snapshot()["side_objects"] == 0 and r4["ok"]


def test_broker_takes_the_reports_of_a_leaving_client_whose_receives_took_offers():
    b, now = _broker("p", "s", "v")
    # Matched, the match not confirmed yet: the transfer completes, the publisher is released.
    wid = b.handle("s", "subscribe", {"keys": ["k1"], "timeout": None})["results"][0]["wid"]
    o1 = b.handle("p", "publish", {"items": [_item("k1", "t1", offered=["s", wid])]})["results"][0]["obj"]
    # Timed out here before its publish came, which is then held for the answer: received.
    w2 = b.handle("s", "subscribe", {"keys": ["k2"], "timeout": 1.0})["results"][0]["wid"]
    now[0] = 2.0
    _events(b, "s")
    o2 = b.handle("p", "publish", {"items": [_item("k2", "t2", offered=["s", w2])]})["results"][0]["obj"]
    # Its publish not here yet: received as soon as it comes; its waiter goes now.
    w3 = b.handle("s", "subscribe", {"keys": ["k3"], "timeout": None})["results"][0]["wid"]
    taken = [[wid, "k1", ["p", 9, "t1"]], [w2, "k2", ["p", 9, "t2"]], [w3, "k3", ["p", 9, "t3"]], ["bad"], 5]
    b.handle("s", "goodbye", {"taken": taken})
    o3 = b.handle("p", "publish", {"items": [_item("k3", "t3", offered=["s", w3])]})["results"][0]["obj"]
    released = [(e["obj"], e["reason"]) for e in _events(b, "p") if e["type"] == "released"]
    assert released == [(o1, "received"), (o2, "received"), (o3, "received")]
    assert b.snapshot()["objects"] == {} and b.snapshot()["waiters"] == 0
    b.handle("v", "subscribe", {"keys": ["k3"], "timeout": None})
    assert _events(b, "v") == []  # never delivered twice


def test_broker_counts_publishes_receives_reads_timeouts_failures_and_offer_fates():
    b, now = _broker("p", "s", "v")
    wid = b.handle("s", "subscribe", {"keys": ["k"], "timeout": None})["results"][0]["wid"]
    b.handle("p", "publish", {"items": [_item("k", "t1")]})
    (m,) = _events(b, "s")
    b.handle("s", "complete", {"tid": m["transfer"]["tid"], "ok": False, "error": "x"})  # failed: back to ready
    w2 = b.handle("v", "subscribe", {"keys": ["k"], "timeout": None})["results"][0]
    b.handle("v", "complete", {"tid": w2["transfer"]["tid"], "ok": True})
    b.handle("p", "mset", {"items": [_item("m", "t2")]})
    r = b.handle("v", "mget", {"keys": ["m"], "timeout": None})["results"][0]
    b.handle("v", "complete", {"tid": r["transfer"]["tid"], "ok": True})
    assert b.handle("p", "publish", {"items": [_item("m", "t3")]})["results"][0]["error"] == "KeyExists"
    b.handle("s", "subscribe", {"keys": ["late"], "timeout": 1.0})
    now[0] = 2.0
    _events(b, "s")
    o = b.handle("p", "publish", {"items": [_item("late", "t4", offered=["s", wid])]})["results"][0]["obj"]
    b.handle("s", "offer_fate", {"obj": o, "key": "late", "took": True})
    stats = b.stats()
    assert {k: stats[k] for k in ("published", "registered", "received", "reads", "timeouts", "receives_failed")} == {
        "published": 2, "registered": 1, "received": 2, "reads": 1, "timeouts": 1, "receives_failed": 1}  # fmt: skip
    assert (stats["offer_fates_taken"], stats["offer_fates_not_taken"], stats["objects"], stats["waiters"]) == (
        1, 0, 1, 0)  # fmt: skip
    assert stats["clients"] == 3 and stats["transfers"] == 0 and stats["broadcasts"] == 0


# -- offers between clients -----------------------------------------------------------------------
def test_a_waiting_subscriber_takes_the_offer_and_the_match_confirms_it(make):
    a, b = make(), make()
    assert a._offer_box is not None and b._offer_box is not None
    for i in range(4):
        dst = torch.zeros(64)
        fut = b.dev_subscribe([f"k{i}"], [[dst]], timeout=WAIT)[0]
        _waiting_wid(b, f"k{i}")
        src = torch.arange(64.0) + i
        pub = a.dev_publish([f"k{i}"], [[src]])[0]
        fut.result(WAIT)
        pub.result(WAIT)  # the publisher is released once the broker's match was confirmed
        assert torch.equal(dst, src)
    assert a._offer_box.sent == 4
    assert b.offers_taken == 4 and b.offers_used == 4
    assert b.debug_state()["offers"] == {"box": True, "sent": 0, "refused": 0, "taken": 4, "used": 4}
    _until(lambda: not b._wants and not b._taken, "the matches")
    assert not b._inflight


def _record(owner: DeviceObjects, key: str, token: str, t: torch.Tensor) -> dict:
    return {"key": key, "tensors": specs_of([t]), "handles": [], "pid": os.getpid(), "node_id": CFG.node_id,
            "local": token, "owner": owner.link.client_id, "transport": "ipc", "device": {}}  # fmt: skip


def test_a_receive_that_took_an_offer_hands_another_object_back_whole(make):
    """Another publisher's object matched with a receive that took an offer (the offer's own publish not at the
    broker yet) goes back to the broker whole, for the next receive."""
    a, b, v = make(), make(), make()
    dst = torch.zeros(32)
    fut = b.dev_subscribe(["k"], [[dst]], timeout=WAIT)[0]
    wid = _waiting_wid(b, "k")
    offered = torch.full((32,), -1.0)
    LOCAL_EXPORTS["offered-token"] = ([offered], [])
    try:
        assert a._offer_box.send(b.link.client_id, wid, "k", _record(a, "k", "offered-token", offered))
        fut.result(WAIT)  # taken: done once the copy ended
        assert torch.equal(dst, offered) and b.offers_used == 1
        a._offer = lambda exported: None  # this publish sends no offer of its own: the broker matches it with b
        src = torch.arange(32.0)
        pub = a.dev_publish(["k"], [[src]])[0]
        _until(lambda: not b._wants, "the match handed back")
        assert torch.equal(dst, offered) and not pub.done()
        dst2 = torch.zeros(32)
        v.dev_subscribe(["k"], [[dst2]], timeout=WAIT)[0].result(WAIT)
        assert torch.equal(dst2, src)
        pub.result(WAIT)
    finally:
        LOCAL_EXPORTS.pop("offered-token", None)


def test_a_publish_reaching_the_broker_after_its_receive_timed_out_is_taken_not_delivered_twice(make):
    a, b, v = make(), make(), make()
    dst = torch.zeros(16)
    # (1 s: the offer, sent at once, must be taken before it on a loaded machine too)
    fut = b.dev_subscribe(["late"], [[dst]], timeout=1.0)[0]
    _waiting_wid(b, "late")
    call = a._call

    def slow_publish(op, args, timeout=None):  # the offer goes at once, the publish after the receive's deadline
        if op == "publish":
            time.sleep(1.5)
        return call(op, args, timeout)

    a._call = slow_publish
    src = torch.arange(16.0)
    pub = a.dev_publish(["late"], [[src]])[0]
    fut.result(WAIT)
    assert torch.equal(dst, src) and b.offers_used == 1
    pub.result(WAIT)  # released: the broker asked b, which took it
    assert not b._taken and not b._wants
    with pytest.raises(errors.Timeout):
        v.dev_subscribe(["late"], [[torch.zeros(16)]], timeout=0.3)[0].result(WAIT)  # never a second time


def test_an_offer_arriving_after_its_receive_timed_out_is_not_taken_and_the_object_stays(make):
    a, b, v = make(), make(), make()
    fut = b.dev_subscribe(["gone"], [[torch.zeros(16)]], timeout=0.2)[0]
    _waiting_wid(b, "gone")
    send = a._offer_box.send

    def slow_send(*args):  # read the hint while b waited; the offer arrives after its deadline (well after)
        time.sleep(1.5)
        return send(*args)

    a._offer_box.send = slow_send
    src = torch.arange(16.0)
    pub = a.dev_publish(["gone"], [[src]])[0]
    with pytest.raises(errors.Timeout):
        fut.result(WAIT)
    dst = torch.zeros(16)
    v.dev_subscribe(["gone"], [[dst]], timeout=WAIT)[0].result(WAIT)  # b said: not taken
    assert torch.equal(dst, src) and b.offers_taken == 0
    pub.result(WAIT)


def test_a_subscriber_that_leaves_right_after_taking_an_offer_still_releases_the_publisher(make):
    a, b = make(), make()
    dst = torch.zeros(16)
    fut = b.dev_subscribe(["bye"], [[dst]], timeout=WAIT)[0]
    _waiting_wid(b, "bye")
    call = a._call

    def slow_publish(op, args, timeout=None):  # the publish reaches the broker after the subscriber left
        if op == "publish":
            time.sleep(0.3)
        return call(op, args, timeout)

    a._call = slow_publish
    src = torch.arange(16.0)
    pubs = []
    t = threading.Thread(target=lambda: pubs.extend(a.dev_publish(["bye"], [[src]])))
    t.start()
    fut.result(WAIT)
    b.close()  # its goodbye says which offers it took
    assert torch.equal(dst, src)
    t.join(WAIT)
    pubs[0].result(WAIT)  # released: the broker knew the export was taken when its publish came


def test_a_receive_can_take_an_offer_whose_publish_never_reaches_the_broker(make):
    """Offers come only from processes of this user (the box checks): one is as good as its publish. The
    receive's waiter then times out at the broker, which the receive, done already, ignores."""
    a, b = make(), make()
    dst = torch.zeros(8)
    fut = b.dev_subscribe(["never"], [[dst]], timeout=0.3)[0]
    wid = _waiting_wid(b, "never")
    src = torch.ones(8)
    LOCAL_EXPORTS["never-published"] = ([src], [])
    try:
        a._offer_box.send(b.link.client_id, wid, "never", _record(a, "never", "never-published", src))
        fut.result(WAIT)
        assert torch.equal(dst, src) and b.offers_used == 1
        _until(lambda: not b._wants, "the broker's timeout")
        assert fut.exception() is None
    finally:
        LOCAL_EXPORTS.pop("never-published", None)


def test_racing_publishers_subscribers_timeouts_and_cancels_deliver_each_object_once_whole(make):
    """Publishers and subscribers of a few shared keys in threads, with short timeouts and cancels, offers on: each
    publish is received at most once, whole; one whose future says received was received exactly once; one that
    failed (KeyExists) never was; every subscriber's receive ends; after the subscribers leave, every publish that
    was received has been released."""
    import random

    keys = [f"race/{i}" for i in range(4)]
    pubs, subs = [make() for _ in range(3)], [make() for _ in range(3)]
    published: list[tuple[int, Future]] = []  # (payload id, the publish's future)
    received: list[int] = []
    lock = threading.Lock()
    ids = iter(range(1, 1_000_000))
    stop = time.monotonic() + 3.0

    def publisher(c: DeviceObjects, seed: int) -> None:
        rnd = random.Random(seed)
        while time.monotonic() < stop:
            with lock:
                pid = next(ids)
            (f,) = c.dev_publish([rnd.choice(keys)], [[torch.full((64,), float(pid))]])
            with lock:
                published.append((pid, f))
            time.sleep(rnd.uniform(0, 0.004))

    def subscriber(c: DeviceObjects, seed: int) -> None:
        rnd = random.Random(seed)
        while time.monotonic() < stop:
            dst = torch.full((64,), -1.0)
            (f,) = c.dev_subscribe([rnd.choice(keys)], [[dst]], timeout=rnd.uniform(0.001, 0.05))
            if rnd.random() < 0.2:
                f.cancel()
            try:
                f.result(WAIT)
            except (errors.Timeout, cf.CancelledError):
                continue
            v = dst[0].item()
            assert v > 0 and bool((dst == v).all()), f"a receive got a mix of objects: {dst.unique()}"
            with lock:
                received.append(int(v))

    threads = [threading.Thread(target=publisher, args=(c, i)) for i, c in enumerate(pubs)]
    threads += [threading.Thread(target=subscriber, args=(c, 10 + i)) for i, c in enumerate(subs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads)
    assert len(received) == len(set(received)), "an object was received twice"
    for c in subs:  # their goodbyes say which offers they took
        c.close()
    outcome = {}
    for pid, f in published:
        try:
            f.result(WAIT if pid in set(received) else 0.5)
            outcome[pid] = "released"
        except errors.KeyExists:
            outcome[pid] = "exists"
        except cf.TimeoutError:
            outcome[pid] = "waiting"  # nobody received it (yet): published, still held by its owner
    got = set(received)
    assert all(outcome[pid] == "released" for pid in got), {p: outcome[p] for p in got if outcome[p] != "released"}
    assert not [pid for pid, o in outcome.items() if o == "released" and pid not in got], "released, never received"
    assert len(got) > 10 and sum(s.offers_used for s in subs) > 0  # the race ran, offers included


def test_offers_of_other_shapes_or_unknown_receives_and_bad_datagrams_are_ignored(make):
    a, b = make(), make()
    dst = torch.zeros(8)
    fut = b.dev_subscribe(["k"], [[dst]], timeout=WAIT)[0]
    _waiting_wid(b, "k")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendto(b"\xc1 not msgpack", address(b.link.client_id))
    s.sendto(b"\x93\x01\x02\x03", address(b.link.client_id))  # msgpack, not an offer
    s.sendto(msgpack.packb((1, "k", "t", msgpack.packb({"owner": 5}))), address(b.link.client_id))  # owner not str
    s.sendto(msgpack.packb(("w", "k", "t", msgpack.packb({"owner": "x"}))), address(b.link.client_id))  # wid not int
    s.close()
    record = {"tensors": specs_of([torch.zeros(8)]), "handles": [], "pid": os.getpid(), "local": "none"}
    a._offer_box.send(b.link.client_id, 999_999, "k", dict(record, owner="x"))  # no such receive
    _until(lambda: b._offer_box.refused == 4, "the bad datagrams")
    with pytest.raises(ValueError, match="tensor"):
        a.dev_publish(["k"], [[torch.zeros(16)]])  # offered, not taken (other shape): the broker says why
        fut.result(WAIT)
    assert b.offers_taken == 0
    assert torch.equal(_hand_off(a, b, "k2", torch.ones(4)), torch.ones(4))  # and the client still works
    assert b.offers_used == 1


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
    assert torch.equal(_hand_off(c, b, "off", torch.ones(4)), torch.ones(4)) and b.offers_taken == 0


def _owner(address: str, go, published) -> None:
    import kvstrata

    c = kvstrata.connect(address)
    c.device_objects(device="cpu", config=DeviceObjectConfig(allow_cpu=True))
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
    takes offers (most, or all: a receive whose match the reader sees first copies the match instead)."""
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

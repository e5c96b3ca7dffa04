"""DeviceBroker logic, without GPUs: matching in either order, timeouts, one-shot forgetting,
mset/mget readers, owner death, broadcast planning, NCCL pairing, serializable records."""

from __future__ import annotations

import re
import threading

import msgpack
import pytest

from kvstrata.devobj import broker as B
from kvstrata.devobj.broker import DeviceBroker


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def item(key: str, shape=(4, 8), dtype="float16", **extra):
    return {
        "key": key,
        "tensors": [{"shape": list(shape), "dtype": dtype, "nbytes": 64}],
        "handles": [],
        "events": [],
        "device": {"uuid": "GPU-a", "index": 0},
        **extra,
    }


def spec(shape=(4, 8), dtype="float16"):
    return [{"shape": list(shape), "dtype": dtype, "nbytes": 64}]


@pytest.fixture
def broker():
    b = DeviceBroker()
    for c, pid, uuid in (("pub", 1, "GPU-a"), ("sub", 2, "GPU-b"), ("sub2", 3, "GPU-a"), ("sub3", 4, "GPU-b")):
        b.handle(c, "hello", {"info": {"pid": pid, "node_id": "n1", "device": {"uuid": uuid, "index": 0}}})
    return b


def events(b, client, timeout=0.0):
    return b.handle(client, "wait_events", {"timeout": timeout})["events"]


def test_publish_first_then_subscribe_matches_at_once(broker):
    assert broker.handle("pub", "publish", {"items": [item("k")]})["results"][0]["ok"]
    r = broker.handle("sub", "subscribe", {"keys": ["k"], "specs": [spec()], "timeout": 1})["results"][0]
    assert r["status"] == "matched"
    t = r["transfer"]
    assert (t["src"], t["dst"], t["kind"], t["path"]) == ("pub", "sub", "sub", "ipc")
    assert broker.handle("sub", "complete", {"tid": t["tid"], "ok": True})["ok"]
    ev = events(broker, "pub")
    assert [e["type"] for e in ev] == ["released"] and ev[0]["key"] == "k"
    assert broker.snapshot()["objects"] == {}  # one-shot: forgotten once received


def test_publisher_first_subscribe_leaves_nothing_queued(broker):
    """A ready one-shot key is claimed at once: no waiter, deadline or timer left behind; a second subscriber
    waits; a size mismatch answers an error and leaves the object for a right-sized subscriber."""
    broker.handle("pub", "publish", {"items": [item("k")]})
    bad = broker.handle("sub", "subscribe", {"keys": ["k"], "specs": [spec((2, 2))], "timeout": 5})["results"][0]
    assert bad["status"] == "error" and bad["error"] == B.E_MISMATCH
    r = broker.handle("sub", "subscribe", {"keys": ["k"], "specs": [spec()], "timeout": 5})["results"][0]
    assert r["status"] == "matched" and broker.snapshot()["waiters"] == 0 and not broker._deadlines
    r2 = broker.handle("sub2", "subscribe", {"keys": ["k"], "specs": [spec()], "timeout": 5})["results"][0]
    assert r2["status"] == "waiting"  # claimed by the first: the next waits for the next publish
    broker.handle("sub", "complete", {"tid": r["transfer"]["tid"], "ok": False, "error": "x"})
    ev = events(broker, "sub2")  # a failed receive hands the object to the waiting subscriber, whole
    assert [e["type"] for e in ev] == ["matched"] and ev[0]["wid"] == r2["wid"]


def test_subscribe_first_then_publish_gets_event(broker):
    r = broker.handle("sub", "subscribe", {"keys": ["k"], "specs": [spec()], "timeout": None})["results"][0]
    assert r["status"] == "waiting"
    broker.handle("pub", "publish", {"items": [item("k")]})
    ev = events(broker, "sub")
    assert ev[0]["type"] == "matched" and ev[0]["wid"] == r["wid"] and ev[0]["transfer"]["key"] == "k"


def test_timeout_event_and_no_match_after_it():
    clock = Clock()
    b = DeviceBroker(clock=clock)
    b.handle("sub", "hello", {"info": {}})
    r = b.handle("sub", "subscribe", {"keys": ["k"], "timeout": 0.5})["results"][0]
    assert events(b, "sub") == []
    clock.t += 0.6
    ev = events(b, "sub")
    assert ev == [{"type": "timeout", "wid": r["wid"], "key": "k", "error": B.E_TIMEOUT, "message": ev[0]["message"]}]
    b.handle("pub", "hello", {"info": {}})
    b.handle("pub", "publish", {"items": [item("k")]})
    assert events(b, "sub") == []  # the expired waiter does not take it
    assert b.snapshot()["objects"]["k"]["state"] == "ready"


def test_wait_events_wakes_on_real_timeout():
    b = DeviceBroker()
    b.handle("sub", "hello", {"info": {}})
    b.handle("sub", "subscribe", {"keys": ["k"], "timeout": 0.05})
    ev = events(b, "sub", timeout=5.0)  # must return at the waiter's deadline, not after 5 s
    assert [e["type"] for e in ev] == ["timeout"]


def test_one_shot_taken_by_exactly_one_subscriber(broker):
    broker.handle("pub", "publish", {"items": [item("k")]})
    r1 = broker.handle("sub", "subscribe", {"keys": ["k"], "timeout": 1})["results"][0]
    r2 = broker.handle("sub2", "subscribe", {"keys": ["k"], "timeout": 1})["results"][0]
    assert r1["status"] == "matched" and r2["status"] == "waiting"
    assert broker.snapshot()["objects"]["k"]["state"] == "claimed"


def test_failed_receive_returns_object_to_next_subscriber(broker):
    broker.handle("pub", "publish", {"items": [item("k")]})
    t = broker.handle("sub", "subscribe", {"keys": ["k"], "timeout": 1})["results"][0]["transfer"]
    r2 = broker.handle("sub2", "subscribe", {"keys": ["k"], "timeout": 1})["results"][0]
    broker.handle("sub", "complete", {"tid": t["tid"], "ok": False, "error": "copy failed"})
    assert [e["type"] for e in events(broker, "sub")] == ["error"]
    assert events(broker, "pub") == []  # not released: nothing was received
    ev = events(broker, "sub2")
    assert ev[0]["type"] == "matched" and ev[0]["wid"] == r2["wid"]


def test_subscriber_death_mid_receive_keeps_object(broker):
    broker.handle("pub", "publish", {"items": [item("k")]})
    broker.handle("sub", "subscribe", {"keys": ["k"], "timeout": 1})
    broker.owner_gone("sub")
    assert broker.snapshot()["objects"]["k"]["state"] == "ready"
    assert broker.handle("sub2", "subscribe", {"keys": ["k"], "timeout": 1})["results"][0]["status"] == "matched"


def test_mismatch_is_an_error_and_leaves_object(broker):
    broker.handle("pub", "publish", {"items": [item("k")]})
    r = broker.handle("sub", "subscribe", {"keys": ["k"], "specs": [spec((4, 9))], "timeout": 1})["results"][0]
    assert r["status"] == "error" and r["error"] == B.E_MISMATCH and "tensor 0" in r["message"]
    r = broker.handle("sub", "subscribe", {"keys": ["k"], "specs": [spec(dtype="bfloat16")]})["results"][0]
    assert r["error"] == B.E_MISMATCH
    assert broker.snapshot()["objects"]["k"]["state"] == "ready"


def test_duplicate_publish_is_key_exists(broker):
    broker.handle("pub", "publish", {"items": [item("k")]})
    r = broker.handle("pub", "publish", {"items": [item("k"), item("j")]})["results"]
    assert r[0]["error"] == B.E_EXISTS and r[1]["ok"]  # per-key results


def test_mset_many_readers_many_times(broker):
    broker.handle("pub", "mset", {"items": [item("w")]})
    tids = []
    for c in ("sub", "sub2", "sub3", "sub"):
        r = broker.handle(c, "mget", {"keys": ["w"], "specs": [spec()], "timeout": 0})["results"][0]
        assert r["status"] == "matched"
        tids.append((c, r["transfer"]["tid"]))
    assert broker.snapshot()["objects"]["w"]["transfers"] == 4
    for c, tid in tids:
        broker.handle(c, "complete", {"tid": tid, "ok": True})
    assert broker.snapshot()["objects"]["w"] == {"state": "ready", "mode": "mset", "owner": "pub", "transfers": 0}


def test_subscribe_does_not_take_mset_and_mget_does_not_take_publish(broker):
    broker.handle("pub", "mset", {"items": [item("w")]})
    broker.handle("pub", "publish", {"items": [item("p")]})
    assert broker.handle("sub", "subscribe", {"keys": ["w"], "timeout": 1})["results"][0]["status"] == "waiting"
    assert broker.handle("sub", "mget", {"keys": ["p"], "timeout": 1})["results"][0]["status"] == "waiting"


def test_delete_waits_for_reads_in_flight_and_invalidates_readers(broker):
    broker.handle("pub", "mset", {"items": [item("w")]})
    t = broker.handle("sub", "mget", {"keys": ["w"], "timeout": 0})["results"][0]["transfer"]
    r = broker.handle("pub", "delete", {"keys": ["w"]})["results"][0]
    assert r["ok"] and r["pending"]
    assert broker.handle("sub2", "mget", {"keys": ["w"], "timeout": 0})["results"][0]["status"] == "waiting"
    assert events(broker, "pub") == []
    broker.handle("sub", "complete", {"tid": t["tid"], "ok": True})
    assert [e["type"] for e in events(broker, "pub")] == ["released"]
    assert [e["type"] for e in events(broker, "sub")] == ["invalidate"]


def test_a_key_deleted_while_read_can_be_registered_again_at_once(broker):
    """The deleted object waits, out of the key's way, for the read in flight; the new one is the key's meanwhile,
    and the old read's completion releases the old object only."""
    broker.handle("pub", "mset", {"items": [item("w")]})
    old = broker.handle("sub", "mget", {"keys": ["w"], "timeout": 0})["results"][0]["transfer"]
    assert broker.handle("pub", "delete", {"keys": ["w"]})["results"][0]["pending"]
    assert broker.stats()["deleted_still_read"] == 1
    new = broker.handle("sub2", "mset", {"items": [item("w", shape=(2, 2))]})["results"][0]  # another owner, even
    assert new["ok"]
    r = broker.handle("sub3", "mget", {"keys": ["w"], "specs": [spec((2, 2))], "timeout": 0})["results"][0]
    assert r["status"] == "matched" and r["transfer"]["record"]["obj"] == new["obj"]
    assert broker.handle("sub", "complete", {"tid": old["tid"], "ok": True})["ok"]
    (ev,) = events(broker, "pub")
    assert (ev["type"], ev["obj"], ev["reason"]) == ("released", old["record"]["obj"], "deleted")
    assert broker.snapshot()["objects"]["w"]["owner"] == "sub2" and broker.stats()["deleted_still_read"] == 0
    assert events(broker, "sub2") == []  # the new object's owner hears nothing of the old one
    assert broker.handle("sub3", "complete", {"tid": r["transfer"]["tid"], "ok": True})["ok"]
    assert broker.snapshot()["objects"]["w"]["transfers"] == 0


def test_the_owner_of_a_deleted_object_still_read_going_away_fails_that_read(broker):
    broker.handle("pub", "mset", {"items": [item("w")]})
    t = broker.handle("sub", "mget", {"keys": ["w"], "timeout": 0})["results"][0]["transfer"]
    broker.handle("pub", "delete", {"keys": ["w"]})
    broker.owner_gone("pub")
    ev = events(broker, "sub")
    assert ev[0]["type"] == "error" and ev[0]["tid"] == t["tid"] and ev[0]["error"] == B.E_OWNER_GONE
    assert broker.stats()["deleted_still_read"] == 0 and broker.stats()["transfers"] == 0


def test_delete_by_other_client_and_missing_key(broker):
    broker.handle("pub", "mset", {"items": [item("w")]})
    r = broker.handle("sub", "delete", {"keys": ["w", "nope"]})["results"]
    assert r[0]["error"] == B.E_NOT_OWNER and r[1]["error"] == B.E_NOT_FOUND


def test_owner_gone_errors_transfers_and_keys_vanish(broker):
    broker.handle("pub", "mset", {"items": [item("w")]})
    broker.handle("pub", "publish", {"items": [item("p")]})
    t = broker.handle("sub", "mget", {"keys": ["w"], "timeout": 0})["results"][0]["transfer"]
    broker.handle("sub2", "subscribe", {"keys": ["p"], "timeout": 1})
    broker.owner_gone("pub")
    ev = events(broker, "sub")
    assert ev[0]["type"] == "error" and ev[0]["tid"] == t["tid"] and ev[0]["error"] == B.E_OWNER_GONE
    assert ev[1:] == [{"type": "peer_gone", "client": "pub"}]
    ev2 = events(broker, "sub2")
    assert [e.get("error") for e in ev2 if e["type"] == "error"] == [B.E_OWNER_GONE]
    assert broker.snapshot()["objects"] == {}
    r = broker.handle("sub", "complete", {"tid": t["tid"], "ok": True})
    assert r["error"] == B.E_NOT_FOUND  # a late completion cannot make it "done"


def test_broadcast_waits_for_all_and_plans_one_leader_per_gpu(broker):
    broker.handle("pub", "broadcast", {"item": item("b", receivers=3, chunk_bytes=4096)})
    got = {}
    for c in ("sub", "sub3", "sub2"):  # sub, sub3 on GPU-b; sub2 on the sender's GPU-a
        got[c] = broker.handle(c, "subscribe", {"keys": ["b"], "timeout": 5})["results"][0]
    assert got["sub"]["status"] == got["sub3"]["status"] == "waiting"
    assert got["sub2"]["status"] == "matched"  # the last one in gets its answer at once
    t = {"sub2": got["sub2"]["transfer"]}
    for c in ("sub", "sub3"):
        (ev,) = events(broker, c)
        t[c] = ev["transfer"]
    plan = {c: (x["position"], x["group"], x["role"], x.get("pred"), x.get("successor")) for c, x in t.items()}
    # The sender's GPU first; on GPU-b the lowest client id leads and pulls from the sender itself (GPU-a's
    # copy is the same bytes over the same link), so GPU-a's leader exports to nobody.
    assert plan == {
        "sub2": (0, 0, "leader", "sender", False),
        "sub": (1, 1, "leader", "sender", False),
        "sub3": (2, 1, "member", None, None),
    }
    assert (t["sub"]["members"], t["sub2"]["members"], t["sub3"]["leader"]) == (1, 0, 1)
    r = broker.handle("sub3", "member_ready", {"tid": t["sub3"]["tid"], "export": {"progress": "p", "handles": [1]}})
    assert r == {"ok": True, "leader_pid": 2}
    (ev,) = events(broker, "sub")
    assert ev["type"] == "member_ready" and ev["tid"] == t["sub"]["tid"]
    assert ev["member"] == {"progress": "p", "handles": [1], "client": "sub3", "position": 2}
    assert broker.handle("sub", "member_ready", {"tid": t["sub"]["tid"], "export": {}})["error"] == B.E_NOT_FOUND
    for c in ("sub2", "sub"):
        assert broker.handle(c, "complete", {"tid": t[c]["tid"], "ok": True})["pending"]
    assert events(broker, "pub") == []  # not done until the last receiver is
    broker.handle("sub3", "complete", {"tid": t["sub3"]["tid"], "ok": True})
    assert [e["type"] for e in events(broker, "pub")] == ["released"]
    for c in ("sub", "sub2", "sub3"):
        assert [e["type"] for e in events(broker, c)] == ["transfer_done"]


def test_broadcast_roles_follow_client_ids_not_arrival_order(broker):
    """Broadcast after broadcast the same receiver leads its GPU, whoever subscribes first: a leader then
    finds its members' buffers already mapped from the last time."""
    roles = []
    for n, order in enumerate((("sub", "sub3", "sub2"), ("sub3", "sub2", "sub"), ("sub2", "sub", "sub3"))):
        key = f"b{n}"
        broker.handle("pub", "broadcast", {"item": item(key, receivers=3, chunk_bytes=4096)})
        got = {c: broker.handle(c, "subscribe", {"keys": [key], "timeout": 5})["results"][0] for c in order}
        t = {c: r["transfer"] for c, r in got.items() if r["status"] == "matched"}
        for c in order:
            for e in events(broker, c):
                if e["type"] == "matched":
                    t[c] = e["transfer"]
        roles.append({c: (x["position"], x["role"]) for c, x in t.items()})
        for c, x in t.items():
            broker.handle(c, "complete", {"tid": x["tid"], "ok": True})
        events(broker, "pub")
        for c in order:
            events(broker, c)
    assert roles[0] == roles[1] == roles[2] == {"sub2": (0, "leader"), "sub": (1, "leader"), "sub3": (2, "member")}


def test_broadcast_chain_of_leaders_when_the_sender_gpu_has_no_receiver():
    b = DeviceBroker()
    layout = {"pub": "GPU-a", "x1": "GPU-c", "x2": "GPU-b", "x3": "GPU-c", "x4": "GPU-d"}
    for i, (c, uuid) in enumerate(layout.items()):
        b.handle(c, "hello", {"info": {"pid": 10 + i, "node_id": "n1", "device": {"uuid": uuid, "index": 0}}})
    b.handle("pub", "broadcast", {"item": item("b", receivers=4)})
    t = {}
    for c in ("x1", "x2", "x3", "x4"):
        r = b.handle(c, "subscribe", {"keys": ["b"]})["results"][0]
        t[c] = r["transfer"] if r["status"] == "matched" else None
    for c in ("x1", "x2", "x3"):
        (ev,) = events(b, c)
        t[c] = ev["transfer"]
    plan = {c: (x["position"], x["group"], x["role"], x.get("pred"), x.get("successor")) for c, x in t.items()}
    assert plan == {  # GPU uuid order after the sender's; each later leader pulls from the one before
        "x2": (0, 0, "leader", "sender", True),
        "x1": (1, 1, "leader", "chain", True),
        "x3": (2, 1, "member", None, None),
        "x4": (3, 2, "leader", "chain", False),
    }
    b.handle("x2", "chain_ready", {"tid": t["x2"]["tid"], "export": {"progress": "q"}})
    (ev,) = events(b, "x1")
    assert (ev["type"], ev["tid"], ev["pred"]["client"]) == ("chain_pred", t["x1"]["tid"], "x2")
    assert events(b, "x4") == [] and events(b, "x3") == []
    b.handle("x1", "chain_ready", {"tid": t["x1"]["tid"], "export": {"progress": "r"}})
    assert [e["pred"]["client"] for e in events(b, "x4")] == ["x1"]
    assert b.handle("x3", "member_ready", {"tid": t["x3"]["tid"], "export": {}})["leader_pid"] == 11
    assert [e["type"] for e in events(b, "x1")] == ["member_ready"]
    b.owner_gone("x3")  # a member goes: everyone is aborted; its leader hears it is gone
    assert [e["type"] for e in events(b, "x1")] == ["error", "peer_gone"]
    assert [e["type"] for e in events(b, "pub")] == ["failed", "peer_gone"]
    assert b.snapshot()["objects"] == {} and b.snapshot()["transfers"] == 0


def test_broadcast_receiver_failure_aborts_everyone(broker):
    broker.handle("pub", "broadcast", {"item": item("b", receivers=2)})
    broker.handle("sub", "subscribe", {"keys": ["b"]})
    t = broker.handle("sub2", "subscribe", {"keys": ["b"]})["results"][0]["transfer"]
    events(broker, "sub")
    broker.handle("sub2", "complete", {"tid": t["tid"], "ok": False, "error": "boom"})
    assert [e["type"] for e in events(broker, "pub")] == ["failed"]
    assert [e["error"] for e in events(broker, "sub")] == [B.E_ABORTED]
    assert broker.snapshot()["objects"] == {} and broker.snapshot()["transfers"] == 0


def test_broadcast_pending_receiver_times_out():
    clock = Clock()
    b = DeviceBroker(clock=clock)
    for c in ("pub", "sub"):
        b.handle(c, "hello", {"info": {}})
    b.handle("pub", "broadcast", {"item": item("b", receivers=2)})
    r = b.handle("sub", "subscribe", {"keys": ["b"], "timeout": 1})["results"][0]
    clock.t += 2
    assert [e["type"] for e in events(b, "sub")] == ["timeout"]
    assert b.handle("pub", "broadcast", {"item": item("c", receivers=0)})["results"][0]["error"] == B.E_BAD_REQUEST
    assert r["status"] == "waiting"


def test_nccl_pair_uid_from_destination_then_sends_flow(broker):
    broker.handle("pub", "publish", {"items": [item("a", transport="nccl"), item("b", transport="nccl")]})
    ta = broker.handle("sub", "subscribe", {"keys": ["a"]})["results"][0]["transfer"]
    tb = broker.handle("sub", "subscribe", {"keys": ["b"]})["results"][0]["transfer"]
    assert ta["path"] == "nccl" and ta["nccl"] == {"seq": 0, "create_uid": True}
    assert tb["nccl"] == {"seq": 1, "create_uid": False}
    assert events(broker, "pub") == []  # no send before the communicator id exists
    broker.handle("sub", "pair_uid", {"src": "pub", "uid": [1, 2, 3]})
    ev = events(broker, "pub")
    got = [(e["type"], e["transfer"]["key"], e["uid"]) for e in ev]
    assert got == [("send", "a", [1, 2, 3]), ("send", "b", [1, 2, 3])]


@pytest.mark.parametrize("uid_first", [False, True], ids=["before-uid", "after-uid"])
def test_a_failed_nccl_transfer_resets_its_pair(broker, uid_first):
    """Both ends run a pair's transfers strictly in sequence: one that never runs (a receive cancelled as it
    matched, a start that failed) used to hold every later transfer of the pair forever, and the pair's unique
    id was never made when that one was the first."""
    broker.handle("pub", "publish", {"items": [item(k, transport="nccl") for k in ("a", "b", "c")]})
    ta = broker.handle("sub", "subscribe", {"keys": ["a"]})["results"][0]["transfer"]
    if uid_first:
        broker.handle("sub", "pair_uid", {"src": "pub", "uid": [1, 2, 3]})
    tb = broker.handle("sub", "subscribe", {"keys": ["b"]})["results"][0]["transfer"]
    events(broker, "pub")
    assert broker.handle("sub", "complete", {"tid": ta["tid"], "ok": False, "error": "receive cancelled"})["ok"]
    # The pair is reset: its other transfer fails too (its object goes back), both ends drop their channel.
    assert [e["type"] for e in events(broker, "pub")] == ["pair_reset"]
    got = events(broker, "sub")
    assert [e["type"] for e in got] == ["error", "error", "pair_reset"] and got[1]["tid"] == tb["tid"]
    assert broker.snapshot()["transfers"] == 0 and not broker._pairs
    again = broker.handle("sub", "subscribe", {"keys": ["a"]})["results"][0]["transfer"]
    assert again["nccl"] == {"seq": 0, "create_uid": True}  # a new pair, with a new unique id
    # The sender may find the object released: it says so, and the pair is reset the same way.
    assert broker.handle("pub", "nccl_failed", {"tid": again["tid"], "error": "released"})["ok"]
    assert [e["type"] for e in events(broker, "pub")] == ["pair_reset"]
    assert broker.handle("sub2", "nccl_failed", {"tid": again["tid"]})["error"] == B.E_NOT_FOUND


def test_a_client_in_a_broadcast_twice_going_away(broker):
    broker.handle("pub", "broadcast", {"item": item("b", receivers=3)})
    broker.handle("sub", "subscribe", {"keys": ["b"]})
    broker.handle("sub", "subscribe", {"keys": ["b"]})  # once as the leader of GPU-b, once as its member
    broker.handle("sub2", "subscribe", {"keys": ["b"]})
    assert broker.snapshot()["transfers"] == 3
    assert broker.owner_gone("sub") == {"keys": 0, "copies": 2, "waits": 0}  # raised KeyError, half done
    assert [e["type"] for e in events(broker, "pub")] == ["failed", "peer_gone"]
    assert broker.snapshot()["transfers"] == 0 and "sub" not in broker._peers and "sub" not in broker._events


def test_receivers_waiting_for_a_broadcast_whose_sender_left_are_forgotten(broker):
    broker.handle("pub", "broadcast", {"item": item("b", receivers=3)})
    broker.handle("sub", "subscribe", {"keys": ["b"]})
    broker.handle("sub2", "subscribe", {"keys": ["b"], "timeout": 60})
    broker.owner_gone("pub")
    assert [e["error"] for e in events(broker, "sub") + events(broker, "sub2")] == [B.E_OWNER_GONE] * 2
    assert broker.stats()["waiters"] == 0 and not broker._waiter_by_id


def test_other_node_uses_nccl_same_pid_uses_local():
    b = DeviceBroker()
    b.handle("p", "hello", {"info": {"pid": 7, "node_id": "n1"}})
    b.handle("q", "hello", {"info": {"pid": 7, "node_id": "n2"}})
    b.handle("r", "hello", {"info": {"pid": 7, "node_id": "n1"}})
    b.handle("p", "mset", {"items": [item("w")]})
    assert b.handle("q", "mget", {"keys": ["w"]})["results"][0]["transfer"]["path"] == "nccl"
    assert b.handle("r", "mget", {"keys": ["w"]})["results"][0]["transfer"]["path"] == "local"


def test_records_and_events_are_msgpack_serializable(broker):
    broker.handle("pub", "publish", {"items": [item("k", handles=[{"handle": b"\x00\x01"}])]})
    r = broker.handle("sub", "subscribe", {"keys": ["k"], "timeout": 1})
    msgpack.packb(r)
    msgpack.packb(broker.snapshot())
    broker.handle("sub", "complete", {"tid": r["results"][0]["transfer"]["tid"], "ok": True})
    msgpack.packb(broker.handle("pub", "wait_events", {"timeout": 0}))


def test_unknown_op(broker):
    with pytest.raises(ValueError, match="op"):
        broker.handle("pub", "frobnicate", {})


def test_no_deadlock_many_pairs_both_directions():
    """Many clients publish to and subscribe from each other at once; every hand-off completes."""
    b = DeviceBroker()
    clients = [f"c{i}" for i in range(6)]
    for c in clients:
        b.handle(c, "hello", {"info": {"pid": 0, "node_id": "n"}})
    errors: list[BaseException] = []

    def run(me: str) -> None:
        try:
            wants = {}
            for other in clients:
                if other == me:
                    continue
                for j in range(5):
                    r = b.handle(me, "subscribe", {"keys": [f"{other}->{me}/{j}"], "timeout": 20})["results"][0]
                    if r["status"] == "matched":
                        b.handle(me, "complete", {"tid": r["transfer"]["tid"], "ok": True})
                    else:
                        wants[r["wid"]] = True
                    b.handle(me, "publish", {"items": [item(f"{me}->{other}/{j}")]})
            released = 0
            while wants or released < 25:
                for e in b.handle(me, "wait_events", {"timeout": 5})["events"]:
                    if e["type"] == "matched":
                        wants.pop(e["wid"])
                        b.handle(me, "complete", {"tid": e["transfer"]["tid"], "ok": True})
                    elif e["type"] == "released":
                        released += 1
                    else:
                        raise AssertionError(e)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "deadlock: hand-offs did not finish"
    assert not errors, errors
    assert b.snapshot()["objects"] == {} and b.snapshot()["waiters"] == 0


def test_delete_of_claimed_one_shot_then_failed_receive_forgets_it(broker):
    broker.handle("pub", "publish", {"items": [item("k")]})
    t = broker.handle("sub", "subscribe", {"keys": ["k"]})["results"][0]["transfer"]
    assert broker.handle("pub", "delete", {"keys": ["k"]})["results"][0]["pending"]
    broker.handle("sub2", "subscribe", {"keys": ["k"], "timeout": 5})
    broker.handle("sub", "complete", {"tid": t["tid"], "ok": False, "error": "x"})
    assert broker.snapshot()["objects"] == {}  # not back to ready: it was deleted
    (ev,) = events(broker, "pub")
    assert ev["type"] == "released" and ev["reason"] == "deleted"
    assert events(broker, "sub2") == []


def test_delete_of_broadcast_errors_receivers_already_joined(broker):
    broker.handle("pub", "broadcast", {"item": item("b", receivers=3)})
    r = broker.handle("sub", "subscribe", {"keys": ["b"], "timeout": 5})["results"][0]
    broker.handle("pub", "delete", {"keys": ["b"]})
    (ev,) = events(broker, "sub")
    assert ev["type"] == "error" and ev["wid"] == r["wid"] and ev["error"] == B.E_NOT_FOUND
    assert broker.snapshot()["waiters"] == 0


def test_peers_told_when_a_client_goes(broker):
    broker.handle("pub", "mset", {"items": [item("w")]})
    t = broker.handle("sub", "mget", {"keys": ["w"]})["results"][0]["transfer"]
    broker.handle("sub", "complete", {"tid": t["tid"], "ok": True})
    broker.owner_gone("pub")
    assert [(e["type"], e["client"]) for e in events(broker, "sub")] == [("peer_gone", "pub")]
    assert events(broker, "sub2") == []  # never exchanged anything with it


def test_source_gpu_hidden_from_reader_uses_nccl():
    b = DeviceBroker()
    b.handle("p", "hello", {"info": {"pid": 1, "node_id": "n"}})
    b.handle("q", "hello", {"info": {"pid": 2, "node_id": "n", "visible": ["GPU-b"]}})
    b.handle("r", "hello", {"info": {"pid": 3, "node_id": "n", "visible": ["GPU-a", "GPU-b"]}})
    b.handle("p", "mset", {"items": [item("w")]})  # on GPU-a
    assert b.handle("q", "mget", {"keys": ["w"]})["results"][0]["transfer"]["path"] == "nccl"
    assert b.handle("r", "mget", {"keys": ["w"]})["results"][0]["transfer"]["path"] == "ipc"


@pytest.mark.parametrize(
    ("op", "args", "exc", "field"),
    [
        ("publish", {"items": [item("ok"), {**item("bad"), "tensors": 5}]}, TypeError, "a.items[1].tensors"),
        ("publish", {"items": [item("ok"), {**item("bad"), "device": ["GPU-a"]}]}, TypeError, "a.items[1].device"),
        ("mset", {"items": [item("ok"), item("")]}, ValueError, "a.items[1].key"),
        ("mset", {"items": [item("ok", shape=(4, -8))]}, ValueError, "a.items[0].tensors[0].shape[1]"),
        ("broadcast", {"item": {**item("b", receivers=2), "tensors": []}}, ValueError, "a.item.tensors"),
        ("subscribe", {"keys": ["k", 3], "timeout": 1}, TypeError, "a.keys[1]"),
        ("subscribe", {"keys": ["k"], "specs": [spec(), spec()]}, ValueError, "a.specs: 2 spec lists for 1 keys"),
        ("mget", {"keys": ["k"], "timeout": float("nan")}, ValueError, "a.timeout"),
        ("mget", {"keys": ["k"], "known": ["7"]}, TypeError, "a.known[0]"),
        ("cancel", {"wids": [1, "2"]}, TypeError, "a.wids[1]"),
        ("delete", {}, TypeError, "a.keys"),
        ("complete", {"ok": True}, TypeError, "a.tid"),
        ("complete_many", {"items": [{"tid": 1}, {"tid": True}]}, TypeError, "a.items[1].tid"),
        ("pair_uid", {"src": "pub"}, TypeError, "a.uid"),
        ("member_ready", {"tid": 1, "export": "x"}, TypeError, "a.export"),
        ("wait_events", {"timeout": "soon"}, TypeError, "a.timeout"),
        ("goodbye", {"done": 5}, TypeError, "a.done"),
    ],
)
def test_malformed_arguments_are_refused_whole_before_anything_changes(broker, op, args, exc, field):
    before = broker.snapshot()
    with pytest.raises(exc, match=re.escape(field)):
        broker.handle("pub", op, args)
    assert broker.snapshot() == before  # the good item before the bad one was not registered either
    assert broker.stats()["clients"] == 4


def test_a_record_refused_for_its_device_never_reaches_a_subscriber(broker):
    # Stored, a device that is not a map would have failed the subscriber's own request at its match.
    with pytest.raises(TypeError, match=r"a\.items\[0\]\.device"):
        broker.handle("pub", "publish", {"items": [{**item("k"), "device": "GPU-a"}]})
    r = broker.handle("sub", "subscribe", {"keys": ["k"], "specs": [spec()], "timeout": 1})["results"][0]
    assert r["status"] == "waiting"
    assert broker.handle("pub", "publish", {"items": [item("k")]})["results"][0]["ok"]
    assert [e["type"] for e in events(broker, "sub")] == ["matched"]

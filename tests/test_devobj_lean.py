"""Lean subscribe/mget replies (shared record fields once per reply), their widening on the client, the
broker's path memo, spec reuse and the reply-spin setting; all on CPU."""

from __future__ import annotations

import threading

import msgpack
import pytest
import torch

from kvstrata.devobj import (
    DeviceBroker,
    DeviceObjectConfig,
    DeviceObjects,
    InprocBrokerLink,
    _core,
    ipc,
    request,
    service,
)
from kvstrata.devobj import broker as B

SPEC = [{"shape": [4, 8], "dtype": "float16", "nbytes": 64}]


def item(key: str, **extra):
    return {
        "key": key,
        "tensors": [dict(SPEC[0])],
        "handles": [{"handle": b"h" + key.encode(), "storage_offset": 0, "size": [4, 8]}],
        "events": [],
        "device": {"uuid": "GPU-a", "index": 0},
        "pid": 1,
        "local": f"t-{key}",
        "transport": "auto",
        **extra,
    }


@pytest.fixture
def broker():
    b = DeviceBroker()
    for c, pid, uuid in (("pub", 1, "GPU-a"), ("pub2", 5, "GPU-b"), ("sub", 2, "GPU-b")):
        b.handle(c, "hello", {"info": {"pid": pid, "node_id": "n1", "device": {"uuid": uuid, "index": 0}}})
    return b


def _wire(reply):
    """What the worker connection does to a reply."""
    return msgpack.unpackb(msgpack.packb(reply, use_bin_type=True), raw=False, strict_map_key=False)


def _full(b, op, keys, **args):
    """The same request answered whole (no ``lean``): what widening must give back."""
    return b.handle("sub", op, {"keys": keys, "specs": [SPEC] * len(keys), **args})


@pytest.mark.parametrize("op, mode", [("subscribe", "publish"), ("mget", "mset")])
def test_lean_reply_widens_to_the_full_transfer(broker, op, mode):
    keys = ["a", "b", "c"]
    broker.handle("pub", mode, {"items": [item(k) for k in keys[:2]]})
    broker.handle("pub2", mode, {"items": [item("c", device={"uuid": "GPU-b", "index": 0}, pid=5)]})
    reply = _wire(broker.handle("sub", op, {"keys": keys, "specs": [SPEC] * 3, "timeout": 1, "lean": True}))
    assert len(reply["shared"]) == 2  # once per (client, mode), not once per key
    assert {s["owner"] for s in reply["shared"]} == {"pub", "pub2"}
    got = []
    for r in reply["results"]:
        lean = r["transfer"]
        assert set(lean) == {"tid", "s", "record"}
        assert not set(lean["record"]) & {"key", "tensors", "events", *B.SHARED_FIELDS}
        got.append(request.widen(lean, r, reply, "sub" if op == "subscribe" else "get", "sub", SPEC))
    if op == "subscribe":  # one-shot objects were claimed: publish them again for the whole answer
        for t in got:
            broker.handle("sub", "complete", {"tid": t["tid"], "ok": True})
        broker.handle("pub", mode, {"items": [item(k) for k in keys[:2]]})
        broker.handle("pub2", mode, {"items": [item("c", device={"uuid": "GPU-b", "index": 0}, pid=5)]})
    full = _wire(_full(broker, op, keys, timeout=1))["results"]
    for t, r in zip(got, full):
        want = r["transfer"]
        skip = ("tid", "wid", "obj")  # a later request: other ids
        assert {k: v for k, v in t.items() if k not in skip and k != "record"} == {
            k: v for k, v in want.items() if k not in skip and k != "record"
        }
        assert want["record"].pop("events") == []  # empty: left out of lean records, read by no one
        assert {k: v for k, v in t["record"].items() if k != "obj"} == {
            k: v for k, v in want["record"].items() if k != "obj"
        }
    assert [t["path"] for t in got] == ["ipc"] * 3


def test_lean_reply_keeps_errors_waiting_and_known_records(broker):
    broker.handle("pub", "mset", {"items": [item("m")]})
    first = broker.handle("sub", "mget", {"keys": ["m"], "specs": [SPEC], "lean": True})
    obj = first["results"][0]["transfer"]["record"]["obj"]
    bad = [{"shape": [3], "dtype": "float16", "nbytes": 6}]
    r = broker.handle(
        "sub", "mget", {"keys": ["m", "m2"], "specs": [SPEC, SPEC], "known": [obj], "timeout": 5, "lean": True}
    )
    known, waiting = r["results"]
    assert known["transfer"] == {"tid": known["transfer"]["tid"], "s": 0, "obj": obj} and r["paths"] == ["ipc"]
    assert waiting["status"] == "waiting"
    err = broker.handle("sub", "mget", {"keys": ["m"], "specs": [bad], "lean": True})["results"][0]
    assert err["status"] == "error" and err["error"] == B.E_MISMATCH


def test_path_memo_follows_a_client_that_says_hello_again(broker):
    broker.handle("pub", "publish", {"items": [item("x")]})
    t = broker.handle("sub", "subscribe", {"keys": ["x"], "specs": [SPEC]})["results"][0]["transfer"]
    assert t["path"] == "ipc"
    broker.handle("sub", "complete", {"tid": t["tid"], "ok": True})
    # The receiver moves to another node: the path the broker worked out before must not stick.
    broker.handle("sub", "hello", {"info": {"pid": 2, "node_id": "n2", "device": {"uuid": "GPU-b", "index": 0}}})
    broker.handle("pub", "publish", {"items": [item("y")]})
    t = broker.handle("sub", "subscribe", {"keys": ["y"], "specs": [SPEC]})["results"][0]["transfer"]
    assert t["path"] == "nccl"


def test_objects_of_one_client_with_other_fields_keep_their_own(broker):
    broker.handle("pub", "publish", {"items": [item("p"), item("q", transport="nccl")]})
    r = broker.handle("sub", "subscribe", {"keys": ["p", "q"], "specs": [SPEC, SPEC], "lean": True})
    lean, whole = (x["transfer"] for x in r["results"])
    assert r["paths"][lean["s"]] == "ipc"
    assert "s" not in whole and whole["path"] == "nccl"  # sent whole (the sender hears of it by event)


def test_many_keys_move_exactly_through_lean_replies():
    broker = DeviceBroker()
    cfg = DeviceObjectConfig(allow_cpu=True, poll_seconds=0.05)
    a = DeviceObjects(InprocBrokerLink(broker), device="cpu", config=cfg)
    b = DeviceObjects(InprocBrokerLink(broker), device="cpu", config=cfg)
    try:
        src = [
            [torch.arange(i, i + 7, dtype=torch.float32), torch.full((2, 3), i, dtype=torch.int16)] for i in range(40)
        ]
        dst = [[torch.zeros(7), torch.zeros((2, 3), dtype=torch.int16)] for _ in range(40)]
        keys = [f"k{i}" for i in range(40)]
        pubs = a.dev_publish(keys, src)
        for f in b.dev_subscribe(keys, dst, timeout=10):
            assert f.exception(10) is None
        for f in pubs:
            assert f.exception(10) is None
        assert all(torch.equal(d, s) for ds, ss in zip(dst, src) for d, s in zip(ds, ss))
        assert broker.snapshot()["objects"] == {}
    finally:
        a.close()
        b.close()


def test_specs_of_reuses_one_list_per_shape_and_dtype():
    x, y = torch.zeros(3, 4), torch.ones(3, 4)
    assert _core.specs_of([x]) is _core.specs_of([y]) == [{"shape": [3, 4], "dtype": "float32", "nbytes": 48}]
    assert _core.specs_of([x.half()]) != _core.specs_of([x])
    two = _core.specs_of([x, torch.zeros(2, dtype=torch.int8)])
    assert two == [ipc.spec(x), {"shape": [2], "dtype": "int8", "nbytes": 2}]


def test_reply_spin_setting(monkeypatch):
    monkeypatch.setenv("KVSTRATA_DEVOBJ_SPIN_US", "50")
    assert service.reply_spin_seconds() == pytest.approx(50e-6)
    monkeypatch.setenv("KVSTRATA_DEVOBJ_SPIN_US", "0")
    assert service.reply_spin_seconds() == 0.0
    monkeypatch.setenv("KVSTRATA_DEVOBJ_SPIN_US", "lots")
    monkeypatch.setattr(service.os, "sched_getaffinity", lambda pid: set(range(4)))
    assert service.reply_spin_seconds() == 0.0  # few CPUs: wait asleep
    monkeypatch.delenv("KVSTRATA_DEVOBJ_SPIN_US")
    monkeypatch.setattr(service.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert service.reply_spin_seconds() == pytest.approx(service.SPIN_US * 1e-6)


def test_event_spin_setting(monkeypatch):
    monkeypatch.delenv("KVSTRATA_DEVOBJ_EVENT_SPIN_US", raising=False)
    assert service.event_spin_seconds() == 0.0  # off unless asked for
    monkeypatch.setenv("KVSTRATA_DEVOBJ_EVENT_SPIN_US", "1500")
    assert service.event_spin_seconds() == pytest.approx(1.5e-3)
    monkeypatch.setenv("KVSTRATA_DEVOBJ_EVENT_SPIN_US", "1e9")
    assert service.event_spin_seconds() == pytest.approx(0.1)  # capped
    monkeypatch.setenv("KVSTRATA_DEVOBJ_EVENT_SPIN_US", "soon")
    assert service.event_spin_seconds() == 0.0


def test_inline_receive_reports_done_off_the_callers_thread(monkeypatch):
    """A small publisher-first receive is copied on the caller's thread; the broker hears of it from a copy
    thread (not the caller's, not a poll: polls here wait 30 s), so the publisher's future completes."""
    broker = DeviceBroker()
    cfg = DeviceObjectConfig(allow_cpu=True, poll_seconds=30.0)
    a = DeviceObjects(InprocBrokerLink(broker), device="cpu", config=cfg)
    b = DeviceObjects(InprocBrokerLink(broker), device="cpu", config=cfg)
    senders = []
    real = b._flush_done

    def flush():
        senders.append(threading.current_thread().name)
        real()

    monkeypatch.setattr(b, "_flush_done", flush)
    try:
        src = torch.arange(16, dtype=torch.int32)
        (pub,) = a.dev_publish(["k"], [[src]])
        dst = torch.zeros(16, dtype=torch.int32)
        (f,) = b.dev_subscribe(["k"], [[dst]], timeout=5)
        assert f.done() and f.exception() is None and torch.equal(dst, src)  # copied inline, settled
        assert pub.exception(5) is None  # released: the broker heard of the receive
        assert senders and all(name.startswith("kvstrata-devobj_") for name in senders)
    finally:
        a.close()
        b.close()

"""Faults found by an audit of the device-object package, each pinned down: a long poll's timeout past the clock's
range (the broker's timer thread died of it, and every later receive's timeout with it), a timer thread that fails
anyway (the next parked poll starts another), a client's hello info the broker reads inside other clients' requests
(checked when said; a failure to start one receive's copy fails that receive alone, never the publish that matched
it), the link's maps let go at close instead of whenever the cyclic GC runs, events parked ahead of their receive
forgotten once taken, and an owner's death told apart by type."""

from __future__ import annotations

import gc
import itertools
import os
import threading
import time

import pytest
import torch

from kvstrata import errors
from kvstrata.devobj import DeviceBroker, DeviceObjectConfig, DeviceObjects, InprocBrokerLink, OwnerGone
from kvstrata.devobj import broker as B
from kvstrata.devobj.broker_args import check_seconds
from kvstrata.devobj.link import TransferAborted, error_from

CFG = DeviceObjectConfig(allow_cpu=True, poll_seconds=0.05, chunk_bytes=4096)
WAIT = 10  # seconds: a hang fails the test instead of blocking the run
SPEC = [{"shape": [4], "dtype": "float32"}]


@pytest.fixture
def broker():
    return DeviceBroker()


@pytest.fixture
def make(broker):
    made = []

    def _make(name: str | None = None) -> DeviceObjects:
        c = DeviceObjects(InprocBrokerLink(broker, name), device="cpu", config=CFG)
        made.append(c)
        return c

    yield _make
    for c in made:
        c.close()


@pytest.fixture
def worker(tmp_path):
    from kvstrata.server.config import WorkerConfig
    from kvstrata.server.worker import Worker

    w = Worker(WorkerConfig(socket=str(tmp_path / "kv.sock"), memory=16 << 20, disk_dir="")).start()
    yield w
    w.stop()


def record(key: str) -> dict:
    return {"key": key, "tensors": SPEC, "handles": [], "events": [], "device": {"uuid": "GPU-a", "index": 0}}


class Answers:
    """A parked poll's ``deliver``: the answers it got, and when."""

    def __init__(self) -> None:
        self.got: list[tuple[float, dict]] = []
        self.came = threading.Event()

    def __call__(self, reply: dict) -> None:
        self.got.append((time.monotonic(), reply))
        self.came.set()


def park(broker: DeviceBroker, client: str, timeout) -> Answers:
    broker.handle(client, "hello", {"info": {}})
    answers = Answers()
    assert broker.park_poll(client, timeout, answers) is None  # no events: parked
    return answers


# -- 1. timeouts past the clock's range, and a timer thread that fails ----------------------------------------------
@pytest.mark.parametrize("seconds", [1e9, 1e10, 1e300, float("inf"), 10**400])
def test_seconds_of_forever_or_more_mean_no_limit(seconds):
    assert check_seconds(seconds, "t") is None  # as the client's check_timeout and the waiters' deadlines say
    assert check_seconds(2, "t") == 2.0 and check_seconds(None, "t") is None
    with pytest.raises(errors.InvalidValue, match="t: "):
        check_seconds(float("nan"), "t")
    with pytest.raises(errors.InvalidType, match="t: "):
        check_seconds(True, "t")


@pytest.mark.parametrize("seconds", [1e10, 1e300, float("inf")])
def test_a_parked_poll_of_forever_leaves_the_timer_to_others(broker, seconds):
    forever = park(broker, "forever", seconds)
    time.sleep(0.1)  # the timer thread plans its wait (once an OverflowError there: the thread died, still "set")
    soon = park(broker, "soon", 0.2)
    t0 = time.monotonic()
    assert soon.came.wait(WAIT), "a parked poll with a 0.2 s timeout was never answered"
    assert soon.got[0][1] == {"events": []} and soon.got[0][0] - t0 < 5
    assert not forever.got  # still parked: it waits for events, or the client's end
    broker.owner_gone("forever")
    assert forever.got[-1][1] == {"events": [], "closed": True}


def test_an_in_process_long_poll_of_forever_waits_instead_of_raising(broker):
    broker.handle("c", "hello", {"info": {}})
    broker.handle("p", "hello", {"info": {}})
    wait = broker.handle("c", "subscribe", {"keys": ["k"], "specs": [SPEC], "timeout": None})["results"][0]
    got: list = []

    def poll() -> None:
        try:
            got.append(broker.handle("c", "wait_events", {"timeout": 1e300}))
        except Exception as exc:  # once OverflowError out of the condition's wait
            got.append(exc)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    time.sleep(0.1)
    assert broker.handle("p", "publish", {"items": [record("k")]})["results"][0]["ok"]  # c's match wakes the poll
    thread.join(WAIT)
    assert got and not isinstance(got[0], Exception), got
    assert [(e["type"], e["wid"]) for e in got[0]["events"]] == [("matched", wait["wid"])]


def test_a_long_poll_of_forever_through_the_worker_leaves_other_receives_their_timeout(worker):
    from kvstrata.devobj.service import WorkerBrokerLink
    from kvstrata.transport import connect

    bad = connect(worker.address, timeout=5, hello={"shm": False, "name": "bad"})
    link = WorkerBrokerLink(worker.address)
    c = DeviceObjects(link, device="cpu", config=CFG)
    try:
        bad.send({"op": "dev", "dop": "hello", "cid": "bad", "a": {"info": {}}})
        assert bad.recv(5)[0] == {"r": {"ok": True}}
        bad.send({"op": "dev", "dop": "wait_events", "cid": "bad", "a": {"timeout": 1e300}, "t": 1e300})
        time.sleep(0.3)
        t0 = time.monotonic()
        (f,) = c.dev_subscribe(["never"], [[torch.zeros(4)]], timeout=0.5)
        with pytest.raises(errors.Timeout):
            f.result(WAIT)
        assert time.monotonic() - t0 < 5
    finally:
        c.close()
        link.close()
        bad.close()


def test_a_failed_timer_thread_is_replaced_by_the_next_parked_poll(broker, monkeypatch, caplog):
    expire = broker._expire_locked
    failed = threading.Event()

    def expire_failing_once_in_the_timer() -> None:
        if threading.current_thread().name == "kvstrata-devobj-timer" and not failed.is_set():
            failed.set()
            raise RuntimeError("a bug in a timer round")
        expire()

    monkeypatch.setattr(broker, "_expire_locked", expire_failing_once_in_the_timer)
    first = park(broker, "first", 0.05)
    assert failed.wait(WAIT)
    deadline = time.monotonic() + WAIT
    while broker._timer is not None and time.monotonic() < deadline:  # the failed thread let its place go
        time.sleep(0.01)
    assert broker._timer is None and "timer thread failed" in caplog.text
    later = park(broker, "later", 0.05)  # starts another, which answers both
    assert later.came.wait(WAIT) and first.came.wait(WAIT)
    assert later.got[0][1] == first.got[0][1] == {"events": []}


def test_a_deliver_that_raises_does_not_keep_the_other_answers(broker):
    def raising(reply: dict) -> None:
        raise RuntimeError("against the contract")

    broker.handle("x", "hello", {"info": {}})
    broker.park_poll("x", 0.05, raising)
    ok = park(broker, "ok", 0.05)
    assert ok.came.wait(WAIT)
    time.sleep(0.1)
    assert broker._timer is None or broker._timer.is_alive()
    again = park(broker, "again", 0.05)
    assert again.came.wait(WAIT)


# -- 2. a client's hello info -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("info", "field"),
    [
        ({"visible": 5}, "a.info.visible"),
        ({"visible": ["GPU-a", 3]}, r"a.info.visible\[1\]"),
        ({"node_id": 7}, "a.info.node_id"),
        ({"pid": "12"}, "a.info.pid"),
        ({"pid": True}, "a.info.pid"),
        ({"device": "GPU-a"}, "a.info.device"),
        ({"device": {"uuid": 1}}, "a.info.device.uuid"),
        ([1], "a.info"),
    ],
)
def test_hello_info_is_checked_naming_the_field(broker, info, field):
    with pytest.raises(errors.InvalidArgument, match=field):
        broker.handle("bad", "hello", {"info": info})
    assert "bad" not in broker._clients
    good = {"pid": 3, "node_id": "n", "device": {"uuid": "GPU-a", "index": 0}, "visible": ["GPU-a"]}
    assert broker.handle("good", "hello", {"info": good}) == {"ok": True}
    assert broker.handle("none", "hello", {"info": None}) == {"ok": True}


def test_a_bad_hello_cannot_fail_another_clients_publish(broker):
    broker.handle("pub", "hello", {"info": {"pid": 1, "node_id": "n"}})
    with pytest.raises(errors.InvalidType):
        broker.handle("bad", "hello", {"info": {"visible": 5, "node_id": "other"}})
    assert "bad" not in broker._clients  # refused whole: it may say a good one
    broker.handle("bad", "hello", {"info": {"visible": ["GPU-a"], "node_id": "n"}})
    wait = broker.handle("bad", "subscribe", {"keys": ["k"], "specs": [SPEC], "timeout": 30})["results"][0]
    assert wait["status"] == "waiting"
    assert broker.handle("pub", "publish", {"items": [record("k")]})["results"][0]["ok"]
    (ev,) = broker.handle("bad", "wait_events", {"timeout": 0})["events"]
    assert ev["type"] == "matched" and ev["wid"] == wait["wid"]


def test_a_receive_whose_copy_cannot_start_fails_alone(broker, monkeypatch):
    """The backstop: whatever fails while a publish's object is matched with one waiter (here the path, which reads
    the clients' infos) answers that waiter with an error and leaves the publish, the object and the others whole."""
    for c in ("pub", "odd", "sub"):
        broker.handle(c, "hello", {"info": {"pid": 1 + len(c), "node_id": "n"}})
    path = broker._path

    def path_failing_for_odd(rec, dst):
        if dst == "odd":
            raise TypeError("a client info the checks missed")
        return path(rec, dst)

    monkeypatch.setattr(broker, "_path", path_failing_for_odd)
    odd = broker.handle("odd", "subscribe", {"keys": ["k"], "specs": [SPEC], "timeout": 30})["results"][0]
    sub = broker.handle("sub", "subscribe", {"keys": ["k"], "specs": [SPEC], "timeout": 30})["results"][0]
    r = broker.handle("pub", "publish", {"items": [record("k")]})
    assert r["results"][0]["ok"]
    (ev,) = broker.handle("odd", "wait_events", {"timeout": 0})["events"]
    assert ev["type"] == "error" and ev["wid"] == odd["wid"] and ev["error"] == B.E_BAD_REQUEST
    assert "a client info the checks missed" in ev["message"]
    (ev,) = broker.handle("sub", "wait_events", {"timeout": 0})["events"]  # the next waiter has it, whole
    assert ev["type"] == "matched" and ev["wid"] == sub["wid"]
    assert len(broker._transfers) == 1 and broker._objects["k"].transfers == {ev["transfer"]["tid"]}
    assert "odd" not in broker._peers.get("pub", set())


# -- 3. the link's maps and descriptors -------------------------------------------------------------------------------
def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_clients_made_and_closed_leave_no_descriptors_without_the_cyclic_gc(worker):
    from kvstrata.devobj.service import WorkerBrokerLink

    def one(i: int) -> None:
        link = WorkerBrokerLink(worker.address)
        c = DeviceObjects(link, device="cpu", config=CFG)
        assert link.generation_counter is not None  # the worker sent its page: there is something to let go
        c.dev_publish([f"x{i}"], [[torch.ones(4)]])
        dst = torch.zeros(4)
        assert c.dev_subscribe([f"x{i}"], [[dst]], timeout=WAIT)[0].result(WAIT) is None and dst[0] == 1
        c.close()
        link.close()

    one(-1)  # warm: lazy imports, the worker's threads
    gc.collect()
    gc.disable()
    try:
        before = _fds()
        for i in range(30):
            one(i)
        after = _fds()
    finally:
        gc.enable()
    assert after - before <= 4, f"{after - before} descriptors more after 30 clients (2 a client: their maps)"


def test_a_link_closed_under_a_reader_keeps_the_page_mapped(worker):
    from kvstrata.devobj.service import WorkerBrokerLink

    link = WorkerBrokerLink(worker.address)
    counter = link.generation_counter
    assert counter is not None
    link.close()
    assert link.generation_counter is None and link.offer_table is None
    assert link._page is not None  # exported to `counter`: left mapped, so this read is safe
    assert counter.value >= 0
    del counter
    link.close()  # again: nothing exports it now
    assert link._page is None and link._table_map is None


def test_a_closed_client_lets_go_of_the_link(worker):
    from kvstrata.devobj.service import WorkerBrokerLink

    link = WorkerBrokerLink(worker.address)
    c = DeviceObjects(link, device="cpu", config=CFG)
    assert link.on_poll_sent is not None
    c.close()
    assert link.on_poll_sent is None and c._gen is None and c._offer_table is None
    with pytest.raises(errors.ClosedError):
        c.dev_mget(["k"], [[torch.zeros(4)]])
    link.close()
    assert link._page is None


# -- 4. events parked ahead of their receive -------------------------------------------------------------------------
def test_events_parked_ahead_of_their_publish_are_forgotten_once_taken(make, broker):
    """A publish's ``released`` can come before the publish's reply is read (its receiver was quick): parked, then
    taken by the publish. Taken, it leaves nothing behind in either table."""
    a = make("a")
    futures = []
    for i in range(50):
        broker._ids = itertools.count(10_000 + 10 * i)  # the object id the next publish gets
        a._dispatch({"type": "released", "obj": 10_000 + 10 * i, "key": f"k{i}", "reason": "received"})
        assert list(a._early_at) == [("obj", 10_000 + 10 * i)]
        (f,) = a.dev_publish([f"k{i}"], [[torch.ones(4)]])
        futures.append(f)
        assert not a._early and not a._early_at
    assert all(f.result(WAIT) is None for f in futures)


def test_a_key_taken_and_parked_again_is_timed_from_then(make, monkeypatch):
    from kvstrata.devobj import events

    c = make()
    now = [1000.0]
    monkeypatch.setattr(events, "_clock", lambda: now[0])
    c._dispatch({"type": "transfer_done", "tid": 91})
    with c._lock:
        assert c._take_early(("tid", 91)) == [{"type": "transfer_done", "tid": 91}]
        assert c._take_early(("tid", 91)) == []
    now[0] += events.EARLY_KEEP_S - 1
    c._dispatch({"type": "transfer_done", "tid": 91})  # parked again, young
    now[0] += 2
    c._dispatch({"type": "released", "obj": 5, "key": "k"})  # the first parking is past EARLY_KEEP_S: not this one
    assert set(c._early) == set(c._early_at) == {("tid", 91), ("obj", 5)}


# -- 5. an owner's death, by type -------------------------------------------------------------------------------------
def test_owner_gone_and_aborted_have_types_of_their_own_and_stay_server_errors():
    gone = error_from(B.E_OWNER_GONE, "owner of 'k' went away")
    aborted = error_from(B.E_ABORTED, "broadcast of 'k' failed")
    assert type(gone) is OwnerGone and isinstance(gone, errors.ServerError)
    assert type(aborted) is TransferAborted and isinstance(aborted, errors.ServerError)
    assert str(gone) == "OwnerGone: owner of 'k' went away" and str(aborted).startswith("Aborted: ")
    assert type(error_from("SomethingElse", "x")) is errors.ServerError


def test_a_receive_from_a_broadcaster_that_left_fails_with_owner_gone(make):
    a, b = make("a"), make("b")
    sent = a.dev_broadcast("k", [torch.ones(4)], receivers=2)
    (waiting,) = b.dev_subscribe(["k"], [[torch.zeros(4)]], timeout=WAIT)  # joins; the second receiver never comes
    time.sleep(0.05)
    a.close()
    with pytest.raises(OwnerGone, match="went away"):
        waiting.result(WAIT)
    with pytest.raises(errors.ClosedError):
        sent.result(WAIT)

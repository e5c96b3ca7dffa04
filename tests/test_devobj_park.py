"""Parked long polls (how a worker hosts the broker): events answered by the thread that pushes them,
before the pusher's own reply; deadlines; departures; the owner-liveness watch; one-way requests."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from kvstrata.devobj._core import PidWatch
from kvstrata.devobj.broker import DeviceBroker

WAIT = 5.0


def item(key: str) -> dict:
    return {"key": key, "tensors": spec(), "handles": [], "events": [], "device": {"uuid": "GPU-a", "index": 0}}


def spec() -> list[dict]:
    return [{"shape": [4, 8], "dtype": "float16", "nbytes": 64}]


class Inbox:
    """A parked poll's deliver callback: the replies it got, and which thread sent them."""

    def __init__(self) -> None:
        self.replies: list[dict] = []
        self.threads: list[str] = []
        self.got = threading.Event()

    def __call__(self, reply: dict) -> None:
        self.replies.append(reply)
        self.threads.append(threading.current_thread().name)
        self.got.set()


def _broker() -> DeviceBroker:
    b = DeviceBroker()
    for c, pid in (("pub", 1), ("sub", 2)):
        b.handle(c, "hello", {"info": {"pid": pid, "node_id": "n1", "device": {"uuid": "GPU-a", "index": 0}}})
    return b


def test_match_is_delivered_by_the_publishing_thread_before_its_reply():
    b = _broker()
    assert b.handle("sub", "subscribe", {"keys": ["k"], "specs": [spec()], "timeout": 10})["results"][0]["status"] == (
        "waiting"
    )
    inbox = Inbox()
    assert b.park_poll("sub", 10.0, inbox) is None  # nothing yet: parked
    assert inbox.replies == []
    r = b.handle("pub", "publish", {"items": [item("k")]})
    assert r["results"][0]["ok"]
    # delivered inside handle(), on this thread: no other thread had to wake up to carry it
    assert [e["type"] for e in inbox.replies[0]["events"]] == ["matched"]
    assert inbox.threads == [threading.current_thread().name]
    # the parked poll is answered once: later events queue for the next poll
    tid = inbox.replies[0]["events"][0]["transfer"]["tid"]
    pub_inbox = Inbox()
    assert b.park_poll("pub", 10.0, pub_inbox) is None
    b.handle("sub", "complete", {"tid": tid, "ok": True})
    assert [e["type"] for e in pub_inbox.replies[0]["events"]] == ["released"]
    assert len(inbox.replies) == 1


def test_queued_events_answer_a_poll_at_once_and_a_zero_timeout_never_parks():
    b = _broker()
    b.handle("sub", "subscribe", {"keys": ["k"], "specs": [spec()], "timeout": 10})
    b.handle("pub", "publish", {"items": [item("k")]})
    inbox = Inbox()
    r = b.park_poll("sub", 10.0, inbox)
    assert [e["type"] for e in r["events"]] == ["matched"] and inbox.replies == []
    assert b.park_poll("sub", 0.0, inbox) == {"events": []}
    assert b.park_poll("nobody", 1.0, inbox) == {"events": [], "closed": True}


def test_parked_poll_ends_empty_at_its_timeout():
    b = _broker()
    inbox = Inbox()
    t0 = time.monotonic()
    assert b.park_poll("sub", 0.05, inbox) is None
    assert inbox.got.wait(WAIT)
    assert inbox.replies == [{"events": []}] and time.monotonic() - t0 >= 0.04
    assert inbox.threads == ["kvstrata-devobj-timer"]


def test_waiter_deadline_reaches_a_parked_poll():
    b = _broker()
    inbox = Inbox()
    assert b.park_poll("sub", 30.0, inbox) is None  # the timer now sleeps ~30 s: the waiter must wake it
    b.handle("sub", "subscribe", {"keys": ["never"], "specs": [spec()], "timeout": 0.05})
    assert inbox.got.wait(WAIT), "the waiter's timeout was not delivered to the parked poll"
    (ev,) = inbox.replies[0]["events"]
    assert ev["type"] == "timeout" and ev["key"] == "never"


def test_departure_answers_the_parked_poll_closed_and_peers_hear_of_it():
    b = _broker()
    b.handle("pub", "publish", {"items": [item("k")]})
    r = b.handle("sub", "subscribe", {"keys": ["k"], "specs": [spec()], "timeout": 1})["results"][0]
    assert r["status"] == "matched"
    sub_inbox, pub_inbox = Inbox(), Inbox()
    b.park_poll("sub", 10.0, sub_inbox)
    b.park_poll("pub", 10.0, pub_inbox)
    b.owner_gone("pub")  # the owner dies mid-transfer
    assert pub_inbox.replies == [{"events": [], "closed": True}]
    types = [e["type"] for e in sub_inbox.replies[0]["events"]]
    assert types[0] == "error" and "peer_gone" in types


def test_a_second_poll_ends_the_first():
    b = _broker()
    first, second = Inbox(), Inbox()
    b.park_poll("sub", 10.0, first)
    b.park_poll("sub", 10.0, second)
    assert first.replies == [{"events": []}]
    b.handle("pub", "publish", {"items": [item("k")]})
    b.handle("sub", "subscribe", {"keys": ["k"], "specs": [spec()], "timeout": 1})  # matched at once: no event
    b.owner_gone("sub")
    assert second.replies == [{"events": [], "closed": True}]


def test_pid_watch_tells_live_dead_and_zombie_processes():
    w = PidWatch(max_pids=2)
    try:
        assert w.alive(os.getpid()) and w.alive(os.getppid())
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        assert not w.alive(gone.pid)
        live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            assert w.alive(live.pid)  # evicts the oldest entry (max_pids=2): still answers
            assert w.alive(os.getpid())
            live.stdin.close()
            deadline = time.monotonic() + WAIT
            while w.alive(live.pid) and time.monotonic() < deadline:  # exited, not reaped yet: a zombie
                time.sleep(0.01)
            assert not w.alive(live.pid)
        finally:
            live.wait()
    finally:
        w.close()
    assert w.alive(os.getpid())  # after close: the slow way, or a new pidfd
    w.close()


def test_pid_watch_answers_threads_asking_for_one_pid_at_once():
    """Copy threads and the event thread check an owner after their copies at the same time: one pidfd's poll object
    serves them all (a poll object refuses a second concurrent poll() with RuntimeError)."""
    w = PidWatch()
    errors_seen: list[BaseException] = []
    go = threading.Barrier(8)

    def ask() -> None:
        go.wait()
        try:
            for _ in range(5000):
                assert w.alive(os.getpid())
        except BaseException as exc:
            errors_seen.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    w.close()
    assert not errors_seen, errors_seen[:1]


@pytest.mark.parametrize("event_spin_us", ["", "2000"])
def test_worker_link_parks_polls_and_one_way_errors_keep_the_connection_in_step(tmp_path, monkeypatch, event_spin_us):
    from kvstrata.devobj.service import WorkerBrokerLink

    monkeypatch.setenv("KVSTRATA_DEVOBJ_EVENT_SPIN_US", event_spin_us)  # the poll spins first, or sleeps at once
    from kvstrata.server.config import WorkerConfig
    from kvstrata.server.worker import Worker

    w = Worker(WorkerConfig(socket=str(tmp_path / "kv.sock"), memory=16 << 20, disk_dir="")).start()
    links = []
    try:
        pub, sub = (WorkerBrokerLink(w.address) for _ in range(2))
        links += [pub, sub]
        info = {"pid": os.getpid(), "node_id": "n1", "device": {"uuid": "GPU-a", "index": 0}}
        for link in links:
            link.call("hello", {"info": info})
        sub.call("subscribe", {"keys": ["k"], "specs": [spec()], "timeout": 10})
        got: list[dict] = []
        poller = threading.Thread(target=lambda: got.append(sub.call("wait_events", {"timeout": 10}, 30)))
        poller.start()
        deadline = time.monotonic() + WAIT
        while sub.client_id not in w.devobj_broker._parked and time.monotonic() < deadline:
            time.sleep(0.005)
        pub.notify("complete_many", {"items": [{"tid": 12345, "ok": True}]})  # unknown transfer: logged only
        pub.notify("no_such_op", {})  # a bad one-way request: logged, never answered
        assert pub.call("publish", {"items": [item("k")]})["results"][0]["ok"]  # this reply is publish's
        poller.join(WAIT)
        assert [e["type"] for e in got[0]["events"]] == ["matched"]
    finally:
        for link in links:
            link.close()
        w.stop()


def test_requests_carry_completions_ahead_of_themselves_and_repeats_are_ignored():
    b = _broker()
    b.handle("pub", "publish", {"items": [item("k")]})
    t = b.handle("sub", "subscribe", {"keys": ["k"], "specs": [spec()], "timeout": 1})["results"][0]["transfer"]
    done = [{"tid": t["tid"], "ok": True}]
    # the receiver re-publishes the key it just received, in a request that carries the completion
    r = b.handle("sub", "publish", {"items": [item("k")], "done": done})["results"][0]
    assert r["ok"], r  # the old object was forgotten first: no KeyExists
    assert [e["type"] for e in b.handle("pub", "wait_events", {"timeout": 0})["events"]] == ["released"]
    # the same completion again (a poll that carried it is read later): nothing happens
    assert b.handle("sub", "wait_events", {"timeout": 0, "done": done}) == {"events": []}
    inbox = Inbox()
    assert b.park_poll("pub", 10.0, inbox) is None
    b.completed("sub", done)
    b.handle("sub", "goodbye", {"done": done})
    assert b.snapshot()["objects"] == {} and b.snapshot()["transfers"] == 0
    assert [e["type"] for e in inbox.replies[0]["events"]] == ["peer_gone"]

"""A device-object subscriber that stops reading its socket never stalls another client's worker thread: the
publisher's thread hands the match to the subscriber's parked poll without waiting (kvstrata.devobj.outbox), so
its publish and its later requests are answered; the subscriber gets its events when it reads again, in order,
or is disconnected (and forgotten by the broker) once it read nothing for the stall limit."""

from __future__ import annotations

import os
import select
import socket
import struct
import time

import msgpack
import pytest

from kv_helpers import worker_config
from kvstrata.devobj import outbox as outbox_mod
from kvstrata.errors import ConnectionLost
from kvstrata.server import Worker
from kvstrata.transport import PROTOCOL_VERSION

WAIT = 5.0
INFO = {"info": {"pid": 1, "node_id": "n1", "device": {"uuid": "GPU-a", "index": 0}}}
SPEC = [{"shape": [4, 8], "dtype": "float16", "nbytes": 64}]


def item(key: str) -> dict:
    return {"key": key, "tensors": SPEC, "handles": [], "events": [], "device": {"uuid": "GPU-a", "index": 0}}


class Raw:
    """A client speaking the wire protocol on a bare socket, so that it can stop reading at will."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(address.split("://", 1)[1])
        hello = {"op": "hello", "protocol": PROTOCOL_VERSION, "pid": os.getpid() + 1, "shm": False}
        assert "err" not in self.call(hello)

    def send(self, msg: dict) -> None:
        payload = msgpack.packb(msg, use_bin_type=True)
        self.sock.sendall(struct.pack("<II", len(payload), 0) + payload)

    def recv(self, timeout: float = WAIT) -> dict | None:
        """The next frame; None if the worker closed the connection. Raises TimeoutError if none comes in time."""
        self.sock.settimeout(timeout)
        head = self._exactly(8)
        if head is None:
            return None
        n, nfds = struct.unpack("<II", head)
        assert nfds == 0
        body = self._exactly(n)
        assert body is not None
        return msgpack.unpackb(body, raw=False, strict_map_key=False)

    def _exactly(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            got = self.sock.recv(n - len(buf))
            if not got:
                return None
            buf += got
        return bytes(buf)

    def call(self, msg: dict) -> dict:
        self.send(msg)
        reply = self.recv()
        assert reply is not None
        return reply

    def dev(self, cid: str, dop: str, args: dict) -> dict:
        reply = self.call({"op": "dev", "dop": dop, "cid": cid, "a": args})
        assert "err" not in reply, reply
        return reply["r"]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def worker(tmp_path):
    with Worker(worker_config(tmp_path, memory=64 << 20, segment=32 << 20)).start() as w:
        yield w


@pytest.fixture
def raws():
    made: list[Raw] = []
    yield made
    for r in made:
        r.close()


def _parked(w: Worker, cid: str) -> None:
    deadline = time.monotonic() + WAIT
    while cid not in w.devobj_broker._parked:
        assert time.monotonic() < deadline, "the subscriber's poll was never parked"
        time.sleep(0.005)


def test_a_subscriber_that_stops_reading_is_dropped_and_stalls_no_other_client(worker, raws, monkeypatch):
    monkeypatch.setattr(outbox_mod, "STALL_SECONDS", 4.0)
    sub = Raw(worker.address)
    raws.append(sub)
    sub.dev("sub", "hello", INFO)
    assert sub.call({"op": "put", "key": "big", "v": b"B" * (16 << 20)}) == {}
    assert sub.dev("sub", "subscribe", {"keys": ["k"], "specs": [SPEC], "timeout": 60})["results"][0]["status"] == (
        "waiting"
    )
    sub.send({"op": "dev", "dop": "wait_events", "cid": "sub", "a": {}, "t": 60})
    _parked(worker, "sub")
    # a 16 MiB reply the subscriber does not read: its session thread sends it, holding the connection's send lock
    sub.send({"op": "get", "key": "big"})
    assert select.select([sub.sock], [], [], WAIT)[0], "the reply never started"

    pub = Raw(worker.address)
    raws.append(pub)
    pub.dev("pub", "hello", INFO)
    start = time.monotonic()
    assert pub.dev("pub", "publish", {"items": [item("k")]})["results"][0]["ok"]  # (no reply at all when it stalls)
    assert pub.call({"op": "ping"}) == {"pong": True}
    other = Raw(worker.address)
    raws.append(other)
    assert other.call({"op": "ping"}) == {"pong": True}
    assert time.monotonic() - start < 3.0  # before the stall limit: nobody waited on the subscriber

    # The subscriber read nothing for the stall limit: disconnected, and the broker forgot it
    deadline = time.monotonic() + WAIT + 2
    while "sub" in worker.devobj_broker._events:
        assert time.monotonic() < deadline, "the stalled subscriber was never dropped"
        time.sleep(0.01)
    sub.sock.settimeout(WAIT)
    while sub.sock.recv(1 << 20):  # the part of the reply that went out, then the end of the connection
        pass
    assert pub.call({"op": "ping"}) == {"pong": True}


def test_a_stalled_subscriber_gets_its_events_in_order_when_it_reads_again(worker, raws):
    n = 3000  # one answer of n matches: several times what the socket holds, so it goes out in parts
    keys = [f"key-{i:05d}" for i in range(n)]
    sub = Raw(worker.address)
    raws.append(sub)
    sub.dev("sub", "hello", INFO)
    results = sub.dev("sub", "subscribe", {"keys": keys, "specs": [SPEC] * n, "timeout": 60})["results"]
    assert {r["status"] for r in results} == {"waiting"}
    sub.send({"op": "dev", "dop": "wait_events", "cid": "sub", "a": {}, "t": 60, "tag": 1})
    _parked(worker, "sub")

    pub = Raw(worker.address)
    raws.append(pub)
    pub.dev("pub", "hello", INFO)
    results = pub.dev("pub", "publish", {"items": [item(k) for k in keys]})["results"]  # answered while unread
    assert all(r["ok"] for r in results)
    assert pub.call({"op": "ping"}) == {"pong": True}
    # the subscriber's next poll is answered on its own thread: after the answer still waiting for it
    sub.send({"op": "dev", "dop": "wait_events", "cid": "sub", "a": {}, "t": 0, "tag": 2})
    sub.send({"op": "ping"})  # (its reply may come before or between the polls' answers: it has no tag)

    got = []
    while len(got) < 3:
        reply = sub.recv()
        assert reply is not None
        got.append(reply)
    polls = [r for r in got if "r" in r]
    assert [r["tag"] for r in polls] == [1, 2]
    assert [e["key"] for e in polls[0]["r"]["events"]] == keys
    assert {e["type"] for e in polls[0]["r"]["events"]} == {"matched"}
    assert polls[1]["r"] == {"events": []}
    assert "sub" in worker.devobj_broker._events  # still a client: it was slow, not gone


# -- the outbox alone, over a socket pair --------------------------------------------------------------------------
@pytest.fixture
def pair():
    from kvstrata.transport.stream import StreamConnection

    a, b = socket.socketpair()
    ends = StreamConnection(a, "worker-end"), StreamConnection(b, "client-end")
    yield ends
    for conn in ends:
        conn.close()


def test_outbox_sends_never_wait_for_the_reader_and_arrive_in_order(pair):
    worker_end, client_end = pair
    box = outbox_mod.Outbox(worker_end, "reader")
    blob = "x" * 4096
    start = time.monotonic()
    for i in range(300):  # ~1.2 MB: many times what the socket holds while nobody reads
        box.send({"i": i, "blob": blob})
    assert time.monotonic() - start < 2.0
    assert box.busy
    got = [client_end.recv(WAIT)[0]["i"] for _ in range(300)]
    assert got == list(range(300))
    deadline = time.monotonic() + WAIT
    while box.busy:  # everything went out: the next send is the common one again (no thread)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    box.send({"i": 300})
    assert client_end.recv(WAIT)[0] == {"i": 300}


def test_outbox_drops_a_reader_that_takes_nothing_for_the_stall_limit(pair, monkeypatch):
    monkeypatch.setattr(outbox_mod, "STALL_SECONDS", 0.3)
    worker_end, _ = pair
    box = outbox_mod.Outbox(worker_end, "stalled")
    for i in range(100):
        box.send({"i": i, "blob": "x" * 4096})
    deadline = time.monotonic() + WAIT
    while not worker_end.closed:
        assert time.monotonic() < deadline, "never dropped"
        time.sleep(0.01)
    with pytest.raises(ConnectionLost):
        box.send({"i": 100})


def test_outbox_drops_a_reader_whose_backlog_grows_past_the_cap(pair, monkeypatch):
    monkeypatch.setattr(outbox_mod, "MAX_QUEUED_BYTES", 256 << 10)
    worker_end, _ = pair
    box = outbox_mod.Outbox(worker_end, "hoarder")
    with pytest.raises(ConnectionLost):
        for i in range(1000):  # 4 MB
            box.send({"i": i, "blob": "x" * 4096})
    assert worker_end.closed


def test_outbox_that_cannot_start_its_drain_thread_drops_the_connection_rather_than_wedge_it(pair, monkeypatch):
    """Part of a frame sent, the send lock kept for the drain thread, and then no thread: the lock stayed held and the
    connection's own replies waited for ever."""
    worker_end, _ = pair
    box = outbox_mod.Outbox(worker_end, "no-threads")

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(outbox_mod.threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        for i in range(1000):  # until a frame does not go out whole
            box.send({"i": i, "blob": "x" * 4096})
    assert not worker_end._send_lock.locked() and worker_end.closed
    with pytest.raises(ConnectionLost):
        box.send({"i": -1})

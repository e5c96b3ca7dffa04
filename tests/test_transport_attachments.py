"""Attachments: large values sent beside a frame's msgpack, not inside it (kvstrata.transport.stream).

They arrive bit for bit over unix and tcp (as views of the frame's own buffer, or copies where the frame shared the
connection's read buffer), with descriptors beside them, and are released once sent (or not); the in-process
transport copies them in. A frame whose attachment lengths do not add up is a ProtocolError, never a crash, a
misread next frame or a hang; through a worker over TCP large values go this way both directions, and the lease a
reply was sent under is dropped once it went out.
"""

from __future__ import annotations

import os
import socket
import struct
import threading

import msgpack
import numpy as np
import pytest

import kvstrata
from kv_helpers import wait_until
from kvstrata.errors import InvalidType, ProtocolError
from kvstrata.server import Worker, WorkerConfig
from kvstrata.transport import connect, listen
from kvstrata.transport.stream import (
    _ATTACHED,
    _ATTACHMENT_EXT,
    ATTACH_MIN_BYTES,
    Attachment,
    StreamConnection,
    attach,
    pack,
    pack_attached,
)

HEADER = struct.Struct("<II")


@pytest.fixture
def pair():
    """Two StreamConnections on the ends of a unix socketpair, and the raw socket behind the first."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left, right = StreamConnection(a, "unix://left"), StreamConnection(b, "unix://right")
    yield a, left, right
    left.close()
    right.close()


def recv_in_thread(conn: StreamConnection, **kwargs) -> dict:
    out: dict = {}

    def run() -> None:
        try:
            out["msg"], out["fds"] = conn.recv(timeout=5, **kwargs)
        except BaseException as exc:  # (handed to the test)
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return {"thread": t, "out": out}


def finish(pending: dict) -> dict:
    pending["thread"].join(10)
    assert not pending["thread"].is_alive(), "recv still blocked"
    return pending["out"]


@pytest.mark.parametrize("size", [ATTACH_MIN_BYTES, 3 << 20, 17 << 20])  # a grown bytearray, and a mapping
def test_attachments_arrive_bit_for_bit_in_their_places(pair, size):
    _, left, right = pair
    rng = np.random.default_rng(size)
    big = rng.integers(0, 255, size, dtype=np.uint8).tobytes()
    other = rng.integers(0, 255, ATTACH_MIN_BYTES + 7, dtype=np.uint8)  # (an ndarray: any buffer)
    released: list[str] = []
    msg = {
        "op": "mput",
        "items": [["a", Attachment(big, lambda: released.append("a"))], ["small", b"xy"], ["b", Attachment(other)]],
        "after": 5,
    }
    pending = recv_in_thread(right)
    left.send(msg)
    out = finish(pending)
    got = out["msg"]
    assert got["after"] == 5 and got["items"][1] == ["small", b"xy"]
    assert type(got["items"][0][1]) is memoryview and got["items"][0][1] == big
    assert bytes(got["items"][2][1]) == other.tobytes()
    assert released == ["a"]  # once, after the send


def test_a_small_frame_with_attachments_gets_copies_not_views_of_the_shared_buffer(pair):
    raw, _, right = pair
    meta = msgpack.packb({"v": msgpack.ExtType(_ATTACHMENT_EXT, struct.pack("<Q", 3))}, use_bin_type=True)
    first = struct.pack("<I", len(meta)) + meta + b"abc"
    second = msgpack.packb({"op": "next"}, use_bin_type=True)
    raw.sendall(HEADER.pack(len(first), _ATTACHED) + first + HEADER.pack(len(second), 0) + second)
    msg, _ = right.recv(timeout=5)
    assert msg["v"] == b"abc" and type(msg["v"]) is bytes  # (a view would show the next frame's bytes later)
    assert right.recv(timeout=5)[0] == {"op": "next"}
    assert msg["v"] == b"abc"


def test_attachments_and_descriptors_travel_together(pair):
    _, left, right = pair
    r, w = os.pipe()
    try:
        data = os.urandom(ATTACH_MIN_BYTES * 2)
        pending = recv_in_thread(right)
        left.send({"v": Attachment(data)}, [w])
        out = finish(pending)
        assert out["msg"]["v"] == data and len(out["fds"]) == 1
        os.write(out["fds"][0], b"!")
        assert os.read(r, 1) == b"!"
        os.close(out["fds"][0])
    finally:
        os.close(r)
        os.close(w)


def test_more_attachments_than_one_sendmsg_takes(pair):
    _, left, right = pair
    values = [bytes([i % 251]) * ATTACH_MIN_BYTES for i in range(1100)]  # (over Linux's 1024 buffers a call)
    pending = recv_in_thread(right)
    left.send({"vs": [Attachment(v) for v in values]})
    out = finish(pending)
    assert [bytes(v) for v in out["msg"]["vs"]] == values


def test_attach_wraps_only_large_values_and_runs_done_for_the_rest():
    ran: list[int] = []
    small = attach(b"x" * (ATTACH_MIN_BYTES - 1), lambda: ran.append(1))
    assert small == b"x" * (ATTACH_MIN_BYTES - 1) and ran == [1]
    assert isinstance(attach(bytearray(ATTACH_MIN_BYTES)), Attachment)


def test_pack_copies_attachments_in_and_releases_them():
    ran: list[int] = []
    msg = msgpack.unpackb(pack({"v": Attachment(b"abc", lambda: ran.append(1))}))
    assert msg == {"v": b"abc"} and ran == [1]


def test_an_unencodable_value_is_invalid_type_and_the_attachments_before_it_are_released():
    ran: list[int] = []
    with pytest.raises(InvalidType, match="cannot encode"):
        pack_attached({"a": Attachment(b"abc", lambda: ran.append(1)), "b": object()})
    assert ran == [1]
    with pytest.raises(InvalidType, match="cannot encode"):
        pack({"b": object()})


def test_the_in_process_transport_copies_attachments_in():
    got: dict = {}
    done = threading.Event()

    def serve(conn) -> None:
        got["msg"] = conn.recv(timeout=5)[0]
        conn.send({"ok": True})
        done.set()

    with listen("inproc://attachments-test", serve), connect("inproc://attachments-test", timeout=5) as conn:
        data = os.urandom(ATTACH_MIN_BYTES)
        conn.send({"v": Attachment(data)})
        assert conn.recv(timeout=5)[0] == {"ok": True}
    assert done.wait(5) and got["msg"]["v"] == data and type(got["msg"]["v"]) is bytes


def _frame(meta: bytes, tail: bytes, meta_len: int | None = None) -> bytes:
    body = struct.pack("<I", len(meta) if meta_len is None else meta_len) + meta + tail
    return HEADER.pack(len(body), _ATTACHED) + body


def _ext(n: int, code: int = _ATTACHMENT_EXT, raw: bytes | None = None) -> bytes:
    return msgpack.packb({"v": msgpack.ExtType(code, struct.pack("<Q", n) if raw is None else raw)})


BAD_FRAMES = {
    "an attachment past the end": _frame(_ext(ATTACH_MIN_BYTES * 2), b"z" * ATTACH_MIN_BYTES),
    "bytes no attachment claims": _frame(_ext(10), b"z" * (ATTACH_MIN_BYTES + 10)),
    "a msgpack length past the end": _frame(_ext(10), b"z" * 10, meta_len=1 << 20),
    "an unknown extension": _frame(_ext(3, code=7), b"abc"),
    "a short extension": _frame(_ext(0, raw=b"\x01"), b""),
    "no room for the msgpack length": HEADER.pack(2, _ATTACHED) + b"\x00\x00",
    "not a map": _frame(msgpack.packb([1, 2]), b""),
}


@pytest.mark.parametrize("case", list(BAD_FRAMES))
def test_a_frame_whose_attachments_do_not_add_up_is_a_protocol_error(pair, case):
    raw, _, right = pair
    raw.sendall(BAD_FRAMES[case])
    with pytest.raises(ProtocolError):
        right.recv(timeout=5)
    assert right.closed


@pytest.fixture
def tcp_client(tmp_path):
    """A worker listening on TCP only (no shared memory) and a client of it."""
    config = WorkerConfig(socket="tcp://127.0.0.1:0", memory=256 << 20, disk_dir="")
    with Worker(config).start() as worker, kvstrata.connect(address=worker.address) as kv:
        assert not kv._b().shm
        yield worker, kv


def test_large_values_through_a_tcp_worker_both_ways(tcp_client):
    worker, kv = tcp_client
    rng = np.random.default_rng(0)
    values = {f"k{n}": rng.integers(0, 255, n, dtype=np.uint8).tobytes() for n in (100, 70_000, 3 << 20, 20 << 20)}
    for k, v in values.items():
        kv.set(k, v)
    for k, v in values.items():
        got = kv.get(k)
        assert type(got) is bytes and got == v
    assert kv.mget(list(values)) == list(values.values())
    kv.mset([(f"m{k}", v) for k, v in values.items()])
    assert kv.mget([f"m{k}" for k in values]) == list(values.values())
    # the leases the replies were sent under are gone: nothing stays held once the values went out
    assert wait_until(lambda: worker.store.stats()["leases"] == 0)


def test_a_client_that_leaves_mid_reply_leaves_no_lease_behind(tcp_client):
    worker, kv = tcp_client
    kv.set("big", os.urandom(32 << 20))
    with connect(worker.address, timeout=5) as conn:
        conn.send({"op": "get", "key": "big", "timeout": 0})
        conn._sock.recv(1 << 16)  # (a start of the reply; then gone)
    assert wait_until(lambda: worker.store.stats()["leases"] == 0, 10)
    assert kv.get("big") is not None and len(kv.get("big")) == 32 << 20

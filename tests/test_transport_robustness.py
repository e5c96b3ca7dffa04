"""The transport against hostile, stalled and unlucky peers: partial frames, huge headers, stray descriptors,
descriptor exhaustion, busy listeners, bad addresses, peers that vanish.

Each test fails on the transport before its fix (see the defect it names) and takes well under a second or two;
a receive that used to block forever runs in a helper thread, so such a regression fails instead of hanging.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
import time
import tracemalloc

import msgpack
import pytest

from kvstrata.errors import ClosedError, ConnectionLost, InvalidValue, ProtocolError, Timeout, TransportError
from kvstrata.transport import PROTOCOL_VERSION, connect, core, listen, sockets
from kvstrata.transport.stream import StreamConnection

HEADER = struct.Struct("<II")


def frame(msg: dict, nfds: int = 0) -> bytes:
    payload = msgpack.packb(msg, use_bin_type=True)
    return HEADER.pack(len(payload), nfds) + payload


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def call_in_thread(fn, join_s: float = 5.0):
    """``fn()``'s result or exception, or AssertionError if it is still running after ``join_s`` (a hang)."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # (handed to the test)
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(join_s)
    assert not thread.is_alive(), f"still blocked after {join_s} s"
    out["elapsed"] = time.monotonic() - start
    return out


@pytest.fixture
def pair():
    """A raw socket (the peer, free to misbehave) and a StreamConnection on the other end of a unix socketpair."""
    raw, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = StreamConnection(other, "unix://pair")
    yield raw, conn
    raw.close()
    conn.close()


# --- defect 2: recv(timeout) bounds the whole frame, and the connection stays in step -----------------------


@pytest.mark.parametrize("cut", ["in the header", "in the payload", "in a large payload"])
def test_recv_timeout_bounds_a_frame_cut_short_then_continues_it(pair, cut):
    raw, conn = pair
    big = cut == "in a large payload"
    data = frame({"v": os.urandom(300_000 if big else 1000)})
    split = {"in the header": 3, "in the payload": 500, "in a large payload": 90_000}[cut]
    raw.sendall(data[:split])
    got = call_in_thread(lambda: conn.recv(timeout=0.3))
    assert isinstance(got.get("error"), Timeout), got
    assert "only part of a message" in str(got["error"])
    assert got["elapsed"] < 2
    assert not conn.closed
    # The rest comes: the same frame is delivered whole, then the next one.
    sender = threading.Thread(target=raw.sendall, args=(data[split:] + frame({"after": 1}),))
    sender.start()
    assert conn.recv(timeout=5)[0] == msgpack.unpackb(data[8:])
    assert conn.recv(timeout=5)[0] == {"after": 1}
    sender.join()


def test_recv_timeout_zero_never_waits_for_a_frame_begun(pair):
    """A worker session asks ``recv(timeout=0)`` whether a request is buffered; a request half arrived must not
    hold it (nor be lost): Timeout now, the request whole later."""
    raw, conn = pair
    data = frame({"op": "set", "v": b"x" * 200_000})
    raw.sendall(frame({"op": "first"}) + data[:70_000])
    assert conn.recv(timeout=0)[0] == {"op": "first"}
    for _ in range(3):
        got = call_in_thread(lambda: conn.recv(timeout=0))
        assert isinstance(got.get("error"), Timeout), got
    sender = threading.Thread(target=raw.sendall, args=(data[70_000:],))
    sender.start()
    assert conn.recv()[0]["v"] == b"x" * 200_000
    sender.join()


def test_handshake_deadline_covers_a_partial_hello(tmp_path, monkeypatch):
    """A peer that sends three bytes of its hello is dropped at the handshake deadline, not held forever."""
    monkeypatch.setattr(core, "HANDSHAKE_TIMEOUT", 0.3)
    lst = listen(f"unix://{tmp_path}/w.sock", lambda c: c.close())
    try:
        peer = socket.socket(socket.AF_UNIX)
        peer.connect(str(tmp_path / "w.sock"))
        peer.sendall(frame({"op": "hello", "protocol": PROTOCOL_VERSION})[:3])
        peer.settimeout(3)
        assert peer.recv(100) == b""  # the listener hung up (a timeout here: it still waits)
        peer.close()
    finally:
        lst.stop()


def test_client_request_timeout_covers_a_half_reply(monkeypatch):
    """A worker that stops halfway through a reply: the client's call fails after request_timeout, not never."""
    import kvstrata
    from kvstrata.client.connection import WorkerConnection

    monkeypatch.setattr(WorkerConnection, "request_timeout", 0.3)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    done = threading.Event()

    def fake_worker() -> None:
        conn, _ = server.accept()
        with conn:
            stream = StreamConnection(conn, "fake")
            stream.recv(timeout=5)  # the hello
            conn.sendall(frame({"op": "welcome", "protocol": PROTOCOL_VERSION, "pid": 1, "inline_max": 65536}))
            stream.recv(timeout=5)  # the request
            conn.sendall(frame({"v": b"x" * 1000})[:20])  # half a reply, then silence
            done.wait(10)

    thread = threading.Thread(target=fake_worker, daemon=True)
    thread.start()
    try:
        kv = kvstrata.connect(f"tcp://127.0.0.1:{port}", timeout=5)
        got = call_in_thread(lambda: kv.get("k"))
        assert isinstance(got.get("error"), ConnectionLost), got
        assert "did not answer" in str(got["error"])
        kv.close()
    finally:
        done.set()
        thread.join(5)
        server.close()


# --- defect 1: memory follows the bytes that arrived; a hello is capped --------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_large_frame_memory_follows_the_bytes_that_arrived(pair):
    raw, conn = pair
    data = frame({"v": os.urandom(32 << 20)})
    before = _rss_bytes()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        raw.sendall(data[:90_000])  # a 32 MiB frame announced, 90 kB of it sent
        got = call_in_thread(lambda: conn.recv(timeout=0.2))
        assert isinstance(got.get("error"), Timeout), got
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 4 << 20, f"{peak} bytes allocated for 90 kB received"
    finally:
        tracemalloc.stop()
    grew = _rss_bytes() - before  # memory outside Python's allocator (an mmap) counts here, not in tracemalloc
    assert grew < 8 << 20, f"the process grew by {grew} bytes for 90 kB received"
    sender = threading.Thread(target=raw.sendall, args=(data[90_000:],))
    sender.start()
    assert conn.recv(timeout=10)[0] == msgpack.unpackb(data[8:])
    sender.join()


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_a_huge_frame_before_the_handshake_is_refused_at_once(tmp_path, kind):
    address = f"unix://{tmp_path}/w.sock" if kind == "unix" else "tcp://127.0.0.1:0"
    lst = listen(address, lambda c: c.close())
    try:
        if kind == "unix":
            peer = socket.socket(socket.AF_UNIX)
            peer.connect(str(tmp_path / "w.sock"))
        else:
            peer = socket.create_connection(("127.0.0.1", int(lst.address.rsplit(":", 1)[1])))
        peer.sendall(HEADER.pack(256 << 20, 0) + b"\x80")  # 256 MiB announced, one byte sent
        peer.settimeout(3)  # (the handshake's own deadline is 10 s)
        assert peer.recv(100) == b""
        peer.close()
    finally:
        lst.stop()


@pytest.mark.parametrize("kind", ["unix", "inproc"])
def test_recv_max_bytes(pair, kind):
    if kind == "unix":
        raw, conn = pair
        raw.sendall(frame({"v": b"x" * 100}))
    else:
        lst = listen("inproc://*", lambda c: c.send({"v": b"x" * 100}))
        conn = connect(lst.address, timeout=5)
        lst.stop()
    with pytest.raises(ProtocolError, match="limit 50"):
        conn.recv(timeout=5, max_bytes=50)
    assert conn.closed
    conn.close()


# --- defect 4: descriptors no frame announces -----------------------------------------------------------------


def test_stray_descriptors_are_a_protocol_error_and_closed(pair):
    raw, conn = pair
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        baseline = open_fds()
        socket.send_fds(raw, [frame({"op": "ping"}, nfds=0)], [fd] * 5)  # 5 descriptors, none announced
        with pytest.raises(ProtocolError, match="no frame announces"):
            conn.recv(timeout=5)
        assert conn.closed
        assert open_fds() <= baseline  # the five copies this side received are closed (and the socket)
    finally:
        os.close(fd)


def test_stray_descriptors_cannot_pile_up_behind_a_busy_buffer(pair):
    """Frames cut so that the read buffer never empties, each read bringing 64 descriptors no frame announces."""
    raw, conn = pair
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        baseline = open_fds()
        frames = [frame({"i": i}) for i in range(8)]
        chunks = [frames[0] + frames[1][:4]] + [frames[i][4:] + frames[i + 1] + frames[i + 2][:4] for i in (1, 3, 5)]
        for chunk in chunks:
            socket.send_fds(raw, [chunk], [fd] * 64)

        def read_on() -> int:
            for n in range(8):
                try:
                    conn.recv(timeout=1)
                except ProtocolError:
                    return n
            return -1

        got = call_in_thread(read_on)
        assert 0 <= got.get("result", -1) < 4, got  # caught within the first few frames
        assert open_fds() <= baseline
    finally:
        os.close(fd)


def test_descriptors_of_pipelined_frames_stay_with_them(pair):
    """Frames sent back to back before any is read: each frame's descriptors, even read a frame early, are its."""
    raw, conn = pair
    peer = StreamConnection(raw, "unix://peer")
    fds = [os.memfd_create(f"m{i}") for i in range(4)]
    sender = threading.Thread(
        target=lambda: [peer.send({"i": i, "pad": b"p" * (i * 3000)}, fds[: i % 3]) for i in range(20)]
    )
    sender.start()  # (more than the socket holds: sent while read)
    try:
        for i in range(20):
            msg, got = conn.recv(timeout=5)
            assert msg["i"] == i and len(got) == i % 3
            for g in got:
                os.close(g)
    finally:
        sender.join(5)
        for f in fds:
            os.close(f)


# --- defect 3: the accept loop outlives descriptor exhaustion ---------------------------------------------------


class _FlakyListeningSocket:
    """A listening socket whose first accepts fail as a process out of descriptors sees them fail."""

    def __init__(self, sock: socket.socket, failures: int) -> None:
        self._sock = sock
        self.failures = failures

    def settimeout(self, timeout: float) -> None:
        self._sock.settimeout(timeout)

    def accept(self):
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return self._sock.accept()

    def close(self) -> None:
        self._sock.close()


def test_accept_goes_on_after_running_out_of_descriptors(tmp_path, caplog):
    path = str(tmp_path / "w.sock")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    sock.listen(8)
    accepted: list = []
    lst = sockets.StreamListener(_FlakyListeningSocket(sock, failures=3), f"unix://{path}", accepted.append)
    try:
        peer = socket.socket(socket.AF_UNIX)
        peer.connect(path)
        deadline = time.monotonic() + 5
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(accepted) == 1, "the accept loop gave up"
        assert "Too many open files" in caplog.text and "still accepting" in caplog.text
        peer.close()
        accepted[0].close()
    finally:
        lst.stop()


# --- defect 7: a live but busy socket is not taken over --------------------------------------------------------


def _fill_backlog(path: str) -> tuple[socket.socket, list[socket.socket]]:
    """A listener that accepts nothing (backlog 0) and the connections that fill its backlog."""
    live = socket.socket(socket.AF_UNIX)
    live.bind(path)
    live.listen(0)
    fillers = []
    for _ in range(3):
        c = socket.socket(socket.AF_UNIX)
        c.setblocking(False)
        try:
            c.connect(path)
        except BlockingIOError:
            pass
        fillers.append(c)
    return live, fillers


def test_a_busy_live_socket_is_not_unlinked(tmp_path):
    path = str(tmp_path / "w.sock")
    live, fillers = _fill_backlog(path)
    inode = os.stat(path).st_ino
    try:
        with pytest.raises(TransportError, match="busy"):
            listen(f"unix://{path}", lambda c: c.close())
        assert os.stat(path).st_ino == inode  # still the live listener's
    finally:
        for c in fillers:
            c.close()
        live.close()


# --- defect 8: connect waits out a full accept backlog --------------------------------------------------------


def test_connect_retries_a_full_backlog(tmp_path):
    path = str(tmp_path / "w.sock")
    live, fillers = _fill_backlog(path)

    def serve_later() -> None:  # the listener catches up after 0.3 s and handshakes whoever sends a hello
        time.sleep(0.3)
        for c in fillers:
            c.close()
        live.settimeout(5)
        while True:
            conn = StreamConnection(live.accept()[0], f"unix://{path}")
            try:
                conn.recv(timeout=2)
            except (ConnectionLost, Timeout):
                conn.close()
                continue
            conn.send({"op": "welcome", "protocol": PROTOCOL_VERSION})
            time.sleep(0.5)
            conn.close()
            return

    thread = threading.Thread(target=serve_later, daemon=True)
    thread.start()
    try:
        with connect(f"unix://{path}", timeout=5) as conn:
            assert conn.peer_info["op"] == "welcome"
    finally:
        thread.join(5)
        live.close()


# --- defect 9: addresses no socket can have --------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:65536", "tcp://[::1]:99999", "unix:///tmp/a\x00b.sock"],
)
def test_bad_addresses_are_invalid_value(address):
    with pytest.raises(InvalidValue, match="address"):
        connect(address, timeout=0.5)
    with pytest.raises(InvalidValue, match="address"):
        listen(address, lambda c: c.close())


def test_connect_to_port_zero_or_an_overlong_path_is_invalid_value():
    with pytest.raises(InvalidValue, match="port 0"):
        connect("tcp://127.0.0.1:0", timeout=0.5)
    with pytest.raises(InvalidValue, match="longer than 107"):
        connect("unix:///" + "x" * 200, timeout=0.5)


# --- defect 11: inproc sends to a closed peer, descriptors of unread messages ---------------------------------


def test_inproc_send_to_a_closed_peer_is_connection_lost_and_leaks_nothing():
    ends: list = []
    lst = listen("inproc://*", ends.append)
    client = connect(lst.address, timeout=5)
    lst.stop()
    deadline = time.monotonic() + 5
    while not ends and time.monotonic() < deadline:  # (the handler runs just after the handshake's reply)
        time.sleep(0.01)
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        baseline = open_fds()
        client.send({"unread": 1}, [fd] * 3)  # the peer never reads it: its close closes the copies
        ends[0].close()
        assert open_fds() == baseline
        with pytest.raises(ConnectionLost):
            client.send({"op": "x"}, [fd] * 3)
        assert open_fds() == baseline
        with pytest.raises(ConnectionLost):
            client.recv(timeout=1)
        client.close()
        with pytest.raises(ClosedError):
            client.send({"op": "x"})
    finally:
        os.close(fd)


# --- defect 12: TCP keepalive ----------------------------------------------------------------------------------


def test_tcp_connections_keep_alive_on_both_ends():
    accepted: list = []
    ready = threading.Event()

    def handler(conn) -> None:
        accepted.append(conn)
        ready.set()

    lst = listen("tcp://127.0.0.1:0", handler)
    try:
        with connect(lst.address, timeout=5) as conn:
            assert ready.wait(5)
            for end in (conn, accepted[0]):
                sock = end._sock
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
                if hasattr(socket, "TCP_KEEPIDLE"):
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == sockets.TCP_KEEPIDLE_S
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == sockets.TCP_KEEPCNT
                if hasattr(socket, "TCP_USER_TIMEOUT"):
                    want = sockets.TCP_USER_TIMEOUT_S * 1000
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == want
            accepted[0].close()
    finally:
        lst.stop()

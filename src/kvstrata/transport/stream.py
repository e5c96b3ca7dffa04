"""Length-prefixed msgpack frames over a stream socket, shared by the ``unix://`` and ``tcp://`` backends.

Frame: ``<u32 payload length><u32 number of fds>`` then the msgpack payload. Descriptors ride as
SCM_RIGHTS ancillary data on the first byte of the header, so the receiver reads every header with
``recvmsg`` and collects them there.
"""

from __future__ import annotations

import array
import collections
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgpack

from kvstrata._proc import PID
from kvstrata.errors import ClosedError, ConnectionLost, InvalidType, InvalidValue, ProtocolError, Timeout
from kvstrata.transport.base import Connection, Message

_HEADER = struct.Struct("<II")
MAX_FRAME = 1 << 30  # a bigger message is a bug or an attack: values that big go through shared memory
MAX_FDS = 64
_CMSG_FLAGS = int(getattr(socket, "MSG_CMSG_CLOEXEC", 0))
_POLL_FLAGS = _CMSG_FLAGS | int(socket.MSG_DONTWAIT)
_CTRUNC = int(socket.MSG_CTRUNC)  # a plain int: enum flag arithmetic is slow on this hot path
_FD = array.array("i")
_ANC_SPACE = socket.CMSG_SPACE(MAX_FDS * _FD.itemsize)
_READ_CHUNK = 1 << 16
_BUF_BYTES = 2 * _READ_CHUNK  # the read buffer: any frame up to _READ_CHUNK fits after compaction


def pack(msg: Message) -> bytes:
    try:
        return msgpack.packb(msg, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidType(f"msg: cannot encode {type(exc).__name__}: {exc}") from exc


def unpack(payload: bytes | memoryview) -> Message:
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable message ({type(exc).__name__}: {exc})") from exc
    if not isinstance(msg, dict):
        raise ProtocolError(f"expected a map message, got {type(msg).__name__}")
    return msg


class StreamConnection(Connection):
    """A :class:`Connection` over a connected stream socket (AF_UNIX or AF_INET/6)."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self._sock = sock
        self._address = address
        self.can_pass_fds = sock.family == socket.AF_UNIX
        self.peer_info: Message = {}
        self.handshake_fds: list[int] = []
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._closed = False
        self._lost = False
        self._pid = PID[0]  # a forked child's copy must not shut the parent's connection down (close)
        # Frames are read into one preallocated buffer (no allocation per message); the unread
        # bytes are _rbuf[_rpos:_rend]. It is never resized: _rview exports it.
        self._rbuf = bytearray(_BUF_BYTES)
        self._rview = memoryview(self._rbuf)
        self._rpos = self._rend = 0
        self._rfds: collections.deque[int] = collections.deque()
        sock.settimeout(None)

    @property
    def address(self) -> str:
        return self._address

    @property
    def closed(self) -> bool:
        return self._closed or self._lost

    def fileno(self) -> int:
        return self._sock.fileno()

    def buffered(self) -> bool:
        """Whether bytes read from the socket wait in this connection's buffer (``select`` cannot see them)."""
        return self._rpos != self._rend

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"connection to {self._address} is closed")
        if self._lost:
            raise ConnectionLost(f"connection to {self._address} was lost")

    def send(self, msg: Message, fds: Sequence[int] = ()) -> None:
        payload = pack(msg)
        if len(payload) > MAX_FRAME:
            raise InvalidValue(f"msg: {len(payload)} bytes encoded, over the {MAX_FRAME}-byte frame limit")
        fds = list(fds)
        if fds and not self.can_pass_fds:
            raise InvalidValue(f"fds: {self._address} cannot pass file descriptors")
        if len(fds) > MAX_FDS:
            raise InvalidValue(f"fds: at most {MAX_FDS} per message, got {len(fds)}")
        header = _HEADER.pack(len(payload), len(fds))
        self._check_open()
        with self._send_lock:
            try:
                if fds:
                    sent = socket.send_fds(self._sock, [header], fds)
                    if sent < len(header):
                        self._sock.sendall(header[sent:])
                    self._sock.sendall(payload)
                elif len(payload) < 65536:
                    self._sock.sendall(header + payload)
                else:  # avoid copying a large payload just to prepend 8 bytes
                    sendall_msg(self._sock, [header, payload])
            except OSError as exc:
                self._lost = True
                if self._closed:
                    raise ClosedError(f"connection to {self._address} is closed") from exc
                raise ConnectionLost(f"lost connection to {self._address} while sending: {exc}") from exc

    def recv(self, timeout: float | None = None, *, spin: float = 0.0) -> tuple[Message, list[int]]:
        self._check_open()
        with self._recv_lock:
            try:
                return self._recv_frame(timeout, spin)
            except ProtocolError:
                self._lost = True
                self._sock.close()
                raise

    def _recv_frame(self, timeout: float | None, spin: float = 0.0) -> tuple[Message, list[int]]:
        # Frames are parsed out of a read buffer filled by recvmsg, so a small message costs one
        # system call. Descriptors are queued in arrival order and handed to frames by their
        # header's count: the kernel delivers them with the first byte of their frame.
        if self._rpos == self._rend:
            self._rpos = self._rend = 0
            self._fill(timeout, spin)
        while self._rend - self._rpos < _HEADER.size:
            self._fill(None)
        length, nfds = _HEADER.unpack_from(self._rbuf, self._rpos)
        if length > MAX_FRAME or nfds > MAX_FDS:
            raise ProtocolError(f"frame header announces {length} bytes and {nfds} fds: not a kvstrata peer")
        start = self._rpos + _HEADER.size
        payload: Any
        if length > _READ_CHUNK:  # a large frame: read its rest straight into place
            have = min(self._rend - start, length)
            payload = bytearray(length)
            payload[:have] = self._rview[start : start + have]
            self._rpos = start + have
            if self._rpos == self._rend:
                self._rpos = self._rend = 0
            if have < length:  # nothing of the next frame was read yet: read exactly the rest
                self._read_into(memoryview(payload)[have:])
        else:
            while self._rend - start < length:
                self._fill(None)
                start = self._rpos + _HEADER.size  # _fill may have moved the unread bytes
            payload = self._rview[start : start + length]
            self._rpos = start + length
        if len(self._rfds) < nfds:
            raise ProtocolError(f"expected {nfds} file descriptors with the message, got {len(self._rfds)}")
        fds = [self._rfds.popleft() for _ in range(nfds)]
        try:
            return unpack(payload), fds
        except ProtocolError:
            for fd in fds:
                os.close(fd)
            raise

    def _fill(self, timeout: float | None, spin: float = 0.0) -> None:
        """One recvmsg into the read buffer; only the wait for a new frame's first byte may time out.

        The socket stays blocking (a socket timeout would also cut sends short); a timed wait polls first.
        ``spin`` seconds of non-blocking polls come before the blocking wait: waking a sleeping
        process costs tens of microseconds, several times a small request's whole round trip.
        """
        try:
            if len(self._rbuf) - self._rend < _READ_CHUNK:  # make room: move the unread bytes to the front
                n = self._rend - self._rpos
                self._rbuf[:n] = bytes(self._rview[self._rpos : self._rend])
                self._rpos, self._rend = 0, n
            into = [self._rview[self._rend :]]
            got = self._poll(into, spin) if spin > 0.0 else None
            if got is None:
                ready = timeout is None or select.select([self._sock], [], [], max(timeout, 0))[0]
                if ready:
                    got = self._sock.recvmsg_into(into, _ANC_SPACE, _CMSG_FLAGS)
        except (OSError, ValueError) as exc:  # ValueError: select on a socket closed by another thread
            raise self._lost_error(exc if isinstance(exc, OSError) else None) from exc
        if got is None:
            raise Timeout(f"no message from {self._address} within {timeout} s")
        nbytes, ancdata, flags, _ = got
        for level, kind, fd_bytes in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(fd_bytes) - len(fd_bytes) % _FD.itemsize
                self._rfds.extend(array.array("i", fd_bytes[:usable]))
        if flags & _CTRUNC:
            raise ProtocolError("file descriptors were truncated in transit")
        if not nbytes:
            raise self._lost_error(None)
        self._rend += nbytes

    def _poll(self, into: list[memoryview], spin: float) -> Any:
        """recvmsg's result if data arrives within ``spin`` seconds of busy polling, else None.

        Each empty poll yields the CPU: when the peer shares this core (a busy machine), it runs at
        once instead of waiting for this poller's time slice to end.
        """
        recvmsg_into, yield_cpu, clock = self._sock.recvmsg_into, os.sched_yield, time.perf_counter
        end = clock() + spin
        while True:
            try:
                return recvmsg_into(into, _ANC_SPACE, _POLL_FLAGS)
            except BlockingIOError:
                if clock() >= end:
                    return None
                yield_cpu()

    def _read_into(self, view: memoryview) -> None:
        """Exactly len(view) bytes: never past the frame, so the next frame's descriptors are not lost."""
        got, n = 0, len(view)
        while got < n:
            try:
                k = self._sock.recv_into(view[got:])
            except OSError as exc:
                raise self._lost_error(exc) from exc
            if k == 0:
                raise self._lost_error(None)
            got += k

    def _lost_error(self, exc: OSError | None) -> Exception:
        if self._closed:
            return ClosedError(f"connection to {self._address} is closed")
        self._lost = True
        why = f": {exc}" if exc else " (peer closed the connection)"
        return ConnectionLost(f"lost connection to {self._address}{why}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while self._rfds:
            os.close(self._rfds.popleft())
        if self._pid == PID[0]:  # (in a forked child the socket is the parent's too: only this copy is closed)
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on this socket
            except OSError:
                pass
        self._sock.close()


def sendall_msg(sock: socket.socket, buffers: list[Any]) -> None:
    """``sendmsg`` until every byte of ``buffers`` is out (sendmsg may stop early on a stream socket)."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]

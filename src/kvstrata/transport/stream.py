"""Length-prefixed msgpack frames over a stream socket, shared by the ``unix://`` and ``tcp://`` backends.

Frame: ``<u32 payload length><u32 number of fds>`` then the msgpack payload. Descriptors ride as
SCM_RIGHTS ancillary data on the first byte of the header, so the receiver reads every header with
``recvmsg`` and collects them there.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

import msgpack

from kvstrata.errors import ClosedError, ConnectionLost, ProtocolError, Timeout
from kvstrata.transport.base import Connection, Message

_HEADER = struct.Struct("<II")
MAX_FRAME = 1 << 30  # a bigger message is a bug or an attack: values that big go through shared memory
MAX_FDS = 64
_CMSG_FLAGS = getattr(socket, "MSG_CMSG_CLOEXEC", 0)


def pack(msg: Message) -> bytes:
    try:
        return msgpack.packb(msg, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"msg: cannot encode {type(exc).__name__}: {exc}") from exc


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
        sock.settimeout(None)

    @property
    def address(self) -> str:
        return self._address

    @property
    def closed(self) -> bool:
        return self._closed or self._lost

    def fileno(self) -> int:
        return self._sock.fileno()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"connection to {self._address} is closed")
        if self._lost:
            raise ConnectionLost(f"connection to {self._address} was lost")

    def send(self, msg: Message, fds: Sequence[int] = ()) -> None:
        payload = pack(msg)
        if len(payload) > MAX_FRAME:
            raise ValueError(f"msg: {len(payload)} bytes encoded, over the {MAX_FRAME}-byte frame limit")
        fds = list(fds)
        if fds and not self.can_pass_fds:
            raise ValueError(f"fds: {self._address} cannot pass file descriptors")
        if len(fds) > MAX_FDS:
            raise ValueError(f"fds: at most {MAX_FDS} per message, got {len(fds)}")
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

    def recv(self, timeout: float | None = None) -> tuple[Message, list[int]]:
        self._check_open()
        with self._recv_lock:
            fds: list[int] = []
            try:
                header = self._read_header(timeout, fds)
                length, nfds = _HEADER.unpack(header)
                if length > MAX_FRAME or nfds > MAX_FDS:
                    raise ProtocolError(f"frame header announces {length} bytes and {nfds} fds: not a kvstrata peer")
                if len(fds) != nfds:
                    raise ProtocolError(f"expected {nfds} file descriptors with the message, got {len(fds)}")
                payload = self._read_exact(length)
                return unpack(payload), fds
            except BaseException as exc:
                for fd in fds:
                    os.close(fd)
                if isinstance(exc, ProtocolError):
                    self._lost = True
                    self._sock.close()
                raise

    def _read_header(self, timeout: float | None, fds: list[int]) -> bytes:
        buf = b""
        while len(buf) < _HEADER.size:
            # Only the wait for the first byte may time out: after that the frame is in flight.
            try:
                self._sock.settimeout(timeout if not buf else None)
                data, got_fds, flags, _ = socket.recv_fds(self._sock, _HEADER.size - len(buf), MAX_FDS, _CMSG_FLAGS)
                self._sock.settimeout(None)
            except TimeoutError:
                self._sock.settimeout(None)
                raise Timeout(f"no message from {self._address} within {timeout} s") from None
            except OSError as exc:
                raise self._lost_error(exc) from exc
            fds.extend(got_fds)
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError("file descriptors were truncated in transit")
            if not data:
                raise self._lost_error(None)
            buf += data
        return buf

    def _read_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                k = self._sock.recv_into(view[got:])
            except OSError as exc:
                raise self._lost_error(exc) from exc
            if k == 0:
                raise self._lost_error(None)
            got += k
        return buf

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

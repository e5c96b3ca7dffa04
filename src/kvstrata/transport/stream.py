"""Length-prefixed msgpack frames over a stream socket, shared by the ``unix://`` and ``tcp://`` backends.

Frame: ``<u32 payload length><u32 number of fds>`` then the msgpack payload. Descriptors ride as
SCM_RIGHTS ancillary data on the first byte of the header, so the receiver reads every header with
``recvmsg`` and collects them there.

Attachments: a large value wrapped in :class:`Attachment` travels beside the msgpack, not inside it, so that neither
side copies it to encode or decode it (over TCP a 64 MiB value was copied four times on its way, at a fresh page
fault a page). Such a frame sets the top bit of the fd word (:data:`_ATTACHED`); its payload is ``<u32 msgpack
length>``, the msgpack, then the attachments' bytes back to back, each standing in the msgpack as an extension value
that holds its length (:data:`_ATTACHMENT_EXT`). The receiver hands each out as a memoryview of the frame's own
buffer (a copy where the frame was small enough to share the connection's read buffer).

A receiver trusts a header's length only as far as bytes back it: a large frame's buffer starts at a megabyte and
doubles as its payload fills it, and a frame of 8 MiB or more is read into anonymous memory mapped without
reserve, backed page by page as the bytes arrive (2 MiB pages where the kernel gives them). So a peer that announces
a gigabyte and sends nine bytes costs a page. (Doubling alone made 16-64 MiB frames 20-35% slower to receive than a
buffer allocated whole; the mapping receives them faster than either, with no copy, but paid a fault per 4 KiB page:
slower below ~16 MiB. With huge pages it is faster from 8 MiB: 8 MiB values over TCP 0.59-0.70 -> 0.89-1.09 GB/s
set, 0.66-0.80 -> 1.10-1.27 get on the development machine, session 43.)
``recv``'s ``max_bytes`` caps frames further where the peer is not known yet (a listener's handshake).
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import math
import mmap
import os
import select
import socket
import struct
import sys
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
#: the top bit of a header's fd word: the payload carries attachments (see the module docstring)
_ATTACHED = 1 << 31
_ATTACHMENT_EXT = 1  # the msgpack extension type code of an attachment's place
_META_LEN = struct.Struct("<I")
_ATTACHMENT_LEN = struct.Struct("<Q")
#: values this large or larger go as attachments (:func:`attach`); a frame holding one is always read into its own
#: buffer (over _READ_CHUNK), never into the connection's shared read buffer
ATTACH_MIN_BYTES = 1 << 16
_IOV_MAX = 512  # buffers per sendmsg (Linux takes at most 1024)
_CMSG_FLAGS = int(getattr(socket, "MSG_CMSG_CLOEXEC", 0))
_POLL_FLAGS = _CMSG_FLAGS | int(socket.MSG_DONTWAIT)
_CTRUNC = int(socket.MSG_CTRUNC)  # a plain int: enum flag arithmetic is slow on this hot path
_FD = array.array("i")
_ANC_SPACE = socket.CMSG_SPACE(MAX_FDS * _FD.itemsize)
_READ_CHUNK = 1 << 16
_BUF_BYTES = 2 * _READ_CHUNK  # the read buffer: any frame up to _READ_CHUNK fits after compaction
# A spin that makes _fill try one non-blocking read before it waits: the rest of a frame begun has usually come.
_ONE_POLL = 1e-9
_DONTWAIT = int(socket.MSG_DONTWAIT)
# Waits go through poll(2), not select(2): select cannot take a descriptor numbered 1024 or more (FD_SETSIZE), which
# a worker with a thousand clients, or a client process with many files open, hands out.
_POLL_LONGEST_MS = (1 << 31) - 1  # poll's timeout is a C int of milliseconds: a longer wait ends there (24 days)


#: MAP_NORESERVE (Linux): a large frame's buffer is charged to memory only as its bytes arrive
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


#: a frame at least this large is read into its own mapping (see the module docstring); a smaller one into a buffer
#: that starts at _FIRST_LARGE_ALLOC and doubles as the bytes fill it
_MAPPED_FRAME_BYTES = 8 << 20
_FIRST_LARGE_ALLOC = 1 << 20


#: asks the kernel to back a large frame's buffer with 2 MiB pages where it can (transparent huge pages in "madvise"
#: mode, the common default): first writes into fresh pages cost ~half as much then (64 MiB on the development
#: machine: 43 -> 20 ms, beside 12 ms into warm pages), and a frame's bytes are all first writes. Where the kernel's
#: THP defrag setting makes such faults compact memory first (``madvise``, the default) a fragmented host can stall
#: them: ``KVSTRATA_HUGE_FRAMES=0`` asks for none.
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None) if os.environ.get("KVSTRATA_HUGE_FRAMES", "1") != "0" else None


def _frame_buffer(length: int, have: int) -> bytearray | mmap.mmap:
    """Room for a large frame's ``length`` bytes, ``have`` of them arrived, that costs memory only as bytes arrive."""
    if length >= _MAPPED_FRAME_BYTES:
        buffer = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        if _MADV_HUGEPAGE is not None:
            with contextlib.suppress(OSError):  # (THP off, or not built in: 4 KiB pages, as without the advice)
                buffer.madvise(_MADV_HUGEPAGE)
        return buffer
    return bytearray(max(have, min(length, _FIRST_LARGE_ALLOC)))


class Attachment:
    """A bytes-like value sent beside a message rather than inside its msgpack (see the module docstring).

    ``done`` (if given) runs once the bytes went out, or could not: a worker sending straight out of its store holds
    the object's lease until then. A transport that cannot send it out of band (in process, a lane) copies it into the
    message instead, and runs ``done`` after the copy.
    """

    __slots__ = ("_done", "data")

    def __init__(self, data: Any, done: Any = None) -> None:
        view = data if type(data) is memoryview else memoryview(data)
        self.data = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        self._done = done

    def __len__(self) -> int:
        return self.data.nbytes

    def release(self) -> None:
        """Run ``done`` (once)."""
        done, self._done = self._done, None
        if done is not None:
            done()


def attach(data: Any, done: Any = None) -> Any:
    """``data`` as an :class:`Attachment` where it is at least :data:`ATTACH_MIN_BYTES` long, else ``data`` (and
    ``done`` run now)."""
    if len(data) >= ATTACH_MIN_BYTES:
        return Attachment(data, done)
    if done is not None:
        done()
    return data


def _inline(obj: Any) -> Any:
    """msgpack's ``default``: an attachment's bytes copied into the message (a transport with no out-of-band path)."""
    if type(obj) is Attachment:
        try:
            return bytes(obj.data)
        finally:
            obj.release()
    raise TypeError(f"can not serialize {type(obj).__name__!r} object")


def pack(msg: Message) -> bytes:
    """``msg`` encoded whole, attachments copied in (the in-process transport and the lanes)."""
    try:
        return msgpack.packb(msg, use_bin_type=True, default=_inline)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidType(f"msg: cannot encode {type(exc).__name__}: {exc}") from exc


def pack_attached(msg: Message) -> tuple[bytes, list[Attachment]]:
    """``msg``'s msgpack with each :class:`Attachment` left in its place as an extension value, and the attachments
    in the order they stand there (the order the receiver meets them). Plain messages cost one packb, as
    :func:`pack`'s."""
    try:
        return msgpack.packb(msg, use_bin_type=True), []
    except TypeError:
        pass  # (an attachment, or a value that cannot be encoded at all: the second pass tells which)
    except (ValueError, OverflowError) as exc:
        raise InvalidType(f"msg: cannot encode {type(exc).__name__}: {exc}") from exc
    found: list[Attachment] = []

    def place(obj: Any) -> Any:
        if type(obj) is Attachment:
            found.append(obj)
            return msgpack.ExtType(_ATTACHMENT_EXT, _ATTACHMENT_LEN.pack(obj.data.nbytes))
        raise TypeError(f"can not serialize {type(obj).__name__!r} object")

    try:
        return msgpack.packb(msg, use_bin_type=True, default=place), found
    except (TypeError, ValueError, OverflowError) as exc:
        _release_all(found)
        raise InvalidType(f"msg: cannot encode {type(exc).__name__}: {exc}") from exc


def _release_all(attachments: list[Attachment]) -> None:
    for a in attachments:
        a.release()


def unpack(payload: bytes | memoryview) -> Message:
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable message ({type(exc).__name__}: {exc})") from exc
    if not isinstance(msg, dict):
        raise ProtocolError(f"expected a map message, got {type(msg).__name__}")
    return msg


def unpack_attached(payload: Any, *, copy: bool) -> Message:
    """A frame's message whose payload carries attachments: each one a memoryview of ``payload`` (``copy``: bytes,
    where ``payload`` is a buffer the connection reuses). ProtocolError where the lengths do not add up."""
    view = memoryview(payload)
    if view.nbytes < _META_LEN.size:
        raise ProtocolError(f"a frame with attachments of {view.nbytes} bytes: too short for its msgpack's length")
    start = _META_LEN.size + _META_LEN.unpack_from(view)[0]
    if start > view.nbytes:
        raise ProtocolError(f"a frame's msgpack of {start - _META_LEN.size} bytes runs past its {view.nbytes} bytes")
    at = [start]

    def take(code: int, data: bytes) -> Any:
        if code != _ATTACHMENT_EXT or len(data) != _ATTACHMENT_LEN.size:
            raise ProtocolError(f"unknown msgpack extension {code} ({len(data)} bytes)")
        lo = at[0]
        hi = lo + _ATTACHMENT_LEN.unpack(data)[0]
        if hi > view.nbytes:
            raise ProtocolError(f"an attachment runs to byte {hi} of a {view.nbytes}-byte frame")
        at[0] = hi
        return bytes(view[lo:hi]) if copy else view[lo:hi]

    try:
        msg = msgpack.unpackb(view[_META_LEN.size : start], raw=False, strict_map_key=False, ext_hook=take)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable message ({type(exc).__name__}: {exc})") from exc
    if not isinstance(msg, dict):
        raise ProtocolError(f"expected a map message, got {type(msg).__name__}")
    if at[0] != view.nbytes:
        raise ProtocolError(f"{view.nbytes - at[0]} bytes at the end of a frame that no attachment claims")
    return msg


def _seconds(timeout: float | None) -> str:
    """A timeout as a message shows it: three significant digits (not 4.999757560999569)."""
    return f"{timeout:.3g}" if isinstance(timeout, int | float) else str(timeout)


def encode_frame(msg: Message) -> bytes:
    """A whole frame carrying ``msg`` and no descriptors: what a socket with no connection made for it sends."""
    payload = pack(msg)
    return _HEADER.pack(len(payload), 0) + payload


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
        # A large frame whose payload is being read (straight into its own buffer), kept across a recv that
        # timed out halfway so that the next recv continues it: the stream never loses its place.
        self._large: _LargeFrame | None = None
        sock.settimeout(None)
        # One poll object for the connection's life: its timed waits register nothing anew
        self._readable = select.poll()
        self._readable.register(sock.fileno(), select.POLLIN)

    @property
    def address(self) -> str:
        return self._address

    @property
    def closed(self) -> bool:
        return self._closed or self._lost

    def fileno(self) -> int:
        return self._sock.fileno()

    def buffered(self) -> bool:
        """Whether bytes read from the socket wait in this connection's buffer (a poll of the socket misses them)."""
        return self._rpos != self._rend

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"connection to {self._address} is closed")
        if self._lost:
            raise ConnectionLost(f"connection to {self._address} was lost")

    def send(self, msg: Message, fds: Sequence[int] = ()) -> None:
        """Send ``msg`` (its :class:`Attachment` values out of band, each released once sent or not)."""
        payload, attachments = pack_attached(msg)
        try:
            self._send_frame(payload, attachments, fds)
        finally:
            if attachments:
                _release_all(attachments)

    def _send_frame(self, payload: bytes, attachments: list[Attachment], fds: Sequence[int]) -> None:
        length = len(payload)
        parts: list[Any] = [payload]
        flag = 0
        if attachments:
            flag = _ATTACHED
            length += _META_LEN.size + sum(a.data.nbytes for a in attachments)
            parts = [_META_LEN.pack(len(payload)), payload, *(a.data for a in attachments)]
        if length > MAX_FRAME:
            raise InvalidValue(f"msg: {length} bytes encoded, over the {MAX_FRAME}-byte frame limit")
        fds = list(fds)
        if fds and not self.can_pass_fds:
            raise InvalidValue(f"fds: {self._address} cannot pass file descriptors")
        if len(fds) > MAX_FDS:
            raise InvalidValue(f"fds: at most {MAX_FDS} per message, got {len(fds)}")
        header = _HEADER.pack(length, len(fds) | flag)
        self._check_open()
        with self._send_lock:
            try:
                if fds:
                    sent = socket.send_fds(self._sock, [header], fds)
                    if sent < len(header):
                        self._sock.sendall(header[sent:])
                    sendall_msg(self._sock, parts)
                elif length < 65536:
                    self._sock.sendall(header + b"".join(parts))
                else:  # avoid copying a large payload just to prepend 8 bytes
                    sendall_msg(self._sock, [header, *parts])
            except OSError as exc:
                self._lost = True
                if self._closed:
                    raise ClosedError(f"connection to {self._address} is closed") from exc
                raise ConnectionLost(f"lost connection to {self._address} while sending: {exc}") from exc

    def recv(
        self, timeout: float | None = None, *, spin: float = 0.0, max_bytes: int | None = None
    ) -> tuple[Message, list[int]]:
        """The next message and its descriptors; ``timeout`` bounds the whole frame, not just its first byte.

        A frame cut short by ``timeout`` raises :class:`Timeout` and keeps what was read of it: the next
        ``recv`` continues that frame, so the connection stays in step. A frame longer than ``max_bytes``
        (default :data:`MAX_FRAME`), or a header or descriptors that do not add up, raise
        :class:`ProtocolError`, after which the connection is lost.
        """
        self._check_open()
        with self._recv_lock:
            try:
                return self._recv_frame(timeout, spin, MAX_FRAME if max_bytes is None else max_bytes)
            except ProtocolError:
                self._lost = True
                self._large = None
                self._close_queued_fds()
                self._sock.close()
                raise

    def _recv_frame(self, timeout: float | None, spin: float, max_bytes: int) -> tuple[Message, list[int]]:
        # Frames are parsed out of a read buffer filled by recvmsg, so a small message costs one
        # system call. Descriptors are queued in arrival order and handed to frames by their
        # header's count: the kernel delivers them with the first byte of their frame.
        if self._large is not None:  # an earlier recv timed out halfway through a large frame: finish it first
            return self._finish_large(timeout, 0.0)
        waited_since = 0.0
        if self._rpos == self._rend:
            self._rpos = self._rend = 0
            waited_since = self._fill(timeout, spin)
        # The deadline for the frame's rest is worked out only once a read leaves it incomplete: most
        # frames arrive whole in the first read, and they pay no clock read for it.
        deadline: float | None = None
        while self._rend - self._rpos < _HEADER.size:
            if deadline is None:
                deadline = _deadline(timeout, waited_since)
            self._fill_until(deadline, timeout)
        length, nfds = _HEADER.unpack_from(self._rbuf, self._rpos)
        attached = nfds & _ATTACHED
        nfds ^= attached
        if length > max_bytes or nfds > MAX_FDS:
            raise ProtocolError(
                f"frame header from {self._address} announces {length} bytes (limit {max_bytes}) and {nfds} "
                f"file descriptors (limit {MAX_FDS}): not a kvstrata peer, or not one allowed to send that yet"
            )
        start = self._rpos + _HEADER.size
        if length > _READ_CHUNK:  # a large frame: read its rest straight into place
            have = min(self._rend - start, length)
            payload = _frame_buffer(length, have)
            payload[:have] = self._rview[start : start + have]
            self._rpos = start + have
            if self._rpos == self._rend:
                self._rpos = self._rend = 0
            self._large = _LargeFrame(payload, have, length, nfds, attached)
            return self._finish_large(timeout, waited_since)
        while self._rend - start < length:
            if deadline is None:
                deadline = _deadline(timeout, waited_since)
            self._fill_until(deadline, timeout)
            start = self._rpos + _HEADER.size  # _fill may have moved the unread bytes
        view = self._rview[start : start + length]
        self._rpos = start + length
        return self._decode(view, nfds, attached, copy=True)

    def _decode(self, payload: Any, nfds: int, attached: int = 0, *, copy: bool = False) -> tuple[Message, list[int]]:
        """A whole frame's message and its ``nfds`` descriptors (closed if the payload does not decode).
        ``copy``: ``payload`` is the connection's read buffer, which the next frame overwrites."""
        fds = self._take_fds(nfds) if nfds or self._rfds else []
        try:
            return (unpack_attached(payload, copy=copy) if attached else unpack(payload)), fds
        except ProtocolError:
            for fd in fds:
                os.close(fd)
            raise

    def _finish_large(self, timeout: float | None, waited_since: float) -> tuple[Message, list[int]]:
        """Read the rest of ``self._large`` (by the deadline ``timeout`` sets) and decode it."""
        frame = self._large
        assert frame is not None
        payload, length = frame.payload, frame.length
        if frame.have < length:
            deadline = _deadline(timeout, waited_since)
            while frame.have < length:
                if frame.have == len(payload):  # (a bytearray) the peer filled what it has shown it sends: double it
                    payload.extend(bytes(min(length, 2 * len(payload)) - len(payload)))
                with memoryview(payload) as whole, whole[frame.have :] as rest:  # (released: payload can grow)
                    frame.have += self._read_into(rest, deadline, timeout)
        self._large = None
        try:
            return self._decode(payload, frame.nfds, frame.attached)
        finally:
            if isinstance(payload, mmap.mmap) and not frame.attached:
                try:
                    payload.close()  # (the message holds copies: msgpack copies what it decodes)
                except BufferError:  # a view of it still alive somewhere: unmapped when that goes
                    pass
            # (attachments are views of the mapping: it is unmapped when the last of them goes)

    def _take_fds(self, nfds: int) -> list[int]:
        """The ``nfds`` descriptors of the frame just read; ProtocolError if too few came, or ones no frame claims.

        One recvmsg brings the descriptors of at most one frame (the kernel ends a read after the message
        that carried them), and a new read starts only when the buffer holds no whole frame. So what is
        queued beyond this frame's can only be the next frame's, which then has begun in the buffer, and
        is at most MAX_FDS: anything else was attached to no frame (a peer flooding this process's fd table).
        """
        queued = self._rfds
        if len(queued) < nfds:
            raise ProtocolError(
                f"frame from {self._address} announces {nfds} file descriptors, but {len(queued)} came with it"
            )
        fds = [queued.popleft() for _ in range(nfds)]
        if queued and (self._rpos == self._rend or len(queued) > MAX_FDS):
            stray = len(queued)
            for fd in fds:
                os.close(fd)
            raise ProtocolError(
                f"{self._address}: {stray} file descriptor(s) came that no frame announces (this one announced {nfds})"
            )
        return fds

    def _close_queued_fds(self) -> None:
        while self._rfds:
            try:
                os.close(self._rfds.popleft())
            except OSError:
                pass

    def _fill(self, timeout: float | None, spin: float = 0.0) -> float:
        """One recvmsg into the read buffer, waiting up to ``timeout`` seconds (None: forever) for data.

        Returns when a timed wait began (``time.monotonic()``; 0.0 when none was timed), from which the
        caller dates the deadline of a frame the read left incomplete.
        The socket stays blocking (a socket timeout would also cut sends short); a timed wait polls first.
        ``spin`` seconds of non-blocking polls come before the blocking wait: waking a sleeping
        process costs tens of microseconds, several times a small request's whole round trip.
        """
        waited_since = 0.0
        try:
            if len(self._rbuf) - self._rend < _READ_CHUNK:  # make room: move the unread bytes to the front
                n = self._rend - self._rpos
                self._rbuf[:n] = bytes(self._rview[self._rpos : self._rend])
                self._rpos, self._rend = 0, n
            into = [self._rview[self._rend :]]
            got = self._poll(into, spin) if spin > 0.0 else None
            if got is None:
                if timeout is None:
                    ready = True
                else:
                    if timeout > 0:  # (next to a poll that may sleep, a clock read costs nothing)
                        waited_since = time.monotonic()
                    ready = self._wait_readable(timeout)
                if ready:
                    got = self._sock.recvmsg_into(into, _ANC_SPACE, _CMSG_FLAGS)
        except OSError as exc:
            raise self._lost_error(exc if isinstance(exc, OSError) else None) from exc
        if got is None:
            raise Timeout(f"no message from {self._address} within {_seconds(timeout)} s")
        nbytes, ancdata, flags, _ = got
        if ancdata:
            self._queue_fds(ancdata)
        if flags & _CTRUNC:
            raise ProtocolError(f"file descriptors from {self._address} were truncated in transit")
        if not nbytes:
            raise self._lost_error(None)
        self._rend += nbytes
        return waited_since

    def _queue_fds(self, ancdata: list[tuple[int, int, bytes]]) -> None:
        for level, kind, fd_bytes in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(fd_bytes) - len(fd_bytes) % _FD.itemsize
                self._rfds.extend(array.array("i", fd_bytes[:usable]))
        # At most the frame being read and the next one have descriptors queued (see _take_fds): a peer
        # attaching more to a frame it trickles in must not get to fill this process's fd table meanwhile.
        if len(self._rfds) > 2 * MAX_FDS:
            raise ProtocolError(f"{self._address} sent {len(self._rfds)} file descriptors that no frame announces")

    def _fill_until(self, deadline: float, timeout: float | None) -> None:
        """:meth:`_fill` for the rest of a frame begun: Timeout once ``deadline`` (``time.monotonic()``) passed."""
        if deadline == math.inf:
            self._fill(None)
            return
        try:
            self._fill(max(deadline - time.monotonic(), 0.0), _ONE_POLL)
        except Timeout:
            raise Timeout(
                f"only part of a message from {self._address} arrived within {_seconds(timeout)} s "
                "(the next recv continues it)"
            ) from None

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

    def _read_into(self, view: memoryview, deadline: float, timeout: float | None) -> int:
        """Bytes read into ``view`` (at least one; never past it, so the next frame's descriptors are not lost).

        Waits until ``deadline`` (``time.monotonic()``; ``math.inf``: forever), then raises Timeout.
        """
        got = -1
        try:
            if deadline == math.inf:
                got = self._sock.recv_into(view)
            else:
                try:  # what has come already, with no poll: a large frame's rest mostly has
                    got = self._sock.recv_into(view, 0, _DONTWAIT)
                except BlockingIOError:
                    if self._wait_readable(deadline - time.monotonic()):
                        got = self._sock.recv_into(view)
        except OSError as exc:
            raise self._lost_error(exc if isinstance(exc, OSError) else None) from exc
        if got < 0:
            raise Timeout(
                f"only part of a message from {self._address} arrived within {_seconds(timeout)} s "
                "(the next recv continues it)"
            )
        if got == 0:
            raise self._lost_error(None)
        return got

    def _wait_readable(self, timeout: float) -> bool:
        """Whether the socket became readable (data, end of stream or an error) within ``timeout`` seconds.

        Raises OSError (EBADF) where another thread closed the connection: its descriptor's number may be another
        file's by now, so it is not waited on.
        """
        if self._closed:
            raise OSError(errno.EBADF, "the connection was closed")
        ms = 0 if timeout <= 0 else min(math.ceil(timeout * 1000), _POLL_LONGEST_MS)  # (up: never wake early)
        return bool(self._readable.poll(ms))

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
        self._large = None
        self._close_queued_fds()
        if self._pid == PID[0]:  # (in a forked child the socket is the parent's too: only this copy is closed)
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on this socket
            except OSError:
                pass
        self._sock.close()


class _LargeFrame:
    """A frame over _READ_CHUNK being read into its own buffer: ``payload[:have]`` arrived of ``length``."""

    __slots__ = ("attached", "have", "length", "nfds", "payload")

    def __init__(self, payload: bytearray | mmap.mmap, have: int, length: int, nfds: int, attached: int) -> None:
        self.payload = payload
        self.have = have
        self.length = length
        self.nfds = nfds
        self.attached = attached


def _deadline(timeout: float | None, waited_since: float) -> float:
    """When a frame begun must be whole (``time.monotonic()``): ``timeout`` after its wait began, or from now."""
    if timeout is None:
        return math.inf
    return (waited_since or time.monotonic()) + timeout


def sendall_msg(sock: socket.socket, buffers: list[Any]) -> None:
    """``sendmsg`` until every byte of ``buffers`` is out (sendmsg may stop early on a stream socket)."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX])
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]

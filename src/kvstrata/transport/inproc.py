"""``inproc://name``: connections between threads of one process, through queues.

For the embedded mode and for tests. Messages go through the same msgpack encoding as on a socket,
so code that works in-process works over ``unix://``; passed descriptors are duplicated, so the
receiver owns (and must close) what it gets, as with SCM_RIGHTS.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

from kvstrata.errors import ClosedError, ConnectionLost, InvalidValue, ProtocolError, Timeout, TransportError
from kvstrata.transport.base import Backend, Connection, Handler, Listener, Message, register_backend, split_address
from kvstrata.transport.stream import MAX_FDS, pack, unpack

_CLOSED = object()
_listeners: dict[str, InprocListener] = {}
_listeners_lock = threading.Lock()
_ids = itertools.count(1)


class InprocConnection(Connection):
    """One end of an in-process connection: what it sends goes through a queue to the other end's inbox.

    Both ends share a :class:`_Link`, so that a send either reaches a peer that is still open, or raises: the
    descriptors of a message nobody will read are never duplicated (or, queued before the peer closed,
    are closed by its close), as a socket's close closes what it holds.
    """

    can_pass_fds = True

    def __init__(
        self, address: str, inbox: queue.SimpleQueue, outbox: queue.SimpleQueue, link: _Link, end: int
    ) -> None:
        self._address = address
        self._inbox = inbox
        self._outbox = outbox
        self._link = link  # shared with the peer, which is end 1 - end of it
        self._end = end
        self._closed = False
        self._lost = False
        self._recv_lock = threading.Lock()
        self.peer_info: Message = {}
        self.handshake_fds: list[int] = []

    @property
    def address(self) -> str:
        return self._address

    @property
    def closed(self) -> bool:
        return self._closed or self._lost

    def send(self, msg: Message, fds: Sequence[int] = ()) -> None:
        payload = pack(msg)
        if len(fds) > MAX_FDS:
            raise InvalidValue(f"fds: at most {MAX_FDS} per message, got {len(fds)}")
        link = self._link
        with link.lock:
            if self._closed:
                raise ClosedError(f"connection to {self._address} is closed")
            if self._lost or link.closed[1 - self._end]:
                self._lost = True
                raise ConnectionLost(f"lost connection to {self._address} (peer closed the connection)")
            self._outbox.put((payload, [os.dup(fd) for fd in fds]))

    def recv(
        self, timeout: float | None = None, *, spin: float = 0.0, max_bytes: int | None = None
    ) -> tuple[Message, list[int]]:
        if self._closed:
            raise ClosedError(f"connection to {self._address} is closed")
        if self._lost:
            raise ConnectionLost(f"connection to {self._address} was lost")
        with self._recv_lock:
            try:
                item = self._inbox.get(timeout=timeout)
            except queue.Empty:
                raise Timeout(f"no message from {self._address} within {timeout:.3g} s") from None
        if item is _CLOSED:
            if self._closed:
                raise ClosedError(f"connection to {self._address} is closed")
            self._lost = True
            raise ConnectionLost(f"lost connection to {self._address} (peer closed the connection)")
        payload, fds = item
        if max_bytes is not None and len(payload) > max_bytes:
            _close_all(fds)
            self._lost = True
            raise ProtocolError(f"message from {self._address} has {len(payload)} bytes, over the limit {max_bytes}")
        return unpack(payload), fds

    def close(self) -> None:
        with self._link.lock:
            if self._closed:
                return
            self._closed = self._link.closed[self._end] = True
            # Messages that came and will never be read: their descriptors are ours to close.
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is not _CLOSED:
                    _close_all(item[1])
            self._outbox.put(_CLOSED)
            self._inbox.put(_CLOSED)  # wakes a local thread blocked in recv


class _Link:
    """What the two ends of an in-process connection share: which of them closed, under one lock (so that no
    message enters an inbox after its end closed)."""

    __slots__ = ("closed", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = [False, False]


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class InprocListener(Listener):
    def __init__(self, address: str, accept: Handler) -> None:
        self._address = address
        self._accept = accept
        self._stopped = False

    @property
    def address(self) -> str:
        return self._address

    def connect(self) -> InprocConnection:
        a_to_b: queue.SimpleQueue = queue.SimpleQueue()
        b_to_a: queue.SimpleQueue = queue.SimpleQueue()
        link = _Link()
        client = InprocConnection(self._address, inbox=b_to_a, outbox=a_to_b, link=link, end=0)
        server = InprocConnection(self._address, inbox=a_to_b, outbox=b_to_a, link=link, end=1)
        self._accept(server)
        return client

    def stop(self) -> None:
        self._stopped = True
        with _listeners_lock:
            if _listeners.get(self._address) is self:
                del _listeners[self._address]


class InprocBackend(Backend):
    def connect(self, address: str, timeout: float) -> InprocConnection:
        split_address(address)
        with _listeners_lock:
            listener = _listeners.get(address)
        if listener is None:
            raise ConnectionRefusedError(f"nothing listens on {address}")
        return listener.connect()

    def listen(self, address: str, accept: Handler, **options: Any) -> InprocListener:
        _, name = split_address(address)
        if name == "*":  # a fresh unique name, like tcp port 0
            address = f"inproc://{os.getpid()}-{next(_ids)}"
        with _listeners_lock:
            if address in _listeners:
                raise TransportError(f"cannot listen on {address}: already in use")
            listener = _listeners[address] = InprocListener(address, accept)
        return listener


register_backend("inproc", InprocBackend())

"""Answers to a client's parked polls, sent by whichever worker thread has them without ever waiting on that client.

A parked ``wait_events`` is answered by the thread that pushes the client's next event: most often another
client's session thread (the publisher's, for a match), or the broker's timer thread. A blocking send there
would let one client that stops reading its socket (hung, stopped, hostile) stall every thread that has an
event for it: the publisher's request would never be answered, nor its later ones, and its session would
never end. So :meth:`Outbox.send` tries once, without blocking: the connection's send lock taken only if it
is free, the frame written with ``MSG_DONTWAIT``. That is the common path, one system call, as many as the
transport's own send. Where the frame (or its rest) cannot go out at once, a thread of this connection's own
(started then, gone once the queue is empty) finishes it, and sends the answers queued behind it in order.
A client that takes no byte of them for :data:`STALL_SECONDS` (or lets :data:`MAX_QUEUED_BYTES` pile up) is
disconnected: its session ends, and the broker forgets it (``owner_gone``) as for any client that went away.

The worker's replies to a connection's own requests still go through :meth:`StreamConnection.send` on its own
session thread: a client that stops reading them blocks only itself.
"""

from __future__ import annotations

import collections
import logging
import select
import socket
import threading
import time
from typing import Any

from kvstrata.devobj.debug import trace
from kvstrata.errors import ClosedError, ConnectionLost, InvalidValue
from kvstrata.transport.stream import _HEADER, MAX_FRAME, StreamConnection, pack

log = logging.getLogger(__name__)

#: seconds a connection may take no byte of the answers waiting for it (or keep its send lock busy) before the
#: worker disconnects it as a client that stopped reading
STALL_SECONDS = 30.0
#: bytes of answers that may wait for one connection; past it the client is disconnected at once
MAX_QUEUED_BYTES = 64 << 20
_DONTWAIT = int(socket.MSG_DONTWAIT)
_WAIT_SLICE = 0.5  # the drain thread looks at whether the connection closed under it at least this often


class Outbox:
    """The parked polls' answers to one connection (a worker session's), in the order they are sent.

    The stream transport's internals (the socket, the send lock that keeps frames whole) are used here only; a
    transport without them (in-process queues, which never block) is sent to with its own ``send``.
    """

    def __init__(self, conn: Any, name: str = "") -> None:
        self.conn = conn
        self.name = name or repr(conn)
        stream = isinstance(conn, StreamConnection)
        self._sock: socket.socket | None = conn._sock if stream else None
        self._send_lock: threading.Lock | None = conn._send_lock if stream else None
        self._lock = threading.Lock()  # the fields below
        self._queue: collections.deque[bytes] = collections.deque()  # whole frames waiting behind the one draining
        self._queued = 0  # their bytes
        self._draining = False  # a drain thread owns the sending (and sends what is queued when it can)
        self._dead: str | None = None  # why nothing more can be sent (a fresh ConnectionLost is raised each time)

    @property
    def busy(self) -> bool:
        """Whether earlier answers still wait to go out (a later one must go after them, through :meth:`send`)."""
        return self._draining

    def send(self, msg: dict) -> None:
        """Send ``msg`` now if the connection takes it at once, else queue it for the drain thread; never waits.

        Raises what a send raises for a connection closed or lost, or a message that cannot be encoded.
        """
        sock, send_lock = self._sock, self._send_lock
        if sock is None or send_lock is None:
            self.conn.send(msg)
            return
        payload = pack(msg)
        if len(payload) > MAX_FRAME:
            raise InvalidValue(f"msg: {len(payload)} bytes encoded, over the {MAX_FRAME}-byte frame limit")
        frame = _HEADER.pack(len(payload), 0) + payload
        with self._lock:
            if self._dead is not None:
                raise ConnectionLost(self._dead)
            if self._draining:
                self._queue.append(frame)
                self._queued += len(frame)
                if self._queued > MAX_QUEUED_BYTES:
                    self._drop_locked(f"{self._queued} bytes of device-object events wait for it")
                trace("worker: events queued")
                return
            sent = 0
            held = send_lock.acquire(blocking=False)  # else the session's own thread sends (maybe stuck): don't wait
            if held:
                try:
                    sent = sock.send(frame, _DONTWAIT)  # (a closed connection's socket raises EBADF)
                except BlockingIOError:
                    pass
                except OSError as exc:
                    send_lock.release()
                    self._dead = f"lost connection to {self.conn.address} while sending: {exc}"
                    raise ConnectionLost(self._dead) from exc
                if sent == len(frame):
                    send_lock.release()
                    trace("worker: events sent")
                    return
            elif self.conn.closed:
                raise ClosedError(f"connection to {self.conn.address} is closed")
            # (if part of the frame went out, the send lock stays held: the drain thread sends the rest, then frees it)
            rest = memoryview(frame)[sent:]
            self._draining = True
            try:
                drain = threading.Thread(target=self._drain, args=(rest, held), name="kvstrata-devobj-outbox")
                drain.daemon = True
                drain.start()
            except BaseException:  # no thread to finish the frame (threads exhausted): the connection cannot go on
                self._draining = False
                if held:
                    send_lock.release()
                self._drop_locked("no thread could be started to send its events")
                raise
            trace("worker: events handed to the outbox")

    def _drop_locked(self, why: str) -> None:
        """Disconnect the client (its session thread wakes, ends and cleans up: the broker forgets it)."""
        if self._dead is None:
            log.warning("device objects: disconnecting client %s, which stopped reading: %s", self.name, why)
            self._dead = f"connection to {self.conn.address} dropped: the client stopped reading"
        self._queue.clear()
        self._queued = 0
        self.conn.close()

    def _drain(self, rest: memoryview | None, held: bool) -> None:
        """Finish ``rest`` (sent in part already if ``held``: the send lock is this thread's), then what queued."""
        send_lock = self._send_lock
        assert send_lock is not None
        try:
            while True:
                if not held:
                    held = self._acquire(send_lock)
                    if not held:
                        return
                if rest is not None and not self._write(rest):
                    return
                send_lock.release()
                held = False
                with self._lock:
                    if not self._queue or self._dead is not None:
                        self._draining = False
                        return
                    rest = memoryview(b"".join(self._queue))
                    self._queue.clear()
                    self._queued = 0
        except Exception:  # a bug: nothing more can go out in order on this connection
            log.exception("device objects: sending events to client %s failed", self.name)
            with self._lock:
                self._drop_locked("sending its events failed")
        finally:
            if held:
                send_lock.release()

    def _acquire(self, send_lock: threading.Lock) -> bool:
        """The connection's send lock (held by its session thread sending a reply, maybe to a client that does not
        read it); False, the client dropped, if it stays busy for STALL_SECONDS."""
        end = time.monotonic() + STALL_SECONDS
        while not send_lock.acquire(timeout=_WAIT_SLICE):
            if self.conn.closed:
                self._give_up(None)
                return False
            if time.monotonic() >= end:
                with self._lock:
                    self._drop_locked(f"a reply to it could not go out for {STALL_SECONDS:g} s")
                return False
        return True

    def _write(self, view: memoryview) -> bool:
        """All of ``view``, as the client reads; False (the client dropped, or gone) if it takes no byte of it for
        STALL_SECONDS or the connection fails."""
        sock = self._sock
        assert sock is not None
        poller = select.poll()
        fd = sock.fileno()
        if fd < 0:
            self._give_up(None)
            return False
        poller.register(fd, select.POLLOUT)
        moved = time.monotonic()
        while view:
            try:
                sent = sock.send(view, _DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self._give_up(exc)
                return False
            now = time.monotonic()
            if sent:
                view = view[sent:]
                moved = now
                continue
            if self.conn.closed:
                self._give_up(None)
                return False
            if now - moved >= STALL_SECONDS:
                with self._lock:
                    self._drop_locked(f"it read nothing of its events for {STALL_SECONDS:g} s")
                return False
            poller.poll(min(_WAIT_SLICE, STALL_SECONDS - (now - moved)) * 1000)
        trace("worker: events sent (drained)")
        return True

    def _give_up(self, exc: OSError | None) -> None:
        """The connection closed or failed under the drain thread: what waits is lost with it."""
        log.debug("device objects: events for client %s not sent: connection %s", self.name, exc or "closed")
        with self._lock:
            if self._dead is None:
                self._dead = f"lost connection to {self.conn.address}: {exc or 'closed'}"
            self._queue.clear()
            self._queued = 0


__all__ = ["MAX_QUEUED_BYTES", "STALL_SECONDS", "Outbox"]

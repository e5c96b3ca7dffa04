"""Who reads a device-object client's event connection: its event thread, or a thread waiting for a receive.

Leader/follower, for the 4 KiB hand-off's last wake-ups. A subscriber's future whose key is not published
yet completes when the broker's ``matched`` event arrives on the client's event connection, is copied,
and is settled. With the event thread reading that connection, the waiter pays two thread wake-ups in a
row (the event thread's, by the socket, then its own, by the settled future) and, in between, competes
with the event thread for the GIL. Instead, the thread that waits in ``result()`` takes the *role* of
reading the connection (:class:`PollRole`): it receives the event, copies and settles its own future,
and returns; no other thread of the process runs on that path. The event thread keeps the role
whenever no thread waits that way (a caller that never calls ``result()``, callbacks, owners' events),
and gets it back as soon as the waiter is done.

The role is a small state under a condition: its holder (a thread, or None), and how many waiters want
it. The event thread waits on the connection *and* a wake pipe (:meth:`PollRole.wait_readable`); a
waiter that wants the role writes to the pipe, the event thread steps aside between two events (a poll
sent stays outstanding: its answer is read by whoever holds the role next). Only one waiter leads at a
time; others wait on their futures as before (the leader dispatches every event, theirs too). The pipe
also wakes a leader whose future was cancelled or whose client closed.

A leader may busy-poll the connection for :func:`lead_spin_seconds` before sleeping in ``select``
(on hosts with at least :data:`~kvstrata.devobj.futures.SPIN_MIN_CPUS` CPUs; it is then the only thread
of the process on the hand-off's path, so its polls, which sleep a few microseconds with the GIL
released in between, compete with nobody for the GIL).
"""

from __future__ import annotations

import math
import os
import select
import threading
import time
from typing import Any

from kvstrata.devobj.futures import SPIN_SLACK_NS, _pause, _slack_set, spin_seconds

_POLL_MAX_MS = 2**31 - 1  # poll()'s timeout is a C int of milliseconds

#: default busy-polling budget of a leading waiter (microseconds), on hosts with enough CPUs: a subscriber
#: that waits for a publish about to come (the hand-off's shape) sees it without a thread wake-up
LEAD_SPIN_US = 1000.0


def lead_spin_seconds() -> float:
    """Seconds a leading waiter polls its connection before sleeping: ``KVSTRATA_DEVOBJ_LEAD_SPIN_US``, else
    :data:`LEAD_SPIN_US` on hosts with at least 8 CPUs and 0 on smaller ones (a polling thread holds a core)."""
    return spin_seconds("KVSTRATA_DEVOBJ_LEAD_SPIN_US", LEAD_SPIN_US)


def lead_enabled() -> bool:
    """Whether waiters may lead: ``KVSTRATA_DEVOBJ_LEAD=0`` turns it off (the event thread alone reads events)."""
    return os.environ.get("KVSTRATA_DEVOBJ_LEAD", "1").strip() not in ("0", "off", "false", "no")


class PollRole:
    """The right to read a client's event connection (module docstring). Thread-safe."""

    def __init__(self, fileno: int, offers: int | None = None) -> None:
        self._fd = fileno
        self._offers_fd = offers  # the client's offer box (kvstrata.devobj.offers), waited on beside the connection
        #: whether the last :meth:`wait_readable` saw offers queued in the box
        self.offers_ready = False
        self._cond = threading.Condition(threading.Lock())
        self.holder: threading.Thread | None = None
        self._leader: threading.Thread | None = None  # the holder when it is a waiter
        self._wanted = 0  # waiters waiting to take the role
        self._rfd, self._wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._closed = False

    # -- taking and giving back -------------------------------------------------------------------
    def take_for_events(self, should_stop) -> bool:
        """The event thread: wait until no waiter leads or wants the role, then hold it; False when
        ``should_stop()`` became true meanwhile (checked whenever the role changes hands)."""
        me = threading.current_thread()
        with self._cond:
            while self._wanted or (self.holder is not None and self.holder is not me):
                if should_stop() or self._closed:
                    return False
                self._cond.wait(0.5)  # bounded: should_stop may turn true with no notify
            self.holder = me
            return True

    def take_for_waiter(self, deadline: float | None) -> bool:
        """A waiter: hold the role, once the event thread stepped aside; False when another waiter leads or
        wants it, this thread holds it already (a ``result()`` called from an event's callback: never nest),
        the role is closed, or ``deadline`` (monotonic) passes first."""
        me = threading.current_thread()
        with self._cond:
            if self._closed or self.holder is me or self._wanted or self._leader is not None:
                return False
            self._wanted += 1
            try:
                if self.holder is not None:
                    self._signal()
                while self.holder is not None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if (left is not None and left <= 0) or self._closed:
                        return False
                    self._cond.wait(left)
                self.holder = self._leader = me
                return True
            finally:
                self._wanted -= 1

    def give_back(self) -> None:
        """The holder is done for now; the event thread or a waiting waiter takes over."""
        with self._cond:
            self.holder = self._leader = None
            self._cond.notify_all()

    def leader(self) -> threading.Thread | None:
        """The waiter holding the role now (None: the event thread or nobody)."""
        return self._leader

    # -- waking and waiting -----------------------------------------------------------------------
    def wake(self) -> None:
        """Wake the holder from :meth:`wait_readable` (it then rechecks why it waits)."""
        if self.holder is not None and self.holder is not threading.current_thread():
            self._signal()

    def _signal(self) -> None:
        try:
            os.write(self._wfd, b"x")
        except (BlockingIOError, OSError):  # full (a wake is pending anyway) or closed
            pass

    def _drain(self) -> None:
        try:
            while os.read(self._rfd, 64):
                pass
        except (BlockingIOError, OSError):
            pass

    def wait_readable(self, timeout: float | None, spin: float = 0.0, buffered: Any = None) -> bool:
        """Until the connection has data (True) or the pipe was written / ``timeout`` passed / offers came
        (False; :attr:`offers_ready` says the latter, which may also come with True).
        ``spin``: seconds of polling first (short sleeps with the GIL released between polls); ``buffered()``:
        whether the connection holds bytes read already (``select`` cannot see those)."""
        self.offers_ready = False
        if buffered is not None and buffered():
            return True
        # poll, not select: a process with 1,024 descriptors or more open (data loaders, many files) numbers its new
        # ones past what select can watch (session 38's audit of many clients). One poll object per wait: a thread
        # other than the holder never waits here at the same time, but a poll object must never be shared by two.
        poller = select.poll()
        for fd in (self._fd, self._rfd) if self._offers_fd is None else (self._fd, self._rfd, self._offers_fd):
            poller.register(fd, select.POLLIN)
        ready: set[int] = set()
        if spin > 0.0:
            end = time.monotonic() + (spin if timeout is None else min(spin, timeout))
            slack = _slack_set(SPIN_SLACK_NS)
            try:
                while True:
                    ready = {fd for fd, _ in poller.poll(0)}  # (readable, or at EOF / in error: a read says which)
                    if ready:
                        break
                    if time.monotonic() >= end:
                        break
                    _pause()
            finally:
                if slack is not None:
                    _slack_set(slack)
            if not ready and timeout is not None:
                timeout = max(0.0, timeout - spin)
        if not ready:
            wait_ms = None if timeout is None else min(math.ceil(timeout * 1000), _POLL_MAX_MS)  # never early
            ready = {fd for fd, _ in poller.poll(wait_ms)}
        if self._offers_fd is not None and self._offers_fd in ready:
            self.offers_ready = True
        if self._rfd in ready:
            self._drain()
        return self._fd in ready

    def close(self) -> None:
        """Wake everyone for good (the client closes); the pipe is closed once nobody can use it (finalizer)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._signal()

    def release(self) -> None:
        """After :meth:`close`, with the event thread gone: close the wake pipe now, unless a thread still holds
        the role (then the finalizer does). A closed client's pipe would otherwise wait for the garbage
        collector: the client's threads and callbacks make reference cycles."""
        with self._cond:
            if not self._closed or self.holder is not None:
                return
            fds, self._rfd, self._wfd = (self._rfd, self._wfd), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def __del__(self) -> None:
        for fd in (getattr(self, "_rfd", -1), getattr(self, "_wfd", -1)):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


__all__ = ["LEAD_SPIN_US", "PollRole", "lead_enabled", "lead_spin_seconds"]

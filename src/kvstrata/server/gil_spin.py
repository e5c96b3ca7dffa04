"""How the worker's busy-polling threads share the GIL: they never give it up of their own accord.

A worker busy-polls for small requests (a lone client's connection thread, :meth:`kvstrata.server.session.
Session._next`; the lane poller, :mod:`kvstrata.server.lane_poller`). A polling loop that releases the GIL
each turn (``os.sched_yield``, or a ``select`` with no timeout, both of which release it around their system
call) starves every other thread of the worker on an idle many-core host: each release-and-retake resets
CPython's forced switch for the threads waiting for the GIL, and the polling thread retakes it before a
woken waiter runs. Measured on the 32-CPU H200 host: a socket request beside 8 clients writing through the
lane poller's first version waited up to 2.5 s; a new client's connect beside one client polled by its
connection thread waited 22-26 ms at p90, 84-90 ms at p99 (``tools/probe_worker_mixed.py --connect``).

So a polling loop holds the GIL without a break and lets CPython take it away: a thread waiting for it gets
it after the switch interval, which a worker process sets to :data:`GIL_SWITCH_S`
(:meth:`kvstrata.server.worker.Worker.serve_forever`). Its socket checks go through :class:`ReadyCheck`, a
``poll(2)`` called with the GIL held (a zero timeout never blocks).
"""

from __future__ import annotations

import ctypes
import errno
import os
import select

from kvstrata.errors import InvalidValue

#: the GIL switch interval of a worker process (CPython's default is 5 ms): about the longest another
#: thread of the worker waits for the GIL while a thread busy-polls
GIL_SWITCH_S = 100e-6

_READY = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR | select.POLLNVAL


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


try:  # PyDLL: the call keeps the GIL (a CDLL call would release it, which is what this module avoids)
    _poll = ctypes.PyDLL(None, use_errno=True).poll
    _poll.argtypes = [ctypes.POINTER(_PollFd), ctypes.c_ulong, ctypes.c_int]
    _poll.restype = ctypes.c_int
except (AttributeError, OSError):  # no poll() in this process's C library: select, which releases the GIL
    _poll = None


class ReadyCheck:
    """Whether one descriptor has something to read (or hung up), without releasing the GIL.

    ``ReadyCheck(fd)()`` is True when a read would not block: data, the peer's hang-up or an error (which the
    read reports). Raises :class:`OSError` for a descriptor that is not open (closed under the caller).
    """

    __slots__ = ("_fd", "_pfd", "_ref")

    def __init__(self, fd: int) -> None:
        if not isinstance(fd, int) or fd < 0:
            raise InvalidValue(f"fd: an open file descriptor, got {fd!r}")
        self._fd = fd
        self._pfd = _PollFd(fd, select.POLLIN | select.POLLPRI, 0)
        self._ref = ctypes.byref(self._pfd)

    def __call__(self) -> bool:
        if _poll is None:
            return bool(select.select([self._fd], (), (), 0)[0])
        n = _poll(self._ref, 1, 0)
        if n < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:  # a signal came: the next turn looks again
                return False
            raise OSError(err, f"poll on descriptor {self._fd} failed: {os.strerror(err)}")
        if n and self._pfd.revents & select.POLLNVAL:
            raise OSError(errno.EBADF, f"descriptor {self._fd} is not open")
        return bool(n and self._pfd.revents & _READY)

"""Receive futures whose waiters poll briefly before sleeping: the 4 KiB hand-off's last step.

A thread asleep in ``Future.result()`` is woken by a futex after the event thread settles the future,
and then needs the GIL: 47 us of the 4 KiB hand-off on the H200 host (2026-11-30 trace, "future done").
:class:`SpinFuture` is a :class:`concurrent.futures.Future` (callbacks, exceptions, timeouts and
cancellation unchanged) whose ``result()`` / ``exception()``:

* poll ``done()`` for up to :func:`result_spin_seconds` (a few microseconds' sleep between polls, GIL
  released, see :meth:`SpinFuture._spin`), for a receive that ends within that time;
* else sleep until the receive is matched (the event thread sets the future running: it wakes the
  waiters, so their wake-up overlaps the copy) or done, then poll again up to the same budget;
* else sleep as a plain future does.

And, where waiters poll, the thread that settled it hands them the GIL (:meth:`SpinFuture.handoff`): it
waits, GIL released, until a waiter came out (bounded by :data:`HANDOFF_S`; at once when nobody waits).
The event thread does so right after sending its next poll (which carries the completions), before it
waits for the answer: with ``KVSTRATA_DEVOBJ_EVENT_SPIN_US`` that wait spins, and CPython lets a thread
that drops the GIL take it straight back, so a woken waiter could otherwise wait out the whole spin.

Only on hosts with at least :data:`SPIN_MIN_CPUS` CPUs (a polling thread holds a core, and on a 2-core
machine shared with the worker and the peer, the hand-off's extra thread switches cost more than they
save); ``KVSTRATA_DEVOBJ_RESULT_SPIN_US`` overrides (0: never poll and no hand-off, exactly a plain future).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED, PENDING
from typing import Any

from kvstrata.errors import DeadlockError, InvalidValue

log = logging.getLogger(__name__)

#: CPUs this process may run on at or above which a waiter polls before sleeping
SPIN_MIN_CPUS = 8
#: default polling budget (microseconds) per phase: a matched 4 KiB copy settles within ~100 us of its match
RESULT_SPIN_US = 300.0
#: longest a settling thread waits for a waiter to come out (seconds): a woken thread runs within tens of us
HANDOFF_S = 200e-6


def spin_seconds(env_name: str, default_us: float, *, min_cpus: int | None = SPIN_MIN_CPUS) -> float:
    """A busy-poll budget in seconds: the environment variable ``env_name`` (microseconds, clamped to
    0..100,000) where set, else ``default_us`` on hosts with at least ``min_cpus`` CPUs (None: on any host)
    and 0 on smaller ones (a polling thread holds a core)."""
    env = os.environ.get(env_name, "").strip()
    if env:
        try:
            return min(max(float(env), 0.0), 1e5) * 1e-6
        except ValueError:
            log.warning("%s=%r is not a number of microseconds; ignored", env_name, env)
    if min_cpus is not None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        if cpus < min_cpus:
            return 0.0
    return default_us * 1e-6


def result_spin_seconds() -> float:
    """Seconds a receive future's waiter polls per phase (see the module docstring)."""
    return spin_seconds("KVSTRATA_DEVOBJ_RESULT_SPIN_US", RESULT_SPIN_US)


#: sleep between polls (seconds) and the thread's timer slack meanwhile (ns)
SPIN_PAUSE_S = 4e-6
SPIN_SLACK_NS = 1000


def _prctl():
    """libc's ``prctl`` (Linux), or None."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.prctl
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        return fn
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl() if os.name == "posix" else None
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30


def _slack_set(ns: int) -> int | None:
    """Set this thread's timer slack to ``ns``; the previous one, or None where it cannot be set."""
    if _PRCTL is None:
        return None
    old = _PRCTL(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    if old <= 0 or _PRCTL(_PR_SET_TIMERSLACK, ns, 0, 0, 0) != 0:
        return None
    return old


def _pause() -> None:
    time.sleep(SPIN_PAUSE_S) if _PRCTL is not None else os.sched_yield()


_OVER = frozenset((FINISHED, CANCELLED, CANCELLED_AND_NOTIFIED))
_SPIN = [result_spin_seconds()]  # read once per process (tests set it through set_result_spin)


def current_result_spin() -> float:
    """This process's polling budget per phase (seconds; 0: waiters never poll)."""
    return _SPIN[0]


def set_result_spin(seconds: float) -> float:
    """Set this process's polling budget (seconds, >= 0); returns the previous one. For tests and benchmarks."""
    if seconds < 0:
        raise InvalidValue(f"seconds: expected >= 0, got {seconds!r}")
    old, _SPIN[0] = _SPIN[0], float(seconds)
    return old


def _usual(timeout: Any) -> bool:
    """Whether ``timeout`` is one this module's waits handle (None or a number of seconds a clock can reach)."""
    return timeout is None or (
        (type(timeout) is float or type(timeout) is int) and 0 <= timeout <= threading.TIMEOUT_MAX
    )


class SpinFuture(Future):
    """A :class:`~concurrent.futures.Future` whose waiters poll briefly before sleeping (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._watchers = 0  # waiters asleep until the future runs (see set_running_or_notify_cancel)
        self._inside = 0  # threads in result() / exception()
        self._out: threading.Event | None = None  # set when one of them came out (see handoff)
        #: ``lead(future, timeout) -> timeout left``: lets a waiter read the match itself while the receive
        #: waits in the broker (kvstrata.devobj.lead); set by the client, None where it cannot
        self._lead: Any = None
        #: the thread that settles this future (its client's event thread), which must never wait for it
        self._settler: threading.Thread | None = None

    def set_running_or_notify_cancel(self) -> bool:
        running = super().set_running_or_notify_cancel()
        if running and self._watchers:  # matched: wake the waiters now, their wake-up overlaps the copy
            with self._condition:
                self._condition.notify_all()
        return running

    def result(self, timeout: float | None = None) -> Any:
        if self._state == PENDING and self._settler is threading.current_thread():
            self._refuse_deadlock()
        if not _usual(timeout):  # NaN, negative, beyond the clock: whatever a plain future does with it
            return super().result(timeout)
        if self._lead is not None and self._state == PENDING:
            timeout = self._lead(self, timeout)
        if self._state == FINISHED or _SPIN[0] <= 0.0:  # not polling: a plain future, no hand-off either
            return super().result(timeout)
        self._enter()
        try:
            return super().result(self._await(timeout))
        finally:
            self._leave()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._state == PENDING and self._settler is threading.current_thread():
            self._refuse_deadlock()
        if not _usual(timeout):  # NaN, negative, beyond the clock: whatever a plain future does with it
            return super().exception(timeout)
        if self._lead is not None and self._state == PENDING:
            timeout = self._lead(self, timeout)
        if self._state == FINISHED or _SPIN[0] <= 0.0:  # not polling: a plain future, no hand-off either
            return super().exception(timeout)
        self._enter()
        try:
            return super().exception(self._await(timeout))
        finally:
            self._leave()

    def _refuse_deadlock(self) -> None:
        raise DeadlockError(
            "a device-object receive's result() was awaited on its client's event thread (in a future's callback?), "
            "which is the thread that would deliver it: wait for it in another thread"
        )

    def handoff(self, timeout: float = HANDOFF_S) -> bool:
        """For the thread that just settled this future: wait (GIL released) up to ``timeout`` seconds until
        a thread waiting in ``result()`` / ``exception()`` came out; True when one did or none waits."""
        out = self._out
        if out is None or not self._inside:
            return True
        return out.wait(timeout)

    def _enter(self) -> None:
        with self._condition:
            self._inside += 1
            if self._out is None:
                self._out = threading.Event()

    def _leave(self) -> None:
        with self._condition:
            self._inside -= 1
        out = self._out
        if out is not None:
            out.set()

    def _await(self, timeout: float | None) -> float | None:
        """Poll and wait as the module docstring says; the timeout left for the plain wait that follows
        (which returns at once when the future is done, or raises its TimeoutError when time is up)."""
        budget = _SPIN[0]
        if budget <= 0.0 or self._state == FINISHED or (timeout is not None and timeout <= 0):
            return timeout
        now = time.monotonic()
        end = None if timeout is None else now + timeout
        if self._spin(now, budget, end):
            return self._left(end)
        if self._state == PENDING:  # not matched yet: sleep until it is (or it ends, or time is up)
            with self._condition:
                self._watchers += 1
                try:
                    while self._state == PENDING:
                        left = self._left(end)
                        if left == 0.0:
                            return 0.0
                        self._condition.wait(left)
                finally:
                    self._watchers -= 1
        self._spin(time.monotonic(), budget, end)  # matched now: the copy ends soon
        return self._left(end)

    def _spin(self, now: float, budget: float, end: float | None) -> bool:
        """Poll until done, ``budget`` seconds or ``end``; True when done.

        Between polls the thread sleeps a few microseconds with the GIL released (timer slack lowered for
        the while, else a short sleep lasts 50 us or more): polls back to back with ``os.sched_yield`` would
        hold the GIL a large share of the time, and each time the event thread, which does the receive's
        work, found it taken, it would sleep on the GIL's condition variable and pay a thread wake-up.
        """
        stop = now + budget if end is None else min(now + budget, end)
        slack = _slack_set(SPIN_SLACK_NS)
        try:
            while self._state not in _OVER:
                if time.monotonic() >= stop:
                    return False
                _pause()
            return True
        finally:
            if slack is not None:
                _slack_set(slack)

    @staticmethod
    def _left(end: float | None) -> float | None:
        return None if end is None else max(0.0, end - time.monotonic())


__all__ = [
    "HANDOFF_S",
    "RESULT_SPIN_US",
    "SPIN_MIN_CPUS",
    "SpinFuture",
    "current_result_spin",
    "result_spin_seconds",
    "set_result_spin",
]

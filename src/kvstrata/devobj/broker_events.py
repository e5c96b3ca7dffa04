"""The device-object broker's event delivery: per-client event queues, the long poll
(``wait_events``), parked polls answered by whoever pushes the next event, and the timer thread that
answers parked polls and waiters at their deadlines.

:class:`EventQueues` is part of :class:`~kvstrata.devobj.broker.DeviceBroker` (whose lock, conditions and
tables it uses). Events pushed under the lock to a parked poll are answered after the lock is released
(:func:`_deliver`), so a ``deliver`` callback never runs with the broker locked.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvstrata.devobj.broker_args import check_seconds

log = logging.getLogger(__name__)


class EventQueues:
    """The event-delivery methods of :class:`~kvstrata.devobj.broker.DeviceBroker` (``_push`` and the
    ``_locked`` ones run under its lock)."""

    def park_poll(self, client: str, timeout: float | None, deliver) -> dict[str, Any] | None:
        """``wait_events`` for a host that can answer later: the events at once if there are any (the
        reply), else ``None``, and ``deliver(reply)`` is called exactly once later: by the thread that
        pushes the client's next event (no thread wakes up to carry it), with ``{"events": []}`` at
        ``timeout``, or ``{"events": [], "closed": True}`` when the client goes away. ``deliver`` runs
        outside the broker's lock and must not raise. A ``timeout`` of
        :data:`~kvstrata.server.protocol.FOREVER_S` or more waits as None does.
        """
        timeout = check_seconds(timeout, "timeout")
        reply = None
        with self._lock:
            self._expire_locked()
            out = self._take_due_locked()  # others' timeouts just pushed
            q = self._events.get(client)
            if q is None:
                reply = {"events": [], "closed": True}
            elif q or (timeout is not None and timeout <= 0):
                reply = {"events": list(q)}
                q.clear()
            else:
                old = self._parked.pop(client, None)
                if old is not None:  # a client polls once at a time; a second poll ends the first (empty)
                    out.append((old[0], {"events": []}))
                end = None if timeout is None else self._clock() + timeout
                self._parked[client] = (deliver, end)
                self._plan_timer_locked(end)
        _deliver(out)
        return reply

    def op_wait_events(self, client: str, args: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        """Long poll: this client's events, waiting up to ``timeout`` for the first one (FOREVER_S or more: forever)."""
        timeout = check_seconds(args.get("timeout", timeout), "a.timeout")
        end = None if timeout is None else self._clock() + timeout
        with self._lock:
            while True:
                self._expire_locked()
                if self._due:  # timeouts for parked polls: the timer thread answers them
                    self._timer_cond.notify()
                q = self._events.get(client)
                if q is None:
                    return {"events": [], "closed": True}
                if q:
                    events = list(q)
                    q.clear()
                    return {"events": events}
                now = self._clock()
                if end is not None and now >= end:
                    return {"events": []}
                waits = [x - now for x in (end, self._deadlines[0][0] if self._deadlines else None) if x is not None]
                self._cond.wait(_bounded(max(0.0, min(waits)) + 1e-4) if waits else None)

    def _push(self, client: str, event: dict[str, Any]) -> None:
        q = self._events.get(client)
        if q is not None:
            q.append(event)
            if client in self._parked:
                self._due.add(client)  # answered by _take_due_locked at the end of this locked section
            else:
                self._cond.notify_all()  # an in-process wait_events

    def _take_due_locked(self) -> list[tuple[Any, dict[str, Any]]]:
        """Answers for parked polls whose clients have events: (deliver, reply), to call outside the lock."""
        out = []
        for client in self._due:
            parked = self._parked.pop(client, None)
            q = self._events.get(client)
            if parked is not None and q:
                out.append((parked[0], {"events": list(q)}))
                q.clear()
        self._due.clear()
        return out

    def _plan_timer_locked(self, when: float | None) -> None:
        """Make the timer thread (parked polls' and waiters' deadlines) wake by ``when`` at the latest."""
        if self._timer is None:
            self._timer = threading.Thread(target=self._timer_main, name="kvstrata-devobj-timer", daemon=True)
            self._timer_wake = when
            self._timer.start()
        elif when is not None and (self._timer_wake is None or when < self._timer_wake):
            self._timer_cond.notify()

    def _timer_main(self) -> None:
        """Answers parked polls at their deadline and times out waiters while polls are parked.

        Should a round fail anyway, the thread logs it and stops with ``_timer`` cleared, so the next parked poll
        starts another one: a thread that died with ``_timer`` still set would leave every later parked poll and
        waiter of this worker without its timeout.
        """
        while True:
            try:
                with self._lock:
                    if not self._parked:
                        self._timer = None
                        return
                    now = self._clock()
                    self._expire_locked()
                    out = self._take_due_locked()
                    for client, (deliver, end) in list(self._parked.items()):
                        if end is not None and end <= now:
                            del self._parked[client]
                            out.append((deliver, {"events": []}))
                    if not out:
                        ends = [e for _, e in self._parked.values() if e is not None]
                        if self._deadlines:
                            ends.append(self._deadlines[0][0])
                        self._timer_wake = min(ends) if ends else None
                        self._timer_cond.wait(None if self._timer_wake is None else _bounded(self._timer_wake - now))
                        self._timer_wake = None
                _deliver(out)
            except Exception:
                log.exception("device objects: the broker's timer thread failed; the next parked poll starts another")
                with self._lock:
                    if self._timer is threading.current_thread():
                        self._timer = None
                        self._timer_wake = None
                return


def _bounded(seconds: float) -> float:
    """``seconds`` as a condition wait takes it: at least 0, at most ``threading.TIMEOUT_MAX`` (above it the wait
    raises OverflowError; a deadline that far off is woken for early, harmlessly, and planned again)."""
    return min(max(0.0, seconds), threading.TIMEOUT_MAX)


def _deliver(out: list[tuple[Any, dict[str, Any]]]) -> None:
    for deliver, reply in out:
        try:
            deliver(reply)
        except Exception:  # against its contract: the other answers still go out
            log.exception("device objects: delivering a parked poll's answer failed")


__all__ = ["EventQueues"]

"""The device-object client's event thread: requests to the broker, the long poll for events, and their
dispatch (matches, completions, timeouts, releases, chain steps, invalidations, peers gone).

:class:`EventThread` is part of :class:`~kvstrata.devobj.api.DeviceObjects` (whose state it uses: the
broker link, lock and tables). One thread per client long-polls the broker (``wait_events``); each poll
carries the completions of the receives finished since the last (see
:class:`~kvstrata.devobj.receive.CopyReceiver`), and every other request carries those the broker may not
have read yet (:meth:`EventThread._call`). Whatever ends the thread unexpectedly fails every pending future.

Where the link's event connection can be waited on (a worker's), a thread waiting in a receive future's
``result()`` reads it instead while its receive waits in the broker (:meth:`EventThread._lead`, see
:mod:`kvstrata.devobj.lead`): it copies its own match, with no wake-up of this thread or by it on the way.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvstrata import errors
from kvstrata.devobj._core import settle as _settle
from kvstrata.devobj.debug import brief, trace
from kvstrata.devobj.link import error_from

log = logging.getLogger(__name__)

#: longest wait for the broker's answer to a goodbye (a frozen worker must not hold a close() up)
GOODBYE_S = 2.0

#: seconds an event that arrived before its receive, transfer or object was known here is kept for it:
#: such a race lasts milliseconds; an event for something already gone (a transfer failed here first)
#: would otherwise be kept for the client's whole life
EARLY_KEEP_S = 120.0
_clock = time.monotonic  # (tests move it)


class EventThread:
    """The event-thread methods of :class:`~kvstrata.devobj.api.DeviceObjects`."""

    def _call(self, op: str, args: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """A request to the broker, carrying the receives finished here that it may not know of yet."""
        if self._flush_lock.locked():  # a one-way send of completions in progress: this request goes after it
            with self._flush_lock:
                pass
        done = self._take_done() if (self._done_items or self._unacked) else []
        if done:  # a later request must see every receive reported done: it carries those not yet known read
            args = dict(args, done=done)
        r = self.link.call(op, args, timeout)
        self._acked(done)
        return r

    def _poll_main(self) -> None:
        """The event thread: whatever ends it unexpectedly fails every pending future (and is logged)."""
        try:
            self._thread_init()
            self._poll()
        except BaseException as exc:
            log.exception("devobj: the event thread of %s died", getattr(self.link, "client_id", "?"))
            # Nothing reads this client's events any more: later calls are refused (_check_open), and the broker
            # is told to forget it, which hands back what it had matched here (its publishers are not left waiting).
            self._poll_over = True
            self._goodbye()
            self._fail_all(errors.ServerError(f"device-object event thread died: {type(exc).__name__}: {exc}"))

    def _poll(self) -> None:
        if self._role is not None:
            self._poll_events()
            return
        while not self._closed:  # a link without a pollable event connection (in process, tests)
            args: dict[str, Any] = {"timeout": self.config.poll_seconds}
            done = self._take_done() if (self._done_items or self._unacked) else []
            if done:  # the receives this thread just finished: no message of their own
                args["done"] = done
            if not self._hook:
                self._poll_sent()
            try:
                r = self.link.call("wait_events", args, self.config.poll_seconds + 30)
            except Exception as exc:
                if not self._closed:
                    log.error("devobj: lost the broker: %s", exc)
                    self._fail_all(errors.ConnectionLost(f"device-object broker unreachable: {exc}"))
                return
            self._acked(done)
            if r.get("closed"):
                self._fail_all(self._forgotten())
                return
            self._dispatch_all(r["events"])

    def _dispatch_all(self, events: list[dict[str, Any]]) -> None:
        for i, ev in enumerate(events):
            trace(f"event {ev.get('type')}")
            if log.isEnabledFor(logging.DEBUG):
                log.debug("devobj: event %s", brief(ev))
            try:
                self._dispatch(ev)
            except Exception:  # one bad event must not stop the others
                log.exception("devobj: event %s", ev.get("type"))
            except BaseException:  # e.g. Ctrl-C in a leading caller's thread: the next holder dispatches the rest
                self._leftover.extend(events[i + 1 :])
                raise

    # -- the event connection read by whoever holds the role (see kvstrata.devobj.lead) ---------------
    def _poll_events(self) -> None:
        """The event thread's loop where the link's event connection can be waited on: it holds the role
        whenever no waiter takes it (:meth:`_lead`), one event answer at a time."""
        role = self._role
        stop = lambda: self._closed or self._poll_over
        while not stop():
            if not role.take_for_events(stop):
                return
            try:
                if not self._poll_step(self.link.event_spin, None):
                    return
            finally:
                role.give_back()

    def _poll_step(self, spin: float, timeout: float | None) -> bool:
        """As the role's holder: send a poll if none is out, wait for its answer up to ``timeout`` (or a wake
        of the role) and dispatch its events; False when the event connection is over for good."""
        if self._leftover:  # left by a holder interrupted mid-answer (see _dispatch_all)
            left, self._leftover = self._leftover, []
            self._dispatch_all(left)
        try:
            if self._poll_carried is None:
                self._send_poll()
            readable = self._role.wait_readable(timeout, spin, self.link.poll_buffered)
            if self._role.offers_ready:  # before the connection's events: an offer comes ahead of its match
                trace("offers readable")
                self._take_offers()
            if not readable:
                if self._done_items:  # woken to send receives finished on another thread (_notify_done)
                    self._flush_done()
                return True
            trace("events readable")
            r = self.link.recv_poll()
        except Exception as exc:
            self._poll_over = True
            if not self._closed:
                log.error("devobj: lost the broker: %s", exc)
                self._fail_all(errors.ConnectionLost(f"device-object broker unreachable: {exc}"))
            return False
        done, self._poll_carried = self._poll_carried, None
        self._acked(done)
        if r.get("closed"):
            self._poll_over = True
            self._fail_all(self._forgotten())
            return False
        self._dispatch_all(r["events"])
        return True

    def _send_poll(self) -> None:
        """As the role's holder, with no poll out: send one, carrying the receives finished since the last."""
        args: dict[str, Any] = {"timeout": self.config.poll_seconds}
        done = self._take_done() if (self._done_items or self._unacked) else []
        if done:  # the receives just finished: no message of their own
            args["done"] = done
        self.link.send_poll(args)
        self._poll_carried = done
        if threading.current_thread() is self._poller:
            self._poll_sent()

    def _lead(self, future: Any, timeout: float | None) -> float | None:
        """Called by ``future.result()`` / ``.exception()`` while the receive waits in the broker: this thread
        reads the event connection itself until the future is matched or done, or ``timeout`` passes (see
        :mod:`kvstrata.devobj.lead`); returns the timeout left. Returns at once where it cannot lead."""
        role = self._role
        if role is None or self._closed or self._poll_over or getattr(self._helper, "on", False):
            return timeout
        end = None if timeout is None else time.monotonic() + timeout
        if not role.take_for_waiter(end):
            return timeout if end is None else max(0.0, end - time.monotonic())
        try:
            with self._device_guard():
                while future._state == "PENDING" and not (self._closed or self._poll_over):
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    if not self._poll_step(self._lead_spin, left):
                        break
        finally:
            # The event thread takes over, and sends the next poll with this receive's completion: off the
            # caller's path (sending it here cost the caller 30-50 us on a 2-core host; the publisher's
            # release then waits until the event thread gets the GIL, +80-300 us there).
            role.give_back()
        return None if end is None else max(0.0, end - time.monotonic())

    def _is_event_thread(self) -> bool:
        """Whether this thread reads events now: the event thread, or a waiter leading (see _lead)."""
        me = threading.current_thread()
        return me is self._poller or (self._role is not None and self._role.leader() is me)

    def _park(self, key: tuple[str, int], ev: dict[str, Any]) -> None:
        """Keep ``ev`` for the receive, transfer or object ``key`` not known here yet (under the lock); drop
        what was parked more than :data:`EARLY_KEEP_S` ago (nothing came for it)."""
        now = _clock()
        parked = self._early_at
        while parked:
            old, when = next(iter(parked.items()))
            if when >= now - EARLY_KEEP_S:
                break
            del parked[old]
            if self._early.pop(old, None) is not None:
                log.debug("devobj: dropped events for %s:%s, which never came", *old)
        if key not in self._early:
            parked[key] = now
        self._early.setdefault(key, []).append(ev)

    def _take_early(self, key: tuple[str, int]) -> list[dict[str, Any]]:
        """The events parked for ``key`` (none: an empty list), forgotten here (under the lock). Every consumer takes
        them through this, so ``_early_at`` holds exactly ``_early``'s keys: one taken and parked again later is
        timed from then, and none lingers behind a taken one until :data:`EARLY_KEEP_S` passes."""
        events = self._early.pop(key, None)
        if events is None:
            return []
        self._early_at.pop(key, None)
        return events

    def _dispatch(self, ev: dict[str, Any]) -> None:
        kind = ev["type"]
        if kind == "matched" or (kind in ("timeout", "error") and "tid" not in ev):
            with self._lock:
                want = self._wants.pop(ev["wid"], None)
                cancelled = want is None and ev["wid"] in self._cancelled
                self._cancelled.discard(ev["wid"])
                if want is None and not cancelled:
                    self._park(("wid", ev["wid"]), ev)
                    return
            if cancelled:
                if kind == "matched":  # withdrawn by its caller after the broker matched it: hand it back
                    self._call("complete", {"tid": ev["transfer"]["tid"], "ok": False, "error": "receive cancelled"})
                return
            if kind == "matched":
                self._start(ev["transfer"], want)
            else:
                self._end_offer(want)  # no copy may still write into the caller's tensors once it fails
                _settle(want.future, error_from(ev.get("error"), ev.get("message", "")))
        elif kind == "error":  # a transfer in flight broke (its source went away)
            with self._lock:
                want = self._inflight.pop(ev["tid"], None)
            if want is not None:
                self._bcast_done(want, error_from(ev.get("error"), ev.get("message", "")))
        elif kind in ("chain_pred", "member_ready", "transfer_done"):
            with self._lock:
                want = self._inflight.get(ev["tid"])
                if want is None:
                    self._park(("tid", ev["tid"]), ev)
                    return
                if kind == "transfer_done":
                    self._inflight.pop(ev["tid"], None)
            if kind == "transfer_done":
                self._bcast_done(want, None)
            else:
                self._on_chain_event(want, ev)
        elif kind in ("released", "failed"):
            with self._lock:
                if ev["obj"] not in self._owned:
                    self._park(("obj", ev["obj"]), ev)
                    return
            if kind == "failed":
                exc = errors.ServerError(f"broadcast of {ev['key']!r} failed: {ev.get('message')}")
            elif ev.get("reason") == "deleted":
                exc = errors.KeyNotFound(f"device object {ev['key']!r} was deleted before anyone received it")
            elif ev.get("reason") == "exists":  # its offer was not taken, and the key has another object
                exc = errors.KeyExists(f"device object {ev['key']!r} already exists")
            else:
                exc = None
            self._release(ev["obj"], exc)
        elif kind == "offer_fate":
            self._offer_fate(ev)
        elif kind == "send":
            self._nccl_send(ev)
        elif kind == "invalidate":
            with self._lock:
                kept = self._records.get(ev["key"])
                if kept is not None and kept[1]["obj"] == ev["obj"]:
                    del self._records[ev["key"]]
                entry = self._read.pop(ev["obj"], None)
            if entry is not None and self._imports is not None:
                self._imports.drop_handles(entry[0], entry[1], obj=ev["obj"])
        elif kind == "pair_reset":
            if self._nccl is not None:
                self._nccl.reset(ev["src"], ev["dst"])
        elif kind == "peer_gone":
            with self._lock:
                for k in [k for k, e in self._records.items() if e[1]["owner"] == ev["client"]]:
                    del self._records[k]
                for obj in [o for o, e in self._read.items() if e[0] == ev["client"]]:
                    del self._read[obj]  # its imports go with drop_peer below
            if self._nccl is not None:
                self._nccl.peer_gone(ev["client"])
            if self._imports is not None:
                self._imports.drop_peer(ev["client"])

    def _forgotten(self) -> BaseException:
        """What pending calls fail with once the broker forgot this client: closed here, or dropped there."""
        if self._closed:
            return errors.ClosedError("device-object client closed")
        return errors.ConnectionLost("the worker dropped this device-object client (shutting down?)")

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            wants = list(self._wants.values()) + list(self._inflight.values())
            owned = list(self._owned.values())
            self._wants.clear()
            self._inflight.clear()
            self._owned.clear()
        for w in wants:
            self._end_offer(w)
            self._bcast_done(w, exc)  # settles; a broadcast receiver's export is released too
        for o in owned:
            self._free(o)
            if o.future is not None and o.mode != "mset":
                _settle(o.future, exc)
        if self._role is not None:  # a leading waiter's future is settled: it stops reading events
            self._role.wake()


__all__ = ["EventThread"]

"""One worker thread that polls the request lanes of every client while several clients are connected.

A lone client's connection thread busy-polls its own lane (:mod:`kvstrata.server.lane`,
:meth:`kvstrata.server.session.Session._next`): its small writes take ~20 us. With several clients the
connection threads cannot each poll (they would pass the GIL among themselves between any two requests), and
until now none did: every request woke a sleeping thread in the worker and another in the client, and the
code after each wake-up runs several times slower than when hot on these VMs. Measured on the 2 x H200 host
(32 CPUs, ``tools/probe_worker_clients.py``, 4 KiB ``set``, clients started together): 52-54k ops/s from one
client, but 21-24k from two, 15-18k from eight and 11k from 24 (p50 1.4 ms). With the poller's first version
(which yielded the GIL every turn, see :meth:`LanePoller._spell`): 79k from two, 73-80k from eight, 47-57k
from 24.

The poller is one thread for all of them. While lane requests come, it checks every polled client's lane in
turn (a memory load each) and serves what it finds on its own thread; after ``spin`` seconds without one it
lowers the lanes' polling flags (clients then use their sockets) and sleeps until :meth:`LanePoller.kick`:
a connection thread that served, over the socket, a request the client would have sent through its lane
had it seen the flag up. So it polls while small requests flow and costs nothing when they stop.

Only lane requests (:data:`kvstrata.server.lane.LANE_OPS`: small writes, seals, pings) are served here;
everything else stays on the connection's own thread, which blocks on its socket meanwhile. Each lane's lock
(``Session.lane_lock``) makes a request taken and answered exactly once, by whichever thread sees it first,
and keeps a departing client's lane from being closed under the poller (:meth:`LanePoller.detach`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.server.session import Session

log = logging.getLogger("kvstrata.worker")


class LanePoller:
    """The worker's lane-polling thread. ``on`` says whether it serves now (the worker decides:
    :meth:`kvstrata.server.worker.Worker._update_spin`); sessions with a lane are attached while connected."""

    def __init__(self, spin: float) -> None:
        #: seconds without a lane request after which a polling spell ends
        self.spin = spin
        self._sessions: tuple[Session, ...] = ()
        self._attach_lock = threading.Lock()  # between connection threads attaching and detaching
        self._turns = 0  # turns begun (detach waits for the poller to begin a turn on the new sessions)
        self._wake = threading.Event()
        self._on = False
        #: whether a polling spell is on (its flags up): a connection thread leaves the flags to it meanwhile
        self.spelling = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        #: requests served, polling spells begun and kicks taken while serving (the worker's stats)
        self.served = 0
        self.spells = 0
        self.kicks = 0

    @property
    def on(self) -> bool:
        return self._on

    def start(self) -> LanePoller:
        self._thread = threading.Thread(target=self._main, name="kvstrata-lane-poller", daemon=True)
        self._thread.start()
        return self

    def set_on(self, on: bool) -> None:
        """Serve lanes (from the next kick) or stop serving them (the current spell ends within a turn)."""
        self._on = on

    def attach(self, session: Session) -> None:
        """Poll ``session``'s lane from the next spell on (``session.lane`` must be open)."""
        with self._attach_lock:
            self._sessions = (*self._sessions, session)

    def detach(self, session: Session) -> None:
        """Stop polling ``session``'s lane; on return the poller no longer touches it (so it may be closed)."""
        with self._attach_lock:
            self._sessions = tuple(s for s in self._sessions if s is not session)
        # A turn that read the old tuple may still touch the lane: wait until two more began (each reads the
        # tuple anew), or the poller is between spells. No lock the poller holds: it would keep taking it first.
        turns = self._turns
        while self.spelling and self._turns - turns < 2:
            time.sleep(50e-6)

    def kick(self) -> None:
        """Begin a polling spell if serving and asleep (a client just found its lane unpolled)."""
        if self._on:
            self.kicks += 1
            self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._on = False
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    # the thread ------------------------------------------------------------------------------------
    def _main(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopped:
                return
            if not self._on:
                continue
            self.spells += 1
            self.spelling = True
            try:
                self._spell()
            except Exception:  # a bug: say so, and keep the worker serving (the clients fall back to sockets)
                log.exception("lane poller failed; clients use their sockets until the next spell")
                self._flags(False, self._sessions)
            finally:
                self.spelling = False

    def _spell(self) -> None:
        """Poll every attached lane until none brought a request for ``spin`` seconds, or serving stops.

        The loop never gives up the GIL of its own accord. A first version yielded the CPU every turn
        (``sched_yield``, GIL released and retaken): but each retake also resets CPython's forced switch for
        every thread waiting for the GIL, and on an idle many-core host the poller retakes it before a woken
        thread runs, so that thread waited for as long as the spell lasted (measured on the 32-CPU H200 host
        beside 8 writing clients: a socket request waited up to 2.5 s). Held without a break, the GIL goes to
        a waiting thread after the switch interval, which a worker process sets to
        :data:`kvstrata.server.gil_spin.GIL_SWITCH_S`.
        (A spell that slept ~60 us every 500 us instead bounded the wait too, but cost its clients 10-40% of
        their rate on the 2-CPU VM.)
        """
        clock, kicked = time.perf_counter, self._wake.is_set
        sessions: tuple[Session, ...] = ()
        end = clock() + self.spin
        while self._on:
            served = False
            self._turns += 1
            # Raise the flags of sessions attached since, and all of them after a kick: a client found its
            # flag down (a connection thread that stopped polling lowered it as this spell began).
            if self._sessions is not sessions or kicked():
                self._wake.clear()
                sessions = self._sessions
                self._flags(True, sessions)
            for s in sessions:
                lane = s.lane
                if lane is not None and lane.pending() and self._serve(s):
                    served = True
            now = clock()
            if served:
                end = now + self.spin
            elif now >= end:
                break
        self._turns += 1
        sessions = self._sessions
        self._flags(False, sessions)
        for s in sessions:  # handed over as the flag went down: served now, not at the client's timeout
            lane = s.lane
            if lane is not None and lane.pending():
                self._serve(s)

    @staticmethod
    def _flags(on: bool, sessions: tuple[Session, ...]) -> None:
        for s in sessions:
            with s.lane_lock:
                if s.lane is not None:
                    s.lane.set_polling(on)

    def _serve(self, s: Session) -> bool:
        """Serve ``s``'s pending lane request, if still pending under its lock (its own thread may have)."""
        with s.lane_lock:
            lane = s.lane
            if lane is None or not lane.pending():
                return False
            try:
                s.answer_lane(lane)
            except Exception as exc:  # bytes that are no request: the client broke the protocol
                log.warning("client %s sent a bad lane request (%s); disconnecting it", s.name, exc)
                s.conn.close()  # its connection thread wakes, ends the session and cleans up
                return False
        self.served += 1
        return True

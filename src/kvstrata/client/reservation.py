"""A client's write reservation: where its next ``mset_d2h`` objects go, known without asking the worker.

The worker holds, for this client, an extent ``[head, end)`` of one shared segment
(:mod:`kvstrata.store.reservations`); this object mirrors it. A device call that holds it lays its stages'
objects side by side from ``head`` (no request), queues their copies at once, and commits each stage once
its bytes landed; the worker moves its own head as it commits, and each commit's reply says where it is.
After a call the client takes the worker's word (so a call that failed between carving and committing
just leaves those bytes to the next call), and asks for a new reservation, without waiting, when what is
left would not hold a call like this one; the next call reads that reply first. A call that commits ahead of
its copies asks as soon as that commit is answered, while its last bytes still move
(:meth:`WriteReservation.renew`), not after them.

One call at a time holds it, and a concurrent call takes the create path, with one exception: a *chain* of
``async_mset_d2h`` calls. Those are issued one after another by the client's issuing thread and finished
(committed) in the same order by its completion thread, so call N+1 may carve on from where call N's carving
ended while N's commits are still to be sent: the worker sees the commits in carving order, as one call's
would be. Only the chain's last holder asks for a new reservation (which frees the old one's rest, where a
later call's copies might still be landing), so a call that finds too little room waits for the chain to end
(:meth:`WriteReservation.take` with ``chain_bytes``). A chained call whose commits leave the worker's head
elsewhere than its carving ended (a failed call) marks the reservation lost: no call chains on, and the
last holder forgets it (the next reservation replaces it) instead of trusting the local head.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvstrata.client._shared import Loc
from kvstrata.errors import InvalidValue
from kvstrata.store.allocator import ALIGNMENT

log = logging.getLogger(__name__)

#: default cap on one reservation (``kvstrata.connect(reserve_bytes=...)``; 0 turns reservations off)
RESERVE_BYTES = 256 << 20
#: a reservation asked for holds at least this much (or :data:`CALLS_AHEAD` calls like the last one, if more)
FLOOR_BYTES = 64 << 20
#: calls like the last one a new reservation should hold (up to the cap): the call after it reads the reserve's reply
#: before its first copy (~10 us on the development machine after a request), once in this many calls of a steady
#: writer. Four (tried in session 30) put a 64 x 1 MiB writer's reservation at 256 MiB, a whole segment of the
#: worker's (``StoreConfig.segment_bytes``), and bench store's rows, whose timed writes never read a reply, gained
#: nothing (its cold read after a rewrite read 0.829-0.900 in six runs, 0.820-0.916 with two): two stays.
CALLS_AHEAD = 2
#: the calls of a chain of async calls (module docstring) a reservation should hold at its start
CHAIN_CALLS = 4
#: seconds before asking again after the worker refused a reservation (memory full)
RETRY_SECONDS = 1.0
_MASK = ALIGNMENT - 1
_new = tuple.__new__


def rounded(size: int) -> int:
    """The bytes an object of ``size`` takes in a reservation (the worker rounds the same way)."""
    return (size + _MASK) & ~_MASK


class WriteReservation:
    """This client's reservation as last heard from the worker, and who holds it: one call, or a chain of
    async calls (module docstring)."""

    def __init__(self, limit: int = RESERVE_BYTES) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise InvalidValue(f"reserve_bytes: must be an int >= 0, got {limit!r}")
        self.limit = limit
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._holders = 0  # calls holding it: one, or more along a chain
        self._chained = False  # the holders are a chain of async calls
        self._lost = False  # a chained call left the worker's head elsewhere: nobody chains on, the last forgets it
        self._pending: Any = None  # a reserve request sent, its reply not read yet
        self._retry_at = 0.0
        self.segment = self.head = self.end = 0  # end == head: none held (or used up)

    @property
    def remaining(self) -> int:
        return self.end - self.head

    @property
    def lost(self) -> bool:
        """Whether a chained call failed after later ones carved on: their commits would be refused."""
        return self._lost

    def take(self, backend: Any, *, chain_bytes: int | None = None) -> bool:
        """Hold the reservation for one call (reading a pending reserve's reply first); False when another
        call holds it or reservations are off. A holder must call :meth:`give`.

        ``chain_bytes`` (an async call of that many bytes, rounded as :func:`rounded`, issued by the one thread
        that issues the chain): join the chain of async calls holding it when what is left holds the call;
        otherwise wait until every holder gave it back, then hold it (a new reservation asked for meanwhile is
        read then). Always True while reservations are on."""
        if self.limit <= 0:
            return False
        if chain_bytes is None:  # the common case, in few steps: a plain call finds it free, no reply to read
            with self._lock:
                if not self._holders and self._pending is None:
                    self._holders = 1
                    self._chained = False
                    return True
        with self._cond:
            if self._holders:
                if chain_bytes is None:
                    return False
                if self._chained and not self._lost and self.end and self.end - self.head >= chain_bytes:
                    self._holders += 1
                    return True
                while self._holders:
                    self._cond.wait()
            self._holders = 1
            self._chained = chain_bytes is not None
            token, self._pending = self._pending, None
        if token is not None:
            try:
                loc = backend.reserve_finish(token)
            except Exception as exc:  # refused (memory full) or the connection failed: create path for now
                log.debug("write reservation refused: %s", exc)
                self._retry_at = time.monotonic() + RETRY_SECONDS
            else:
                self.segment, self.head, self.end = loc.segment, loc.offset, loc.offset + loc.size
        return True

    def carve(self, sizes: list[int]) -> list[Loc] | None:
        """Locations for objects of ``sizes`` side by side from the head (which moves past them), or None
        when they do not all fit what is left. (``mset_d2h`` lays its keys out the same way, one by one as it checks
        them, with the head in a local until it is done: ``lay_out`` in ``DeviceCallsMixin._mset_d2h_steps``.)"""
        head = self.head
        if not self.end or sum(map(rounded, sizes)) > self.end - head:
            return None
        out = []
        segment = self.segment
        for size in sizes:
            out.append(_new(Loc, (segment, head, size)))  # NamedTuple's own __new__ is Python: 3x the cost
            head += (size + _MASK) & ~_MASK
        self.head = head
        return out

    def give(
        self,
        backend: Any,
        head: int | None,
        call_bytes: int,
        carved: tuple[int, int] | None = None,
    ) -> None:
        """End a call: ``head`` is where the worker's head is now (None: unknown, or the worker holds none),
        ``call_bytes`` what the call wrote, ``carved`` the local head before and after its carving (a chained
        call's). The last holder asks for a new reservation, not waiting, when what is left would not hold
        another such call (a chain: :data:`CHAIN_CALLS` of them)."""
        with self._cond:
            if self._holders > 1:  # a chained call ended while others hold it: the local head stands
                self._holders -= 1
                if carved is None or head != carved[1]:
                    if carved is not None and head == carved[0] and self.head == carved[1]:
                        self.head = carved[0]  # it committed nothing and nobody carved after it: rewind
                    else:
                        self._lost = True
                return
            try:
                if self._lost or head is None or not self.end or head > self.end:
                    self.head = self.end = 0  # forget it: the next reservation replaces the worker's
                else:
                    self.head = head
                # A chain asks again while what is left would not hold CHAIN_CALLS calls: the next chain then
                # carves them all without waiting for the chain to end in the middle (a drain: H200 host, 64 x 1 MiB
                # calls, the copy engine idle ~500 us).
                if self._pending is None:  # (not asked for already by renew)
                    self._ask_locked(backend, CHAIN_CALLS if self._chained else 1, call_bytes)
            finally:
                self._holders = 0
                self._chained = self._lost = False
                self._cond.notify_all()

    def renew(self, backend: Any, head: int | None, call_bytes: int) -> None:
        """Ask for the next reservation now, where :meth:`give` would at the call's end: for a call that holds it
        alone (not a chain), whose commits left the worker's head at ``head`` and which wrote ``call_bytes``. Sent
        while the call's last copies still move (its objects are committed, so the worker frees only the rest past
        ``head``), the request costs the call nothing; at its end it cost a writer the request's send (19 us for a
        256-key write on the development machine, CUDA faked) every :data:`CALLS_AHEAD` calls, and bench store's
        timed write every call. The reply is read as :meth:`give`'s would be, by the next call's :meth:`take`."""
        with self._lock:
            if self._holders != 1 or self._chained or self._pending is not None or head is None:
                return
            if not self.end or head > self.end:
                return  # the worker holds none, or not this one: give forgets it
            self.head = head
            self._ask_locked(backend, 1, call_bytes)

    def _ask_locked(self, backend: Any, calls: int, call_bytes: int) -> None:
        """Ask for a new reservation, not waiting, where what is left would not hold ``calls`` more calls of
        ``call_bytes`` (and not within :data:`RETRY_SECONDS` of a refusal)."""
        want = min(max(CALLS_AHEAD * calls * call_bytes, FLOOR_BYTES), self.limit)
        if self.remaining < min(calls * call_bytes, want) and time.monotonic() >= self._retry_at:
            try:
                self._pending = backend.reserve_start(want)
                self.head = self.end = 0  # the worker frees what was left when it replaces it
            except Exception as exc:  # a broken connection: the call's own error says so
                log.debug("write reservation not asked for: %s", exc)

"""A client's write reservation: where its next ``mset_d2h`` objects go, known without asking the worker.

The worker holds, for this client, an extent ``[head, end)`` of one shared segment
(:mod:`kvstrata.store.reservations`); this object mirrors it. A device call that holds it lays its stages'
objects side by side from ``head`` (no request), queues their copies at once, and commits each stage once
its bytes landed; the worker moves its own head as it commits, and each commit's reply says where it is.
After a call the client takes the worker's word (so a call that failed between carving and committing
just leaves those bytes to the next call), and asks for a new reservation, without waiting, when what is
left would not hold a call like this one; the next call reads that reply first.

One call at a time holds it: a concurrent call (``async_mset_d2h`` threads) takes the create path.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvstrata.client._shared import Loc
from kvstrata.store.allocator import ALIGNMENT

log = logging.getLogger(__name__)

#: default cap on one reservation (``kvstrata.connect(reserve_bytes=...)``; 0 turns reservations off)
RESERVE_BYTES = 256 << 20
#: a reservation asked for holds at least this much (or two calls like the last one, if more)
FLOOR_BYTES = 64 << 20
#: seconds before asking again after the worker refused a reservation (memory full)
RETRY_SECONDS = 1.0
_MASK = ALIGNMENT - 1
_new = tuple.__new__


def rounded(size: int) -> int:
    """The bytes an object of ``size`` takes in a reservation (the worker rounds the same way)."""
    return (size + _MASK) & ~_MASK


class WriteReservation:
    """This client's reservation as last heard from the worker, and the lock a call holds it under."""

    def __init__(self, limit: int = RESERVE_BYTES) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"reserve_bytes: must be an int >= 0, got {limit!r}")
        self.limit = limit
        self._lock = threading.Lock()
        self._pending: Any = None  # a reserve request sent, its reply not read yet
        self._retry_at = 0.0
        self.segment = self.head = self.end = 0  # end == head: none held (or used up)

    @property
    def remaining(self) -> int:
        return self.end - self.head

    def take(self, backend: Any) -> bool:
        """Hold the reservation for one call (reading a pending reserve's reply first); False when another
        call holds it or reservations are off. A holder must call :meth:`give`."""
        if self.limit <= 0 or not self._lock.acquire(blocking=False):
            return False
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
        when they do not all fit what is left."""
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

    def give(self, backend: Any, head: int | None, call_bytes: int) -> None:
        """End a call: ``head`` is where the worker's head is now (None: unknown, or the worker holds none),
        ``call_bytes`` what the call wrote. Asks for a new reservation, not waiting, when what is left
        would not hold another such call."""
        try:
            if head is None or not self.end or head > self.end:
                self.head = self.end = 0  # forget it: the next reservation replaces the worker's
            else:
                self.head = head
            if self.remaining < call_bytes and time.monotonic() >= self._retry_at:
                want = min(max(2 * call_bytes, FLOOR_BYTES), self.limit)
                try:
                    self._pending = backend.reserve_start(want)
                    self.head = self.end = 0  # the worker frees what was left when it replaces it
                except Exception as exc:  # a broken connection: the call's own error says so
                    log.debug("write reservation not asked for: %s", exc)
        finally:
            self._lock.release()

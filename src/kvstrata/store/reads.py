"""The read path: finding a key's visible version, waiting for it to appear, copying its bytes out.

``_lookup`` gives a key's visible version, dropping one found past its deadline (the engine's
background TTL sweep drops those nobody looks up). ``_wait_for`` waits on a per-key condition over
the engine's lock for a key to be sealed, and brings an object that is only on SSD back into DRAM
(one reader loads it; the others wait for that load). ``get_bytes`` / ``read`` copy: values up to
``_SMALL`` bytes under the lock, larger ones outside it under a temporary pin. Zero-copy reads take
a lease instead (store.leases).

This is a mixin of :class:`~kvstrata.store.engine.ObjectStore`; it shares the engine's fields.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvstrata.errors import CapacityError, ClosedError, InvalidValue, KeyNotFound, Timeout
from kvstrata.store.objects import Entry, check_key, check_size, check_timeout
from kvstrata.store.writes import _SMALL

#: how often a wait guarded by :meth:`ReadMixin.guard_waits` asks whether whoever waits is still there (s)
GUARD_CHECK_S = 0.25
_guards = threading.local()


class ReadMixin:
    """``get_bytes`` / ``read`` of the engine, and the lookups every other path uses (see the module docstring)."""

    @staticmethod
    def guard_waits(gone: Callable[[], bool] | None) -> None:
        """Make this thread's waits for keys (``timeout`` other than 0) ask ``gone()`` every :data:`GUARD_CHECK_S`
        seconds and at :meth:`wake_waiters`, and end with ``ClosedError`` once it says True: a worker's connection
        thread waits for its client, which may die or be disconnected by a stopping worker meanwhile (else the
        thread would wait out a timeout of minutes, or of None, for nobody). ``None``: unguarded again."""
        _guards.gone = gone

    def wake_waiters(self) -> None:
        """Wake every thread waiting for a key to look again (and its guard to be asked, see :meth:`guard_waits`)."""
        with self._lock:
            for w in self._waiters.values():
                w[0].notify_all()

    def _lookup(self, key: str) -> Entry | None:
        e = self._objects.get(key)
        if e is not None and e.expires and e.expires <= time.monotonic():
            self._retire_expired(e)
            return None
        return e

    def _wait_for(self, key: str, timeout: float | None, promote: bool = True) -> Entry:
        """The visible entry of ``key``, waiting up to ``timeout`` s for it to appear (and for a load
        by another reader to finish); brought into DRAM if ``promote``. Under the lock; may release it.
        """
        deadline = None
        w = None
        try:
            while True:
                e = self._lookup(key)
                if e is not None:
                    if e.loc is not None or not promote:
                        break
                    if not e.loading:
                        if self._load(e):
                            break
                        continue  # deleted or replaced while loading: look again
                    remaining = None  # another reader is loading it: loads finish, wait for it
                else:
                    if timeout == 0.0:
                        self._counts["misses"] += 1
                        raise KeyNotFound(f"key {key!r} not found")
                    if deadline is None and timeout is not None:
                        deadline = time.monotonic() + timeout
                    remaining = None if timeout is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        self._counts["misses"] += 1
                        # (to the ms: a client's remaining time printed whole read 0.2166268938559338 s)
                        raise Timeout(f"key {key!r} did not appear within {round(timeout, 3):g} s")
                if self._closed:
                    raise ClosedError("the object store is closed")
                if w is None:
                    w = self._waiters.get(key)
                    if w is None:
                        w = self._waiters[key] = [threading.Condition(self._lock), 0]
                    w[1] += 1
                gone = getattr(_guards, "gone", None)
                if gone is None:
                    w[0].wait(remaining)
                    continue
                w[0].wait(GUARD_CHECK_S if remaining is None else min(remaining, GUARD_CHECK_S))
                if gone():
                    raise ClosedError(f"stopped waiting for {key!r}: whoever asked is gone")
        finally:
            if w is not None:
                w[1] -= 1
                if w[1] == 0:
                    del self._waiters[key]
        e.referenced = True
        return e

    def _copy_out(self, key: str, offset: int, size: int | None, timeout: float | None) -> bytes:
        with self._lock:
            if self._closed:
                raise ClosedError("the object store is closed")
            want = size
            while True:
                e = self._wait_for(key, timeout, promote=False)
                size = e.size - offset if want is None else want
                if offset + size > e.size:
                    what = "offset" if offset > e.size else "size"  # the one that is wrong whatever the other says
                    raise InvalidValue(f"{what}: range [{offset}, {offset + size}) is outside {key!r} ({e.size} bytes)")
                if e.loc is not None:
                    break
                try:
                    self._wait_for(key, timeout, promote=True)
                except CapacityError:
                    data = self._read_direct(e, offset, size)  # DRAM full of leased data: serve from SSD
                    if data is None:
                        continue  # replaced or deleted meanwhile: look again
                    self._counts["hits"] += 1
                    return data
            self._counts["hits"] += 1
            if size <= _SMALL:
                return bytes(self.buffer(e.loc)[offset : offset + size])
            e.leases += 1
            loc = e.loc
        try:
            return bytes(self._mem.view(loc)[offset : offset + size])
        finally:
            with self._lock:
                e.leases -= 1
                if e.dead and e.leases == 0:
                    self._free_locked(e)

    def get_bytes(self, key: str, *, timeout: float | None = 0.0) -> bytes:
        """A copy of ``key``'s value, waiting up to ``timeout`` s for it to appear."""
        check_key(key)
        data = self._copy_out(key, 0, None, check_timeout(timeout))
        if self._announced < len(self._mem.segments):  # a promotion may have grown the tier
            self._announce_segments()
        return data

    def read(self, key: str, offset: int, size: int) -> bytes:
        """A copy of ``size`` bytes of ``key`` from ``offset``; ValueError for a range outside the object."""
        check_key(key)
        check_size(offset, "offset")
        check_size(size)
        data = self._copy_out(key, offset, size, 0.0)
        if self._announced < len(self._mem.segments):
            self._announce_segments()
        return data


__all__ = ["ReadMixin"]

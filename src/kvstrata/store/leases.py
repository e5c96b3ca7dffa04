"""Leases: a reader's hold on one version of an object, so its bytes stay where they are until released.

A lease pins a version, not a key: a newer write makes a new version, and the leased one is freed only
when its last lease goes (a dead version's blocks go back to the memory tier then). Leases are counted
per owner (a client's session), so a client that goes away gives back everything it held. The batch
forms take and give back a whole batch in one critical section: the worker answers a device call's
stage of keys with them. This is a mixin of :class:`~kvstrata.store.engine.ObjectStore`; every method
runs under, or takes, its one metadata lock.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Iterable

from kvstrata.errors import ClosedError, KvstrataError
from kvstrata.store.device import GpuCopy
from kvstrata.store.objects import ZERO_LOCATION, Entry, Lease, check_key, check_keys, check_timeout
from kvstrata.store.tiers.base import Location

_LOC, _MUTABLE, _PLACED = operator.attrgetter("loc"), operator.attrgetter("mutable"), operator.attrgetter("placed")


class LeaseMixin:
    """``acquire`` / ``acquire_many`` / ``lease_many`` / ``release`` / ``release_many`` of the engine."""

    def acquire(self, key: str, *, owner: object, timeout: float | None = 0.0) -> Lease:
        """Lease the current version of ``key``, waiting up to ``timeout`` s (None: forever) for it to appear.

        The bytes stay at ``lease.location`` until :meth:`release`. KeyNotFound, or Timeout after a wait.
        """
        check_key(key)
        timeout = check_timeout(timeout)
        with self._lock:
            if self._closed:
                raise ClosedError("the object store is closed")
            e = self._wait_for(key, timeout)
            self._counts["hits"] += 1
            e.leases += 1
            lid = next(self._lease_ids)
            self._leases[lid] = (e, owner)
            leases = self._owner_leases.get(owner)
            if leases is None:
                leases = self._owner_leases[owner] = set()
            leases.add(lid)
            lease = Lease(lid, key, e.loc, e.size, e.mutable, e.placed)
        if self._announced < len(self._mem.segments):
            self._announce_segments()
        return lease

    def acquire_many(
        self, keys: Iterable[str], *, owner: object, timeout: float | None = 0.0
    ) -> list[Lease | KvstrataError]:
        """Per-key :meth:`acquire`; a failed key yields its exception in place. ``timeout`` bounds the whole call."""
        keys = check_keys(keys)
        ids, locs, mutable, placed, errors = self.lease_many(keys, owner=owner, timeout=timeout)
        # tuple.__new__ builds each NamedTuple in C (its generated __new__ is Python code)
        sizes = [loc.size for loc in locs]
        out: list = list(map(tuple.__new__, itertools.repeat(Lease), zip(ids, keys, locs, sizes, mutable, placed)))
        for i, exc in errors.items():
            out[i] = exc
        return out

    def lease_many(
        self, keys: Iterable[str], *, owner: object, timeout: float | None = 0.0
    ) -> tuple[list[int], list[Location], list[bool], list[int], dict[int, KvstrataError]]:
        """:meth:`acquire_many` in columns, for a caller answering many keys at once (the worker builds its
        reply from these without a tuple per key): each key's lease id, location, whether the object is
        mutable and its placement (:mod:`kvstrata.store.placements`), plus ``{position: exception}`` for
        refused keys (lease id 0, ``ZERO_LOCATION``, False, 0 there).
        """
        keys = check_keys(keys)
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        n = len(keys)
        # Keys resident in DRAM and unexpired are leased in one critical section; the rest (missing,
        # expired, on SSD only) go one by one through acquire, which waits, promotes and counts misses.
        with self._lock:
            if self._closed:
                raise ClosedError("the object store is closed")
            entries: list = list(map(self._objects.get, keys))
            now = time.monotonic()
            slow: list[int] = []
            for i, e in enumerate(entries):
                if e is None or e.loc is None or (e.expires and e.expires <= now):
                    slow.append(i)
                    continue
                e.referenced = True
                e.leases += 1
            if slow:
                for i in slow:
                    entries[i] = None
                got = [e for e in entries if e is not None]
            else:
                got = entries
            if got:
                lids = list(itertools.islice(self._lease_ids, len(got)))  # one C call for the batch
                self._leases.update(zip(lids, zip(got, itertools.repeat(owner))))
                owned = self._owner_leases.get(owner)
                if owned is None:
                    owned = self._owner_leases[owner] = set()
                owned.update(lids)
                self._counts["hits"] += len(got)
            else:
                lids = []
            locs = list(map(_LOC, got))
            mutable = list(map(_MUTABLE, got))
            placed = list(map(_PLACED, got))
        if slow:
            it_ids, it_locs, it_mut, it_placed = iter(lids), iter(locs), iter(mutable), iter(placed)
            lids, locs, mutable, placed = [0] * n, [ZERO_LOCATION] * n, [False] * n, [0] * n
            for i, e in enumerate(entries):
                if e is not None:
                    lids[i], locs[i], mutable[i], placed[i] = next(it_ids), next(it_locs), next(it_mut), next(it_placed)
        errors: dict[int, KvstrataError] = {}
        for i in slow:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                lease = self.acquire(keys[i], owner=owner, timeout=left)
            except KvstrataError as exc:
                errors[i] = exc
                continue
            lids[i], locs[i], mutable[i], placed[i] = lease.lease_id, lease.location, lease.mutable, lease.placement
        if self._announced < len(self._mem.segments):
            self._announce_segments()
        return lids, locs, mutable, placed, errors

    def release_many(self, lease_ids: Iterable[int]) -> None:
        """:meth:`release` of each lease, in one critical section."""
        with self._lock:
            # _release_locked inlined: a 64-key batch of reads gives back 64 leases at once
            pop, by_owner = self._leases.pop, self._owner_leases
            last_owner, owned = None, None
            freed: list[Entry] = []  # dead versions whose last lease went: their blocks go back together
            for lease_id in lease_ids:
                item = pop(lease_id, None)
                if item is None:
                    continue
                e, owner = item
                if owner is not last_owner or owned is None:
                    if owned is not None and not owned:
                        by_owner.pop(last_owner, None)
                    last_owner, owned = owner, by_owner.get(owner)
                if owned is not None:
                    owned.discard(lease_id)
                if type(e) is GpuCopy:
                    self._gpu_release(e)
                    continue
                e.leases -= 1
                if e.leases == 0:
                    self._evict_blocked = False
                    if e.dead and e.loc is not None:
                        freed.append(e)
            if owned is not None and not owned:
                by_owner.pop(last_owner, None)
            if freed:
                self._mem.free_many([e.loc for e in freed if e.loc.size])
                for e in freed:
                    e.loc = None

    def release(self, lease_id: int) -> None:
        """Give a lease back (idempotent)."""
        with self._lock:
            self._release_locked(lease_id)

    def _release_locked(self, lease_id: int) -> None:
        """The body of :meth:`release`; call under the lock."""
        item = self._leases.pop(lease_id, None)
        if item is None:
            return
        e, owner = item
        leases = self._owner_leases.get(owner)
        if leases is not None:
            leases.discard(lease_id)
            if not leases:
                del self._owner_leases[owner]
        if type(e) is GpuCopy:
            self._gpu_release(e)
            return
        e.leases -= 1
        if e.leases == 0:
            self._evict_blocked = False
            if e.dead:
                self._free_locked(e)

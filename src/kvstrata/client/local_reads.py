"""Repeated reads of unchanged keys answered from shared memory, with no round trip to the worker.

The client keeps the leases of up to ``max_entries`` immutable TTL-free objects it read (the worker
says which ones qualify, and which of its per-key counters covers each). An entry is good while that
key has not changed: the worker's generation still shows the value at which the entry was last found
current, or the key's counter still shows the count it had when the lease was taken (the protocol is
in :mod:`kvstrata.server.validity`). Writes to other keys leave the entry alone. A stale entry is
dropped when it is next looked up, or by the sweep that runs at most every ``SWEEP_S`` seconds while
the generation moves, and its lease given back with the client's next message.

A thread of the client, its *keeper*, gives back every lease the cache keeps when the worker asks for them (a write
that found no room but leased objects: caches of idle clients would otherwise pin memory the worker needs, each up to
its budget), and, while the application makes no call, stale entries' leases (else they go with the next call).

``get_buffers`` keeps entries too (any size, up to the budget the worker advertises): a later view of
the same key shares the entry's lease with no round trip. The backend counts a shared lease's holders
and gives it back only when the cache and every view let go, so a view's bytes stay pinned after
its entry is dropped.
"""

from __future__ import annotations

import ctypes
import operator
import time
from collections import OrderedDict
from typing import Any

from kvstrata._imports import imported
from kvstrata.server.validity import RECLAIM_OFFSET, SLOTS  # the worker's slot numbers index this table

MAX_ENTRIES = 256
MAX_BYTES = 4 << 20  # what one client may keep pinned (leased objects cannot be evicted or spilled)
#: the gets' access counts behind :meth:`LocalReads.admits` are halved after this many gets per entry the cache
#: holds, so that keys hot long ago give way to keys hot now
AGE_EVERY = 8
SWEEP_S = 0.01  # stale entries pin old versions: looked for at most this often while writes happen

# An entry: [lease id, location, slot, the slot's count when leased, generation when last found current]
_LEASE, _LOC, _SLOT, _COUNT, _SEEN = range(5)
#: an entry's location (of :meth:`LocalReads.entries_prefix`'s entries)
entry_location = operator.itemgetter(_LOC)
_SEEN_OF = operator.itemgetter(_SEEN)


class LocalReads:
    """The entries and the mapped table of counters. Not thread-safe: the backend's lock guards it."""

    def __init__(
        self,
        page: Any,
        max_entries: int = MAX_ENTRIES,
        max_bytes: int = MAX_BYTES,
        *,
        spin_offset: int | None = None,
        slots_offset: int = 4096,
    ) -> None:
        self._page = page
        self._gen = ctypes.c_uint64.from_address(page.address)  # one 8-byte load per read: never torn
        self._slots = (ctypes.c_uint64 * SLOTS).from_address(page.address + slots_offset)
        self._slots_address = page.address + slots_offset
        # The worker's advice on busy-polling for replies (microseconds), where it gives one.
        self._spin = None if spin_offset is None else ctypes.c_uint64.from_address(page.address + spin_offset)
        # The worker's reclaim count: it moves when a write found no room but leased objects (keeper_round)
        self._reclaim = ctypes.c_uint64.from_address(page.address + RECLAIM_OFFSET)
        self._reclaim_seen = self._reclaim.value
        self._entries: OrderedDict[str, list] = OrderedDict()
        self._dropped: list[int] = []  # leases of stale entries, given back with the next message
        # Leases a batch read took to keep, judged current and not entered yet (add_columns(later=True)):
        # entered by :meth:`settle`, off the path to the read's copies.
        self._add_later: list[tuple] = []
        # Keys entries_prefix found current: moved to the recent end by :meth:`settle`, before any entry is made.
        self._touch_later: list[list[str]] = []
        self._swept_gen = -1
        self._next_sweep = 0.0
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._bytes = 0
        self.hits = 0
        # How often each key was read by a get lately (aged by halving): decides which keys a full cache admits
        self._freq: dict[str, int] = {}
        self._counted = 0

    def generation(self) -> int:
        return self._gen.value

    def spin(self) -> float:
        """Seconds to busy-poll for a reply before sleeping, as the worker currently advises."""
        return self._spin.value * 1e-6 if self._spin is not None else 0.0

    def _current(self, entry: list, gen: int) -> bool:
        """Whether ``entry``'s version is still its key's, ``gen`` read before this call."""
        if entry[_SEEN] == gen:
            return True
        if self._slots[entry[_SLOT]] != entry[_COUNT]:
            return False
        entry[_SEEN] = gen  # unchanged at a moment after gen was read: any later change moves gen
        return True

    def _stale_entry(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry[_LOC].size
        self._dropped.append(entry[_LEASE])

    def lookup(self, key: str) -> Any:
        """The location of ``key``'s leased bytes if they are still current, else None."""
        entry = self.entry(key)
        return None if entry is None else entry[_LOC]

    def entry(self, key: str) -> tuple[int, Any] | None:
        """``(lease id, location)`` of ``key``'s leased bytes if they are still current, else None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        gen = self._gen.value  # before the count is read
        if entry[_SEEN] != gen and not self._current(entry, gen):
            self._stale_entry(key)
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def count(self, key: str) -> int:
        """Note one get of ``key`` (a hit or a miss); its count of recent gets, this one included."""
        freq = self._freq
        n = freq[key] = freq.get(key, 0) + 1
        self._counted += 1
        if self._counted >= AGE_EVERY * self.max_entries:
            self._counted = 0
            self._freq = {k: c >> 1 for k, c in freq.items() if c > 1}
        return n

    def admits(self, key: str) -> bool:
        """Note a get of ``key`` that missed; whether its lease should be kept. A full cache keeps a new key only if
        it was read more often lately than the entry it would push out (the least recently used): keys read in turn,
        more of them than the cache holds, would otherwise push each other out before any is read again, every get
        paying for a lease it gives back unused (~1.5x a plain get through the worker). Refused, the cache keeps what
        it holds and serves those keys from shared memory (256 of 300 keys read in turn, say), and the get fetches
        the bytes alone."""
        n = self.count(key)
        entries = self._entries
        if len(entries) < self.max_entries and self._bytes < self.max_bytes:
            return True
        return n > self._freq.get(next(iter(entries)), 0)

    def entries(self, keys: list[str]) -> list[tuple[int, Any] | None]:
        """``(lease id, location)`` of each key whose leased bytes are still current, else None per key. A stale
        entry found here is dropped (its lease is among the next :meth:`stale`)."""
        entries = self._entries
        if not entries:
            return [None] * len(keys)
        gen = self._gen.value  # before any count is read
        get, touch, slots = entries.get, entries.move_to_end, self._slots
        out: list[Any] = []
        stale: list[str] = []
        for key in keys:
            entry = get(key)
            if entry is None:
                out.append(None)
            elif entry[_SEEN] == gen:
                touch(key)
                out.append(entry)
            elif slots[entry[_SLOT]] == entry[_COUNT]:  # _current, inline
                entry[_SEEN] = gen
                touch(key)
                out.append(entry)
            else:
                stale.append(key)
                out.append(None)
        for key in stale:  # _stale_entry, inline (a batch of keys just rewritten: all of them)
            entry = entries.pop(key, None)
            if entry is not None:  # a key named twice is dropped once
                self._bytes -= entry[_LOC].size
                self._dropped.append(entry[_LEASE])
        self.hits += len(out) - out.count(None)
        return out

    def entries_prefix(self, keys: list[str]) -> list[list]:
        """The entries of the longest run of keys from the first whose entries are all current (empty where the first
        key's is not), found in one pass that stops at the first key without a current entry (changing nothing for
        it or later keys: a stale entry is left for :meth:`entries`, which the caller's slower path uses). For a
        device call that serves those keys in one pass and the rest another way; a cold call pays for one lookup."""
        entries = self._entries
        if not entries:
            return []
        gen = self._gen.value  # before any count is read
        get, slots = entries.get, self._slots
        out = list(map(get, keys))
        if None not in out and set(map(_SEEN_OF, out)) == {gen}:  # all found current since the last write: C loops
            self._touch_later.append(keys)
            self.hits += len(out)
            return out
        for i, entry in enumerate(out):
            if entry is None or (entry[_SEEN] != gen and slots[entry[_SLOT]] != entry[_COUNT]):  # _current, inline
                del out[i:]
                break
            entry[_SEEN] = gen
        # Their recency is noted by the next settle(), while the caller's copies run, not before the first copy.
        self._touch_later.append(keys[: len(out)] if len(out) < len(keys) else keys)
        self.hits += len(out)
        return out

    def locations_prefix(self, keys: list[str]) -> list[Any]:
        """:meth:`entries_prefix`'s entries' locations, where :mod:`kvstrata.ops.tensor_runs` is loaded looked up in
        one native call (``current_prefix``), before a kept read's first copy: on the development machine ~2 us for
        64 keys against ~9 in Python, and the whole ``kept_leases`` right after a request 4.7 us against 16-17."""
        native = _native()
        if native is None:
            return list(map(entry_location, self.entries_prefix(keys)))
        if not self._entries:
            return []
        out = native.current_prefix(self._entries, keys, self._gen.value, self._slots_address, SLOTS)
        if out:  # their recency is noted by the next settle(), as entries_prefix leaves it
            self._touch_later.append(keys[: len(out)] if len(out) < len(keys) else keys)
            self.hits += len(out)
        return out

    def stale(self) -> list[int]:
        """Lease ids of entries dropped as stale since the last call (looked up, or found by a sweep)."""
        if self._entries and self._swept_gen != self._gen.value:
            now = time.monotonic()
            if now >= self._next_sweep:
                self._next_sweep = now + SWEEP_S
                gen = self._swept_gen = self._gen.value
                for key in [k for k, e in self._entries.items() if not self._current(e, gen)]:
                    self._stale_entry(key)
        if not self._dropped:
            return []
        out, self._dropped = self._dropped, []
        return out

    def reclaim_asked(self) -> bool:
        """Whether the worker asked for the leases caches keep since the last call (a write found no room but leased
        objects: its reclaim count moved). Read by the client's keeper thread alone, with no lock."""
        count = self._reclaim.value
        if count == self._reclaim_seen:
            return False
        self._reclaim_seen = count
        return True

    def dropped(self) -> list[int]:
        """The leases let go of and not given back yet, without looking for stale entries (see :meth:`stale`)."""
        out, self._dropped = self._dropped, []
        return out

    def add(
        self, key: str, lease_id: int, location: Any, generation: int, slot: int, *, evict: bool = True
    ) -> list[int]:
        """Keep a lease taken after reading ``generation``, its key counted in ``slot``; returns lease ids to
        give back (``lease_id`` itself where it cannot be kept). ``evict=False`` keeps it only where it fits
        beside the current entries (a batch larger than the budget then keeps its first keys instead of
        pushing out its own entries, call after call)."""
        return self.add_columns([key], [lease_id], [location], [slot], generation, evict=evict)

    def add_many(self, items: list[tuple[str, int, Any, int]], generation: int, *, evict: bool = True) -> list[int]:
        """:meth:`add` of each ``(key, lease id, location, slot)`` in order; the lease ids to give back (a
        refused lease among them, as from :meth:`add`)."""
        if not items:
            return self.stale()
        keys, lease_ids, locations, slots = map(list, zip(*items))
        return self.add_columns(keys, lease_ids, locations, slots, generation, evict=evict)

    def add_columns(
        self,
        keys: list[str],
        lease_ids: list[int],
        locations: list[Any],
        slots: Any,
        generation: int,
        *,
        evict: bool = True,
        later: bool = False,
    ) -> list[int]:
        """:meth:`add_many` in columns (what an acquire reply holds), without a tuple per key. ``locations``
        have a ``size`` (:class:`~kvstrata.client._shared.Loc`). ``later``: the leases are judged now (the
        counts read, then the generation) and entered at the next :meth:`settle`; what that entry pushes out
        or refuses joins the leases :meth:`stale` gives back, and only leases refused now are returned."""
        table, mask = self._slots, SLOTS - 1
        slots = [slot & mask for slot in slots]
        counts = [table[slot] for slot in slots]  # first the counts, then the generation
        if later:
            if generation != self._gen.value:  # something changed during the request: not trustworthy
                return list(lease_ids)
            self._add_later.append((keys, lease_ids, locations, slots, counts, generation, evict))
            return []
        self.settle()  # in order: what was left for later first
        drop = self.stale()
        if generation != self._gen.value:
            return drop + list(lease_ids)
        return drop + self._enter(keys, lease_ids, locations, slots, counts, generation, evict)

    def settle(self) -> None:
        """Enter the leases that batch reads left for later (``add_columns(later=True)``), in order. The leases
        let go of (entries pushed out or replaced, leases refused) are given back by :meth:`stale`. First the keys
        :meth:`entries_prefix` found are marked recently used (those still kept)."""
        if self._touch_later:
            touched, self._touch_later = self._touch_later, []
            entries = self._entries
            touch = entries.move_to_end
            for keys in touched:
                for key in keys:
                    if key in entries:  # dropped since (stale, or pushed out)
                        touch(key)
        if self._add_later:
            later, self._add_later = self._add_later, []
            for batch in later:
                self._dropped += self._enter(*batch)

    def _enter(
        self,
        keys: list[str],
        lease_ids: list[int],
        locations: list[Any],
        slots: list[int],
        counts: list[int],
        generation: int,
        evict: bool,
    ) -> list[int]:
        """Enter leases judged current (see :meth:`add_columns`); the lease ids let go of."""
        drop: list[int] = []
        entries, max_entries, max_bytes = self._entries, self.max_entries, self.max_bytes
        for key, lease_id, location, slot, count in zip(keys, lease_ids, locations, slots, counts):
            size = location.size
            if not evict and key not in entries and (len(entries) >= max_entries or self._bytes + size > max_bytes):
                drop.append(lease_id)
                continue
            old = entries.pop(key, None)
            if old is not None:
                drop.append(old[_LEASE])
                self._bytes -= old[_LOC].size
            entries[key] = [lease_id, location, slot, count, generation]
            self._bytes += size
            while len(entries) > max_entries or self._bytes > max_bytes:
                old = entries.popitem(last=False)[1]
                drop.append(old[_LEASE])
                self._bytes -= old[_LOC].size
        return drop

    def clear(self) -> list[int]:
        self.settle()
        ids = [entry[_LEASE] for entry in self._entries.values()]
        self._entries.clear()
        self._bytes = 0
        ids += self._dropped
        self._dropped = []
        return ids

    def __len__(self) -> int:
        return len(self._entries) + len(self._dropped) + len(self._add_later)

    def close(self) -> None:
        self._entries.clear()
        self._dropped = []
        self._add_later = []
        self._touch_later = []
        self._gen = self._slots = self._reclaim = None  # type: ignore[assignment]
        self._spin = None
        self._page.close()


#: look a kept read's entries up natively where the module is loaded (``tools/probe_native_planner.py`` switches it)
NATIVE_PREFIX = True


def _native() -> Any:
    """The native module of :mod:`kvstrata.ops.tensor_runs` where a device call of this process loaded it, else None:
    a lookup never starts a build or an import (as :func:`kvstrata.store.placements._native`)."""
    module = imported("kvstrata.ops.tensor_runs")  # (another thread may be importing it: not half made)
    return None if module is None or not NATIVE_PREFIX else module.loaded()

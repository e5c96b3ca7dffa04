"""Repeated small ``get``s answered from shared memory, with no round trip to the worker.

The client keeps the leases of up to ``max_entries`` small immutable TTL-free objects it read
(the worker says which ones qualify). Such an entry is good while the worker's generation page still
shows the generation read before the request that leased it: the worker bumps that generation
around every change it makes, so an unchanged generation means the leased version is still the
current one (the protocol is in :mod:`kvstrata.server.validity`). When the generation moves, every
entry is dropped at once and its lease given back with the client's next message.

``get_buffers`` keeps entries too (any size, up to the budget the worker advertises): a later view of
the same key shares the entry's lease with no round trip. The backend counts a shared lease's holders
and gives it back only when the cache and every view let go, so a view's bytes stay pinned after
its entry is dropped.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from typing import Any

MAX_ENTRIES = 256
MAX_BYTES = 4 << 20  # what one client may keep pinned (leased objects cannot be evicted or spilled)


class LocalReads:
    """The entries and the mapped generation page. Not thread-safe: the backend's lock guards it."""

    def __init__(
        self, page: Any, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES, *, spin_offset: int | None = None
    ) -> None:
        self._page = page
        self._gen = ctypes.c_uint64.from_address(page.address)  # one 8-byte load per read: never torn
        # The worker's advice on busy-polling for replies (microseconds), where it gives one.
        self._spin = None if spin_offset is None else ctypes.c_uint64.from_address(page.address + spin_offset)
        self._entries: OrderedDict[str, tuple[int, Any]] = OrderedDict()
        self._entries_gen = -1
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._bytes = 0
        self.hits = 0

    def generation(self) -> int:
        return self._gen.value

    def spin(self) -> float:
        """Seconds to busy-poll for a reply before sleeping, as the worker currently advises."""
        return self._spin.value * 1e-6 if self._spin is not None else 0.0

    def lookup(self, key: str) -> Any:
        """The location of ``key``'s leased bytes if they are still current, else None."""
        entry = self._entries.get(key)
        if entry is None or self._entries_gen != self._gen.value:
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[1]

    def entry(self, key: str) -> tuple[int, Any] | None:
        """``(lease id, location)`` of ``key``'s leased bytes if they are still current, else None."""
        entry = self._entries.get(key)
        if entry is None or self._entries_gen != self._gen.value:
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def entries(self, keys: list[str]) -> list[tuple[int, Any] | None]:
        """:meth:`entry` of every key, the generation checked once (a batch of keys seen at one moment)."""
        if self._entries_gen != self._gen.value:
            return [None] * len(keys)
        get, touch = self._entries.get, self._entries.move_to_end
        out = []
        for key in keys:
            entry = get(key)
            if entry is not None:
                touch(key)
            out.append(entry)
        self.hits += len(out) - out.count(None)
        return out

    def stale(self) -> list[int]:
        """Lease ids of every entry, dropped, if the generation moved since they were taken."""
        if not self._entries or self._entries_gen == self._gen.value:
            return []
        return self.clear()

    def add(self, key: str, lease_id: int, location: Any, generation: int, *, evict: bool = True) -> list[int]:
        """Keep a lease taken after reading ``generation``; returns lease ids to give back.

        ``evict=False`` keeps it only where it fits beside the current entries (a batch larger than the
        budget then keeps its first keys instead of pushing out its own entries, call after call)."""
        drop = self.stale()
        if generation != self._gen.value:  # something changed during the request: not trustworthy
            return [*drop, lease_id]
        if (
            not evict
            and key not in self._entries
            and (len(self._entries) >= self.max_entries or self._bytes + location.size > self.max_bytes)
        ):
            return [*drop, lease_id]
        self._entries_gen = generation
        old = self._entries.pop(key, None)
        if old is not None:
            drop.append(old[0])
            self._bytes -= old[1].size
        self._entries[key] = (lease_id, location)
        self._bytes += location.size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            lease, loc = self._entries.popitem(last=False)[1]
            drop.append(lease)
            self._bytes -= loc.size
        return drop

    def add_many(self, items: list[tuple[str, int, Any]], generation: int, *, evict: bool = True) -> list[int]:
        """:meth:`add` of each ``(key, lease id, location)`` in order; the lease ids to give back (a refused
        lease among them, as from :meth:`add`)."""
        drop = self.stale()
        if generation != self._gen.value:  # something changed during the request: not trustworthy
            return drop + [lease_id for _, lease_id, _ in items]
        entries, max_entries, max_bytes = self._entries, self.max_entries, self.max_bytes
        self._entries_gen = generation
        for key, lease_id, location in items:
            size = location.size
            if not evict and key not in entries and (len(entries) >= max_entries or self._bytes + size > max_bytes):
                drop.append(lease_id)
                continue
            old = entries.pop(key, None)
            if old is not None:
                drop.append(old[0])
                self._bytes -= old[1].size
            entries[key] = (lease_id, location)
            self._bytes += size
            while len(entries) > max_entries or self._bytes > max_bytes:
                lease, loc = entries.popitem(last=False)[1]
                drop.append(lease)
                self._bytes -= loc.size
        return drop

    def clear(self) -> list[int]:
        ids = [lease_id for lease_id, _ in self._entries.values()]
        self._entries.clear()
        self._bytes = 0
        return ids

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._entries.clear()
        self._gen = None  # type: ignore[assignment]
        self._spin = None
        self._page.close()

"""Second-chance clock over the objects resident in DRAM.

The ring is an insertion-ordered dict (oldest first). A read sets the object's ``referenced`` bit;
the hand passes over a referenced object once (clearing the bit and moving it to the back) before it
may be chosen. Objects the caller's predicate rejects (leased, unsealed, nowhere to spill) are moved
to the back too, so one call inspects each object at most twice. What happens to a victim (drop,
free the DRAM copy of an object already on SSD, spill) is the engine's business, decided by write
mode; the policy only chooses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ClockPolicy:
    """Chooses eviction victims among resident objects (anything with a ``referenced`` attribute)."""

    __slots__ = ("_ring",)

    def __init__(self) -> None:
        self._ring: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self._ring)

    def __contains__(self, key: str) -> bool:
        return key in self._ring

    def add(self, key: str, entry: Any) -> None:
        """Make ``entry`` resident (at the back of the ring); replaces an older entry of ``key``."""
        self._ring.pop(key, None)
        self._ring[key] = entry

    def remove(self, key: str, entry: Any | None = None) -> None:
        """Forget ``key`` (only if it still maps to ``entry``, when given)."""
        ring = self._ring
        if entry is None or ring.get(key) is entry:
            ring.pop(key, None)

    def next_victim(self, can_evict: Callable[[Any], bool]) -> Any | None:
        """Remove and return the next victim, or None when no resident object may be evicted."""
        ring = self._ring
        for _ in range(2 * len(ring) + 1):
            if not ring:
                return None
            key = next(iter(ring))
            entry = ring.pop(key)
            if not can_evict(entry):
                ring[key] = entry
                continue
            if entry.referenced:
                entry.referenced = False
                ring[key] = entry
                continue
            return entry
        return None


__all__ = ["ClockPolicy"]

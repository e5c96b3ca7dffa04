"""The small interfaces every tier implements.

Two shapes of tier: *block* tiers (DRAM, HBM) hand out byte ranges the engine reads and writes in
place; the *file* tier (SSD) stores whole objects and reads them back into a block. Tiers are not
thread-safe by themselves: the engine calls their bookkeeping methods under its metadata lock, and
only the byte-moving methods that say so outside it.
"""

from __future__ import annotations

import abc
from typing import NamedTuple


class Location(NamedTuple):
    """Where an object's bytes live in a block tier: segment index, byte offset, length.

    A NamedTuple, not a frozen dataclass: one is built per object written or read, and a tuple
    builds in a third of the time."""

    segment: int
    offset: int
    size: int


class Tier(abc.ABC):
    """Capacity accounting shared by all tiers."""

    name: str

    @property
    @abc.abstractmethod
    def capacity(self) -> int:
        """Bytes this tier may hold."""

    @property
    @abc.abstractmethod
    def used(self) -> int:
        """Bytes held now (allocation granularity included)."""

    def stats(self) -> dict:
        return {"used": self.used, "capacity": self.capacity}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the tier's resources."""


class BlockTier(Tier):
    """A tier of addressable memory: reserve a range, free it."""

    @abc.abstractmethod
    def allocate(self, size: int) -> Location | None:
        """A range of ``size`` (> 0) bytes, or None when it does not fit now (the caller may evict)."""

    @abc.abstractmethod
    def free(self, location: Location) -> None:
        """Give back a range returned by :meth:`allocate`."""

    def fits_ever(self, size: int) -> bool:
        """Whether ``size`` bytes could fit if the tier were empty."""
        return size <= self.capacity


__all__ = ["BlockTier", "Location", "Tier"]

"""The DRAM tier: shared memory segments carved by offset allocators.

The tier starts with one segment and grows by ``segment_bytes`` (or by what a large object needs)
up to ``capacity``. Every segment is a :class:`~kvstrata.memory.shm.SharedSegment`, so a worker can pass
its fd to clients for zero-copy access.

A value larger than a segment needs a segment of its own. Once the segments mapped fill ``capacity``,
empty segments are *retired* to make that room: their pages go back to the kernel (``MADV_REMOVE``),
they take no more allocations and no longer count as mapped. A retired segment keeps its index and its
mapping (clients may still map it, and indices in their hands must never point elsewhere); only its memory
goes. Without this, a worker whose small values had once grown the tier to ``capacity`` refused every value
larger than a segment for the rest of its life, even empty.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from itertools import repeat
from typing import Any

from kvstrata.memory.shm import SharedSegment
from kvstrata.store.allocator import ALIGNMENT, OffsetAllocator
from kvstrata.store.tiers.base import BlockTier, Location

log = logging.getLogger(__name__)

_GROW_GRANULE = 2 << 20  # segments are whole huge pages


class _RetiredAllocator:
    """What a retired segment allocates from: nothing."""

    capacity = used_bytes = free_bytes = largest_free = allocated_blocks = 0
    fragmentation = 0.0

    def allocate(self, size: int) -> None:
        return None

    def allocate_run(self, sizes: list[int]) -> None:
        return None


_RETIRED_ALLOCATOR: Any = _RetiredAllocator()


class MemoryTier(BlockTier):
    """Host DRAM in shared segments, up to ``capacity`` bytes in total."""

    name = "memory"

    def __init__(
        self,
        capacity: int,
        *,
        segment_bytes: int = 256 << 20,
        hugepages: str | bool = "auto",
        numa_node: int | None = None,
        on_new_segment: Callable[[SharedSegment], None] | None = None,
        on_retire_segment: Callable[[SharedSegment], None] | None = None,
    ):
        self._capacity = capacity
        self._segment_bytes = segment_bytes
        self._hugepages = hugepages
        self._numa_node = numa_node
        self._on_new_segment = on_new_segment
        #: called before a segment's pages go (whoever page-locked it with CUDA must undo that first)
        self._on_retire_segment = on_retire_segment
        self.segments: list[SharedSegment] = []
        #: indices of the segments retired (see the module docstring), in the order they went
        self.retired: list[int] = []
        #: which segments may be retired (the engine's: those whose listeners, CUDA page-locking them, are done)
        self.retirable: Callable[[int], bool] = lambda index: True
        #: segments being emptied for a value larger than a segment: small allocations go elsewhere meanwhile
        self._draining: frozenset[int] = frozenset()
        self._allocators: list[OffsetAllocator] = []
        self._mapped = 0
        self._used = 0
        self._last = 0  # the segment that served the last allocation: tried first
        self._add_segment(min(segment_bytes, capacity))

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used(self) -> int:
        return self._used

    @property
    def mapped(self) -> int:
        return self._mapped

    def _add_segment(self, nbytes: int) -> int:
        nbytes -= nbytes % ALIGNMENT
        seg = SharedSegment.create(
            nbytes,
            name=f"kvstrata-{len(self.segments)}",
            hugepages=self._hugepages,
            numa_node=self._numa_node,
            populate=True,
        )
        self.segments.append(seg)
        self._allocators.append(OffsetAllocator(nbytes))
        self._mapped += nbytes
        log.debug("memory tier: segment %d of %d bytes (hugepages=%s)", len(self.segments) - 1, nbytes, seg.hugepages)
        if self._on_new_segment is not None:
            self._on_new_segment(seg)
        return len(self.segments) - 1

    def fits_ever(self, size: int) -> bool:
        # empty segments are retired to make room for a large value: the whole capacity is there in the end
        return -(-size // ALIGNMENT) * ALIGNMENT <= self._capacity - self._capacity % ALIGNMENT

    def own_segment_bytes(self, size: int) -> int:
        """The segment a value of ``size`` bytes gets for itself, where it is larger than a segment (else 0)."""
        if size <= self._segment_bytes:
            return 0
        # in whole huge pages, but never more than the tier (a value of nearly all of it still fits)
        return min(-(-size // _GROW_GRANULE) * _GROW_GRANULE, self._capacity - self._capacity % ALIGNMENT)

    def segment_room(self) -> int:
        """Bytes not mapped yet: what a new segment may take."""
        return self._capacity - self._mapped

    def segment_usage(self) -> list[tuple[int, int, int, int]]:
        """``(index, bytes, bytes in use, blocks allocated)`` of every segment not retired."""
        return [
            (i, a.capacity, a.used_bytes, a.allocated_blocks)
            for i, a in enumerate(self._allocators)
            if a is not _RETIRED_ALLOCATOR
        ]

    def blocks(self, index: int) -> int:
        """How many blocks segment ``index`` has allocated (0 once retired)."""
        return self._allocators[index].allocated_blocks

    def drain(self, segments: Any) -> None:
        """Keep small allocations out of ``segments`` (indices) until the next call (``drain(())``: none)."""
        self._draining = frozenset(segments)

    def retire_empty(self, need: int, *, only: set[int] | None = None) -> int:
        """Retire empty segments (of ``only``, where given) until ``need`` more bytes may be mapped; the bytes
        freed. Retires nothing when the empty ones are not enough: their memory would go for no gain."""
        empty = [
            (a.capacity, i)
            for i, a in enumerate(self._allocators)
            if a is not _RETIRED_ALLOCATOR and a.used_bytes == 0 and (only is None or i in only) and self.retirable(i)
        ]
        if sum(n for n, _ in empty) < need:
            return 0
        freed = 0
        for nbytes, i in sorted(empty, reverse=True):  # the largest first: the fewest segments go
            if freed >= need:
                break
            self._retire(i)
            freed += nbytes
        return freed

    def _retire(self, index: int) -> None:
        seg, nbytes = self.segments[index], self._allocators[index].capacity
        if self._on_retire_segment is not None:
            self._on_retire_segment(seg)
        if not seg.discard_pages():
            log.warning("memory tier: segment %d retired, but its pages stay until every mapping of it goes", index)
        self._allocators[index] = _RETIRED_ALLOCATOR
        self._mapped -= nbytes
        self.retired.append(index)
        if self._last == index:
            self._last = 0  # tried first: a retired one allocates nothing, and the others are tried next
        log.info("memory tier: segment %d (%d bytes) retired, to map a value larger than a segment", index, nbytes)

    def allocate(self, size: int) -> Location | None:
        allocs = self._allocators
        last = self._last
        # segments being emptied take no small value (a large one, what they are emptied for, may go there)
        draining = self._draining if size <= self._segment_bytes else ()
        off = allocs[last].allocate(size) if not draining or last not in draining else None
        if off is not None:
            self._used += (size + ALIGNMENT - 1) & -ALIGNMENT
            return Location(last, off, size)
        for i, a in enumerate(allocs):
            if i != last and a.largest_free >= size and i not in draining:
                off = a.allocate(size)
                if off is not None:
                    self._last = i
                    self._used += (size + ALIGNMENT - 1) & -ALIGNMENT
                    return Location(i, off, size)
        # a value larger than a segment gets a segment of its own, in whole huge pages
        own = self.own_segment_bytes(size)
        if own and self._capacity - self._mapped < own:
            self.retire_empty(own - (self._capacity - self._mapped))
        want = min(own or self._segment_bytes, self._capacity - self._mapped)
        if want - want % ALIGNMENT >= size and want >= ALIGNMENT:
            i = self._add_segment(want)
            off = allocs[i].allocate(size)
            if off is not None:
                self._last = i
                self._used += (size + ALIGNMENT - 1) & -ALIGNMENT
                return Location(i, off, size)
        return None

    def allocate_run(self, sizes: list[int]) -> list[Location] | None:
        """Locations for ``sizes`` (each > 0) side by side in one segment already mapped, or None (then
        allocate one by one: that path grows the tier and lets the engine evict)."""
        allocs = self._allocators
        last = self._last
        order = [last] + [i for i in range(len(allocs)) if i != last]
        for i in order:
            if i in self._draining:
                continue
            offs = allocs[i].allocate_run(sizes)
            if offs is not None:
                self._last = i
                self._used += sum((n + ALIGNMENT - 1) & -ALIGNMENT for n in sizes)
                # tuple.__new__ builds each NamedTuple in C (its generated __new__ is Python code)
                return list(map(tuple.__new__, repeat(Location), zip(repeat(i), offs, sizes)))
        return None

    def split(self, segment: int, offset: int, first_size: int) -> int | None:
        """:meth:`OffsetAllocator.split` of a block of segment ``segment`` (used bytes do not change)."""
        return self._allocators[segment].split(offset, first_size)

    def split_many(self, segment: int, offset: int, sizes: list[int]) -> list[int]:
        """:meth:`OffsetAllocator.split_many` of a block of segment ``segment`` (used bytes do not change)."""
        return self._allocators[segment].split_many(offset, sizes)

    def free(self, location: Location) -> None:
        self._used -= self._allocators[location.segment].free(location.offset)

    def free_many(self, locations: list[Location]) -> None:
        """:meth:`free` of each location (blocks side by side go back as one range)."""
        by_segment: dict[int, list[int]] = {}
        for segment, offset, _ in locations:
            by_segment.setdefault(segment, []).append(offset)
        for segment, offsets in by_segment.items():
            self._used -= self._allocators[segment].free_many(offsets)

    def view(self, location: Location) -> memoryview:
        return self.segments[location.segment].buffer[location.offset : location.offset + location.size]

    def stats(self) -> dict:
        used = self.used
        frag = [a.fragmentation for a in self._allocators if a is not _RETIRED_ALLOCATOR]
        return {
            "used": used,
            "capacity": self._capacity,
            "mapped": self._mapped,
            "segments": len(self.segments) - len(self.retired),
            "retired_segments": len(self.retired),
            "hugepages": self.segments[0].hugepages if self.segments else "off",
            "fragmentation": round(max(frag), 4) if frag else 0.0,
        }

    def close(self) -> None:
        for seg in self.segments:
            seg.close()


__all__ = ["MemoryTier"]

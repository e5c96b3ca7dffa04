"""Offset allocator over one contiguous region (a shared segment, a GPU buffer).

Best fit with neighbour coalescing. Free blocks are grouped by size: a sorted list of the distinct
free sizes (``bisect``) and, per size, the set of offsets; two dicts map each free block's start and
end to its neighbours for coalescing. ``allocate`` is a binary search plus O(1) dict/set work;
``free`` is O(1) plus, when a size class appears or empties, an insertion into the list of distinct
sizes (a memmove of a few thousand pointers at most, since value sizes repeat). This beats a
balanced tree in Python by several times on the write hot path. Sizes are rounded up to
``alignment`` (64 bytes: a cache line, and enough for any dtype and for vectorised copy kernels).

Example::

    a = OffsetAllocator(1 << 20)
    off = a.allocate(1000)       # 0
    a.free(off)
    assert a.free_bytes == 1 << 20
"""

from __future__ import annotations

from bisect import bisect_left, insort

from kvstrata.errors import InvalidValue

ALIGNMENT = 64


class OffsetAllocator:
    """Hands out aligned ``[offset, offset + size)`` ranges of a region of ``capacity`` bytes."""

    __slots__ = ("_align", "_by_end", "_by_size", "_by_start", "_sizes", "_used", "alignment", "capacity", "used_bytes")

    def __init__(self, capacity: int, *, alignment: int = ALIGNMENT):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise InvalidValue(f"capacity: must be a positive int, got {capacity!r}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidValue(f"alignment: must be a power of two, got {alignment!r}")
        self.capacity = capacity - capacity % alignment
        self.alignment = alignment
        self._align = alignment - 1
        self._sizes: list[int] = []  # distinct sizes of free blocks, ascending
        self._by_size: dict[int, set[int]] = {}  # size -> offsets of free blocks of that size
        self._by_start: dict[int, int] = {}  # offset -> size of free blocks
        self._by_end: dict[int, int] = {}  # end offset -> start offset of free blocks
        self._used: dict[int, int] = {}  # offset -> rounded size of allocated blocks
        self.used_bytes = 0
        if self.capacity:
            self._insert_free(0, self.capacity)

    def _insert_free(self, offset: int, size: int) -> None:
        group = self._by_size.get(size)
        if group is None:
            self._by_size[size] = {offset}
            insort(self._sizes, size)
        else:
            group.add(offset)
        self._by_start[offset] = size
        self._by_end[offset + size] = offset

    def _remove_free(self, offset: int, size: int) -> None:
        group = self._by_size[size]
        group.discard(offset)
        if not group:
            del self._by_size[size]
            sizes = self._sizes
            del sizes[bisect_left(sizes, size)]
        del self._by_start[offset]
        del self._by_end[offset + size]

    def allocate(self, size: int) -> int | None:
        """The offset of a new block of at least ``size`` (> 0) bytes, or None when nothing fits."""
        size = (size + self._align) & ~self._align
        sizes = self._sizes
        i = bisect_left(sizes, size)
        if i == len(sizes):
            return None
        bsize = sizes[i]
        group = self._by_size[bsize]
        offset = min(group) if len(group) < 8 else group.pop()  # low offsets first keeps the tail free
        self._remove_free(offset, bsize)
        if bsize > size:
            self._insert_free(offset + size, bsize - size)
        self._used[offset] = size
        self.used_bytes += size
        return offset

    def allocate_run(self, sizes: list[int]) -> list[int] | None:
        """Offsets of consecutive blocks of ``sizes`` (each > 0) carved from one free range, or None when no
        free range holds them all. Each block is its own allocation afterwards (freed on its own); a batch
        written together lies together, so its copies merge into few long runs."""
        align = self._align
        total = sum((n + align) & ~align for n in sizes)
        base = self.allocate(total) if total else None
        return None if base is None else self.split_many(base, sizes)

    def split(self, offset: int, first_size: int) -> int | None:
        """Cut the allocated block at ``offset`` in two: its first ``first_size`` (> 0) bytes, rounded up,
        stay at ``offset`` and the rest becomes a block of its own; each is freed on its own afterwards.
        Returns the second block's offset, None where ``first_size`` takes the whole block. Used bytes do
        not change (a write reservation hands out its head this way, see ``store.reservations``)."""
        size = self._used.get(offset)
        if size is None:
            raise InvalidValue(f"offset: {offset} is not an allocated block")
        if isinstance(first_size, bool) or not isinstance(first_size, int) or first_size <= 0:
            raise InvalidValue(f"first_size: must be a positive int, got {first_size!r}")
        first = (first_size + self._align) & ~self._align
        if first > size:
            raise InvalidValue(f"first_size: {first_size} bytes is more than the block's {size}")
        if first == size:
            return None
        self._used[offset] = first
        self._used[offset + first] = size - first
        return offset + first

    def split_many(self, offset: int, sizes: list[int]) -> list[int]:
        """:meth:`split` of the allocated block at ``offset`` into pieces of ``sizes`` (each > 0, rounded up)
        laid side by side from ``offset``, in one step; the offset of each piece. What the pieces leave of the
        block becomes a block of its own. Nothing changes when a size is bad or the pieces exceed the block
        (ValueError). A write reservation's commit carves all its items this way."""
        size = self._used.get(offset)
        if size is None:
            raise InvalidValue(f"offset: {offset} is not an allocated block")
        align = self._align
        rounded = []
        for n in sizes:
            if type(n) is not int or n <= 0:
                raise InvalidValue(f"sizes: each must be a positive int, got {n!r}")
            rounded.append((n + align) & ~align)
        total = sum(rounded)
        if total > size:
            raise InvalidValue(f"sizes: {total} bytes in all is more than the block's {size}")
        used = self._used
        out = []
        off = offset
        for n in rounded:
            used[off] = n
            out.append(off)
            off += n
        if total < size:
            used[off] = size - total
        return out

    def free(self, offset: int) -> int:
        """Return the block at ``offset`` to the free list; returns its (rounded) size."""
        try:
            size = self._used.pop(offset)
        except KeyError:
            raise InvalidValue(f"offset: {offset} is not an allocated block") from None
        self.used_bytes -= size
        self._free_range(offset, offset + size)
        return size

    def free_many(self, offsets: list[int]) -> int:
        """:meth:`free` of each block; returns their total (rounded) size. Blocks that lie side by side (a
        batch allocated together) go back as one range: one free-list update instead of one per block."""
        used = self._used
        if len(offsets) < 4 or len(set(offsets)) != len(offsets) or not used.keys() >= set(offsets):
            return sum(map(self.free, offsets))  # the rare case, or a bad offset raising as free does
        sizes = list(map(used.pop, offsets))
        total = sum(sizes)
        self.used_bytes -= total
        blocks = sorted(zip(offsets, sizes))
        start, end = blocks[0][0], blocks[0][0]
        for offset, size in blocks:
            if offset != end:
                self._free_range(start, end)
                start = offset
            end = offset + size
        self._free_range(start, end)
        return total

    def _free_range(self, start: int, end: int) -> None:
        """Put ``[start, end)`` (no longer allocated) on the free list, merged with free neighbours."""
        nxt = self._by_start.get(end)
        if nxt is not None:
            self._remove_free(end, nxt)
            end += nxt
        prev = self._by_end.get(start)
        if prev is not None:
            self._remove_free(prev, start - prev)
            start = prev
        self._insert_free(start, end - start)

    def block_size(self, offset: int) -> int:
        """The rounded size of the allocated block at ``offset``."""
        return self._used[offset]

    @property
    def allocated_blocks(self) -> int:
        return len(self._used)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        return self._sizes[-1] if self._sizes else 0

    @property
    def fragmentation(self) -> float:
        """``1 - largest free block / free bytes``: 0 when all free space is one block."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free / free

    def stats(self) -> dict:
        return {
            "capacity": self.capacity,
            "used": self.used_bytes,
            "free": self.free_bytes,
            "free_blocks": len(self._by_start),
            "allocated_blocks": len(self._used),
            "largest_free": self.largest_free,
            "fragmentation": round(self.fragmentation, 4),
        }


__all__ = ["ALIGNMENT", "OffsetAllocator"]

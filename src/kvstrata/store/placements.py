"""Where each sealed object lies, in a table the worker writes and every client of the node maps read-only.

A client that must lease a key before copying its bytes (a cold ``mget_h2d``: the key was never read by
it, or was rewritten since) waits one round trip to the worker before the first byte moves. This table
lets it start the copy at once, from where the table says the key's bytes are, while the lease is asked
for; the lease then says whether that was right. The table is advice, never trusted:

- Each **placement** (a version's bytes at one place in DRAM, from the moment they are sealed until they
  are freed or moved) has an id no other placement ever gets (``Entry.placed``; a promotion back from
  SSD is a new placement). A lease reply carries its placement's id.
- The worker writes a bucket only after the placement's bytes are final (sealed, landed, promoted); a batch
  being sealed has its buckets written as its seal begins, under the store's lock, which a reader's lease
  request then waits for.
- A copy started from a bucket stands only if the lease names the same placement *and* the same place.
  Then that placement was alive when the bucket was written (before the copy began) and when the lease was
  taken, so its bytes never left in between (a placement never comes back once ended), and the lease
  pins them from then on. Otherwise the key is copied again from the leased place, after the first copy
  on the same stream. A stale, overwritten or torn bucket costs one wasted copy, never a wrong byte.

Layout: ``BUCKETS`` buckets of four 64-bit words, ``[tag, segment << 48 | offset, size, placement]``,
direct-mapped by a hash every process computes alike (CRC-32 of the key's UTF-8 bytes; Python's own
``hash`` differs per process). ``tag`` is the CRC and the key's length with the top bit set (0: empty).
A key whose bucket another key took since is simply not found. Only immutable objects are written.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvstrata._imports import imported

BUCKETS = 1 << 16  # 2 MiB: the placements of the last tens of thousands of objects written
WORDS = 4
TABLE_BYTES = BUCKETS * WORDS * 8
_FILLED = 1 << 63
_OFFSET_BITS = 48
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1


def key_hash(key: str) -> tuple[int, int]:
    """``(bucket, tag)`` of ``key``."""
    raw = key.encode()
    crc = zlib.crc32(raw)
    return crc & (BUCKETS - 1), _FILLED | (len(raw) & 0xFFFF) << 32 | crc


class PlacementTable:
    """The worker's side: a shared segment it writes with :meth:`publish` and passes to clients by ``fd``."""

    def __init__(self) -> None:
        from kvstrata.memory.shm import SharedSegment

        self.segment = SharedSegment.create(TABLE_BYTES, name="kvstrata-placements", hugepages="off", numa_node=None)
        self._rows = np.frombuffer(self.segment.buffer, dtype=np.uint64).reshape(BUCKETS, WORDS)
        # Written word by word: publish runs under the store's lock for every sealed batch, and a word store
        # through a memoryview costs ~0.8 us per entry, against ~1.8 us for a ctypes slice store of the four
        # words and ~20 us of fixed cost for numpy's vector path (2026-11-30, this machine).
        self._words: memoryview | None = memoryview(self.segment.buffer).cast("Q")

    @property
    def fd(self) -> int:
        return self.segment.fd

    def publish(self, entries: Iterable[Any], *, sealing: bool = False) -> None:
        """Write the placements of ``entries`` (store Entries whose bytes are final: ``key``, ``loc``, ``placed``).
        Called under the store's lock by whatever made them so; entries without DRAM bytes are skipped, and so are
        mutable ones, unless ``sealing``: the caller seals them all before it lets the lock go."""
        if self._words is not None:
            self.publish_rows((e.key, e.loc, e.placed) for e in entries if sealing or not e.mutable)

    def publish_rows(self, rows: Iterable[tuple[str, Any, int]]) -> None:
        """:meth:`publish` of ``(key, location, placement)`` rows: the placements of objects whose bytes are final,
        before their Entries exist (a commit ahead of its copies, as it lands)."""
        words = self._words
        if words is None:
            return
        crc32, mask = zlib.crc32, BUCKETS - 1
        for key, loc, placed in rows:
            if loc is None or not loc.size:
                continue
            raw = key.encode()
            crc = crc32(raw)
            at = (crc & mask) * WORDS
            words[at] = _FILLED | (len(raw) & 0xFFFF) << 32 | crc
            words[at + 1] = loc.segment << _OFFSET_BITS | loc.offset
            words[at + 2] = loc.size
            words[at + 3] = placed

    def withdraw(self, e: Any) -> None:
        """``e``'s placement ends (its version retired, or its bytes freed or moved): clear its bucket if that
        still names it, so readers stop starting copies from it (they would be redone, but a key found missing
        then would have had its tensors written). Called under the store's lock."""
        words = self._words
        if words is None or e.loc is None:
            return
        bucket, tag = key_hash(e.key)
        at = bucket * WORDS
        if words[at + 3] == e.placed and words[at] == tag:
            words[at] = 0

    def close(self) -> None:
        self._rows = self._words = None  # never a store into an unmapped page
        self.segment.close()


class PlacementHints:
    """A client's side: the mapped table, read with :meth:`lookup`."""

    def __init__(self, segment: Any) -> None:
        self.segment = segment
        # Read word by word: a device read looks up a stage's few keys at a time, and a numpy gather's fixed
        # costs (the index array, the fancy index, tolist) made that ~12 us for 4 keys, against ~1.5 us so.
        self._words: memoryview | None = memoryview(segment.buffer).cast("Q")

    def lookup(self, keys: list[str]) -> list[tuple[int, int, int, int] | None]:
        """Per key, ``(segment, offset, size, placement)`` as the table has it now, or None where it has
        nothing for that key. Advice only: see the module docstring for what a caller must check (a bucket
        may be torn: its words are read one by one while the worker may write them)."""
        words = self._words
        if words is None or not keys:
            return [None] * len(keys)
        native = _native()
        if native is not None and type(keys) is list:  # one native call, ~0.1 us a key against ~1
            return native.hints(words, keys, 0, len(keys), None)
        out: list[tuple[int, int, int, int] | None] = []
        crc32, mask = zlib.crc32, BUCKETS - 1
        for key in keys:
            raw = key.encode()
            crc = crc32(raw)
            at = (crc & mask) * WORDS
            if words[at] == _FILLED | (len(raw) & 0xFFFF) << 32 | crc:
                where = words[at + 1]
                out.append((where >> _OFFSET_BITS, where & _OFFSET_MASK, words[at + 2], words[at + 3]))
            else:
                out.append(None)
        return out

    def close(self, close_segment: Any = None) -> None:
        """Unmap the table (``close_segment(segment)`` does it where given: one that copes with a lookup
        in another thread still holding a view)."""
        self._words = None
        (close_segment or type(self.segment).close)(self.segment)


#: look keys up natively where the module is loaded (``tools/probe_native_planner.py`` switches it call by call)
NATIVE_LOOKUP = True


def _native() -> Any:
    """The native module of :mod:`kvstrata.ops.tensor_runs` where a device call of this process loaded it (its lookup
    reads the same words, holding the table's buffer for the call), else None: a lookup never starts a build or an
    import."""
    module = imported("kvstrata.ops.tensor_runs")  # (another thread may be importing it: not half made)
    return None if module is None or not NATIVE_LOOKUP else module.loaded()


__all__ = ["BUCKETS", "TABLE_BYTES", "PlacementHints", "PlacementTable", "key_hash"]

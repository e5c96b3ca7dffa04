"""Write reservations: an extent of the DRAM tier held by one writer, who carves new objects from it locally.

A create costs a round trip before its bytes can be written (the worker must say where). A writer that
holds a reservation knows where: it lays its next objects side by side from the reservation's head,
writes them, then :meth:`~ReservationMixin.commit` s them, which makes each one a sealed object at the
place it was written (as ``create`` + ``seal`` would). ``mset_d2h`` starts its DMA at once this way.

The engine keeps, per owner, ``[segment, head, end)``: one allocated block at ``head`` (counted as used
memory, so eviction watermarks see it; never visible to readers). A commit cuts each item off the head
(:meth:`~kvstrata.store.allocator.OffsetAllocator.split`), so every object is its own block, freed on its
own. Items must come in carving order, each at the head: a writer and the engine agree on every offset,
and a mismatch (a writer's bug, or a lost reply) is refused before anything of that item is used.

Example::

    loc = store.reserve("me", 1 << 20)                   # granted: loc.size bytes at loc.offset
    store.buffer(Location(loc.segment, loc.offset, 5))[:] = b"hello"
    assert store.commit("me", [("k", 5, loc.offset)]) == [None]
    assert store.get_bytes("k") == b"hello"

A commit may also come *before* the writer's copies into those places finished (``landed=``, a callable saying
whether they landed: True, failed: False, not yet: None). Its items are checked and its keys taken (for write-once
writes) at once and its per-item results returned; its pieces are cut off the reservation's block later
(:meth:`~ReservationMixin.cut_landings`, or whatever needs the block first), and its objects stay invisible until
the callable says True: the engine asks it whenever its lock is next taken (:class:`SettlingLock`), so every
operation after the writer said so, in any thread, sees the objects, and none before it does. False frees
them. :meth:`~ReservationMixin.settle` asks it now (the worker calls it while it waits for the word, to wake
readers waiting for those keys), and ``release_owner`` asks one last time when the writer goes away. What the
objects show as they land is told to the worker's validity table (:class:`Visibility`).

This is a mixin of :class:`~kvstrata.store.engine.ObjectStore`; every method takes its one metadata lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from kvstrata.errors import (
    CapacityError,
    ClosedError,
    InvalidType,
    InvalidValue,
    KeyExists,
    KvstrataError,
    ProtocolError,
)
from kvstrata.store.allocator import ALIGNMENT
from kvstrata.store.config import WriteMode
from kvstrata.store.objects import FAST_KEY_CHARS, ZERO_LOCATION, Entry, check_key, check_size
from kvstrata.store.tiers.base import Location

#: a reservation holds at most this share of the memory tier
RESERVE_SHARE = 8
#: all reservations together hold at most this share of it: the rest stays for objects, whatever the
#: number of writers (a reservation cannot be evicted)
RESERVED_TOTAL_SHARE = 2
_MASK = ALIGNMENT - 1
_TRIPLE_TYPES = frozenset({list, tuple})
log = logging.getLogger(__name__)


class SettlingLock:
    """The engine's metadata lock while commits wait for their copies (see the module docstring): taking it
    (``with``) first settles them, so what any operation sees includes every commit whose writer said its bytes
    landed before the operation began. It wraps the plain ``lock``, which the engine uses as ``_lock`` the rest
    of the time (a ``with`` on it costs nothing extra); ``acquire``/``release`` are the plain lock's (a
    Condition re-taking the lock after a wait, or a load re-taking it after I/O, settles at its next ``with``).
    """

    __slots__ = ("_store", "acquire", "release")

    def __init__(self, store: object, lock: threading.Lock) -> None:
        self.acquire, self.release = lock.acquire, lock.release
        self._store = store

    def __enter__(self) -> bool:
        self.acquire()
        if self._store._landings:  # type: ignore[attr-defined]
            try:
                self._store._settle_locked()  # type: ignore[attr-defined]
            except BaseException:
                self.release()
                raise
        return True

    def __exit__(self, *exc: object) -> None:
        self.release()


class Visibility(Protocol):
    """What the store tells of the commits it settles outside any request (:meth:`ObjectStore.set_visibility`)."""

    def change(self, keys: list[str]) -> AbstractContextManager[Any]:
        """Around showing new versions of ``keys`` that replace visible ones."""

    def shown(self, keys: list[str], ttl: float | None) -> None:
        """``keys`` just became visible, all with that TTL."""


class Landing:
    """A commit waiting for its copies, in :attr:`ObjectStore._landings`: ``landed`` says when they landed. Until it
    is cut (:meth:`ReservationMixin._cut_locked`) it keeps the items as carved (``carved``, ``refused``: each one's
    error or None) from ``start``; then ``waiting`` holds ``(key, size, location, version)`` per object to make."""

    __slots__ = ("carved", "landed", "owner", "refused", "segment", "start", "ttl_s", "waiting")

    def __init__(
        self,
        landed: Callable[[], bool | None],
        owner: object,
        ttl_s: float,
        segment: int,
        start: int,
        carved: list[tuple[str, int]],
        refused: list[Any],
    ) -> None:
        self.landed, self.owner, self.ttl_s = landed, owner, ttl_s
        self.segment, self.start, self.carved, self.refused = segment, start, carved, refused
        self.waiting: list[tuple[str, int, Location, int]] | None = None


class Reservation:
    """One owner's reserved extent ``[head, end)`` of segment ``segment`` (one allocated block at ``head``)."""

    __slots__ = ("end", "head", "segment")

    def __init__(self, segment: int, head: int, end: int) -> None:
        self.segment, self.head, self.end = segment, head, end

    @property
    def remaining(self) -> int:
        return self.end - self.head


class ReservationMixin:
    """``reserve`` / ``commit`` / ``reservation`` of the engine (see the module docstring)."""

    def reserve(self, owner: object, nbytes: int) -> Location:
        """Reserve about ``nbytes`` of DRAM for ``owner``'s next objects; the granted extent (its size may be
        less: at most a segment and 1/RESERVE_SHARE of the tier, and all owners' reservations together at most
        1/RESERVED_TOTAL_SHARE of it). Replaces ``owner``'s reservation, whose
        unused rest is freed; ``nbytes=0`` only drops it. Evicts as a create would; CapacityError when
        there is no room."""
        nbytes = check_size(nbytes, "nbytes")
        cap = min(self._mem.capacity // RESERVE_SHARE, self.config.segment_bytes) & ~_MASK
        grant = min((nbytes + _MASK) & ~_MASK, cap)
        with self._lock:
            if self._closing:
                raise ClosedError("the object store is closed")
            self._drop_reservation(owner)
            if grant == 0:
                return ZERO_LOCATION
            room = (self._mem.capacity // RESERVED_TOTAL_SHARE - self._reserved) & ~_MASK
            if room <= 0:
                raise CapacityError(
                    f"no room for a write reservation: reservations hold 1/{RESERVED_TOTAL_SHARE} of the memory "
                    "tier already"
                )
            grant = min(grant, room)
            loc = self._allocate(grant)  # may release the lock to evict
            self._drop_reservation(owner)  # another thread of this owner reserved meanwhile: last one wins
            if self._closing:
                self._mem.free(loc)
                raise ClosedError("the object store is closed")
            self._reservations[owner] = Reservation(loc.segment, loc.offset, loc.offset + grant)
            self._reserved += grant
            self._counts["reservations"] += 1
        if self._announced < len(self._mem.segments):
            self._announce_segments()
        return loc

    def reservation(self, owner: object) -> Location | None:
        """What is left of ``owner``'s reservation (size 0 when used up), None when it holds none."""
        with self._lock:
            r = self._reservations.get(owner)
            return None if r is None else Location(r.segment, r.head, r.remaining)

    def commit(
        self,
        owner: object,
        items: Iterable[tuple[str, int, int]],
        *,
        ttl: float | None = None,
        write_mode: WriteMode | str = WriteMode.MEMORY,
        nx: bool = False,
        landed: Callable[[], bool | None] | None = None,
        refuse: Callable[[str], KvstrataError | None] | None = None,
    ) -> list[KvstrataError | ValueError | TypeError | None]:
        """Make each ``(key, size, offset)`` a sealed object at ``offset`` of ``owner``'s reservation, whose
        bytes the owner wrote there; per item None or the exception. With ``landed`` (write mode ``memory``
        only), the owner's copies may still be running: the objects become visible once ``landed()`` says
        True (see the module docstring), and are freed if it says False.

        Items are cut off the reservation's head in order: an item's ``offset`` must be the head, which then
        moves past its ``size`` rounded up to ALIGNMENT. An item that breaks this (or has a bad size or
        offset, or there is no reservation) gets a ProtocolError/ValueError and so does every item after it:
        none of them is carved. A key refused otherwise (``nx`` and it exists, a bad key, an SSD tier full
        for a write-through, an exception ``refuse(key)`` returns: a cluster worker's key not its own) gets its
        exception and its piece is freed. Committed objects are as if created and sealed: new versions, waiters
        woken, TTLs started, written through to SSD where ``write_mode`` says so.

        With ``landed``, the commit does only what its results depend on: it checks the items and takes their
        keys (a write-once write meanwhile sees them, as unsealed creates). The rest, cutting the pieces off the
        reservation's block and giving the objects their versions (~half the work), waits in the commit's
        :class:`Landing` until :meth:`cut_landings` (which the worker calls right after its answer, while the
        copies still run) or until anything else needs it: its landing, another commit or reservation of the
        owner. The worker's answer waits for none of it.
        """
        items = items if isinstance(items, list) else list(items)
        n = len(items)
        out: list = [None] * n
        try:
            mode, ttl_s = self._check_write("_", 0, ttl, write_mode)  # the batch's options, checked once
            if landed is not None and mode is not WriteMode.MEMORY:
                raise InvalidValue(
                    f"write_mode: a commit ahead of its copies makes 'memory' objects, not {mode.value!r}"
                )
        except (KvstrataError, ValueError, TypeError) as exc:
            return [exc] * n
        slow: list[tuple[int, Entry]] = []
        with self._lock:
            if self._closing:
                return [ClosedError("the object store is closed")] * n
            r = self._reservations.get(owner)
            # 1. every item checked against the head, in order, up to the first bad one
            carved: list[tuple[str, int]] = []  # (key, size) of the items carved, in order
            if r is not None:
                start = head = r.head
                end = r.end
            for i, item in enumerate(items):
                if (
                    r is not None
                    and type(item) in _TRIPLE_TYPES
                    and len(item) == 3
                    and type(item[1]) is int
                    and type(item[2]) is int
                    and item[2] == head
                    and item[1] >= 0
                    and head + ((item[1] + _MASK) & ~_MASK) <= end
                ):
                    key, size = item[0], item[1]
                else:
                    if r is not None:
                        r.head = head  # _carving checks against the head so far
                    try:
                        key, size, _ = _carving(item, i, r)
                    except (KvstrataError, ValueError, TypeError) as exc:
                        out[i] = exc
                        for j in range(i + 1, n):
                            out[j] = ProtocolError(f"items[{j}]: not committed: items[{i}] before it was refused")
                        break
                carved.append((key, size))
                head += (size + _MASK) & ~_MASK
            if not carved:
                return out
            r.head = head
            self._reserved -= head - start
            # 2. each carved item checked as a key; where its copies may still run, its key taken (a write-once write
            # meanwhile must see it, as an unsealed create) and the rest left to cut_landings
            objects, creating = self._objects, self._creating
            seen: set[str] = set()  # an nx batch: a key committed earlier in it exists already
            for i, (key, _) in enumerate(carved):
                try:
                    if type(key) is not str or not key or len(key) > FAST_KEY_CHARS or not key.isascii():
                        check_key(key, f"items[{i}]")
                    if nx:
                        if key in seen or key in creating or (key in objects and self._lookup(key) is not None):
                            raise KeyExists(f"key {key!r} already exists")
                        seen.add(key)
                    if refuse is not None and (refusal := refuse(key)) is not None:
                        raise refusal
                except (KvstrataError, ValueError, TypeError) as exc:
                    out[i] = exc
                    continue
                if landed is not None:
                    creating[key] = creating.get(key, 0) + 1
            if landed is not None and None in out:  # (with every key refused, the pieces are freed below)
                self._landings.append(Landing(landed, owner, ttl_s, r.segment, start, carved, out[: len(carved)]))
                self._uncut += 1
                # The writer may have said so already (its word can come before its request is read): settle
                # now, and have every later ``with`` of the lock settle while any commit still waits. An
                # operation that read the plain lock before this switch began before the word was written.
                self._settle_locked()
                if self._landings:
                    self._lock = self._settling_lock
                return out
            # 3. the pieces cut off the reservation's block, each made an object (sealed together below)
            if self._uncut:
                self._cut_locked(owner)  # this owner's earlier pieces first: its block begins where they end
            entries: list[Entry] = []
            entries_at: list[int] = []  # each one's place in out
            refused: list[Location] = []
            version = self._versions
            for i, ((key, size), loc) in enumerate(zip(carved, self._pieces_locked(r.segment, start, carved))):
                if out[i] is None and mode is WriteMode.WRITE_BACK:
                    try:
                        hold = self._hold_disk_locked(key, size, mode)
                    except CapacityError as exc:
                        out[i] = exc
                else:
                    hold = 0
                if out[i] is not None:
                    if size:
                        refused.append(loc)
                    continue
                e = Entry(key, size, loc, mode, next(version), owner)
                e.disk_hold = hold
                if ttl_s:
                    e.ttl = ttl_s
                if mode is WriteMode.WRITE_THROUGH:
                    creating[key] = creating.get(key, 0) + 1  # an nx write meanwhile must see it; _finish undoes
                    slow.append((i, e))
                    continue
                entries.append(e)
                entries_at.append(i)
            if refused:
                self._mem.free_many(refused)
            self._counts["carved"] += len(entries) + len(slow)
            if entries:
                kept = self._seal_batch_locked(entries)
                if kept:
                    for n, exc in kept:
                        out[entries_at[n]] = exc
        return self._finish_slow(slow, out)

    def cut_landings(self, owner: object) -> None:
        """Cut the pieces of ``owner``'s commits waiting for their copies off its reservation and give their
        objects their versions, where not done yet (see :meth:`commit`): the worker does it right after answering
        such a commit, while the copies still run, so that their landing only has to show the objects."""
        with self._lock:  # (which settles those that landed, cutting them first)
            if self._uncut:
                self._cut_locked(owner)

    def _pieces_locked(self, segment: int, start: int, carved: list[tuple[str, int]]) -> list[Location]:
        """The locations of ``carved`` items laid side by side from ``start``, each piece cut off the block there
        (a reservation's) as a block of its own: one split of the allocator."""
        sizes = [size for _, size in carved if size]
        offsets = iter(self._mem.split_many(segment, start, sizes) if sizes else ())
        new = tuple.__new__
        return [new(Location, (segment, next(offsets), size)) if size else ZERO_LOCATION for _, size in carved]

    def _cut_locked(self, owner: object) -> None:
        """Cut every commit of ``owner`` waiting for its copies and not cut yet, in commit order (each one's
        pieces start where the previous one's end): their pieces become blocks, their objects get versions."""
        version = self._versions
        for batch in self._landings:
            if batch.waiting is not None or batch.owner is not owner:
                continue
            refused = batch.refused
            locs = self._pieces_locked(batch.segment, batch.start, batch.carved)
            batch.waiting = [
                (key, size, loc, next(version))
                for (key, size), loc, err in zip(batch.carved, locs, refused)
                if err is None
            ]
            if refused.count(None) != len(refused):
                freed = [loc for (_, size), loc, err in zip(batch.carved, locs, refused) if err is not None and size]
                if freed:
                    self._mem.free_many(freed)
            self._counts["carved"] += len(batch.waiting)
            batch.carved = batch.refused = None
            self._uncut -= 1

    def settle(self, owner: object = None, *, final: bool = False) -> bool:
        """Seal (or free) the commits waiting for their copies whose writer said so, ``owner``'s only if given;
        ``final``: a writer gone away, whose commits not landed by now never will. Whether any still waits."""
        with self._lock:  # which settles them all, except for final
            if final:
                self._settle_locked(owner, final=True)
            return any(owner is None or batch.owner is owner for batch in self._landings)

    def _settle_locked(self, owner: object = None, *, final: bool = False) -> None:
        if self._closed:  # the tiers are gone with every object: nothing to show or free
            self._landings = []
            self._uncut = 0
            self._lock = self._plain_lock
            return
        keep = []
        for batch in self._landings:
            state = None
            who = batch.owner
            if owner is None or who is owner:
                try:
                    state = batch.landed()
                except Exception:  # a bug: never leave the batch half-made, never raise into an unrelated call
                    log.exception("a commit's landing check failed; its objects are dropped")
                    state = False
                if state is None and final:
                    state = False
            if state is None:
                keep.append(batch)
                continue
            if batch.waiting is None:
                self._cut_locked(who)
            waiting = batch.waiting
            uncreate = self._uncreate
            for item in waiting:
                uncreate(item[0])
            if state:
                self._show_locked(waiting, who, batch.ttl_s)
            else:
                self._counts["carved"] -= len(waiting)
                freed = [item[2] for item in waiting if item[1]]
                if freed:
                    self._mem.free_many(freed)
        self._landings = keep
        if not keep:
            self._lock = self._plain_lock  # nothing waits: back to the plain lock (no Python call per ``with``)

    def _show_locked(self, waiting: list[tuple[str, int, Location, int]], owner: object, ttl_s: float) -> None:
        """Make the objects of a landed commit, ``(key, size, location, version)`` each, and show them."""
        if self._placements is not None:  # first: a reader right after the word copies from them (batch.py)
            self._placements.publish_rows((item[0], item[2], item[3]) for item in waiting)
        memory = WriteMode.MEMORY  # (the only mode a commit ahead of its copies makes)
        entries = [Entry(key, size, loc, memory, version, owner) for key, size, loc, version in waiting]
        if ttl_s:
            for e in entries:
                e.ttl = ttl_s
        hooks = self._visibility
        if hooks is None:
            _log_kept(self._seal_batch_locked(entries, published=True), entries)
            return
        # A key written meanwhile by a write that does not wait for creates (a plain put): this commit's object
        # replaces that version now, which readers may have kept leases on.
        objects = self._objects
        replaced = [e.key for e in entries if e.key in objects]
        if replaced:
            with hooks.change(replaced):
                kept = self._seal_batch_locked(entries, published=True)
        else:
            kept = self._seal_batch_locked(entries, published=True)
        _log_kept(kept, entries)
        if kept:
            gone = {n for n, _ in kept}
            entries = [e for n, e in enumerate(entries) if n not in gone]
        hooks.shown([e.key for e in entries], ttl_s or None)

    def _drop_reservation(self, owner: object) -> None:
        """Free the unused rest of ``owner``'s reservation (under the lock)."""
        if self._uncut:
            self._cut_locked(owner)  # the rest is a block of its own only once the pieces before it were cut
        r = self._reservations.pop(owner, None)
        if r is not None and r.remaining:
            self._mem.free(Location(r.segment, r.head, r.remaining))
            self._reserved -= r.remaining


def _log_kept(kept: list | None, entries: list[Entry]) -> None:
    """Objects of a landed commit not shown (the versions they replace kept their undeletable SSD files): logged,
    as the commit's writer was answered before."""
    if kept:
        n, exc = kept[0]
        log.error("%d objects of a landed commit were dropped, first %r: %s", len(kept), entries[n].key, exc)


def _carving(item: object, i: int, r: Reservation | None) -> tuple[object, int, int]:
    """``(key, size, offset)`` of item ``i``, checked against the reservation's head and end."""
    if type(item) not in (list, tuple) or len(item) != 3:
        raise InvalidType(f"items[{i}]: expected a (key, size, offset) triple, got {item!r:.80}")
    key, size, offset = item
    check_size(size, f"items[{i}].size")
    check_size(offset, f"items[{i}].offset")
    if r is None:
        raise ProtocolError(f"items[{i}]: this client holds no write reservation (reserve first)")
    if offset != r.head:
        raise ProtocolError(
            f"items[{i}]: offset {offset} is not the reservation's head {r.head} (items are carved in order)"
        )
    if (size + _MASK) & ~_MASK > r.remaining:
        raise ProtocolError(f"items[{i}]: {size} bytes from {offset} run past the reservation's end {r.end}")
    return key, size, offset


__all__ = [
    "RESERVED_TOTAL_SHARE",
    "RESERVE_SHARE",
    "Landing",
    "Reservation",
    "ReservationMixin",
    "SettlingLock",
    "Visibility",
]

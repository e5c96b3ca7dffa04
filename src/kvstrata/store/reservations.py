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
whether they landed: True, failed: False, not yet: None). Its items are checked and carved at once and its
per-item results returned, but its objects stay invisible (their keys taken for write-once writes) until the
callable says True: the engine asks it whenever its lock is next taken (:class:`SettlingLock`), so every
operation after the writer said so, in any thread, sees the objects, and none before it does. False frees
them. :meth:`~ReservationMixin.settle` asks it now (the worker calls it while it waits for the word, to wake
readers waiting for those keys), and ``release_owner`` asks one last time when the writer goes away.

This is a mixin of :class:`~kvstrata.store.engine.ObjectStore`; every method takes its one metadata lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

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
            if self._closed:
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
            if self._closed:
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
    ) -> list[KvstrataError | ValueError | TypeError | None]:
        """Make each ``(key, size, offset)`` a sealed object at ``offset`` of ``owner``'s reservation, whose
        bytes the owner wrote there; per item None or the exception. With ``landed`` (write mode ``memory``
        only), the owner's copies may still be running: the objects become visible once ``landed()`` says
        True (see the module docstring), and are freed if it says False.

        Items are cut off the reservation's head in order: an item's ``offset`` must be the head, which then
        moves past its ``size`` rounded up to ALIGNMENT. An item that breaks this (or has a bad size or
        offset, or there is no reservation) gets a ProtocolError/ValueError and so does every item after it:
        none of them is carved. A key refused otherwise (``nx`` and it exists, a bad key, an SSD tier full
        for a write-through) gets its exception and its piece is freed. Committed objects are as if created
        and sealed: new versions, waiters woken, TTLs started, written through to SSD where ``write_mode``
        says so.
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
            if self._closed:
                return [ClosedError("the object store is closed")] * n
            r = self._reservations.get(owner)
            # 1. every item checked against the head, in order, up to the first bad one; then one split
            # carves all the good ones' pieces off the reservation's block
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
            if carved:
                mem = self._mem
                segment = r.segment
                offsets = iter(mem.split_many(segment, start, [size for _, size in carved if size]))
                r.head = head
                self._reserved -= head - start
            # 2. each carved item checked as a key and made an object (sealed together below); where its copies may
            # still run, only its key taken and its version given: the object is made when they landed (settle), so
            # the writer's answer does not wait for it (~0.6 us a key on the development machine)
            objects, creating, versions = self._objects, self._creating, self._versions
            entries: list[Entry] = []
            waiting: list[tuple[str, int, Location, int]] = []  # (key, size, location, version), landed
            seen: set[str] = set()  # an nx batch: a key committed earlier in it exists already
            for i, (key, size) in enumerate(carved):
                loc = tuple.__new__(Location, (segment, next(offsets), size)) if size else ZERO_LOCATION
                try:
                    if type(key) is not str or not key or len(key) > FAST_KEY_CHARS or not key.isascii():
                        check_key(key, f"items[{i}]")
                    if nx:
                        if key in seen or key in creating or (key in objects and self._lookup(key) is not None):
                            raise KeyExists(f"key {key!r} already exists")
                        seen.add(key)
                except (KvstrataError, ValueError, TypeError) as exc:
                    out[i] = exc
                    if size:
                        mem.free(loc)
                    continue
                if landed is not None:  # taken: a write-once write meanwhile must see it (as an unsealed create)
                    creating[key] = creating.get(key, 0) + 1
                    waiting.append((key, size, loc, next(versions)))
                    continue
                e = Entry(key, size, loc, mode, next(versions), owner)
                if ttl_s:
                    e.ttl = ttl_s
                if mode is WriteMode.WRITE_THROUGH:
                    creating[key] = creating.get(key, 0) + 1  # an nx write meanwhile must see it; _finish undoes
                    slow.append((i, e))
                    continue
                entries.append(e)
            self._counts["carved"] += len(entries) + len(slow) + len(waiting)
            if waiting:
                self._landings.append((landed, owner, (waiting, ttl_s)))
                # The writer may have said so already (its word can come before its request is read): settle
                # now, and have every later ``with`` of the lock settle while any commit still waits. An
                # operation that read the plain lock before this switch began before the word was written.
                self._settle_locked()
                if self._landings:
                    self._lock = self._settling_lock
            elif entries:
                self._seal_batch_locked(entries)
        return self._finish_slow(slow, out)

    def settle(self, owner: object = None, *, final: bool = False) -> bool:
        """Seal (or free) the commits waiting for their copies whose writer said so, ``owner``'s only if given;
        ``final``: a writer gone away, whose commits not landed by now never will. Whether any still waits."""
        with self._lock:  # which settles them all, except for final
            if final:
                self._settle_locked(owner, final=True)
            return any(owner is None or who is owner for _, who, _ in self._landings)

    def _settle_locked(self, owner: object = None, *, final: bool = False) -> None:
        if self._closed:  # the tiers are gone with every object: nothing to show or free
            self._landings = []
            self._lock = self._plain_lock
            return
        keep = []
        for batch in self._landings:
            landed, who, (waiting, ttl_s) = batch
            state = None
            if owner is None or who is owner:
                try:
                    state = landed()
                except Exception:  # a bug: never leave the batch half-made, never raise into an unrelated call
                    log.exception("a commit's landing check failed; its objects are dropped")
                    state = False
                if state is None and final:
                    state = False
            if state is None:
                keep.append(batch)
                continue
            uncreate = self._uncreate
            for item in waiting:
                uncreate(item[0])
            if state:
                if self._placements is not None:  # first: a reader right after the word copies from them (batch.py)
                    self._placements.publish_rows((item[0], item[2], item[3]) for item in waiting)
                entries = []
                memory = WriteMode.MEMORY  # (the only mode a commit ahead of its copies makes)
                for key, size, loc, version in waiting:
                    e = Entry(key, size, loc, memory, version, who)
                    if ttl_s:
                        e.ttl = ttl_s
                    entries.append(e)
                # A key written meanwhile by a write that does not wait for creates (a plain put): this commit's
                # object replaces that version now, which readers may have kept leases on.
                change, objects = self._visibility_change, self._objects
                replaced = [e.key for e in entries if e.key in objects] if change is not None else None
                if replaced:
                    with change(replaced):
                        self._seal_batch_locked(entries, published=True)
                else:
                    self._seal_batch_locked(entries, published=True)
            else:
                self._counts["carved"] -= len(waiting)
                freed = [item[2] for item in waiting if item[1]]
                if freed:
                    self._mem.free_many(freed)
        self._landings = keep
        if not keep:
            self._lock = self._plain_lock  # nothing waits: back to the plain lock (no Python call per ``with``)

    def _drop_reservation(self, owner: object) -> None:
        """Free the unused rest of ``owner``'s reservation (under the lock)."""
        r = self._reservations.pop(owner, None)
        if r is not None and r.remaining:
            self._mem.free(Location(r.segment, r.head, r.remaining))
            self._reserved -= r.remaining


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


__all__ = ["RESERVED_TOTAL_SHARE", "RESERVE_SHARE", "Reservation", "ReservationMixin", "SettlingLock"]

"""The write path: create -> fill -> seal/publish, ``put``, and how a version leaves service.

A write reserves DRAM under the engine's lock, fills the bytes without it (in this process or,
through a shared mapping, in a client's), then seals under the lock; until then the new version is
invisible (a :class:`~kvstrata.store.objects.Entry` in ``_pending``, counted in ``_creating`` so an
``nx`` write of the same key sees it). A replacing write is a new version: the old one is retired,
and its bytes are freed once no lease holds them. Small values (``put`` up to ``_SMALL`` bytes) are
reserved, copied and sealed in one critical section.

The retire/free helpers at the end are used by every path that takes a version out of service
(delete, expiry, eviction, release of a dead version's last lease). Batch forms: store.batch.

This is a mixin of :class:`~kvstrata.store.engine.ObjectStore`; it shares the engine's fields.
"""

from __future__ import annotations

import heapq
import logging
import time

from kvstrata.errors import CapacityError, ClosedError, InvalidValue, KeyExists, KeyNotFound, KvstrataError, ServerError
from kvstrata.store.allocator import ALIGNMENT
from kvstrata.store.config import WriteMode
from kvstrata.store.objects import Entry, as_bytes_view, check_key, check_mode, check_size, check_ttl
from kvstrata.store.tiers.base import Location

_SMALL = 64 << 10  # values up to this size are copied under the lock (cheaper than a lease)
_ALIGN_MASK = ALIGNMENT - 1
_ALIGN_SHIFT = ALIGNMENT.bit_length() - 1  # blocks are whole ALIGNMENT units: same units, same block
_PERSISTENT = (WriteMode.WRITE_THROUGH, WriteMode.WRITE_BACK)

log = logging.getLogger(__name__)


#: why a create of a key is refused while the same owner's earlier create of it is open
_OPEN_CREATE = (
    "key {key!r}: this client's earlier create of it is still open (seal, publish or abort that buffer first)"
)


def reusable_block(old: Entry | None, size: int) -> bool:
    """Whether a new version of ``size`` (> 0) bytes may be written into the block of the key's current version
    ``old``: nobody holds it (no lease) and it is the size the new one needs, in whole ALIGNMENT units."""
    return (
        old is not None
        and old.leases == 0
        and old.loc is not None
        and size > 0
        and (old.size + _ALIGN_MASK) >> _ALIGN_SHIFT == (size + _ALIGN_MASK) >> _ALIGN_SHIFT
    )


class WriteMixin:
    """``create`` / ``seal`` / ``publish`` / ``abort`` / ``put`` of the engine, and retiring versions (see the
    module docstring)."""

    def create(
        self,
        key: str,
        size: int,
        *,
        owner: object,
        ttl: float | None = None,
        write_mode: WriteMode | str = WriteMode.MEMORY,
        nx: bool = False,
    ) -> Location:
        """Reserve ``size`` bytes for a new version of ``key``; fill them, then :meth:`seal` or :meth:`publish`.

        KeyExists if ``nx`` and the key is present or being created; CapacityError when there is no
        room even after eviction. KeyExists too while the same owner's earlier create of ``key`` is open: that
        create's bytes stay its writer's until it seals or aborts it (replacing it would free memory the writer's
        buffer still points into).
        """
        e = self._reserve(key, size, owner, ttl, write_mode, nx)
        with self._lock:
            if (key, owner) in self._pending:
                self._abort_locked(e)
                raise KeyExists(_OPEN_CREATE.format(key=key))
            self._pending[(key, owner)] = e
            self._owner_creates.setdefault(owner, set()).add(key)
        if self._announced < len(self._mem.segments):
            self._announce_segments()
        return e.loc

    def seal(self, key: str, *, owner: object) -> None:
        """Make ``owner``'s create of ``key`` visible and immutable; waiters wake."""
        self._finish(self._take_pending(key, owner), mutable=False)

    def publish(self, key: str, *, owner: object) -> None:
        """Make ``owner``'s create of ``key`` visible but mutable (a later publish/put replaces it)."""
        self._finish(self._take_pending(key, owner), mutable=True)

    def abort(self, key: str, *, owner: object) -> None:
        """Drop ``owner``'s unsealed create of ``key`` (no-op when there is none)."""
        check_key(key)
        with self._lock:
            e = self._pending.pop((key, owner), None)
            if e is not None:
                self._forget_create(key, owner)
                self._abort_locked(e)

    def put(
        self,
        key: str,
        data: object,
        *,
        owner: object = None,
        ttl: float | None = None,
        write_mode: WriteMode | str = WriteMode.MEMORY,
        nx: bool = False,
    ) -> None:
        """Store ``data`` (bytes-like) under ``key``, atomically replacing an older version."""
        view = as_bytes_view(data)
        size = view.nbytes
        mode, ttl_s = self._check_write(key, size, ttl, write_mode)
        if size <= _SMALL and mode is not WriteMode.WRITE_THROUGH:
            # small values: reserve, copy and seal in one critical section (a copy of a few KiB
            # costs less than taking the lock twice)
            with self._lock:
                self._put_small_locked(key, view, size, owner, mode, ttl_s, nx)
        else:
            with self._lock:
                e = self._reserve_locked(key, size, owner, mode, ttl_s, nx)
            if self._announced < len(self._mem.segments):
                self._announce_segments()
            try:
                self._mem.view(e.loc)[:] = view
            except BaseException:
                with self._lock:
                    self._abort_locked(e)
                raise
            self._finish(e, mutable=False)
        if self._announced < len(self._mem.segments):
            self._announce_segments()

    def _put_small_locked(
        self, key: str, view: memoryview, size: int, owner: object, mode: WriteMode, ttl_s: float, nx: bool
    ) -> None:
        """:meth:`put` of a value of at most ``_SMALL`` bytes, checked, not written through: reserved, copied and
        sealed under the lock (held; :meth:`_allocate` may let it go to wait for room)."""
        old = self._objects.get(key)
        if not nx and not self._closing and reusable_block(old, size):
            # Nobody holds the old version's bytes (readers, local-read caches, the flusher and
            # spills all pin with a lease) and its block is the size the new one needs: write
            # the new version there instead of allocating and freeing. Under the lock, so no
            # reader sees the bytes change; the new version is still a new Entry (version, TTL,
            # placement: a device read that copied early from the old one, unpinned, is redone).
            hold = self._hold_disk_locked(key, size, mode)
            if old.on_disk:  # its file goes before its bytes are overwritten (ServerError: the old one stays)
                try:
                    self._unlink_replaced(old)
                except ServerError:
                    if hold:
                        self._disk.unreserve(hold)
                    raise
            loc = old.loc
            if loc.size != size:
                loc = Location(loc.segment, loc.offset, size)
            self._mem.view(loc)[:] = view
            old.loc = None  # the block is the new version's now: retiring the old one frees nothing
            e = Entry(key, size, loc, mode, next(self._versions), owner)
            e.disk_hold = hold
            if ttl_s:
                e.ttl = ttl_s
        else:
            e = self._reserve_locked(key, size, owner, mode, ttl_s, nx)
            if size:
                self._mem.view(e.loc)[:] = view
            self._uncreate(key)
        self._seal_locked(e, None, mutable=False)

    def _put_small_at_locked(
        self, key: str, view: memoryview, loc: Location, owner: object, mode: WriteMode, ttl_s: float, nx: bool
    ) -> None:
        """:meth:`_put_small_locked` into ``loc``, a block the caller allocated for it (freed here if the key is
        refused). The lock is held throughout, so no create of the key can come in between."""
        if self._closing or (nx and (key in self._creating or self._lookup(key) is not None)):
            self._mem.free(loc)
            if self._closing:
                raise ClosedError("the object store is closed")
            raise KeyExists(f"key {key!r} already exists")
        try:
            hold = self._hold_disk_locked(key, loc.size, mode)
        except CapacityError:
            self._mem.free(loc)
            raise
        e = Entry(key, loc.size, loc, mode, next(self._versions), owner)
        e.disk_hold = hold
        if ttl_s:
            e.ttl = ttl_s
        self._mem.view(loc)[:] = view
        self._seal_locked(e, None, mutable=False)

    def _check_write(self, key, size, ttl, write_mode) -> tuple[WriteMode, float]:
        check_key(key)
        if type(size) is not int or size < 0:  # the checks' common cases inline: this runs for every write
            check_size(size)
        mode = write_mode if type(write_mode) is WriteMode else check_mode(write_mode)
        ttl_s = 0.0 if ttl is None else check_ttl(ttl)
        if mode in _PERSISTENT and self._disk is None:
            raise InvalidValue(
                f"write_mode: {mode.value} needs an SSD tier (the worker's --disk-dir, or disk_dir= of an "
                f"embedded store)"
            )
        if not self._mem.fits_ever(size):
            raise CapacityError(
                f"value of {size} bytes does not fit the memory tier ({self._mem.capacity} bytes, "
                f"segments of {self.config.segment_bytes})"
            )
        return mode, ttl_s

    def _reserve(self, key, size, owner, ttl, write_mode, nx) -> Entry:
        mode, ttl_s = self._check_write(key, size, ttl, write_mode)
        with self._lock:
            return self._reserve_locked(key, size, owner, mode, ttl_s, nx)

    def _reserve_locked(self, key, size, owner, mode, ttl_s, nx) -> Entry:
        if self._closing:  # (close() flushes write-back data: nothing new may be written from then on)
            raise ClosedError("the object store is closed")
        if nx and (key in self._creating or self._lookup(key) is not None):
            raise KeyExists(f"key {key!r} already exists")
        hold = self._hold_disk_locked(key, size, mode)
        # counted before allocating: _allocate may release the lock, and a concurrent nx write of
        # the same key must see this one
        self._creating[key] = self._creating.get(key, 0) + 1
        try:
            loc = self._allocate(size)
        except BaseException:
            self._uncreate(key)
            if hold:
                self._disk.unreserve(hold)
            raise
        if self._closing:  # close() began while _allocate let the lock go
            self._uncreate(key)
            self._free_loc(loc)
            if hold:
                self._disk.unreserve(hold)
            raise ClosedError("the object store is closed")
        e = Entry(key, size, loc, mode, next(self._versions), owner)
        e.disk_hold = hold
        if ttl_s:
            e.ttl = ttl_s
        return e

    def _hold_disk_locked(self, key: str, size: int, mode: WriteMode) -> int:
        """The SSD bytes reserved now for a ``write_back`` version's file (0 for other modes), so that every write-back
        write acknowledged can be flushed: one the SSD tier cannot take is refused with ``CapacityError`` here, as a
        ``write_through`` one is, not acknowledged and lost at shutdown. Given back by :meth:`_drop_disk_hold`, or
        taken by the flush or spill that writes the file."""
        if mode is not WriteMode.WRITE_BACK:
            return 0
        disk = self._disk
        nbytes = disk.file_bytes(key, size)
        if not disk.reserve(nbytes):
            raise CapacityError(
                f"SSD tier full: {nbytes} bytes needed to write {key!r} back, {disk.used} of {disk.capacity} used "
                f"and {disk.stats()['reserved']} reserved"
            )
        short = disk.fs_shortfall()
        if short:
            disk.unreserve(nbytes)
            raise CapacityError(
                f"no room on the SSD tier's file system ({disk.directory}) to write {key!r} back: {short} bytes "
                f"short of the {disk.stats()['reserved'] + nbytes} its files held for writing need (another program "
                f"fills it, or --disk-size is larger than the room there)"
            )
        return nbytes

    def _drop_disk_hold(self, e: Entry) -> None:
        if e.disk_hold:
            self._disk.unreserve(e.disk_hold)
            e.disk_hold = 0

    def _take_pending(self, key: str, owner: object) -> Entry:
        check_key(key)
        with self._lock:
            e = self._pending.pop((key, owner), None)
            if e is None:
                raise KeyNotFound(f"no create of key {key!r} in progress for this owner")
            self._forget_create(key, owner)
        return e

    def _forget_create(self, key: str, owner: object) -> None:
        creates = self._owner_creates.get(owner)
        if creates is not None:
            creates.discard(key)
            if not creates:
                del self._owner_creates[owner]

    def _finish(self, e: Entry, *, mutable: bool) -> None:
        pending = None
        disk = self._disk
        if e.mode is WriteMode.WRITE_THROUGH:
            nbytes = disk.file_bytes(e.key, e.size)
            with self._lock:
                ok = disk.reserve(nbytes)
                if not ok:
                    self._abort_locked(e)
            if not ok:
                raise CapacityError(
                    f"SSD tier full: {nbytes} bytes needed for {e.key!r}, {disk.used} of {disk.capacity} used"
                )
            try:
                expires_at = time.time() + e.ttl if e.ttl else 0.0
                pending = disk.write_temp(e.key, self.buffer(e.loc), e.mode, expires_at)
            except BaseException:
                with self._lock:
                    disk.unreserve(nbytes)
                    self._abort_locked(e)
                raise
        with self._lock:
            self._uncreate(e.key)
            if self._closing:
                if pending is not None:
                    disk.discard(pending)
                self._free_locked(e)
                raise ClosedError("the object store is closed")
            self._seal_locked(e, pending, mutable)

    def _seal_locked(self, e: Entry, pending, mutable: bool) -> None:
        """Make ``e`` the visible version of its key (after its bytes and any SSD file are complete).

        When its SSD file (``pending``) cannot be committed, or the file of the version it replaces cannot be
        deleted, ``e`` is freed and the ``ServerError`` raised: the older version stays, unchanged."""
        key = e.key
        old = self._objects.get(key)
        try:
            if pending is not None:
                try:
                    self._disk.commit(key, pending, e.mode, e.size)
                except KvstrataError:
                    if old is not None and old.on_disk and key not in self._disk.index:
                        self._lost_disk_copy(old)  # (a second failure: its file could not be put back)
                    raise
                e.on_disk = True
            elif old is not None and old.on_disk:
                self._unlink_replaced(old)
        except KvstrataError:
            self._free_locked(e)
            raise
        if old is not None:
            e.ref = old.ref
            self._retire(old, keep_disk_file=pending is not None)
        e.sealed = True
        e.mutable = mutable
        if e.ttl:
            e.expires = time.monotonic() + e.ttl
            heapq.heappush(self._ttl_heap, (e.expires, e.version, key))
        self._objects[key] = e
        if e.size:
            self._clock.add(key, e)
        if e.mode is WriteMode.WRITE_BACK:
            e.dirty = True
            self._dirty[key] = e
            self._wake.set()
        if self._waiters:
            w = self._waiters.get(key)
            if w is not None:
                w[0].notify_all()
        if self._placements is not None and not mutable:
            self._placements.publish((e,))
        if self._mem.used > self._high:
            self._wake.set()

    # -- retiring and freeing versions -----------------------------------------------------------
    def _free_entries(self, freed: list[Entry]) -> None:
        """:meth:`_free_locked` of entries whose blocks are all sized: blocks side by side go back as one range."""
        if len(freed) < 4:  # too few to be worth grouping
            free = self._mem.free
            for e in freed:
                free(e.loc)
                e.loc = None
            return
        self._mem.free_many([e.loc for e in freed])
        for e in freed:
            e.loc = None

    @staticmethod
    def _wall_expiry(e: Entry) -> float:
        """A sealed entry's deadline as Unix time (what SSD files record), 0 for never."""
        return time.time() + (e.expires - time.monotonic()) if e.expires else 0.0

    def _uncreate(self, key: str) -> None:
        n = self._creating.get(key, 0) - 1
        if n > 0:
            self._creating[key] = n
        else:
            self._creating.pop(key, None)

    def _abort_locked(self, e: Entry) -> None:
        self._uncreate(e.key)
        self._free_locked(e)

    def _free_locked(self, e: Entry) -> None:
        if e.disk_hold:
            self._drop_disk_hold(e)
        if e.loc is not None and e.loc.size:
            if self._placements is not None and not e.dead:  # a dead version's placement went with _retire
                self._placements.withdraw(e)
            self._mem.free(e.loc)
        e.loc = None

    def _unlink_replaced(self, old: Entry) -> None:
        """Delete the SSD file of ``old``, a visible version about to be replaced by one without a file (else a
        restart would bring it back). ``ServerError`` with nothing changed when the file cannot be deleted."""
        self._disk.remove(old.key)
        old.on_disk = False

    def _lost_disk_copy(self, e: Entry) -> None:
        """``e``'s SSD file is gone (a failed commit over it could not put it back). Resident: kept, written to SSD
        again by the write-back flusher where its mode persists; else its data is gone with the file."""
        e.on_disk = False
        if e.loc is not None:
            if e.mode in _PERSISTENT:
                e.dirty = True
                self._dirty[e.key] = e
                self._wake.set()
            return
        log.error("the SSD file of %r was lost in a failed commit over it, and no DRAM copy remains: dropped", e.key)
        if self._objects.get(e.key) is e:
            del self._objects[e.key]
        self._retire(e)
        self._counts["corrupt"] += 1

    def _retire_expired(self, e: Entry) -> None:
        """Take ``e``, a visible version whose time to live ran out, out of service, and count it. A file of it
        the SSD tier cannot delete now stays indexed (never served; its header's deadline has passed, so the next
        start drops it), logged."""
        try:
            self._retire(e)
        except ServerError as exc:
            log.error("expired %r: %s; its file stays until the next start", e.key, exc)
            self._retire(e, keep_disk_file=True)
        if self._objects.get(e.key) is e:
            del self._objects[e.key]
        self._counts["expired"] += 1

    def _retire(self, e: Entry, *, keep_disk_file: bool = False, freed: list[Entry] | None = None) -> None:
        """Take a visible version out of service (deleted, replaced, expired, dropped). With ``freed``, a block
        to free is appended there instead (the caller frees them all with :meth:`_free_entries`).

        Its SSD file is deleted first (unless ``keep_disk_file``): ``ServerError`` with nothing changed when that
        fails, the caller keeping ``e`` visible (or deciding otherwise, as :meth:`_retire_expired` does)."""
        if e.on_disk and not keep_disk_file:
            self._disk.remove(e.key)
        e.on_disk = False
        e.dead = True
        self._evict_blocked = False
        if self._placements is not None:
            self._placements.withdraw(e)
        key = e.key
        self._clock.remove(key, e)
        if self._dirty.get(key) is e:
            del self._dirty[key]
        if e.disk_hold:  # never flushed: its file's room goes back
            self._drop_disk_hold(e)
        if e.write_hold:  # its file is being written (flush, spill): the room goes back now, not when that write ends
            self._disk.unreserve(e.write_hold)
            e.write_hold = 0
        if e.gpu is not None:
            self._gpu_retire(e)
        if e.leases == 0:
            if freed is None:
                self._free_locked(e)
            elif e.loc is not None and e.loc.size:
                freed.append(e)
            else:
                e.loc = None


__all__ = ["WriteMixin"]

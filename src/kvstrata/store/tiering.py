"""Moving bytes between tiers: allocation with eviction, spilling, promotion, write-back flushing.

The rule everywhere: decide under the engine's lock, move bytes without it. An object being
spilled or flushed is pinned (``leases += 1``) so its DRAM copy cannot vanish while its file is
written; an object being promoted is marked ``loading`` so concurrent readers wait for the one load
instead of reading the file twice. After the lock is taken back, the entry is checked again: if it
was deleted or replaced meanwhile, the moved bytes are thrown away, never attached to the new
version. Methods here whose docstring says "may release the lock" leave every caller to re-check
its own state afterwards.

This is a mixin of :class:`~kvstrata.store.engine.ObjectStore`; it shares the engine's fields.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from kvstrata.errors import CapacityError, CorruptData, KeyNotFound
from kvstrata.store.config import WriteMode
from kvstrata.store.objects import ZERO_LOCATION, Entry
from kvstrata.store.tiers.base import Location
from kvstrata.units import format_size

#: how long an allocation waits for objects another thread is writing to SSD (they can then be dropped to make
#: room) before it gives up, and how often it looks again meanwhile
MOVE_WAIT_S = 10.0
MOVE_POLL_S = 0.0005
#: how long a value larger than a segment waits for other writes in progress to seal (their blocks keep a segment
#: from being emptied for it) before it is refused
LARGE_WAIT_S = 2.0
#: at most one info line this often sums up the spills, evictions and promotions since the last one
#: (each is logged at debug level)
MOVES_REPORT_S = 10.0
#: what the summary calls each move
_MOVE_WORDS = {"spills": "spilled to SSD", "evictions": "evictable dropped", "promotions": "promoted back"}

log = logging.getLogger(__name__)


class TieringMixin:
    """Eviction, spill, promotion and flush mechanics of the engine (see the module docstring)."""

    # -- DRAM allocation and eviction --------------------------------------------------------------
    def _allocate(self, size: int) -> Location:
        """A DRAM range of ``size`` bytes, evicting as needed (and waiting, up to :data:`MOVE_WAIT_S`, for objects
        another thread is writing to SSD, which can be dropped then). Under the lock; may release the lock."""
        if size == 0:
            return ZERO_LOCATION
        mem = self._mem
        own = mem.own_segment_bytes(size)  # larger than a segment: it needs a segment of its own
        if not own:
            return self._allocate_in(size, 0)
        try:
            return self._allocate_in(size, own)
        finally:
            mem.drain(())  # the segments emptied for it take small writes again (or were retired)

    def _allocate_in(self, size: int, own: int) -> Location:
        mem = self._mem
        deadline = None
        while True:
            loc = mem.allocate(size)
            if loc is not None:
                if mem.used > self._high:
                    self._wake.set()
                return loc
            if self._clear_segments(own - mem.segment_room()) if own else self._make_room(size):
                continue
            # Writes in progress (unsealed creates, puts copying their bytes) hold blocks for milliseconds, most often:
            # a value that needs whole segments waits for them, up to LARGE_WAIT_S, rather than be refused while they
            # land (this write counts itself among the puts in progress)
            waits_for_writes = own and (self._pending or sum(self._creating.values()) > 1)
            if self._moving or waits_for_writes:
                # The objects that could make room are being written to SSD by another thread (a write-back
                # flush, the background eviction): they become free to drop once written, within milliseconds.
                # Wait for them rather than refuse a write that fits.
                now = time.monotonic()
                if deadline is None:
                    deadline = now + (MOVE_WAIT_S if self._moving else LARGE_WAIT_S)
                if now < deadline:
                    self._lock.release()
                    try:
                        time.sleep(MOVE_POLL_S)
                    finally:
                        self._lock.acquire()
                    continue
            if own:
                raise CapacityError(
                    f"no room for {size} bytes: a value larger than a segment ({self.config.segment_bytes} bytes) "
                    f"needs {own} bytes of the memory tier to itself, and its segments hold objects that cannot be "
                    f"evicted (leased, unsealed, or no SSD room to spill); {mem.used} of {mem.capacity} bytes used"
                )
            raise CapacityError(
                f"no room for {size} bytes: memory tier {mem.used} of {mem.capacity} bytes used and nothing "
                f"more can be evicted (leased, unsealed, or no SSD room to spill)"
            )

    def _can_evict(self, e: Entry) -> bool:
        if e.leases or e.loc is None:
            return False
        if e.mode is WriteMode.EVICTABLE or (e.on_disk and not e.dirty):
            return True
        disk = self._disk
        return disk is not None and (e.disk_hold > 0 or disk.has_room(disk.file_bytes(e.key, e.size)))

    def _clear_segments(self, need: int) -> bool:
        """Empty DRAM segments for a value larger than a segment: evict or spill every object of the segments holding
        the fewest bytes, until segments of ``need`` bytes are empty (the memory tier then retires them to map the
        value's own). Only segments whose every block is an object that may go are chosen: emptying one that keeps a
        lease would drop objects for nothing. False when no such segments add up to ``need``. May release the lock."""
        mem = self._mem
        usage = mem.segment_usage()
        if need <= 0 or not usage:
            return False
        held: dict[int, list[Entry]] = {u[0]: [] for u in usage}
        for e in self._objects.values():
            loc = e.loc
            if loc is not None and loc.size and loc.segment in held:
                held[loc.segment].append(e)
        chosen: list[int] = []
        found = 0
        disk = self._disk
        spill_room = disk.capacity - disk.used - disk.stats()["reserved"] if disk is not None else 0
        for i, nbytes, _, blocks in sorted(usage, key=lambda u: u[2]):  # the fewest bytes to move first
            if found >= need:
                break
            entries = held[i]
            if len(entries) != blocks or not all(map(self._can_evict, entries)):
                continue
            files = sum(disk.file_bytes(e.key, e.size) for e in entries if self._needs_file(e)) if disk else 0
            if files > spill_room:  # each fits alone (_can_evict), not all of them together
                continue
            spill_room -= files
            chosen.append(i)
            found += nbytes
        if found < need:
            return False
        # New small writes go elsewhere while these empty (a spill releases the lock): else they refill them
        mem.drain(chosen)
        victims = [e for i in chosen for e in held[i]]
        return self._make_room(sum(e.size for e in victims), iter(victims))

    @staticmethod
    def _needs_file(e: Entry) -> bool:
        """Whether evicting ``e`` writes an SSD file whose room is not held yet."""
        return e.mode is not WriteMode.EVICTABLE and not (e.on_disk and not e.dirty) and not e.disk_hold

    def _make_room(self, goal: int, victims: Iterator[Entry] | None = None) -> bool:
        """Free about ``goal`` bytes of DRAM; False when nothing could be freed. May release the lock.

        Evictable objects are dropped and objects with a clean SSD copy lose their DRAM copy at
        once; others are spilled (file written without the lock, then committed). The victims are the
        eviction policy's, or ``victims`` (resident objects that may go, each checked with :meth:`_can_evict`).
        """
        freed = 0
        jobs: list[tuple[Entry, int]] = []
        pending = 0
        disk = self._disk
        while freed + pending < goal:
            if victims is None:
                e = self._clock.next_victim(self._can_evict)
            else:
                e = next(victims, None)
                if e is not None:
                    self._clock.remove(e.key, e)  # as next_victim would: a spill puts it back if it stays
            if e is None:
                break
            if e.mode is WriteMode.EVICTABLE:
                del self._objects[e.key]
                freed += e.size
                self._retire(e)
                self._moved("evictions", e)
            elif e.on_disk and not e.dirty:  # spilled with no write: its SSD copy is current
                freed += e.size
                self._free_locked(e)
                self._moved("spills", e)
            elif e.disk_hold:  # a write-back version: the room its file needs is held already
                nbytes, e.disk_hold = e.disk_hold, 0
                e.leases += 1
                jobs.append((e, nbytes))
                pending += e.size
            else:
                nbytes = disk.file_bytes(e.key, e.size)
                if not disk.reserve(nbytes):  # _can_evict saw room for it alone; earlier victims took it
                    self._clock.add(e.key, e)
                    continue
                e.leases += 1
                jobs.append((e, nbytes))
                pending += e.size
        written = 0
        if jobs:
            spilled, written = self._spill(jobs)
            freed += spilled
        # A victim written to SSD but kept in DRAM (another thread pinned it meanwhile: a reader, a write-back flush)
        # is progress too: it is clean now, dropped at the next call without a write.
        return freed > 0 or written > 0

    def _spill(self, jobs: list[tuple[Entry, int]]) -> tuple[int, int]:
        """Write pinned victims to SSD without the lock, then free their DRAM; returns the bytes freed and how many
        victims were written."""
        disk = self._disk
        self._moving += len(jobs)
        self._lock.release()
        try:
            written = []
            for e, _ in jobs:
                try:
                    view = self._mem.view(e.loc)
                    written.append(disk.write_temp(e.key, view, e.mode, self._wall_expiry(e)))
                except Exception as exc:  # the pins below must be undone whatever went wrong
                    log.error("spilling %r to SSD failed (%s); it stays in DRAM", e.key, exc)
                    written.append(None)
        finally:
            self._lock.acquire()
            self._moving -= len(jobs)
        freed = 0
        for (e, nbytes), pending in zip(jobs, written):
            e.leases -= 1
            current = not e.dead and self._objects.get(e.key) is e
            if pending is None:
                if current and e.dirty:
                    e.disk_hold = nbytes  # still owed to the write-back flush
                else:
                    disk.unreserve(nbytes)
            elif not current:
                disk.discard(pending)
            else:
                disk.commit(e.key, pending, e.mode, e.size)
                e.on_disk = True
                if e.dirty:
                    e.dirty = False
                    self._dirty.pop(e.key, None)
            if e.leases:  # a reader leased it meanwhile: it stays resident (and is now clean)
                if current:
                    self._clock.add(e.key, e)
                continue
            if current and pending is None:
                self._clock.add(e.key, e)
                continue
            freed += e.size
            self._free_locked(e)
            if current:
                self._moved("spills", e)
        return freed, len(written) - written.count(None)

    def _evict_to_low(self) -> None:
        """Hysteresis: start above the high watermark, stop at the low one."""
        with self._lock:
            if self._mem.used <= self._high or self._evict_blocked:
                return
            while self._mem.used > self._low:
                if not self._make_room(self._mem.used - self._low):
                    # nothing evictable now: do not rescan every pass until a lease is released
                    # or an object is replaced or deleted
                    self._evict_blocked = True
                    break

    # -- promotion -----------------------------------------------------------------------------------
    def _load(self, e: Entry) -> bool:
        """Bring a disk-only entry into DRAM. Under the lock; releases it for the read.

        True when ``e`` is now resident; False when it changed meanwhile (the caller looks the key
        up again). KeyNotFound when its file is corrupt; CapacityError when DRAM has no room.
        """
        e.loading = True
        try:
            loc = self._allocate(e.size)
        except BaseException:
            e.loading = False
            self._notify(e.key)
            raise
        if e.dead:
            self._free_loc(loc)
            e.loading = False
            self._notify(e.key)
            return False
        error = self._read_unlocked(e, self.buffer(loc))
        e.loading = False
        self._notify(e.key)
        if e.dead:
            self._free_loc(loc)
            return False
        if error is not None:
            self._free_loc(loc)
            self._drop_corrupt(e, error)
        e.loc = loc
        e.placed = next(self._versions)  # the same version in new bytes: a new placement
        if e.size:
            self._clock.add(e.key, e)
            if self._placements is not None and e.sealed:
                self._placements.publish((e,))
        self._moved("promotions", e)
        return True

    def _moved(self, what: str, e: Entry) -> None:
        """Count one object moved between tiers (``what``: a key of :data:`_MOVE_WORDS`). Each is a debug line; at
        most every :data:`MOVES_REPORT_S` an info line sums them up, so that a busy tier tells what it does
        without a line per object. Under the lock."""
        self._counts[what] += 1
        log.debug("%s %r (%d bytes)", _MOVE_WORDS[what], e.key, e.size)
        tally = self._moves_untold.setdefault(what, [0, 0])
        tally[0] += 1
        tally[1] += e.size
        now = time.monotonic()
        if now - self._moves_told < MOVES_REPORT_S:
            return
        parts = [f"{n} {_MOVE_WORDS[w]} ({format_size(b)})" for w, (n, b) in sorted(self._moves_untold.items())]
        mem = self._mem
        log.info(
            "memory tier %s of %s used; in the last %.0f s: %s",
            format_size(mem.used),
            format_size(mem.capacity),
            now - self._moves_told,
            ", ".join(parts),
        )
        self._moves_untold.clear()
        self._moves_told = now

    def _read_unlocked(self, e: Entry, dest: memoryview) -> CorruptData | None:
        self._lock.release()
        try:
            self._disk.read_into(e.key, dest)
        except CorruptData as exc:
            return exc
        finally:
            self._lock.acquire()
        return None

    def _read_direct(self, e: Entry, offset: int, size: int) -> bytes | None:
        """A copy straight from SSD when DRAM has no room; None when ``e`` changed meanwhile."""
        buf = bytearray(e.size)
        error = self._read_unlocked(e, memoryview(buf))
        if e.dead:
            return None
        if error is not None:
            self._drop_corrupt(e, error)
        return bytes(buf[offset : offset + size])

    def _drop_corrupt(self, e: Entry, error: CorruptData) -> None:
        """``e``'s file failed verification (and still belongs to ``e``): forget it, count it, raise."""
        self._disk.mark_corrupt(e.key, str(error))
        if self._objects.get(e.key) is e:
            del self._objects[e.key]
        e.on_disk = False
        self._retire(e)
        self._counts["corrupt"] += 1
        self._counts["misses"] += 1
        raise KeyNotFound(f"key {e.key!r} not found (its SSD copy was corrupt: {error})") from error

    def _free_loc(self, loc: Location) -> None:
        if loc.size:
            self._mem.free(loc)

    def _notify(self, key: str) -> None:
        w = self._waiters.get(key)
        if w is not None:
            w[0].notify_all()

    # -- write-back ----------------------------------------------------------------------------------
    def _flush_pass(self) -> None:
        """Write dirty write-back objects to SSD, the file I/O outside the lock."""
        disk = self._disk
        with self._flush_lock:
            with self._lock:
                batch = []
                postponed = 0
                for e in self._dirty.values():
                    if e.flushing or e.loc is None:
                        continue
                    if e.disk_hold:  # reserved when it was written (_hold_disk_locked)
                        nbytes, e.disk_hold = e.disk_hold, 0
                    else:
                        nbytes = disk.file_bytes(e.key, e.size)
                        if not disk.reserve(nbytes):
                            postponed += 1
                            continue
                    e.flushing = True
                    e.leases += 1
                    batch.append((e, nbytes))
                self._moving += len(batch)
                now = time.monotonic()
                if postponed and now - self._flush_warned > 10.0:  # at most one warning per 10 s
                    self._flush_warned = now
                    log.warning("SSD tier full: write-back of %d objects postponed", postponed)
            failed: list[tuple[str, Exception]] = []
            for e, nbytes in batch:
                pending = None
                try:
                    pending = disk.write_temp(e.key, self._mem.view(e.loc), e.mode, self._wall_expiry(e))
                except Exception as exc:  # the pin below must be undone whatever went wrong
                    failed.append((e.key, exc))
                with self._lock:
                    self._moving -= 1
                    e.flushing = False
                    e.leases -= 1
                    if pending is None:
                        if not e.dead and e.dirty:
                            e.disk_hold = nbytes  # kept for the next try
                        else:
                            disk.unreserve(nbytes)
                    elif not e.dead and self._objects.get(e.key) is e:
                        disk.commit(e.key, pending, e.mode, e.size)
                        e.on_disk = True
                        e.dirty = False
                        self._dirty.pop(e.key, None)
                        self._counts["flushes"] += 1
                    else:
                        disk.discard(pending)
                    if e.dead and e.leases == 0:
                        self._free_locked(e)
            if failed:
                now = time.monotonic()
                if now - self._flush_failed_warned > 10.0:  # a failing device fails every pass: one line per 10 s
                    self._flush_failed_warned = now
                    key, exc = failed[0]
                    log.error(
                        "write-back of %d objects to SSD failed (first %r: %s); they stay in DRAM, retried",
                        len(failed),
                        key,
                        exc,
                    )

    def flush(self) -> None:
        """Write all write-back data to SSD now; CapacityError if some could not be (SSD full or failing)."""
        for _ in range(3):
            if not self._dirty:
                return
            self._flush_pass()
        if self._dirty:
            raise CapacityError(
                f"{len(self._dirty)} write-back objects could not be written to SSD "
                f"({self._disk.used} of {self._disk.capacity} bytes used); they stay in DRAM"
            )


__all__ = ["TieringMixin"]

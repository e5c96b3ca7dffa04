"""Moving bytes between tiers: allocation with eviction, spilling, promotion, write-back flushing.

The rule everywhere: decide under the engine's lock, move bytes without it. An object being
spilled or flushed is pinned (``leases += 1``) so its DRAM copy cannot vanish while its file is
written, and marked ``flushing`` so that a spill and the write-back flush never both write it (nor both
hold its SSD room); an object being promoted is marked ``loading`` so concurrent readers wait for the one load
instead of reading the file twice. After the lock is taken back, the entry is checked again: if it
was deleted or replaced meanwhile, the moved bytes are thrown away, never attached to the new
version. Methods here whose docstring says "may release the lock" leave every caller to re-check
its own state afterwards; eviction lets it go every :data:`EVICT_CHUNK` victims, and checks each victim
chosen before that again as it comes to it. A commit that fails leaves the object as it was (in DRAM,
still owed to SSD if it was), its temp file and SSD room given back.

This is a mixin of :class:`~kvstrata.store.engine.ObjectStore`; it shares the engine's fields.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Iterator

from kvstrata.errors import CapacityError, CorruptData, KeyNotFound, KvstrataError, ServerError
from kvstrata.store.config import WriteMode
from kvstrata.store.objects import ZERO_LOCATION, Entry
from kvstrata.store.tiers.base import Location
from kvstrata.store.tiers.disk import PendingFile
from kvstrata.units import format_size

#: how long an allocation waits for objects another thread is writing to SSD (they can then be dropped to make
#: room) before it gives up, and how often it looks again meanwhile
MOVE_WAIT_S = 10.0
MOVE_POLL_S = 0.0005
#: how long a value larger than a segment waits for other writes in progress to seal (their blocks keep a segment
#: from being emptied for it) before it is refused
LARGE_WAIT_S = 2.0
#: how long a write that found no room but leased objects waits for the leases clients' local-read caches keep to come
#: back, once they were asked (:meth:`~kvstrata.store.ObjectStore.set_reclaim`: each client's keeper looks every
#: 10 ms), and how often it looks meanwhile. Writes failing at the same time wait within the same window ...
RECLAIM_WAIT_S = 0.1
RECLAIM_POLL_S = 0.002
#: ... and for this long after a window that ended with a write still refused, writes are refused at once, as before
#: the caches were asked: memory full of leases in use (readers copying, views held) is not waited for again and
#: again (a churn of 1 MiB values in 16 MiB among busy readers, tests/test_worker_e2e.py, slowed to a crawl)
RECLAIM_COOLDOWN_S = 1.0
#: at most one info line this often sums up the spills, evictions and promotions since the last one
#: (each is logged at debug level)
MOVES_REPORT_S = 10.0
#: victims evicted or spilled per hold of the lock: it is let go between (with a spill's writes, or for a moment),
#: so that emptying a segment of many tiny objects for a large value stalls nobody for long (each takes ~5-10 us:
#: a hold is ~10-20 ms on the development machine)
EVICT_CHUNK = 2048
#: objects looked at per hold of the lock when a value larger than a segment looks for segments to empty (sorting the
#: resident objects by segment, looking into a segment's): a few ms a hold on the development machine
SCAN_CHUNK = 1 << 14
#: what choosing a segment to empty counts per object in it, in bytes it would write to SSD: the per-object work of
#: evicting (~5-10 us) is about what writing this many bytes to an SSD takes
OBJECT_COST = 16 << 10
#: what the summary calls each move
_MOVE_WORDS = {"spills": "spilled to SSD", "evictions": "evictable dropped", "promotions": "promoted back"}

log = logging.getLogger(__name__)


class TieringMixin:
    """Eviction, spill, promotion and flush mechanics of the engine (see the module docstring)."""

    # -- DRAM allocation and eviction --------------------------------------------------------------
    def _allocate(self, size: int, *, reclaim: bool = True) -> Location:
        """A DRAM range of ``size`` bytes, evicting as needed (and waiting, up to :data:`MOVE_WAIT_S`, for objects
        another thread is writing to SSD, which can be dropped then; and, where ``reclaim``, up to
        :data:`RECLAIM_WAIT_S` for the leases clients' caches keep). Under the lock; may release the lock."""
        if size == 0:
            return ZERO_LOCATION
        mem = self._mem
        own = mem.own_segment_bytes(size)  # larger than a segment: it needs a segment of its own
        if not own:
            return self._allocate_in(size, 0, reclaim)
        try:
            return self._allocate_in(size, own, reclaim)
        finally:
            mem.drain(())  # the segments emptied for it take small writes again (or were retired)

    def _reclaim_wait(self) -> bool:
        """For an allocation that found no room but leased objects: whether to wait a moment (the lock let go) and
        look again, having asked the clients' caches for their leases where no window is open (:data:`RECLAIM_WAIT_S`;
        none for :data:`RECLAIM_COOLDOWN_S` after a window that ended with a write refused). Under the lock."""
        now = time.monotonic()
        if now >= self._reclaim_until:
            if self._reclaim_until and now - self._reclaim_until < RECLAIM_COOLDOWN_S:
                return False  # the last window did not make room: refuse at once for a while
            self._reclaim_until = now + RECLAIM_WAIT_S
            self._reclaim()  # type: ignore[misc]
        self._lock.release()
        try:
            time.sleep(RECLAIM_POLL_S)
        finally:
            self._lock.acquire()
        return True

    def _allocate_in(self, size: int, own: int, reclaim: bool = True) -> Location:
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
            # Leases may be all that holds the room: the clients' local-read caches keep some for reads with no round
            # trip, and give them back when asked (a promotion does not wait: its read is served from SSD instead)
            if reclaim and self._reclaim is not None and self._leases and self._reclaim_wait():
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
        """Empty DRAM segments for a value larger than a segment: evict or spill every object of the segments that
        cost the least to empty, until segments of ``need`` bytes are empty (the memory tier then retires them to
        map the value's own). The cost of a segment is :data:`OBJECT_COST` per object plus the bytes its objects
        must write to SSD (an evictable object or one with a clean SSD copy writes none): a segment of 240,000 tiny
        objects costs far more than one of a few large ones, though it holds fewer bytes. Only segments whose every
        block is an object that may go are chosen: emptying one that keeps a lease would drop objects for nothing.
        False when no such segments add up to ``need``. May release the lock."""
        mem = self._mem
        if need <= 0 or not mem.segment_usage():
            return False
        held, stale = self._resident_by_segment()
        # The cheapest to empty first. A segment's exact cost needs a look at each of its objects (may it go, does
        # it write a file?); its objects' count alone bounds it from below: segments are taken from a heap by that
        # bound and looked into only as they come up, so a segment of 500,000 tiny objects is never looked into
        # while a few others suffice.
        disk = self._disk
        heap = [(blocks * OBJECT_COST, i, nbytes, -1) for i, nbytes, _, blocks in mem.segment_usage()]
        heapq.heapify(heap)
        chosen: list[int] = []
        looking: set[int] = set()  # segments looked into: small writes go elsewhere meanwhile (see _look_into)
        found = 0
        spill_room = disk.capacity - disk.used - disk.stats()["reserved"] if disk is not None else 0
        while heap and found < need:
            cost, i, nbytes, files = heapq.heappop(heap)
            if files < 0:  # a bound: look into it now
                looking.add(i)
                mem.drain(looking)
                looked = self._look_into(i, held.get(i, []), stale)
                if looked is None:  # not every object of it may go
                    looking.discard(i)
                    mem.drain(looking)
                    continue
                held[i], writes, files = looked
                heapq.heappush(heap, (cost + writes, i, nbytes, files))
                continue
            if files > spill_room:  # each fits alone (_can_evict), not all of them together
                continue
            spill_room -= files
            chosen.append(i)
            found += nbytes
        if found < need:
            return False
        # New small writes go elsewhere while these empty (a spill releases the lock): else they refill them
        mem.drain(chosen)
        # (each checked again as it is reached: _make_room lets the lock go now and then; one moved out of its
        # segment meanwhile, a promotion into another say, stays)
        goal = sum(u[2] for u in mem.segment_usage() if u[0] in chosen)  # (every victim, in the end)
        victims = (e for i in chosen for e in held[i] if e.loc is not None and e.loc.segment == i)
        return self._make_room(goal, victims)

    def _look_into(self, i: int, entries: list[Entry], stale: bool) -> tuple[list[Entry], int, int] | None:
        """Whether every object of segment ``i`` may go (``entries``, its objects as gathered, ``stale`` when the lock
        was let go since): the objects it holds now, the bytes of those that write a file when they go, and the SSD
        room those files need beyond what is held for them; None when an object may not go or a block of it is
        no object seen (an unsealed create, a write reservation, an object that came after the scan). The lock is
        let go every :data:`SCAN_CHUNK` objects; the caller keeps small writes out of ``i`` meanwhile (drain), so
        objects only leave it then. May release the lock."""
        get, can_evict = self._objects.get, self._can_evict
        kept: list[Entry] = []
        writes: list[Entry] = []
        evictable = WriteMode.EVICTABLE
        for lo in range(0, len(entries), SCAN_CHUNK):
            if lo:
                self._let_others_in()
                stale = True
            for e in entries[lo : lo + SCAN_CHUNK]:
                if stale and (get(e.key) is not e or e.loc is None or e.loc.segment != i):
                    continue  # gone or moved meanwhile
                if not can_evict(e):
                    return None
                kept.append(e)
                if e.mode is not evictable and (e.dirty or not e.on_disk):  # (_writes_file, inline)
                    writes.append(e)
        blocks = self._mem.blocks(i)
        if len(kept) > blocks:  # some left after they were looked at
            kept = [e for e in kept if get(e.key) is e and e.loc is not None and e.loc.segment == i]
            writes = [e for e in kept if _writes_file(e)]
        if len(kept) != blocks:
            return None
        if not writes:
            return kept, 0, 0
        disk = self._disk
        files = sum(disk.file_bytes(e.key, e.size) for e in writes if not e.disk_hold)
        return kept, sum(e.size for e in writes), files

    def _resident_by_segment(self) -> tuple[dict[int, list[Entry]], bool]:
        """The objects resident in each DRAM segment (by index), and whether the lock was let go while they were
        gathered: it is every :data:`SCAN_CHUNK` objects (a million took ~0.15 s in one hold on the development
        machine), so the lists may then hold objects gone or moved since, and miss some that came. May release the
        lock."""
        held: dict[int, list[Entry]] = {}
        values = list(self._objects.values())
        for lo in range(0, len(values), SCAN_CHUNK):
            for e in values[lo : lo + SCAN_CHUNK]:
                loc = e.loc
                if loc is not None and loc.size:
                    entries = held.get(loc.segment)
                    if entries is None:
                        entries = held[loc.segment] = []
                    entries.append(e)
            if len(values) > SCAN_CHUNK:  # (after the last chunk too: what follows holds the lock a while again)
                self._let_others_in()
        return held, len(values) > SCAN_CHUNK

    def _make_room(self, goal: int, victims: Iterator[Entry] | None = None) -> bool:
        """Free about ``goal`` bytes of DRAM; False when nothing could be freed. May release the lock.

        Evictable objects are dropped and objects with a clean SSD copy lose their DRAM copy at
        once; others are spilled (file written without the lock, then committed). The victims are the
        eviction policy's, or ``victims`` (objects that may have changed since they were chosen: each still the
        key's visible version, resident and allowed to go is taken, the others skipped). The lock is let go every
        :data:`EVICT_CHUNK` victims (their spills written then), so that emptying a segment of 240,000 tiny objects
        does not stall every other call for seconds.
        """
        freed = 0
        jobs: list[Entry] = []
        pending = 0
        written = 0
        disk = self._disk
        objects = self._objects
        taken = taken_all = 0
        dropped: list[Entry] = []  # evictable victims: their blocks go back together
        while freed + pending < goal:
            if taken >= EVICT_CHUNK:  # let the others in, then go on
                taken = 0
                if dropped:
                    self._free_entries(dropped)
                    dropped = []
                if jobs:
                    spilled, n = self._spill(jobs)  # (lets the lock go for the writes)
                    freed += spilled
                    written += n
                    jobs, pending = [], 0
                else:
                    self._let_others_in()
            if victims is None:
                e = self._clock.next_victim(self._can_evict)
                if e is None:
                    break
            else:
                e = next(victims, None)
                if e is None:
                    break
                if objects.get(e.key) is not e or not self._can_evict(e):
                    continue  # replaced, deleted, leased, spilled or being written meanwhile: not this one
                self._clock.remove(e.key, e)  # as next_victim would: a spill puts it back if it stays
            taken += 1
            taken_all += 1
            if e.mode is WriteMode.EVICTABLE:
                del objects[e.key]
                freed += e.size
                self._retire(e, freed=dropped)
                self._moved("evictions", e)
            elif e.on_disk and not e.dirty:  # spilled with no write: its SSD copy is current
                freed += e.size
                self._free_locked(e)
                self._moved("spills", e)
            elif e.disk_hold:  # a write-back version: the room its file needs is held already
                e.write_hold, e.disk_hold = e.disk_hold, 0
                e.leases += 1
                e.flushing = True  # the write-back flush leaves it to this spill
                jobs.append(e)
                pending += e.size
            else:
                nbytes = disk.file_bytes(e.key, e.size)
                if not disk.reserve(nbytes):  # _can_evict saw room for it alone; earlier victims took it
                    self._clock.add(e.key, e)
                    continue
                e.write_hold = nbytes
                e.leases += 1
                e.flushing = True
                jobs.append(e)
                pending += e.size
        if dropped:
            self._free_entries(dropped)
        if jobs:
            spilled, n = self._spill(jobs)
            freed += spilled
            written += n
        elif taken_all > EVICT_CHUNK:  # a long run of holds: the caller's next step (an allocation) holds it again
            self._let_others_in()
        # A victim written to SSD but kept in DRAM (another thread pinned it meanwhile: a reader, a write-back flush)
        # is progress too: it is clean now, dropped at the next call without a write.
        return freed > 0 or written > 0

    def _let_others_in(self) -> None:
        """Let the lock go for a moment, so that the calls waiting for it run, and take it back."""
        self._lock.release()
        try:
            time.sleep(0)
        finally:
            self._lock.acquire()

    def _spill(self, jobs: list[Entry]) -> tuple[int, int]:
        """Write pinned victims to SSD without the lock, then free their DRAM; returns the bytes freed and how many
        victims were written. Each job's commit stands alone: one that fails leaves its victim in DRAM, the others
        go on."""
        disk = self._disk
        # the deadlines the files record, noted under the lock: one changed by expire() meanwhile is written again
        noted = [(e.expires, self._wall_expiry(e)) for e in jobs]
        self._moving += len(jobs)
        self._lock.release()
        try:
            written = []
            for e, (_, wall) in zip(jobs, noted):
                try:
                    view = self._mem.view(e.loc)
                    written.append(disk.write_temp(e.key, view, e.mode, wall))
                except Exception as exc:  # the pins below must be undone whatever went wrong
                    log.error("spilling %r to SSD failed (%s); it stays in DRAM", e.key, exc)
                    written.append(None)
        finally:
            self._lock.acquire()
            self._moving -= len(jobs)
        freed = 0
        done = 0
        for e, (expires, _), pending in zip(jobs, noted, written):
            e.leases -= 1
            e.flushing = False
            nbytes, e.write_hold = e.write_hold, 0  # (0: the version died meanwhile and gave the room back)
            current = not e.dead and self._objects.get(e.key) is e
            stored = False
            if pending is None:
                self._keep_hold(e, nbytes, current, reserved=True)
            elif not current:
                disk.discard(pending, give_back=nbytes > 0)
            else:
                error = self._commit_moved(e, pending, expires)
                if error is None:
                    stored = True
                    done += 1
                    current = not e.dead and self._objects.get(e.key) is e  # (a file found corrupt: dropped)
                else:
                    log.error("spilling %r to SSD failed (%s); it stays in DRAM", e.key, error)
                    self._keep_hold(e, nbytes, current, reserved=False)
            if e.leases:  # a reader leased it meanwhile: it stays resident (and is now clean)
                if current:
                    self._clock.add(e.key, e)
                continue
            if current and not stored:
                self._clock.add(e.key, e)
                continue
            if e.loc is None:  # (freed already: dropped as corrupt)
                continue
            freed += e.size
            self._free_locked(e)
            if current:
                self._moved("spills", e)
        return freed, done

    def _keep_hold(self, e: Entry, nbytes: int, current: bool, *, reserved: bool) -> None:
        """A write of ``e``'s file failed (``reserved``: its ``nbytes`` of SSD room still reserved; else given back by
        the failed commit): a dirty version keeps one hold of that room for the write-back flush's next try, never
        two; anything else gives it back. Under the lock."""
        disk = self._disk
        if current and e.dirty and not e.disk_hold:
            if reserved or disk.reserve(nbytes):
                e.disk_hold = nbytes  # (else the next flush pass reserves it)
        elif reserved:
            disk.unreserve(nbytes)

    def _commit_moved(self, e: Entry, pending: PendingFile, expires: float) -> KvstrataError | None:
        """Commit the file a spill or flush wrote of ``e`` (still the key's visible version); the error when that
        failed (the temp file and its room given back by the commit, ``e`` unchanged). A deadline that changed
        since the file was written (``expires``, noted then) is written into it now. Under the lock."""
        try:
            self._disk.commit(e.key, pending, e.mode, e.size)
        except KvstrataError as exc:
            return exc
        e.on_disk = True
        if e.dirty:
            e.dirty = False
            self._dirty.pop(e.key, None)
        if e.expires != expires:
            self._record_expiry(e)
        return None

    def _record_expiry(self, e: Entry) -> bool:
        """Write the deadline of ``e`` (visible, ``on_disk``) into its SSD file's header, so that a restart honours
        it. False when that file turned out corrupt: it is marked so and ``e`` dropped, a miss (counted and logged,
        as a read of the file would). An OSError is logged. Under the lock."""
        try:
            self._disk.set_expiry(e.key, self._wall_expiry(e))
        except CorruptData as exc:
            self._disk.mark_corrupt(e.key, str(exc))
            e.on_disk = False
            if self._objects.get(e.key) is e:
                del self._objects[e.key]
            self._retire(e)
            self._counts["corrupt"] += 1
            self._counts["misses"] += 1
            return False
        except OSError as exc:
            log.error("could not record the new expiry of %r on SSD: %s", e.key, exc)
        return True

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
            loc = self._allocate(e.size, reclaim=False)
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
        """Write dirty write-back objects to SSD, the file I/O outside the lock. Objects a spill is writing are left
        to it. Why the last objects could not be written (the SSD tier full, or failing) is kept for :meth:`flush`."""
        disk = self._disk
        with self._flush_lock:
            with self._lock:
                batch = []
                postponed = 0
                for e in self._dirty.values():
                    if e.flushing or e.loc is None:  # (being written by a spill, or not resident)
                        continue
                    if e.disk_hold:  # reserved when it was written (_hold_disk_locked)
                        nbytes, e.disk_hold = e.disk_hold, 0
                    else:
                        nbytes = disk.file_bytes(e.key, e.size)
                        if not disk.reserve(nbytes):
                            postponed += 1
                            continue
                    e.write_hold = nbytes
                    e.flushing = True
                    e.leases += 1
                    # the deadline its file records, noted: one changed by expire() meanwhile is written again
                    batch.append((e, e.expires, self._wall_expiry(e)))
                self._moving += len(batch)
                now = time.monotonic()
                if postponed:
                    self._flush_cause = (
                        CapacityError,
                        f"SSD tier full: {disk.used} of {disk.capacity} bytes used and "
                        f"{disk.stats()['reserved']} reserved",
                    )
                    if now - self._flush_warned > 10.0:  # at most one warning per 10 s
                        self._flush_warned = now
                        log.warning("SSD tier full: write-back of %d objects postponed", postponed)
            failed: list[tuple[str, Exception]] = []
            for e, expires, wall in batch:
                pending = None
                try:
                    pending = disk.write_temp(e.key, self._mem.view(e.loc), e.mode, wall)
                except Exception as exc:  # the pin below must be undone whatever went wrong
                    failed.append((e.key, exc))
                with self._lock:
                    self._moving -= 1
                    e.flushing = False
                    e.leases -= 1
                    nbytes, e.write_hold = e.write_hold, 0  # (0: the version died meanwhile and gave the room back)
                    current = not e.dead and self._objects.get(e.key) is e
                    if pending is None:
                        self._keep_hold(e, nbytes, current, reserved=True)  # kept for the next try
                    elif not current:
                        disk.discard(pending, give_back=nbytes > 0)
                    else:
                        error = self._commit_moved(e, pending, expires)
                        if error is None:
                            self._counts["flushes"] += 1
                        else:
                            failed.append((e.key, error))
                            self._keep_hold(e, nbytes, current, reserved=False)
                    if e.dead and e.leases == 0:
                        self._free_locked(e)
            if failed:
                key, exc = failed[0]
                kind = CapacityError if isinstance(exc, CapacityError) else ServerError
                self._flush_cause = (kind, f"writing {len(failed)} of them failed, first {key!r}: {exc}")
                now = time.monotonic()
                if now - self._flush_failed_warned > 10.0:  # a failing device fails every pass: one line per 10 s
                    self._flush_failed_warned = now
                    log.error(
                        "write-back of %d objects to SSD failed (first %r: %s); they stay in DRAM, retried",
                        len(failed),
                        key,
                        exc,
                    )

    def flush(self) -> None:
        """Write the write-back data written before this call to SSD now (retried up to three passes).
        ``CapacityError`` if some could not be for want of room, ``ServerError`` if writing failed otherwise; the
        message says how many objects and why. Objects written meanwhile are left to the background flusher."""
        with self._lock:
            owed = list(self._dirty.values())
        deadline = time.monotonic() + MOVE_WAIT_S
        passes = 0
        while True:
            with self._lock:
                left = [e for e in owed if e.dirty and not e.dead]  # (one deleted or replaced is owed no more)
                spilled = all(e.flushing for e in left)  # all being written by spills: the flush leaves them
            if not left:
                return
            if spilled and time.monotonic() < deadline:
                time.sleep(MOVE_POLL_S)
                continue
            if passes == 3:
                break
            passes += 1
            self._flush_cause = None
            self._flush_pass()
        # (no cause: those left were being written by spills in each pass)
        error, why = self._flush_cause or (ServerError, "still being written by a spill")
        raise error(f"{len(left)} write-back objects could not be written to SSD ({why}); they stay in DRAM")


def _writes_file(e: Entry) -> bool:
    """Whether evicting ``e`` writes an SSD file (an evictable object is dropped; a clean SSD copy is kept)."""
    return e.mode is not WriteMode.EVICTABLE and not (e.on_disk and not e.dirty)


__all__ = ["TieringMixin"]

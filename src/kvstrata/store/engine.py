"""The object store engine: its state and metadata table, key metadata ops, the background pass, close.

:class:`ObjectStore` is put together from one mixin per concept, sharing the fields ``__init__`` sets:
writes (create/seal/put, retiring versions: store.writes), batch writes (store.batch), reads
(store.reads), leases (store.leases), write reservations (store.reservations), moving bytes between
tiers (store.tiering) and the HBM read cache (store.device). This module keeps the segments, the
per-key metadata operations (delete, exists, expire, refcounts, stats), the background thread
(TTL sweep, watermark eviction, write-back) and close.

One lock guards all metadata; bytes move outside it. A write reserves DRAM under the lock, fills
the bytes without it (in this process or, through a shared mapping, in a client's), then seals under
the lock; until then the new version is invisible, and a replacing write is a new version, so a
reader never sees a partial write and readers holding a lease on the old version keep its bytes.

Example::

    store = ObjectStore(StoreConfig(memory_bytes=64 << 20, numa_node=None))
    store.put("a", b"hello")
    assert store.get_bytes("a") == b"hello"
    lease = store.acquire("a", owner="me")
    view = store.buffer(lease.location)      # zero-copy
    store.release(lease.lease_id)
    store.close()
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvstrata.errors import InvalidType, InvalidValue, KvstrataError, ServerError
from kvstrata.memory.shm import SharedSegment
from kvstrata.store.batch import BatchMixin
from kvstrata.store.config import STORE_COUNTERS, StoreConfig
from kvstrata.store.device import DeviceCacheMixin
from kvstrata.store.eviction import ClockPolicy
from kvstrata.store.leases import LeaseMixin
from kvstrata.store.objects import Entry, check_key, check_keys, check_ttl
from kvstrata.store.placements import PlacementTable
from kvstrata.store.reads import ReadMixin
from kvstrata.store.reservations import Landing, ReservationMixin, SettlingLock, Visibility
from kvstrata.store.tiering import TieringMixin
from kvstrata.store.tiers.base import Location
from kvstrata.store.tiers.disk import DiskTier
from kvstrata.store.tiers.memory import MemoryTier
from kvstrata.store.writes import WriteMixin

#: keys a batch call that changes every key (``delete``, ``expire``) handles per hold of the store's lock: a hold of
#: 4,096 deletes takes ~8 ms on the development machine, so a request of another client waits at most about that
LOCK_CHUNK = 4096

log = logging.getLogger(__name__)


class ObjectStore(LeaseMixin, BatchMixin, WriteMixin, ReadMixin, ReservationMixin, TieringMixin, DeviceCacheMixin):
    """An in-process, thread-safe object store over DRAM (shared memory) and optionally SSD."""

    def __init__(self, config: StoreConfig):
        if not isinstance(config, StoreConfig):
            raise InvalidType(f"config: must be a StoreConfig, got {type(config).__name__}")
        self.config = config
        # the one metadata lock; while commits wait for their copies (store.reservations), every ``with`` of it
        # settles them first: _lock is then the settling wrapper of the same lock
        self._plain_lock = threading.Lock()
        self._settling_lock = SettlingLock(self, self._plain_lock)
        self._lock: threading.Lock | SettlingLock = self._plain_lock
        # commits waiting for their copies, in commit order (store.reservations); how many are not cut yet
        self._landings: list[Landing] = []
        self._uncut = 0
        # told what settled commits show, which no request's validity change covers (set_visibility)
        self._visibility: Visibility | None = None
        self._closed = False
        self._closing = False  # a close() has begun (a second one returns at once)
        self._listeners: list[Callable[[SharedSegment], None]] = []
        self._retire_listeners: list[Callable[[int], None]] = []  # told of each segment retired (its index)
        self._reclaim: Callable[[], None] | None = None  # asks clients for their caches' leases (set_reclaim)
        self._reclaim_until = 0.0  # the end of the last window writes waited in for those leases (tiering)
        self._placements: PlacementTable | None = None  # where sealed objects lie, for clients' copies
        self._announce_lock = threading.RLock()
        self._mem = MemoryTier(
            config.memory_bytes,
            segment_bytes=config.segment_bytes,
            hugepages=config.hugepages,
            numa_node=config.resolved_numa_node(),
            on_retire_segment=self._segment_retired,
        )
        self._announced = len(self._mem.segments)  # the first segment is visible through .segments from the start
        # a segment still being announced (page-locked with CUDA, say) is not retired under its listeners
        self._mem.retirable = lambda index: index < self._announced
        self._disk = None
        self._gpu = None
        try:
            if config.disk_dir:
                self._disk = DiskTier(config.disk_dir, config.disk_bytes, sync=config.disk_sync)
            if config.gpu_bytes:
                from kvstrata.store.tiers.gpu import GpuTier

                self._gpu = GpuTier(config.gpu_bytes, device=config.gpu_device or 0)
                # loads into HBM read DRAM segments: page-lock them so those copies run at DMA speed
                for seg in self._mem.segments:
                    self._gpu.register_host(seg.address, seg.nbytes)
                self._listeners.append(lambda seg: self._gpu.register_host(seg.address, seg.nbytes))
        except BaseException:
            # A tier that failed to start (an SSD folder that cannot be scanned, say): what the others hold goes back
            # (the SSD folder's lock above all: else a retry in this process is refused as "in use")
            self._close_tiers()
            raise
        self._high = int(config.high_watermark * config.memory_bytes)
        self._low = int(config.low_watermark * config.memory_bytes)
        self._objects: dict[str, Entry] = {}  # visible versions
        self._pending: dict[tuple[str, object], Entry] = {}  # (key, owner) -> unsealed create
        self._creating: dict[str, int] = {}  # key -> creates in progress (for nx)
        self._owner_creates: dict[object, set[str]] = {}
        self._reservations: dict[object, object] = {}  # owner -> its write reservation (store.reservations)
        self._reserved = 0  # bytes reserved and not committed yet
        self._leases: dict[int, tuple[Entry, object]] = {}
        self._owner_leases: dict[object, set[int]] = {}
        self._waiters: dict[str, list] = {}  # key -> [Condition, number of waiters]
        self._clock = ClockPolicy()
        self._gpu_clock = ClockPolicy()
        self._gpu_cond = threading.Condition(self._lock)
        self._dirty: dict[str, Entry] = {}
        self._ttl_heap: list[tuple[float, int, str]] = []
        self._versions = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._counts = dict.fromkeys(STORE_COUNTERS, 0)
        self._flush_lock = threading.Lock()
        self._evict_blocked = False
        self._moving = 0  # resident objects being written to SSD outside the lock (spills, write-back flushes)
        self._flush_warned = -1e9
        self.unflushed = 0  # write-back objects close() could not write to SSD
        self._flush_failed_warned = -1e9
        self._flush_cause: tuple[type[KvstrataError], str] | None = None  # why the last flush pass left objects dirty
        self._moves_untold: dict[str, list[int]] = {}  # tiering moves since the last summary in the log
        self._moves_told = time.monotonic()
        if self._disk is not None:
            self._counts["corrupt"] = self._disk.corrupt
            self._counts["expired"] = self._disk.expired
            now, wall = time.monotonic(), time.time()
            for key, rec in self._disk.index.items():
                e = Entry(key, rec.size, None, rec.mode, next(self._versions), None)
                e.sealed = True
                e.on_disk = True
                if rec.expires_at:
                    e.expires = now + (rec.expires_at - wall)
                    heapq.heappush(self._ttl_heap, (e.expires, e.version, key))
                self._objects[key] = e
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._background, name="kvstrata-store", daemon=True)
        self._thread.start()

    # -- segments ----------------------------------------------------------------------------------
    @property
    def segments(self) -> list[SharedSegment]:
        """The DRAM tier's shared segments; ``Location.segment`` indexes this list."""
        return self._mem.segments

    @property
    def retired_segments(self) -> list[int]:
        """Indices of the DRAM segments retired to make room for values larger than a segment (their memory went back
        to the kernel; nothing will point into them again). A client need not map them. The same list all along, only
        ever appended to (a worker's sessions keep it and tell their clients of what it gains)."""
        return self._mem.retired

    def _segment_retired(self, seg: SharedSegment) -> None:
        if self._gpu is not None:  # page-locked for the HBM tier's loads: its pages would stay
            self._gpu.unregister_host(seg.address)
        if self._retire_listeners:
            index = next(i for i, s in enumerate(self._mem.segments) if s is seg)
            for fn in list(self._retire_listeners):
                fn(index)

    def set_reclaim(self, fn: Callable[[], None] | None) -> None:
        """Have a write that finds no room but leased objects call ``fn()`` (under this store's lock: quick, no lock)
        and wait up to :data:`~kvstrata.store.tiering.RECLAIM_WAIT_S`, the lock let go, for leases to come back
        before it gives up (refused at once for a while after a wait that did not help): the worker's
        :meth:`~kvstrata.server.validity.Validity.ask_reclaim`, which has its clients' local-read caches give back
        what they keep. None: refuse at once, as without clients."""
        with self._lock:
            self._reclaim = fn

    def add_retire_listener(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(index)`` whenever the DRAM tier retires a segment (under this store's lock: ``fn`` must be quick
        and take no lock that anyone waits on holding this one). An embedded client page-locks segments with CUDA:
        it is told, and lets go of the ones retired."""
        with self._lock:
            self._retire_listeners.append(fn)

    def remove_retire_listener(self, fn: Callable[[int], None]) -> None:
        """Stop calling ``fn`` (:meth:`add_retire_listener`); a no-op where it is not listening."""
        with self._lock:
            if fn in self._retire_listeners:
                self._retire_listeners.remove(fn)

    def add_segment_listener(self, fn: Callable[[SharedSegment], None]) -> None:
        """Call ``fn(segment)`` (outside the store's lock) whenever the DRAM tier adds a segment."""
        with self._lock:
            self._listeners.append(fn)

    def publish_placements(self, table: PlacementTable | None) -> None:
        """Write every placement sealed from now on into ``table`` (:mod:`kvstrata.store.placements`; a
        worker's clients start copies from it), or stop (None)."""
        with self._lock:
            self._placements = table

    def set_visibility(self, hooks: Visibility | None) -> None:
        """Tell ``hooks`` (the worker's :class:`kvstrata.server.validity.Validity`) what the commits sent ahead of
        their copies show as they settle, which happens outside any request's validity change: those whose objects
        replace versions written meanwhile (a plain put does not wait for creates) are settled inside
        ``hooks.change(keys)``, so its clients' kept leases of those keys go stale, and ``hooks.shown(keys, ttl)``
        hears of every key they show. Both are called under this store's lock (they must take no lock held by
        anyone waiting for this one); None stops them."""
        with self._lock:
            self._visibility = hooks

    def _announce_segments(self) -> None:
        # Whoever announces, a segment is announced before the write that made it returns: a
        # thread finding the list empty waits here for the announcer still calling listeners.
        with self._announce_lock:
            segments = self._mem.segments
            while self._announced < len(segments):
                self._call_listeners(segments[self._announced])
                self._announced += 1

    def _call_listeners(self, seg: SharedSegment) -> None:
        for fn in list(self._listeners):
            try:
                fn(seg)
            except Exception:
                log.exception("segment listener %r failed", fn)

    def buffer(self, location: Location) -> memoryview:
        """A writable view of the bytes at ``location`` (no copy)."""
        if location.size == 0:
            return memoryview(bytearray())
        return self._mem.view(location)

    # -- metadata ----------------------------------------------------------------------------------
    def delete(self, keys: Iterable[str], *, versions: Sequence[int] | None = None) -> list[bool]:
        """Delete keys; True where the key existed. Bytes under a lease are freed at its release.

        ``versions`` (one per key, as :meth:`listing` gives them): delete a key only while its visible version is still
        that one (False where it was written again meanwhile): a cluster worker dropping copies it handed on, never a
        newer write that came after (:mod:`kvstrata.server.rebalance`).

        Many keys are deleted :data:`LOCK_CHUNK` at a time, the lock let go between chunks: 100,000 keys held it
        ~200 ms in one go on the development machine, stalling every other client's request meanwhile.

        A key whose SSD file cannot be deleted (a read-only remount, EIO) stays, unchanged: the other keys are
        deleted, then ``ServerError`` names the keys kept (a retry answers False for those deleted)."""
        keys = check_keys(keys)
        if versions is not None:
            versions = list(versions)
            if len(versions) != len(keys):
                raise InvalidValue(f"versions: one per key, got {len(versions)} for {len(keys)} keys")
        out = []
        kept: list[tuple[str, ServerError]] = []
        objects, retire = self._objects, self._retire
        for lo in range(0, len(keys), LOCK_CHUNK):
            freed: list[Entry] = []  # blocks of a batch written together go back as one range
            with self._lock:
                now = time.monotonic()
                for i, k in enumerate(keys[lo : lo + LOCK_CHUNK], lo):
                    e = objects.get(k)
                    if e is None or (versions is not None and e.version != versions[i]):
                        out.append(False)
                        continue
                    if e.expires and e.expires <= now:  # expired already: counted as _lookup would, not deleted
                        self._retire_expired(e)
                        out.append(False)
                        continue
                    try:
                        retire(e, freed=freed)  # (its SSD file first: ServerError with nothing changed)
                    except ServerError as exc:
                        kept.append((k, exc))
                        out.append(False)
                        continue
                    del objects[k]
                    out.append(True)
                if freed:
                    self._free_entries(freed)
        if kept:
            raise _kept_error("deleted", kept)
        return out

    def exists(self, keys: Iterable[str]) -> list[bool]:
        """Whether each key is present (in any tier). Fast for 100,000 keys."""
        keys = check_keys(keys)
        with self._lock:
            out = list(map(self._objects.__contains__, keys))
            if self._ttl_heap:
                get = self._objects.get
                now = time.monotonic()
                for i, k in enumerate(keys):
                    if out[i]:
                        e = get(k)
                        out[i] = not e.expires or e.expires > now
        return out

    def listing(self) -> list[tuple[str, float | None, int, str]]:
        """Every visible object's key, its seconds left to live (None: no deadline), its version (a number that
        changes with each write of the key) and its write mode, now: a snapshot, which later writes are not in (a
        cluster worker handing its objects on: :mod:`kvstrata.server.drain`, :mod:`kvstrata.server.rebalance`)."""
        now = time.monotonic()
        with self._lock:
            return [
                (key, e.expires - now if e.expires else None, e.version, e.mode.value)
                for key, e in self._objects.items()
                if e.sealed and not e.dead and (not e.expires or e.expires > now)
            ]

    def expire(self, keys: Iterable[str], ttl: float | None) -> list[bool]:
        """Set the time to live of existing keys (None/0: forever); True where the key existed."""
        keys = check_keys(keys)
        ttl_s = check_ttl(ttl)
        out = []
        for lo in range(0, len(keys), LOCK_CHUNK):  # the lock let go between chunks, as delete does
            with self._lock:
                now = time.monotonic()
                for k in keys[lo : lo + LOCK_CHUNK]:
                    e = self._lookup(k)
                    if e is None:
                        out.append(False)
                        continue
                    e.expires = now + ttl_s if ttl_s else 0.0
                    if ttl_s:
                        heapq.heappush(self._ttl_heap, (e.expires, e.version, k))
                    # so a restart honours the new deadline too (a file found corrupt meanwhile: dropped, a miss)
                    out.append(not e.on_disk or self._record_expiry(e))
        return out

    def sizes(self, keys: Iterable[str]) -> list[int | None]:
        """Each key's size in bytes, None where absent."""
        keys = check_keys(keys)
        with self._lock:
            return [None if (e := self._lookup(k)) is None else e.size for k in keys]

    def incref(self, keys: Iterable[str]) -> list[int]:
        """Add one global reference to each key; the new counts (0 where the key is absent)."""
        keys = check_keys(keys)
        out = []
        with self._lock:
            for k in keys:
                e = self._lookup(k)
                if e is None:
                    out.append(0)
                else:
                    e.ref += 1
                    out.append(e.ref)
        return out

    def decref(self, keys: Iterable[str]) -> list[int]:
        """Drop one global reference from each key; a key whose count reaches 0 is deleted. A key whose SSD file
        cannot be deleted then keeps its reference and stays: ``ServerError`` naming those after the others."""
        keys = check_keys(keys)
        out = []
        kept: list[tuple[str, ServerError]] = []
        with self._lock:
            for k in keys:
                e = self._lookup(k)
                if e is None or e.ref == 0:
                    out.append(0)
                    continue
                if e.ref == 1:
                    try:
                        self._retire(e)
                    except ServerError as exc:
                        kept.append((k, exc))
                        out.append(e.ref)
                        continue
                    del self._objects[k]
                e.ref -= 1
                out.append(e.ref)
        if kept:
            raise _kept_error("released (their last reference)", kept)
        return out

    def refcount(self, key: str) -> int:
        """The global reference count of ``key`` (0 when absent)."""
        check_key(key)
        with self._lock:
            e = self._lookup(key)
            return 0 if e is None else e.ref

    def release_owner(self, owner: object) -> None:
        """A client went away: release its leases, abort its unsealed creates, free its write reservation."""
        with self._lock:
            if self._landings:  # its commits whose copies it said landed stand; the others never will
                self._settle_locked(owner, final=True)
            self._drop_reservation(owner)
            lids = list(self._owner_leases.get(owner, ()))  # a copy: release() edits the set
            keys = self._owner_creates.pop(owner, ())
            for k in keys:
                e = self._pending.pop((k, owner), None)
                if e is not None:
                    self._abort_locked(e)
        for lid in lids:
            self.release(lid)

    def stats(self) -> dict:
        """Tiers' use and capacity, object count and event counters."""
        with self._lock:
            tiers = {"memory": self._mem.stats()}
            if self._disk is not None:
                tiers["disk"] = self._disk.stats()
            if self._gpu is not None:
                tiers["gpu"] = self._gpu.stats()
            return {
                "tiers": tiers,
                "objects": len(self._objects),
                "leases": len(self._leases),
                "creates_in_progress": len(self._pending),
                "reserved_bytes": self._reserved,  # write reservations not committed yet
                "dirty": len(self._dirty),
                **self._counts,
            }

    # -- background: write-back, TTL, watermark eviction ------------------------------------------
    def _background(self) -> None:
        interval = self.config.flush_interval
        while not self._stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self._sweep_ttl()
                self._evict_to_low()
                if self._dirty:
                    self._flush_pass()
            except Exception:
                log.exception("object store background pass failed")

    def _sweep_ttl(self) -> None:
        with self._lock:
            heap = self._ttl_heap
            now = time.monotonic()
            while heap and heap[0][0] <= now:
                expires, version, key = heapq.heappop(heap)
                e = self._objects.get(key)
                if e is not None and e.version == version and e.expires == expires:
                    self._retire_expired(e)

    def close(self) -> None:
        """Flush write-back data, stop the background thread, unmap the segments. Idempotent: a second call,
        also one from another thread while the first runs, returns at once. :attr:`unflushed` then says how many
        write-back objects could not be written to SSD (their data is lost with the process)."""
        with self._lock:
            if self._closing:
                return
            # From here every write is refused (ClosedError): one acknowledged after the flush below would be lost
            self._closing = True
        try:
            self.flush()
        except KvstrataError as exc:
            with self._lock:
                self.unflushed = len(self._dirty)
            log.error("closing the store: %s; that data is lost", exc)
        self._stop.set()
        self._wake.set()
        self._thread.join()
        with self._lock:
            self._closed = True
            for owner in list(self._reservations):
                self._drop_reservation(owner)
            for w in self._waiters.values():
                w[0].notify_all()
            self._gpu_cond.notify_all()
        self._close_tiers()

    def _close_tiers(self) -> None:
        if self._gpu is not None:
            self._gpu.close()  # unregisters the segments before they are unmapped
        self._mem.close()
        if self._disk is not None:
            self._disk.close()

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kept_error(done: str, kept: list[tuple[str, ServerError]]) -> ServerError:
    """The error of a batch whose keys ``kept`` (each with why) could not be ``done``: their SSD files could not be
    deleted."""
    names = ", ".join(repr(k) for k, _ in kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
    return ServerError(f"{len(kept)} keys not {done}, kept unchanged: {names} ({kept[0][1]})")


__all__ = ["ObjectStore"]

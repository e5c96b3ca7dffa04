"""The HBM tier as a read cache: device copies of objects for consumers on the GPU.

``acquire_device(key)`` returns a lease on a copy of the object in the store's HBM tier (loaded
from DRAM, or from SSD through DRAM, on first use), and ``device_tensor(lease.location)`` the
uint8 CUDA tensor over it. Device copies are always clean (DRAM or SSD keeps the object), so
evicting one is free: the HBM clock drops unleased copies when the tier is full. A copy belongs to
one version: replacing or deleting the key retires it (freed when its last device lease goes).
Mutable (published) objects are copied as they are at load time.

The H2D copy is synchronous (the data is on the device when ``acquire_device`` returns) and runs
without the engine's lock; the object's DRAM bytes are pinned meanwhile. A consumer must release a
device lease only once the GPU work reading the copy has finished (synchronize or wait on an event
first): after release the range may be reused for another object.

This is a mixin of :class:`~kvstrata.store.engine.ObjectStore`; it shares the engine's fields.
"""

from __future__ import annotations

from typing import Any

from kvstrata.errors import CapacityError, ClosedError, InvalidValue
from kvstrata.store.objects import Entry, Lease, check_key, check_timeout
from kvstrata.store.tiers.base import Location

GPU_SEGMENT = -1  # Location.segment of a location in the HBM tier


class GpuCopy:
    """The HBM copy of one entry."""

    __slots__ = ("entry", "leases", "loading", "loc", "referenced")

    def __init__(self, entry: Entry):
        self.entry = entry
        self.loc: Location | None = None
        self.leases = 0
        self.loading = True
        self.referenced = False


class DeviceCacheMixin:
    """HBM read cache of the engine (see the module docstring)."""

    def acquire_device(self, key: str, *, owner: object, timeout: float | None = 0.0) -> Lease:
        """Lease an HBM copy of ``key`` (``lease.location.segment == -1``); release with :meth:`release`.

        ValueError when the store has no HBM tier; CapacityError when the object is larger than the
        tier or every copy there is leased; otherwise as :meth:`acquire`.
        """
        if self._gpu is None:
            raise InvalidValue("acquire_device: this store has no HBM tier (StoreConfig.gpu_bytes is 0)")
        check_key(key)
        timeout = check_timeout(timeout)
        with self._lock:
            while True:
                if self._closed:  # (also after a wait or a load, which let the lock go: close() may have run)
                    raise ClosedError("the object store is closed")
                e = self._wait_for(key, timeout, promote=False)
                copy = e.gpu
                if copy is not None and not copy.loading:
                    break
                if copy is not None:
                    self._gpu_cond.wait()  # another reader is loading it
                    continue
                if e.loading:
                    # Another reader is bringing it back from SSD (its file read runs without the lock): wait for
                    # that load and look again. A load of our own would give it a second DRAM block, one of the
                    # two never freed.
                    self._wait_for(key, timeout, promote=True)
                    continue
                self._gpu_load(e)
            copy.leases += 1
            copy.referenced = True
            self._counts["hits"] += 1
            lid = next(self._lease_ids)
            self._leases[lid] = (copy, owner)
            self._owner_leases.setdefault(owner, set()).add(lid)
            lease = Lease(lid, key, copy.loc, e.size, False)
        if self._announced < len(self._mem.segments):  # loading through DRAM may have grown it
            self._announce_segments()
        return lease

    def device_tensor(self, location: Location) -> Any:
        """The uint8 device tensor over an HBM ``location`` (no copy)."""
        if self._gpu is None or location.segment != GPU_SEGMENT:
            raise InvalidValue(f"location: {location} is not in an HBM tier")
        offset, size = location.offset, location.size
        # (a slice past the buffer's end, or from a negative offset, would be a shorter tensor or the wrong bytes)
        if offset < 0 or size < 0 or offset + size > self._gpu.capacity:
            raise InvalidValue(f"location: {location} lies outside the HBM tier ({self._gpu.capacity} bytes)")
        return self._gpu.tensor(location)

    def _gpu_load(self, e: Entry) -> None:
        """Give ``e`` an HBM copy. Under the lock; releases it for the copy. Callers look ``e`` up again."""
        if e.size > self._gpu.capacity:
            raise CapacityError(f"object {e.key!r} of {e.size} bytes exceeds the HBM tier ({self._gpu.capacity} bytes)")
        copy = e.gpu = GpuCopy(e)
        try:
            if e.loc is None and not self._load(e):
                e.gpu = None  # deleted or replaced meanwhile
                self._gpu_cond.notify_all()
                return
            loc = self._gpu_allocate(e.size)
        except BaseException:
            e.gpu = None
            self._gpu_cond.notify_all()
            raise
        e.leases += 1  # pin the DRAM source during the copy
        src = self.buffer(e.loc)
        self._lock.release()
        try:
            if e.size:
                import torch

                # a blocking copy_ synchronizes the current stream: the bytes are there on return
                self._gpu.write(loc, torch.frombuffer(src, dtype=torch.uint8))
        except BaseException as exc:
            self._lock.acquire()
            self._gpu_loaded(e, copy, None, loc)
            if self._closed and isinstance(exc, Exception):  # the tier's buffer went with close(), under the copy
                raise ClosedError("the object store is closed") from exc
            raise
        self._lock.acquire()
        self._gpu_loaded(e, copy, loc, loc)

    def _gpu_loaded(self, e: Entry, copy: GpuCopy, loc: Location | None, allocated: Location) -> None:
        e.leases -= 1  # the DRAM source's pin
        if e.leases == 0:
            self._evict_blocked = False  # as a lease's release: the watermark pass may find it evictable now
            if e.dead:
                self._free_locked(e)
        copy.loading = False
        self._gpu_cond.notify_all()
        if loc is None or e.dead or e.gpu is not copy:
            self._gpu_free(allocated)
            if e.gpu is copy:
                e.gpu = None
            return
        copy.loc = loc
        if loc.size:
            self._gpu_clock.add(e.key, copy)
        self._counts["device_loads"] += 1

    def _gpu_allocate(self, size: int) -> Location:
        if size == 0:
            return Location(GPU_SEGMENT, 0, 0)
        gpu = self._gpu
        while True:
            loc = gpu.allocate(size)
            if loc is not None:
                return Location(GPU_SEGMENT, loc.offset, size)
            victim = self._gpu_clock.next_victim(lambda c: c.leases == 0 and not c.loading)
            if victim is None:
                raise CapacityError(
                    f"no room for {size} bytes in the HBM tier: {gpu.used} of {gpu.capacity} bytes held by "
                    "leased copies"
                )
            self._gpu_free(victim.loc)
            victim.loc = None
            victim.entry.gpu = None
            self._counts["device_evictions"] += 1

    def _gpu_free(self, loc: Location) -> None:
        if loc.size:
            self._gpu.free(Location(0, loc.offset, loc.size))

    def _gpu_retire(self, e: Entry) -> None:
        """``e`` left service: its HBM copy goes now, or at its last device lease's release."""
        copy = e.gpu
        self._gpu_clock.remove(e.key, copy)
        if copy.leases == 0 and copy.loc is not None:
            self._gpu_free(copy.loc)
            copy.loc = None
            e.gpu = None

    def _gpu_release(self, copy: GpuCopy) -> None:
        copy.leases -= 1
        e = copy.entry
        if e.dead and copy.leases == 0 and copy.loc is not None:
            self._gpu_free(copy.loc)
            copy.loc = None
            e.gpu = None


__all__ = ["GPU_SEGMENT", "DeviceCacheMixin", "GpuCopy"]

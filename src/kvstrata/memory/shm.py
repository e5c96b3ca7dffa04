"""Shared memory segments: memfd-backed mappings a worker hands to its clients by file descriptor.

A :class:`SharedSegment` is one ``memfd_create`` file mapped ``MAP_SHARED``. The worker creates it
(:meth:`SharedSegment.create`), passes ``fd`` to clients over a Unix socket (SCM_RIGHTS), and each
client maps the same pages with :meth:`SharedSegment.attach`. Huge pages: ``MFD_HUGETLB`` when the
machine has enough free hugetlb pages reserved, else a plain memfd advised with ``MADV_HUGEPAGE``
(transparent huge pages for shmem, when the kernel allows it). What was obtained is recorded in
``.hugepages`` (``"hugetlb"``, ``"thp"`` or ``"off"``) rather than hidden.

Example::

    seg = SharedSegment.create(1 << 20, name="demo")
    seg.buffer[:5] = b"hello"
    peer = SharedSegment.attach(os.dup(seg.fd), seg.nbytes)   # what a client does with a received fd
    assert bytes(peer.buffer[:5]) == b"hello"
    peer.close(); seg.close()
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from typing import Any

from kvstrata.errors import InvalidValue
from kvstrata.memory import numa

log = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_MFD_HUGETLB = getattr(os, "MFD_HUGETLB", 0x0004)


def _free_hugetlb_bytes() -> int:
    """Bytes of free default-size hugetlb pages (0 when none are reserved or /proc is missing)."""
    free = size_kb = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("HugePages_Free:"):
                    free = int(line.split()[1])
                elif line.startswith("Hugepagesize:"):
                    size_kb = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return free * size_kb * 1024


def _address_of(mm: mmap.mmap) -> int:
    # The temporary ctypes object exports the buffer only for the duration of this expression, so
    # the mapping can still be closed later.
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


_warned_no_huge: list[bool] = []


class SharedSegment:
    """One shared memory mapping: ``fd``, ``nbytes``, ``address``, ``buffer`` (a writable memoryview).

    Built by :meth:`create` (owner side) or :meth:`attach` (a peer that received the fd).
    ``close()`` unmaps and closes the descriptor; it is idempotent.
    """

    __slots__ = ("_closed", "_mm", "address", "buffer", "fd", "hugepages", "name", "nbytes", "numa_node")

    def __init__(self, fd: int, nbytes: int, mm: mmap.mmap, *, hugepages: str, name: str, numa_node: int | None):
        self.fd = fd
        self.nbytes = nbytes
        self.hugepages = hugepages
        self.name = name
        self.numa_node = numa_node
        self._mm = mm
        self.address = _address_of(mm)
        self.buffer = memoryview(mm)
        self._closed = False

    @classmethod
    def create(
        cls,
        nbytes: int,
        *,
        name: str | None = None,
        hugepages: str | bool = "auto",
        numa_node: int | None = None,
        populate: bool = False,
    ) -> SharedSegment:
        """A new zero-filled segment of ``nbytes`` (> 0).

        ``hugepages``: ``"auto"``/``True`` try hugetlb pages, then fall back to a plain memfd with
        transparent huge pages advised; ``False``/``"off"`` use normal pages. ``numa_node``: bind
        the pages to that node (None: leave placement to the kernel). The node actually bound is in
        ``.numa_node`` (None when binding was not possible). ``populate``: fault every page in now
        (after binding), so first writes do not pay page faults.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidValue(f"nbytes: must be a positive int, got {nbytes!r}")
        if hugepages not in ("auto", True, False, "off", "on"):
            raise InvalidValue(f"hugepages: must be 'auto', 'on', 'off', True or False, got {hugepages!r}")
        name = name or "kvstrata"
        want_huge = hugepages in ("auto", True, "on")
        fd = -1
        mm = None
        kind = "off"
        if want_huge:
            rounded = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
            if _free_hugetlb_bytes() >= rounded:
                try:
                    fd = os.memfd_create(name, os.MFD_CLOEXEC | _MFD_HUGETLB)
                    os.ftruncate(fd, rounded)
                    mm = mmap.mmap(fd, rounded, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                    kind = "hugetlb"
                    nbytes_mapped = rounded
                except OSError as exc:
                    log.info("hugetlb segment of %d bytes not available (%s); using normal pages", rounded, exc)
                    if fd >= 0:
                        os.close(fd)
                    fd, mm = -1, None
        if mm is None:
            nbytes_mapped = nbytes
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, nbytes)
                mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError:
                os.close(fd)
                raise
            if want_huge and hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    mm.madvise(mmap.MADV_HUGEPAGE)
                    kind = "thp" if _shmem_thp_enabled() else "off"
                except OSError:
                    kind = "off"
        if kind == "off" and hugepages in ("on", True) and not _warned_no_huge:
            _warned_no_huge.append(True)  # once per process: every segment of the tier would say the same
            log.warning(
                "huge pages were asked for (hugepages=on) but none are available: %s uses normal pages "
                "(reserve hugetlb pages in /proc/sys/vm/nr_hugepages, or enable shmem THP in "
                "/sys/kernel/mm/transparent_hugepage/shmem_enabled)",
                name,
            )
        bound: int | None = None
        if numa_node is not None:
            try:
                if numa.bind(_address_of(mm), nbytes_mapped, int(numa_node)):
                    bound = int(numa_node)
            except ValueError:
                mm.close()
                os.close(fd)
                raise
            if bound is None:
                log.info("segment %s: could not bind to NUMA node %s; pages placed by the kernel", name, numa_node)
        if populate:
            _populate(mm, nbytes_mapped)
        # A hugetlb mapping is rounded up; callers see (and allocate from) exactly what they asked for.
        seg = cls(fd, nbytes, mm, hugepages=kind, name=name, numa_node=bound)
        if nbytes_mapped != nbytes:
            seg.buffer = seg.buffer[:nbytes]
        return seg

    @classmethod
    def attach(cls, fd: int, nbytes: int) -> SharedSegment:
        """Map a segment received from its owner. Takes ownership of ``fd`` (closed by ``close()``)."""
        if not isinstance(fd, int) or fd < 0:
            raise InvalidValue(f"fd: must be an open file descriptor, got {fd!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidValue(f"nbytes: must be a positive int, got {nbytes!r}")
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise InvalidValue(f"nbytes: {nbytes} exceeds the segment's size {size}")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        seg = cls(fd, nbytes, mm, hugepages="hugetlb" if size != nbytes else "unknown", name="attached", numa_node=None)
        if size != nbytes:
            seg.buffer = seg.buffer[:nbytes]
        return seg

    @property
    def closed(self) -> bool:
        return self._closed

    def as_numpy(self) -> Any:
        """A writable ``uint8`` numpy array over the whole segment (no copy)."""
        import numpy as np

        return np.frombuffer(self.buffer, dtype=np.uint8)

    def as_tensor(self) -> Any:
        """A ``uint8`` torch CPU tensor over the whole segment (no copy)."""
        import torch

        return torch.frombuffer(self.buffer, dtype=torch.uint8)

    def discard_pages(self) -> bool:
        """Give the segment's memory back to the kernel (``MADV_REMOVE``: a hole punched in the shared file, in every
        process that maps it); the mapping stays, and reads as zeros. False where the kernel refused, or closed.

        Pages page-locked by CUDA in some process stay allocated until that process unregisters them.
        """
        if self._closed or not hasattr(mmap, "MADV_REMOVE"):
            return False
        try:
            self._mm.madvise(mmap.MADV_REMOVE)
        except (OSError, ValueError) as exc:
            log.info("segment %s: pages not discarded (%s)", self.name, exc)
            return False
        return True

    def close(self) -> None:
        """Unmap and close the descriptor. Safe to call twice.

        If numpy arrays or tensors made from this segment are still alive the mapping stays until
        they are collected (unmapping under them would crash the process); the fd is closed now.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.buffer.release()
            self._mm.close()
        except BufferError:
            log.debug("segment %s still has live views; unmapped when they are collected", self.name)
        # Drop our references either way: with live views, the mapping goes with the last of them
        # (mmap's deallocation unmaps), instead of staying mapped for the life of this object.
        self.buffer = None  # type: ignore[assignment]
        self._mm = None  # type: ignore[assignment]
        try:
            os.close(self.fd)
        except OSError:
            pass

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SharedSegment(fd={self.fd}, nbytes={self.nbytes}, hugepages={self.hugepages!r}, name={self.name!r})"


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _populate(mm: mmap.mmap, nbytes: int) -> None:
    try:
        mm.madvise(_MADV_POPULATE_WRITE)  # Linux >= 5.14: faults pages in without writing them
    except OSError:
        ctypes.memset(_address_of(mm), 0, nbytes)  # older kernels: touch every page (memfd pages are zero)


def _shmem_thp_enabled() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            text = f.read()
    except OSError:
        return False
    chosen = text[text.find("[") + 1 : text.find("]")]
    return chosen in ("always", "within_size", "advise", "force")


__all__ = ["SharedSegment"]

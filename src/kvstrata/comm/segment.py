"""Per-NUMA-node shared host segments for the hybrid all-gather's host path.

A segment is a named file under ``/dev/hugepages`` (hugetlbfs) or ``/dev/shm`` that every local rank
maps. The node's first rank creates it, binds its pages to the node (``kvstrata.memory.numa.bind``)
before first touch, reserves them (a tmpfs file is sparse: a page that does not fit would SIGBUS the
first process touching it, so ``posix_fallocate`` turns "full" into :class:`~kvstrata.errors.CapacityError`
up front) and zeroes it; the others attach; then the creator unlinks the name, so the memory lives
exactly as long as some process maps it and nothing is left behind even after SIGKILL. Names carry the
creator's pid, so a file left by a creator that died between create and unlink is swept by the next
job on the host.

Layout: a header of one int64 ready flag per global rank (4 KiB), then per buffer and rank the call
record that rank's flags announce (:data:`CALL_WORDS` int64, see ``hostpath``), then two buffers of
``world * slot_bytes`` (double buffering: call ``seq`` uses buffer ``seq % 2``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
from pathlib import Path

import numpy as np
import torch

from kvstrata._proc import sweep_dead_owner_files
from kvstrata.errors import CapacityError, InvalidValue
from kvstrata.memory import numa, register, unregister

log = logging.getLogger(__name__)

FLAGS_BYTES = 4096  # one int64 ready flag per global rank
MAX_RANKS = FLAGS_BYTES // 8
CALL_WORDS = 4  # int64 per call record (what a rank's flags of one buffer announce)
HEADER_BYTES = FLAGS_BYTES + 2 * MAX_RANKS * CALL_WORDS * 8
SHM_DIR = Path("/dev/shm")
HUGEPAGES_DIR = Path("/dev/hugepages")
PREFIX = "kvstrata-ag-"
_cuda_registered: set[int] = set()


def segment_bytes(world: int, slot_bytes: int, *, huge: bool) -> int:
    """Total size of a segment holding ``world`` slots of ``slot_bytes`` in each of two buffers."""
    size = HEADER_BYTES + 2 * world * slot_bytes
    page = (huge_page_size() or mmap.PAGESIZE) if huge else mmap.PAGESIZE
    return -(-size // page) * page


def _meminfo(field: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def huge_page_size() -> int:
    """The default huge page size in bytes (what ``/dev/hugepages`` hands out), 0 when unknown."""
    return _meminfo("Hugepagesize") * 1024


def hugepages_free_bytes() -> int:
    """Bytes of free default-size huge pages on this host (0 without hugetlbfs mounted)."""
    if not HUGEPAGES_DIR.is_dir():
        return 0
    return _meminfo("HugePages_Free") * huge_page_size()


_SEGMENT_NAME = re.compile(rf"{PREFIX}[0-9a-f]+-n\d+-g\d+-p(\d+)")


def sweep_stale(directory: Path = SHM_DIR) -> int:
    """Unlink segment files whose creator process is gone (it died before unlinking); returns how many."""
    return sweep_dead_owner_files(directory, _SEGMENT_NAME)


def cuda_host_register(ptr: int, nbytes: int) -> None:
    """Page-lock and map ``[ptr, ptr + nbytes)`` for DMA from every device (portable | mapped), through
    the process-wide registry of :mod:`kvstrata.memory`."""
    register(ptr, nbytes)
    _cuda_registered.add(ptr)


def cuda_host_unregister(ptr: int) -> None:
    """Undo :func:`cuda_host_register` (no-op for a pointer that is not registered)."""
    if ptr not in _cuda_registered:
        return
    _cuda_registered.discard(ptr)
    unregister(ptr)


class NodeSegment:
    """One mapped segment: a uint8 tensor over the whole file, the flag array and slot views.

    Use :meth:`create` (first local rank of the node) or :meth:`attach` (everyone else).
    """

    def __init__(self, path: Path, size: int, world: int, slot_bytes: int, mm: mmap.mmap, creator: bool) -> None:
        self.path = path
        self.size = size
        self.world = world
        self.slot_bytes = slot_bytes
        self.creator = creator
        self._mm: mmap.mmap | None = mm
        self.data = torch.frombuffer(mm, dtype=torch.uint8, count=size)
        self.flags = np.frombuffer(mm, dtype=np.int64, count=world)
        self.flags_tensor = torch.from_numpy(self.flags)
        # calls[buffer, rank]: the call that rank's flags in ``buffer`` announce; peers check it matches theirs
        self.calls = np.frombuffer(mm, dtype=np.int64, count=2 * world * CALL_WORDS, offset=FLAGS_BYTES).reshape(
            2, world, CALL_WORDS
        )
        self._registered = False

    @classmethod
    def create(cls, path: Path, world: int, slot_bytes: int, *, huge: bool, node: int | None) -> NodeSegment:
        """Create, bind to ``node`` (when it is online), reserve, zero and map the segment at ``path``.

        Raises :class:`~kvstrata.errors.CapacityError` (naming the directory and the size) when the
        directory's file system cannot hold it; nothing is left behind then.
        """
        if world > MAX_RANKS:
            raise InvalidValue(f"group: at most {MAX_RANKS} ranks, got {world}")
        size = segment_bytes(world, slot_bytes, huge=huge)
        if not huge:  # the quick, common answer; _reserve below is the one that holds under races
            free = _free_bytes(path.parent)
            if free < size:
                raise CapacityError(_no_room(path.parent, size, free))
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        seg = None
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            seg = cls(path, size, world, slot_bytes, mm, creator=True)
            if node is not None and node in numa.online_nodes():
                numa.bind(seg.data.data_ptr(), size, node)
            if not huge:  # hugetlbfs reserves its pages at mmap already
                _reserve(fd, path, size)  # after bind: the pages are allocated on the bound node
            seg.data.zero_()  # first touch, on the bound node
        except BaseException:
            if seg is not None:
                seg.close()  # unmaps and unlinks
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
        finally:
            os.close(fd)
        return seg

    @classmethod
    def attach(cls, path: Path, world: int, slot_bytes: int, *, huge: bool) -> NodeSegment:
        """Map an existing segment created by another rank."""
        size = segment_bytes(world, slot_bytes, huge=huge)
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise RuntimeError(f"segment {path}: size {os.fstat(fd).st_size}, expected {size}")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return cls(path, size, world, slot_bytes, mm, creator=False)

    def register_cuda(self) -> None:
        """Register the whole mapping with CUDA so D2H/H2D copies run as DMA at full speed."""
        cuda_host_register(self.data.data_ptr(), self.size)
        self._registered = True

    def slot(self, buffer: int, rank: int) -> torch.Tensor:
        """The bytes of ``rank``'s slot in ``buffer`` (0 or 1)."""
        start = HEADER_BYTES + (buffer * self.world + rank) * self.slot_bytes
        return self.data[start : start + self.slot_bytes]

    def unlink(self) -> None:
        """Remove the name (the mapping stays valid); idempotent."""
        if self.creator:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def __del__(self) -> None:
        # Dropped without close(): never leave CUDA a registration over memory about to be unmapped.
        try:
            self.close()
        except Exception:
            pass

    def close(self) -> None:
        """Unregister, unmap and unlink. Callers make sure no copy still uses the segment."""
        self.unlink()
        if getattr(self, "_mm", None) is None:
            return
        if self._registered:
            cuda_host_unregister(self.data.data_ptr())
            self._registered = False
        mm, self._mm = self._mm, None
        del self.data, self.flags, self.flags_tensor, self.calls
        try:
            mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            log.debug("segment %s: views still alive, unmapped at garbage collection", self.path)


def _free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _no_room(directory: Path, size: int, free: int) -> str:
    return (
        f"{directory} has {free} bytes free, a hybrid all-gather segment needs {size} "
        "(enlarge it, e.g. docker --shm-size, or use a larger ratio)"
    )


def _reserve(fd: int, path: Path, size: int) -> None:
    """Allocate every page of the file now, so that running out of room is an error here and not a
    SIGBUS later (two creators may both have passed the free-space check before either allocated)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        raise CapacityError(_no_room(path.parent, size, _free_bytes(path.parent))) from exc


__all__ = [
    "CALL_WORDS",
    "HEADER_BYTES",
    "NodeSegment",
    "cuda_host_register",
    "cuda_host_unregister",
    "huge_page_size",
    "hugepages_free_bytes",
    "segment_bytes",
    "sweep_stale",
]

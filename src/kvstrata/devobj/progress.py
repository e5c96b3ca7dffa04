"""Cross-process "chunks complete" counters for pipelined broadcast chains.

A broadcast receiver at chain position ``p`` exports its destination buffers to position ``p+1`` as
soon as it starts, together with a :class:`Progress`: one int64 in a small file under ``/dev/shm``
that ``p`` advances as each of its chunk copies completes, and that ``p+1`` polls before it copies
that chunk on. No interprocess CUDA event is involved (waiting on an opened IPC event crashed readers
on the H200 machine, see ``DeviceObjects._ready_event``): the writer advances the counter only after
its own local event for that chunk completed, so the bytes are in its buffer before the count says so.

Memory ordering: the counter is a naturally aligned int64 (offset 0 of a page-aligned mapping), so
on x86-64 its stores and loads are single ``mov`` instructions, atomic, and x86 keeps stores in
program order (TSO): a reader that sees ``n`` sees a value written after the writer observed chunk
``n-1``'s event complete. The writer's store depends on that observation by a branch, and CPUs do not
make speculative stores visible, so the same holds on ARM (Grace).

Lifetime: the creator unlinks the name when its broadcast ends (or fails); the opener unlinks it
right after mapping it (it needs only the mapping), so in the common case the name lives for
microseconds. Names carry the creator's pid: a file left by a creator that died in between is
removed by the next :meth:`Progress.create` on the node (:func:`sweep_stale`). A negative value
means the writer failed: readers stop at once instead of waiting for the broker's error.

GPU-side waits (``DeviceObjectConfig.broadcast_wait="stream"``, optional): the counter page is
registered with CUDA (:meth:`Progress.device_ptr`) and streams wait on it (:func:`gpu_wait`,
``cuStreamWaitValue32`` on the low word, cyclic ``>=``) or advance it (:func:`gpu_write`,
``cuStreamWriteValue32``, which orders the stream's earlier writes before it), through cuda-bindings'
driver API. Counts stay below 2**30, so the low word is the count; a reader that gives up writes
:data:`RELEASE` into its predecessor's counter so its own stream's pending waits end.

Example::

    w = Progress.create()
    r = Progress.open(w.name)     # another process, given the name
    w.advance(3)
    assert r.value() == 3
    r.close(); w.close()
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import uuid
from pathlib import Path

import numpy as np

from kvstrata._proc import sweep_dead_owner_files
from kvstrata.errors import InvalidValue
from kvstrata.ops.stream_ops import driver as stream_driver

SHM_DIR = Path("/dev/shm")
PREFIX = "kvstrata-bcast-"
_NAME = re.compile(rf"{PREFIX}p(\d+)-[0-9a-f]{{32}}")
FAILED = -1
#: written by a reader into its predecessor's counter to end its own stream's GPU waits (see gpu_wait)
RELEASE = (1 << 30) - 1


def sweep_stale(directory: Path = SHM_DIR) -> int:
    """Unlink progress files whose creator process is gone; returns how many."""
    return sweep_dead_owner_files(directory, _NAME)


class Progress:
    """One shared int64 counter: :meth:`create` (the writer) or :meth:`open` (a reader, by name)."""

    __slots__ = ("_dptr", "_mm", "_view", "creator", "name", "path")

    def __init__(self, path: Path, mm: mmap.mmap, *, creator: bool) -> None:
        self.path = path
        self.name = path.name
        self.creator = creator
        self._mm: mmap.mmap | None = mm
        self._view = np.frombuffer(mm, dtype=np.int64, count=1)
        self._dptr: int | None = None

    @classmethod
    def create(cls, directory: Path = SHM_DIR) -> Progress:
        """A new counter at 0 under ``directory`` (``/dev/shm``), named for this process."""
        sweep_stale(directory)
        path = directory / f"{PREFIX}p{os.getpid()}-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, mmap.PAGESIZE)  # tmpfs pages are zero-filled: the counter starts at 0
            mm = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(path, mm, creator=True)

    @classmethod
    def open(cls, name: str, directory: Path = SHM_DIR) -> Progress:
        """Map the counter ``name`` made by another client; the name is unlinked (the mapping stays)."""
        if _NAME.fullmatch(name) is None:
            raise InvalidValue(f"progress: not a broadcast progress name: {name!r}")
        path = directory / name
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            mm = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)  # nobody else needs the name: nothing is left behind if either side dies now
        return cls(path, mm, creator=False)

    def value(self) -> int:
        """Chunks complete so far (``FAILED`` when the writer gave up)."""
        return int(self._view[0])

    def advance(self, n: int) -> None:
        """Publish that chunks ``[0, n)`` are complete (``n`` never decreases)."""
        self._view[0] = n

    def fail(self) -> None:
        """Tell readers to stop: the writer's copy failed."""
        self._view[0] = FAILED

    def release_waiters(self) -> None:
        """Satisfy every GPU wait on this counter (a reader giving up on its predecessor)."""
        self._view[0] = RELEASE

    def device_ptr(self) -> int:
        """The counter's address for GPU streams: the page registered with CUDA (mapped, portable) once."""
        if self._dptr is None:
            from kvstrata.memory import register

            self._dptr = register(int(self._view.ctypes.data), mmap.PAGESIZE)
        return self._dptr

    def claim(self) -> bool:
        """The creator takes its name back before anyone opened it: True when nobody did (and now nobody
        can), False when a reader opened it already (its open unlinked the name)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        return True

    def unlink(self) -> None:
        """Remove the name only (the mapping stays: a GPU may still touch it)."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unregister and unmap; the creator also removes the name if the reader has not. Idempotent.
        Only once no stream can still wait on or write the counter."""
        mm, self._mm = self._mm, None
        if mm is None:
            return
        if self._dptr is not None:
            from kvstrata.memory import unregister

            unregister(int(self._view.ctypes.data))
            self._dptr = None
        self._view = None
        mm.close()
        if self.creator:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _driver():
    """cuda-bindings' driver module with stream memory operations, or None."""
    drv = stream_driver()
    ok = drv is not None and hasattr(drv, "cuStreamWaitValue32") and hasattr(drv, "cuStreamWriteValue32")
    return drv if ok else None


def gpu_ops_available() -> bool:
    """Whether :func:`gpu_wait` / :func:`gpu_write` can run here (cuda-bindings installed)."""
    return _driver() is not None


def _check(result: object, call: str) -> None:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"{call} failed: {err!r}")


def gpu_wait(stream: object, ptr: int, count: int) -> None:
    """Work queued on ``stream`` after this waits until the counter at ``ptr`` reached ``count``."""
    drv = _driver()
    res = drv.cuStreamWaitValue32(drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(ptr), count, 0)  # 0: GEQ, cyclic
    _check(res, "cuStreamWaitValue32")


def gpu_write(stream: object, ptr: int, count: int) -> None:
    """Set the counter at ``ptr`` to ``count`` once ``stream``'s earlier work is done (and visible)."""
    drv = _driver()
    res = drv.cuStreamWriteValue32(drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(ptr), count, 0)  # 0: barrier
    _check(res, "cuStreamWriteValue32")


__all__ = [
    "FAILED",
    "PREFIX",
    "RELEASE",
    "Progress",
    "gpu_ops_available",
    "gpu_wait",
    "gpu_write",
    "sweep_stale",
]

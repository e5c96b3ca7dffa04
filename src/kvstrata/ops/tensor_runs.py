"""Copy runs between lists of tensors and objects' bytes in host memory, planned natively (C++).

A device call of many keys (``mget_h2d`` / ``mset_d2h``) checks every tensor it is handed and lays its bytes out
as address runs for the copy engine. In Python that is ~1-2 us per tensor on a warm host and several times that on
a cold one (torch's attribute calls, tuples, list appends), which the H200 host's slowed vCPUs could not hide
behind the DMA of the first batches. :func:`plan` does the same pass in one native call, ~0.1 us per tensor:
for the keys ``lo..hi-1``, each a list of tensors and a location ``(segment, offset, size)`` (a tuple, such as
the client's ``Loc``, or a placement hint with more items) in a segment mapped at ``bases[segment]``, or None (the key
is passed over, its tensors unchecked: a cold read copies it once its lease says where from):

* checks every tensor of a key (a plain ``torch.Tensor`` or ``Parameter``, not a subclass; strided,
  non-quantized, contiguous, of the wanted kind, CUDA on one device) before planning the key, so a key is planned
  whole or not at all;
* records the keys whose tensors' bytes differ from their object's size (no runs);
* lays each tensor along its object's bytes (``dst, src`` swapped where ``to_host``) and merges a run into the
  previous one where both sides continue it, within one segment and one tensor storage (a DMA copy must not
  cross separately registered or allocated ranges), as :func:`kvstrata.client.device.plan` does;
* stops after the key with which the runs reach ``max_runs`` or their bytes ``max_bytes`` (the caller's batch).

It stops early, without planning the key it stopped at, where the Python path must take the key (a CPU or bad
tensor, which that path copies or names in its error; a tensor on a second device) or where a segment's address
is not in ``bases`` (the caller adds it and calls again from that key).

:func:`lay_out` is the same pass for a write (``mset_d2h``) into this client's reservation: each key's object is
laid at the reservation's head, which moves on by the object's bytes rounded up to the reservation's alignment, until
a key does not fit before its end.

:func:`plan_copy` and :func:`lay_out_copy` are the same passes that also queue their runs on the copy engine, in the
same native call: the driver's ``cuMemcpyBatchAsync`` (looked up once by :func:`batch_entry`, for the ABI the module
declares, so the module needs no CUDA headers), ``head`` runs in a first call and the rest in calls of ``chunk``, on
the caller's stream (:func:`copier`). No list of addresses is built and read back through cuda-bindings, whose batch
call cost the host ~10-17 us a batch on the H200 machine (``tools/probe_call_steps.py``, session 26): on that machine
(session 29) a kept read of 64 x 1 MiB was done queueing at 119-242 us against 147-308, and a reserved ``mset_d2h`` of
256 x 64 KiB at 288-558 against 442-788. The driver's error, if any, comes back with how many runs were queued.

The native module is compiled from ``native/tensor_runs.cpp`` by torch's extension builder the first time a
process asks for it (``ninja`` and a C++ compiler; ~20 s on two cores), in a background thread unless asked to
wait, and cached on disk (``KVSTRATA_NATIVE_DIR``, default ``~/.cache/kvstrata/native``) by the source's, torch's
and Python's versions, so later processes load it in microseconds. Until it is loaded, or where it cannot be built
(``KVSTRATA_NATIVE=0`` turns it off), :func:`native` answers None and callers take their Python path.

Example (CPU tensors stand in for CUDA ones, ``cuda=False``)::

    >>> import torch
    >>> from kvstrata.ops import tensor_runs
    >>> if tensor_runs.native(wait=True) is not None:
    ...     t = torch.zeros(4, dtype=torch.int32)
    ...     stop, why, dsts, srcs, sizes, bad, _ = tensor_runs.plan(
    ...         [[t[:2], t[2:]]], [(0, 64, 16)], {0: 4096}, 0, 1, 16, 1 << 20, cuda=False)
    ...     assert (stop, why, srcs, sizes, bad) == (1, tensor_runs.DONE, [4160], [16], [])
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

#: why a pass stopped: every key of the range planned; the batch is full (keys remain); the key at ``stop`` needs the
#: Python path; the segment of the key at ``stop`` is not in ``bases`` (:func:`plan`); the key at ``stop`` does not fit
#: the reservation (:func:`lay_out`)
DONE, CUT, PYTHON_PATH, NO_BASE, FULL = 0, 1, 2, 3, 4

SOURCE = Path(__file__).with_name("native") / "tensor_runs.cpp"
_NAME = "kvstrata_tensor_runs"  # the module's init function is PyInit_<this>
_TORCH_LOCK = "lock"  # the file torch's extension builder holds its build folder by (torch.utils.file_baton)

_lock = threading.Lock()
_module: ModuleType | None = None
_state = "new"  # new -> building -> ready | failed
_error = ""  # why it is not loaded, where it failed
_built = threading.Event()


def native(wait: bool = False) -> ModuleType | None:
    """The native module, or None while it is not loaded: the first call starts loading it (from the disk cache,
    else a build in a background thread); ``wait=True`` waits for that to end (a benchmark's or test's set-up).
    None for good where it is turned off (``KVSTRATA_NATIVE=0``) or could not be built (logged once)."""
    global _state
    if _module is not None:
        return _module
    with _lock:
        start = _state == "new"
        if start:
            _state = "building"
    if start:
        if os.environ.get("KVSTRATA_NATIVE", "1") == "0":
            _finish(None, "failed", "turned off (KVSTRATA_NATIVE=0)")
        elif not _load_cached():
            if wait:
                _build()
            else:
                threading.Thread(target=_build, name="kvstrata-native-build", daemon=True).start()
    if wait:
        _built.wait()
    return _module


def plan(
    tensor_lists: Any,
    locs: list[Any],
    bases: dict[int, int],
    lo: int,
    hi: int,
    max_runs: int,
    max_bytes: int,
    *,
    device_index: int = -1,
    to_host: bool = False,
    cuda: bool = True,
) -> tuple[int, int, list[int], list[int], list[int], list[int], int]:
    """Plan keys ``lo..hi-1`` (see the module's docstring): ``(stop, why, dsts, srcs, sizes, mismatched,
    device_index)``, where keys ``lo..stop-1`` were planned, ``why`` is :data:`DONE`, :data:`CUT`,
    :data:`PYTHON_PATH` or :data:`NO_BASE`, ``mismatched`` lists the keys whose tensors' bytes differ from their
    object's size, and ``device_index`` is the device every planned tensor is on (-1 where none was met; pass it
    back in the next call of the same device call). Needs :func:`native` to have answered a module."""
    return _loaded().plan(tensor_lists, locs, bases, lo, hi, max_runs, max_bytes, device_index, to_host, cuda)


def lay_out(
    tensor_lists: Any,
    lo: int,
    hi: int,
    base: int,
    head: int,
    end: int,
    mask: int,
    max_runs: int,
    max_bytes: int,
    *,
    device_index: int = -1,
    segment: int = 0,
    cuda: bool = True,
) -> tuple[int, int, list[int], list[int], list[int], list[int], list[int], int, int]:
    """Lay keys ``lo..hi-1`` out one after another in a reservation of segment ``segment`` (mapped at ``base``) from
    offset ``head`` up to ``end``, each object taking its bytes rounded up to ``mask + 1``, the copies going from the
    tensors to the host: ``(stop, why, dsts, srcs, sizes, totals, offsets, device_index, head)``, where keys
    ``lo..stop-1`` were laid out, ``totals`` and ``offsets`` are their objects' bytes and places, ``why`` is
    :data:`DONE`, :data:`CUT`, :data:`PYTHON_PATH` or :data:`FULL`, and ``head`` is where the next object goes."""
    return _loaded().lay_out(
        tensor_lists, lo, hi, base, head, end, mask, max_runs, max_bytes, device_index, segment, cuda
    )


def plan_copy(
    tensor_lists: Any,
    locs: list[Any],
    bases: dict[int, int],
    lo: int,
    hi: int,
    max_runs: int,
    max_bytes: int,
    copier: tuple[int, int, int, int, int],
    *,
    device_index: int = -1,
    to_host: bool = False,
    cuda: bool = True,
) -> tuple[int, int, int, int, list[int], int]:
    """:func:`plan`, with the pass's runs queued by the driver in the same native call instead of answered:
    ``(stop, why, runs, err, mismatched, device_index)``, where ``runs`` were queued and ``err`` is the driver's
    error (0: none; then the runs from ``runs`` on were not queued). ``copier`` is :func:`copier`'s."""
    return _loaded().plan_copy(
        tensor_lists, locs, bases, lo, hi, max_runs, max_bytes, device_index, to_host, cuda, copier
    )


def lay_out_copy(
    tensor_lists: Any,
    lo: int,
    hi: int,
    base: int,
    head: int,
    end: int,
    mask: int,
    max_runs: int,
    max_bytes: int,
    copier: tuple[int, int, int, int, int],
    *,
    device_index: int = -1,
    segment: int = 0,
    cuda: bool = True,
) -> tuple[int, int, int, int, list[int], list[int], int, int]:
    """:func:`lay_out`, with the pass's runs queued by the driver in the same native call: ``(stop, why, runs, err,
    totals, offsets, device_index, head)`` (``runs`` and ``err`` as :func:`plan_copy` answers them)."""
    return _loaded().lay_out_copy(
        tensor_lists, lo, hi, base, head, end, mask, max_runs, max_bytes, device_index, segment, cuda, copier
    )


def _loaded() -> ModuleType:
    module = _module
    if module is None:
        raise RuntimeError("kvstrata.ops.tensor_runs: the native module is not loaded (see native())")
    return module


def hints(table: Any, keys: list[str], lo: int, hi: int, limits: dict[int, int] | None = None) -> list[Any]:
    """The placement table's hints for keys ``lo..hi-1`` (:meth:`kvstrata.store.placements.PlacementHints.lookup`'s
    ``(segment, offset, size, placement)`` or None, in one native call: CRC-32 of each key's UTF-8 bytes, its bucket's
    words); with ``limits`` (index -> bytes mapped), only those a copy may start from (a placement in a segment of
    ``limits`` whose range lies within it). ``table`` is the mapped table's buffer (held for the call)."""
    return _loaded().hints(table, keys, lo, hi, limits)


def current_prefix(entries: dict[str, list], keys: list[str], gen: int, slots: int, nslots: int) -> list[Any]:
    """The locations of ``keys`` from the first while each key's entry in ``entries`` is current (the local-read
    cache's test, :meth:`kvstrata.client.local_reads.LocalReads.locations_prefix`), in one native call: an entry
    ``[lease, location, slot, count, seen]`` is current where ``seen`` is ``gen`` or the counter at ``slots`` (the
    address of ``nslots`` 8-byte counters) numbered ``slot`` still shows ``count``; ``seen`` then becomes ``gen``.
    Stops at the first key with no current entry (or not a str), changing nothing for it."""
    return _loaded().current_prefix(entries, keys, gen, slots, nslots)


#: :func:`join`'s states: the caller's stream had nothing pending (nothing queued); the side stream waits for an
#: event recorded on it; a wait is needed and no event was given (nothing queued)
IDLE, JOINED, NEEDS_EVENT = 0, 1, 2


def join(calls: tuple[int, int, int], caller: int, side: int, event: int, skip_idle: bool = True) -> tuple[int, int]:
    """Make the raw stream ``side`` wait for the work queued on ``caller`` so far, with the driver's calls
    (:func:`stream_calls`): ``(state, the driver's error or 0)``. With ``skip_idle``, one ``cuStreamQuery`` first,
    and no wait where ``caller`` has nothing pending (:data:`IDLE`); else the raw event ``event`` recorded on it and
    ``side`` made to wait for it (:data:`JOINED`), or nothing where ``event`` is 0 (:data:`NEEDS_EVENT`). The calling
    thread needs the streams' context current."""
    return _loaded().join(calls, caller, side, event, skip_idle)


@functools.cache
def stream_calls() -> tuple[int, int, int] | None:
    """The driver's ``cuStreamQuery``, ``cuEventRecord`` and ``cuStreamWaitEvent`` (addresses, for :func:`join`),
    or None (no cuda-bindings, no GPU)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    try:
        out = []
        for name in (b"cuStreamQuery", b"cuEventRecord", b"cuStreamWaitEvent"):
            got = driver.cuGetProcAddress(name, 12000, 0)
            if int(got[0]) != 0 or not int(got[1]) or (len(got) > 2 and int(got[2]) != 0):
                return None
            out.append(int(got[1]))
        return out[0], out[1], out[2]
    except Exception as exc:  # an unexpected binding: streams are joined through cuda-bindings' runtime calls
        log.warning("kvstrata: the driver's stream calls not found (%s)", exc)
        return None


def loaded() -> ModuleType | None:
    """The native module if it is loaded now, else None; never starts a build (see :func:`native`)."""
    return _module


def copier(stream: int, head: int, chunk: int) -> tuple[int, int, int, int, int] | None:
    """How :func:`plan_copy` and :func:`lay_out_copy` queue their runs: on the raw CUDA stream ``stream`` (not the
    legacy default stream; its device must be the calling thread's current one), ``head`` runs in the first driver
    call and ``chunk`` in each after it. None where the driver's batch call is not there (the caller then copies the
    runs :func:`plan` answers)."""
    entry = batch_entry()
    return None if entry is None else (entry[0], entry[1], stream, head, chunk)


@functools.cache
def batch_entry() -> tuple[int, int] | None:
    """The driver's ``cuMemcpyBatchAsync``: ``(its address, the ABI version it was asked for)``, 13000 (the call as
    CUDA 13 has it) or 12080 (CUDA 12.8's, with a failure index), or None (no cuda-bindings, a driver older than
    12.8, no GPU). Looked up with ``cuGetProcAddress`` for that ABI version, so a newer driver answers the call this
    module declares."""
    import torch

    if not torch.cuda.is_available():  # no driver to ask (and nothing to warn about)
        return None
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    try:
        err, version = driver.cuDriverGetVersion()
        if int(err) != 0 or version < 12080:
            return None
        abi = 13000 if version >= 13000 else 12080
        got = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", abi, 0)
        err, address = got[0], got[1]
        if int(err) != 0 or not int(address) or (len(got) > 2 and int(got[2]) != 0):
            return None
        return int(address), abi
    except Exception as exc:  # an unexpected binding: copies go the Python way
        log.warning("kvstrata: the driver's cuMemcpyBatchAsync not found (%s); copies go through cuda-bindings", exc)
        return None


def cache_dir() -> Path:
    """Where the built module lives: one folder per source, torch and Python version."""
    import torch

    root = Path(os.environ.get("KVSTRATA_NATIVE_DIR") or Path.home() / ".cache" / "kvstrata" / "native")
    tag = hashlib.sha256(
        SOURCE.read_bytes() + f"|{torch.__version__}|{sys.version}|{sys.platform}".encode()
    ).hexdigest()[:16]
    return root / f"{_NAME}-{tag}"


def _load_cached() -> bool:
    """Load the module from the disk cache; False where it is not there (or would not load)."""
    try:
        path = cache_dir() / f"{_NAME}.so"
        if not path.exists():
            return False
        _finish(_import(path), "ready")
        return True
    except Exception as exc:  # a stale or broken build: built again
        log.warning("kvstrata native module at %s would not load (%s); building it again", cache_dir(), exc)
        return False


def _build() -> None:
    try:
        from torch.utils import cpp_extension

        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        # Processes building at once build it once: they take turns on a lock of ours, which the kernel lets go of
        # if its holder dies. torch's builder has a lock of its own, a file it makes and removes, that a process
        # killed mid-build leaves behind: every later build would wait for it forever. Whoever holds our lock
        # knows no live process is building, so a torch lock file there is stale and goes.
        with open(folder / "kvstrata-build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _load_cached():  # (built by the process that held the lock before this one)
                (folder / _TORCH_LOCK).unlink(missing_ok=True)
                module = cpp_extension.load(
                    _NAME, [str(SOURCE)], extra_cflags=["-O2"], build_directory=str(folder), verbose=False
                )
                _finish(module, "ready")
    except Exception as exc:
        log.warning("kvstrata native module not built (%s): device calls plan their copies in Python", exc)
        _finish(None, "failed", f"not built: {exc}")


def _import(path: Path) -> ModuleType:
    import torch  # noqa: F401  (the module links against torch's libraries, loaded by this import)

    module = sys.modules.get(_NAME)
    if module is None:
        spec = importlib.util.spec_from_file_location(_NAME, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[_NAME] = module
    return module


def _finish(module: ModuleType | None, state: str, error: str = "") -> None:
    global _module, _state, _error
    with _lock:
        _module, _state, _error = module, state, error
    _built.set()


def state() -> dict[str, str]:
    """Where the native module stands: ``state`` (new, building, ready or failed), ``path`` (its file, once loaded)
    and ``error`` (why it is not loaded, where it failed)."""
    module = _module
    return {"state": _state, "path": getattr(module, "__file__", "") or "", "error": _error}

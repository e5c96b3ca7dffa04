"""Host <-> device copies between user tensors and objects in shared memory, planned as raw address runs.

``mget_h2d`` / ``mset_d2h`` move many keys' bytes at once. Their per-call cost is kept flat and small:

* :func:`check_key` validates each key's tensors once and keeps only ``(address, nbytes, on_cuda)``
  per tensor (no views, no per-tensor torch ops); :func:`check_tensor_lists` does it for a whole call (the one-pass
  calls, a kept ``mget_h2d`` and a reserved ``mset_d2h``, check and plan natively where they can:
  :mod:`kvstrata.ops.tensor_runs`, whose runs :func:`copy_lists` queues);
* :func:`plan` lays those pieces along each object's bytes in a segment and merges pieces that continue
  each other on both sides (objects written by one ``mset_d2h`` into one batch of tensors often do);
* :func:`enqueue` issues device runs as ``cudaMemcpyBatchAsync`` calls (``kvstrata.ops.copy_engine``)
  on the copy engines and host runs as ``memmove`` (the GIL released); ``mget_h2d`` / ``mset_d2h`` go
  through their keys in :func:`stages` (check, lease or create, plan, enqueue), so the DMA starts after
  the first small stage's host work and the rest runs beside it;
* :class:`Registrations` registers each shared segment with CUDA once per client (pinned for the
  copy engines: DMA straight from and to the worker's memory) and remembers a refusal, so neither
  costs anything on later calls.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import itertools
import logging
import sys
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

from kvstrata.errors import InvalidType, InvalidValue

log = logging.getLogger(__name__)

_memmove = ctypes.memmove  # a foreign call: releases the GIL while it copies
_TORCH_COPY_BYTES = 4 << 20  # host runs this large are copied by torch, which uses several threads
# Descriptors per cudaMemcpyBatchAsync. The driver encodes a whole batch before its first copy starts:
# 64 x 1 MiB pinned<->device in one batch ran at 48 GB/s on the H200, the same in 2-8 batches at 52-53
# (one 64 MiB copy: 55), as the later batches' encoding overlaps the earlier ones' DMA.
BATCH_RUNS = 16
# A call's first batch: short, as the copy engine starts on a batch once it is encoded (64 x 1 MiB from idle,
# host issue included, H200: batches of 16 reached 0.959 of one 64 MiB copy, 2 then 14 then 16s 0.970). The write's
# and the placed read's one pass start with this many runs too; a kept read starts with three (kept_reads.FIRST_RUNS).
FIRST_BATCH_RUNS = 2
# Stages of a pipelined device call (:func:`stages`): the first is small so the DMA starts early (4 MiB is
# ~75 us of PCIe Gen5 DMA), later ones grow by half up to 16 MiB. No stage waits for the worker: mset_d2h lays
# its objects out in its write reservation and mget_h2d asks for every lease at the start where it must ask
# at all (the copies wait for that one round trip). Growing by half rather than doubling keeps each stage's
# host work (H200 host, 1 MiB keys: ~10 us per key, 20-50 us per stage) close to the previous stage's DMA
# (19 us per key), so the copy engine waits little while the stages grow. Why 4 MiB and not less: with every
# setting switched call by call on the H200 (tools/probe_store_ab.py, 200 rounds, two draws), a 1 MiB first
# stage was slower for kept leases (0.925 / 0.884 of one 64 MiB copy against 0.931 / 0.906), for mset_d2h
# (0.808 / 0.824 against 0.812 / 0.831) and right after a rewrite (0.781 / 0.706 against 0.808 / 0.746):
# the host work of the extra stages eats what it starts early.
FIRST_STAGE_BYTES = 4 << 20
MAX_STAGE_BYTES = 16 << 20


class Piece(NamedTuple):
    """One user tensor's bytes: where they are, how many, on a GPU or not (the tensor keeps them alive),
    and for a GPU tensor its storage's address (the allocation a device run must stay inside)."""

    ptr: int
    nbytes: int
    cuda: bool
    tensor: Any
    alloc: int


class Runs(NamedTuple):
    """Copies as ``(dst, src, nbytes, merge key)`` address runs, split by who moves them."""

    host: list[tuple[int, int, int, Any]]
    device: list[tuple[int, int, int, Any]]
    pieces: list[tuple[tuple, int, bool]]  # (piece, host address, to_host): the fallback without cuda-bindings


def check_tensor_lists(n_keys: int, tensor_lists: Any) -> tuple[list[list[tuple]], list[int], Any]:
    """Validate ``tensor_lists`` (one list of tensors per key) before anything is read or written.

    Returns each key's pieces (tuples laid out as :class:`Piece`), each key's total bytes, and the first
    CUDA device met (None: all on the CPU). ValueError/TypeError naming ``tensor_lists[i][j]``.
    """
    check_outer(n_keys, tensor_lists)
    out: list[list[tuple]] = []
    totals: list[int] = []
    device = None
    for i in range(n_keys):
        pieces, total, dev = check_key(tensor_lists[i], i)
        out.append(pieces)
        totals.append(total)
        if device is None:
            device = dev
    return out, totals, device


def check_outer(n_keys: int, tensor_lists: Any) -> None:
    """The container: one entry per key (each entry is checked by :func:`check_key`)."""
    if type(tensor_lists) is list or type(tensor_lists) is tuple:  # the common case: no ABC check
        if len(tensor_lists) == n_keys:
            return
    elif isinstance(tensor_lists, str | bytes | Mapping) or not (
        hasattr(tensor_lists, "__len__") and hasattr(tensor_lists, "__getitem__")
    ):
        raise InvalidType(f"tensor_lists: need one list of tensors per key, got {type(tensor_lists).__name__}")
    if len(tensor_lists) != n_keys:
        raise InvalidValue(f"tensor_lists: need one list of tensors per key ({n_keys} keys, got {len(tensor_lists)})")


def check_key(ts: Any, i: int) -> tuple[list[tuple], int, Any]:
    """Key ``i``'s tensors: (pieces laid out as :class:`Piece`, total bytes, its first CUDA device or None).
    ValueError/TypeError naming ``tensor_lists[i][j]``.

    The hot path of every device call (once per tensor): one combined test per tensor, each attribute read
    once, torch's names looked up once per process; a tensor that fails it is looked at again by :func:`_refuse`,
    which names what is wrong."""
    names = _torch_names or _load_torch_names()
    tensor_type, strided = names
    if type(ts) is not list and not isinstance(ts, list | tuple):
        raise InvalidType(f"tensor_lists[{i}]: must be a list of tensors, got {type(ts).__name__}")
    device = None
    pieces = []
    append = pieces.append
    total = 0
    for t in ts:
        # `layout` first: a sparse tensor has no is_contiguous
        if (
            not isinstance(t, tensor_type)
            or t.layout is not strided
            or t.is_quantized
            or not t.is_contiguous()
            or t.is_conj()  # lazy views (a conjugate, a negation): their bytes are not their values
            or t.is_neg()
        ):
            _refuse(ts, i)
        n = t.nbytes
        if t.is_cuda:
            if device is None:
                device = t.device
            # a Piece's fields (a plain tuple is cheaper to build); a device piece also names its allocation
            append((t.data_ptr(), n, True, t, t.untyped_storage().data_ptr()))
        elif t.is_cpu:
            append((t.data_ptr(), n, False, t, 0))
        else:
            _refuse(ts, i)
        total += n
    return pieces, total, device


_torch_names: tuple = ()  # (torch.Tensor, torch.strided) once loaded: a client without device calls never loads torch


def _load_torch_names() -> tuple:
    global _torch_names
    import torch

    _torch_names = (torch.Tensor, torch.strided)
    return _torch_names


def _refuse(ts: Any, i: int) -> None:
    """Raise the error for key ``i``'s first bad tensor (see :func:`check_key`), naming ``tensor_lists[i][j]``."""
    import torch

    for j, t in enumerate(ts):
        if not isinstance(t, torch.Tensor):
            raise InvalidType(f"tensor_lists[{i}][{j}]: expected a torch.Tensor, got {type(t).__name__}")
        if t.layout is not torch.strided or t.is_quantized:
            raise InvalidType(f"tensor_lists[{i}][{j}]: sparse and quantized tensors have no flat raw bytes")
        if not t.is_contiguous():
            raise InvalidValue(f"tensor_lists[{i}][{j}]: tensor must be contiguous (call .contiguous() first)")
        if not (t.is_cuda or t.is_cpu):
            raise InvalidType(f"tensor_lists[{i}][{j}]: a {t.device} tensor; only CPU and CUDA tensors are copied")
        if t.is_conj() or t.is_neg():
            raise InvalidValue(
                f"tensor_lists[{i}][{j}]: a lazy conjugate or negative view, whose raw bytes are not its values "
                "(call .resolve_conj() / .resolve_neg(), or .clone(), first)"
            )
    raise AssertionError(f"tensor_lists[{i}]: refused, yet every tensor passes")  # pragma: no cover


class Stage(NamedTuple):
    """Keys ``lo..hi-1`` of a device call, checked: their pieces and sizes (index ``i - lo``), and the call's
    CUDA device as known so far (None while every tensor met was on the CPU)."""

    lo: int
    hi: int
    pieces: list[list[tuple]]
    sizes: list[int]
    device: Any


def stages(n_keys: int, tensor_lists: Any, start: int = 0) -> Any:
    """Yield a device call's keys as consecutive :class:`Stage` s, each checked only as it is reached.

    A call pipelines stage by stage: it acquires or creates a stage's objects and queues its copies,
    then goes on to the next stage while the copy engines move the previous ones, so its first DMA
    starts after one small stage's host work, not after all keys' (64 x 1 MiB: ~100-250 us of checks,
    leases and planning on the H200 host, ~10-20% of the DMA). Stages grow from
    :data:`FIRST_STAGE_BYTES` by half each time up to :data:`MAX_STAGE_BYTES` (each stage's DMA outlasts the
    next stage's host work), and are cut only once a CUDA tensor was met: an all-CPU call (memmoves,
    no DMA to overlap) is one stage. A bad tensor raises when its stage is reached; the caller undoes
    or waits out what earlier stages queued. ``start``: the first key (those before it went another way).
    """
    check_outer(n_keys, tensor_lists)
    budget = FIRST_STAGE_BYTES
    device = None
    lo = start
    while lo < n_keys:
        pieces: list[list[tuple]] = []
        sizes: list[int] = []
        acc = 0
        hi = lo
        while hi < n_keys and (device is None or acc < budget):
            p, total, dev = check_key(tensor_lists[hi], hi)
            if device is None:
                device = dev
            pieces.append(p)
            sizes.append(total)
            acc += total
            hi += 1
        yield Stage(lo, hi, pieces, sizes, device)
        budget = min(budget + budget // 2, MAX_STAGE_BYTES)
        lo = hi


def plan(pieces: list[tuple], host: int, to_host: bool, runs: Runs, segment: int = 0) -> None:
    """Add the copies between one object's bytes at address ``host`` (in shared segment ``segment``) and
    its ``pieces`` (in order) to ``runs``, merged with the previous run where both sides continue it.

    A device run never spans two allocations on either side (one segment, one tensor storage): a DMA
    copy across separately registered or allocated ranges is not allowed, however adjacent they are.
    """
    for p in pieces:
        ptr, n, cuda = p[0], p[1], p[2]
        if n:
            dst, src = (host, ptr) if to_host else (ptr, host)
            if cuda:
                bucket = runs.device
                runs.pieces.append((p, host, to_host))
                key = (segment, p[4])
            else:
                bucket, key = runs.host, None  # memmove: any two valid ranges may be joined
            last = bucket[-1] if bucket else None
            if last is not None and last[0] + last[2] == dst and last[1] + last[2] == src and last[3] == key:
                bucket[-1] = (last[0], last[1], last[2] + n, key)
            else:
                bucket.append((dst, src, n, key))
        host += n


def new_runs() -> Runs:
    return Runs([], [], [])


def start(device: Any, stream: Any = None) -> Any:
    """The stream a call's device runs go on: this client process's copy stream for ``device``, after it
    waited for ``stream`` (default: the current one), so the copies see the caller's pending work (no wait where
    it has none); None without a device.

    A side stream of our own, never the caller's: the copy engine's batch call refuses the legacy default
    stream (what most callers run on), and copies queued on the raw handle of a stream we own need no
    stream switch per batch. Device calls wait for their copies on the host before they return, so
    nothing the caller queues afterwards can run ahead of them."""
    if device is None:
        return None
    index = device.index if device.index is not None else _device_modules()[4]()
    side = _copy_streams.get(index)
    if side is None:
        side = _copy_streams.setdefault(index, _device_modules()[0].cuda.Stream(device=index))
    _join(index, side, stream)
    return side


def _join(index: int, side: Any, stream: Any) -> None:
    """Make the copy stream ``side`` of device ``index`` wait for ``stream`` (default: the current one), where it
    has work pending (:func:`start`)."""
    torch, copy_engine, current_stream, raw_stream, _ = _device_modules()
    if stream is None and raw_stream is not None:
        caller, handle = None, raw_stream(index)  # the current stream by its raw handle: no object until needed
    else:
        caller = stream or current_stream(index)
        handle = caller.cuda_stream
    # A caller's stream with nothing pending (everything queued on it before this call has run) owes the copies no
    # wait: one query instead of the join's two calls. The join, where it is needed, overlaps the caller's pending
    # GPU work, which the copies wait for anyway. Work queued on the stream after the query came after the call
    # began, and is no more ordered before the copies than it is by the join's event.
    # stream.wait_stream(), with an event of this thread's instead of a new one per call (3-5 us of the ~15 the
    # call cost on the H200 host, before the first DMA): the wait takes the event's state when it is queued, so
    # recording the event again later, in this thread, never changes what an earlier wait waits for. Once the
    # event exists (torch creates it at its first record), record and wait go as two driver calls on raw handles,
    # with the query before them in one native call (:func:`kvstrata.ops.tensor_runs.join`) where this thread has
    # the device's context bound, else as runtime calls through cuda-bindings.
    events = _wait_events.__dict__
    got = events.get(index)
    joiner = _native_join() if index in _bound.__dict__ else None
    if joiner is not None:
        state, err = joiner[0].join(joiner[1], handle, side.cuda_stream, 0 if got is None else got[1], SKIP_IDLE_JOIN)
        if err:
            raise copy_error("the copy stream's wait for the caller's", err, 0)
        if state != _NEEDS_EVENT:
            return
    elif SKIP_IDLE_JOIN and copy_engine.stream_idle(handle):
        return
    if got is None or not copy_engine.stream_wait(got[1], handle, side.cuda_stream):
        if caller is None:
            caller = current_stream(index)
        event = torch.cuda.Event() if got is None else got[0]
        event.record(caller)
        side.wait_event(event)
        if got is None:
            events[index] = (event, event.cuda_event)


def start_index(index: int, stream: Any = None) -> tuple[Any, Any]:
    """:func:`start` for the device a native pass named by its index (-1: none, the current one): ``(that torch
    device, the copy stream)``."""
    torch = _device_modules()[0]
    device = torch.device("cuda", index) if index >= 0 else torch.device("cuda")
    return device, start(device, stream)


def native_copies(tensor_lists: Any, i: int, stream: Any = None) -> tuple[Any, Any, tuple[int, int, int]] | None:
    """For a native pass that queues its own copies (:func:`kvstrata.ops.tensor_runs.plan_copy`) from key ``i`` on:
    ``(the device of key i's first tensor, the copy stream started for it, the copier's entry point, ABI and stream
    handle)``. None, having started nothing, where that tensor is not a CUDA tensor, its device is not the current
    one (the driver's call copies in the current device's context) or the driver's batch call is not there: the
    pass then answers its runs and :func:`copy_lists` queues them. The answer is found once per thread and device;
    a later call only joins the copy stream (:func:`start`'s wait), with no torch device made and no handle or entry
    point looked up again before its first copy. (``tools/probe_call_steps.py`` on the H200 host, session 30: this
    call's own work outside the join took 5-12 us before, 8 after on a slowed vCPU: within the runs' spread.)"""
    torch, _, _, _, current_index = _device_modules()
    try:
        t = tensor_lists[i][0]
    except (IndexError, KeyError, TypeError):
        return None
    if type(t) is not torch.Tensor or not t.is_cuda:  # a subclass or another kind: the pass's Python path sees it
        return None
    index = t.get_device()
    if index != current_index():
        return None
    got = _native_starts.__dict__.get(index)
    if got is None:  # the first time in this thread: what stays the same from call to call, found once
        entry = _batch_entry()
        if entry is None or not (index in _bound.__dict__ or _bind_context(index)):
            return None
        device = torch.device("cuda", index)
        side = start(device, stream)
        got = _native_starts.__dict__[index] = (device, side, (entry[0], entry[1], side.cuda_stream))
        return got
    _join(index, got[1], stream)
    return got


_copy_streams: dict[int, Any] = {}  # device index -> this process's copy stream for device calls
# device index -> (its torch device, its copy stream, the copier) for native_copies, in a thread that bound the context
_native_starts = threading.local()
# start() skips the join where the caller's stream is idle. On the H200 host (tools/probe_call_variants.py, session
# 25, switched call by call) that saved a 64 x 1 MiB mset_d2h 12-31 us after a request (as much as leaving the join
# out did); a kept mget_h2d gained nothing the drift does not cover. The probe switches it.
SKIP_IDLE_JOIN = True
_wait_events = threading.local()  # device index -> this thread's event for start()'s wait, and its raw handle
#: join the copy stream natively where the module is loaded (``tools/probe_native_planner.py`` switches it)
NATIVE_JOIN = True
_NEEDS_EVENT = 2  # kvstrata.ops.tensor_runs.NEEDS_EVENT (not imported: start() runs before the first copy)
_joiner: list[Any] = [None]  # (the native module, the driver's stream calls), once both were found


def _native_join() -> tuple[Any, tuple[int, int, int]] | None:
    """:func:`kvstrata.ops.tensor_runs.join` and its driver calls, where the module is loaded (never a build) and the
    driver's calls were found; else None (:func:`start` joins through cuda-bindings)."""
    got = _joiner[0]
    if got is None:
        module = sys.modules.get("kvstrata.ops.tensor_runs")
        native = None if module is None else module.loaded()
        calls = None if native is None else module.stream_calls()
        if calls is None:
            return None
        got = _joiner[0] = (native, calls)
    return got if NATIVE_JOIN else None


def enqueue(runs: Runs, device: Any, stream: Any, *, first: bool = False, head: int | None = None) -> None:
    """Do ``runs``: host runs now, device runs enqueued on ``stream`` (from :func:`start`). ``first``: the
    call's first enqueue, whose first batch is cut short (:data:`FIRST_BATCH_RUNS`) so the DMA starts sooner;
    ``head``: that first batch's runs where they are not :data:`FIRST_BATCH_RUNS` (a kept read's first enqueue)."""
    for dst, src, n, _ in runs.host:
        if n < _TORCH_COPY_BYTES:
            _memmove(dst, src, n)
        else:
            _raw_bytes(dst, n).copy_(_raw_bytes(src, n))  # torch spreads a large copy over its threads
    if not runs.device:
        return
    if head is None:
        head = FIRST_BATCH_RUNS if first else BATCH_RUNS
    if not _copy_engine(runs.device, stream, head):
        import torch

        with torch.cuda.stream(stream):
            _torch_copies(runs, device)


def mark(stream: Any) -> Any:
    """A CUDA event completing when everything enqueued on ``stream`` so far has landed (None: no stream)."""
    if stream is None:
        return None
    import torch

    event = torch.cuda.Event()
    event.record(stream)
    return event


def both(first: Any, second: Any) -> Any:
    """An end event for the copies of two parts of one call (either None: the other alone). Each part started its
    copy stream on its own first device, so the parts' streams may differ: the end is when both events are done."""
    if first is None or second is None:
        return second if first is None else first
    return _BothEvents(first, second)


class _BothEvents(NamedTuple):
    first: Any
    second: Any

    def synchronize(self) -> None:
        self.first.synchronize()
        self.second.synchronize()

    def query(self) -> bool:
        return self.first.query() and self.second.query()


def _copy_engine(device_runs: list[tuple[int, int, int, Any]], stream: Any, head: int = BATCH_RUNS) -> bool:
    """The runs as ``cudaMemcpyBatchAsync`` calls on ``stream``'s raw handle (zero SMs, :func:`copy_lists`): ``head``
    runs first, then batches of :data:`BATCH_RUNS`; False where cuda-bindings is missing, so the caller falls back
    to torch copies."""
    _, copy_engine, _, _, _ = _device_modules()
    dsts, srcs, sizes, _ = zip(*device_runs)
    try:
        copy_lists(list(dsts), list(srcs), list(sizes), stream, head)
    except copy_engine.CopyEngineError as exc:  # no cuda-bindings, or the call refused: copy again by torch
        if getattr(exc, "queued", 0):
            raise  # some runs are queued already: a torch re-copy of all would be a second, racing copy
        log.debug("copy engine batch unavailable (%s): torch copies", exc)
        return False
    return True


def copy_lists(
    dsts: list[int], srcs: list[int], sizes: list[int], stream: Any, head: int = BATCH_RUNS, chunk: int = BATCH_RUNS
) -> None:
    """Copy ``sizes[k]`` bytes ``srcs[k] -> dsts[k]`` on ``stream`` (from :func:`start`) as ``cudaMemcpyBatchAsync``
    calls on its raw handle: ``head`` runs first, then ``chunk`` runs a call. A refused call raises
    ``CopyEngineError`` with ``queued``: the runs queued before it."""
    torch, copy_engine, _, _, current_index = _device_modules()
    index = stream.device_index
    if current_index() != index:  # the raw batch call copies on the current device's streams
        with torch.cuda.device(index):
            return copy_lists(dsts, srcs, sizes, stream, head, chunk)
    handle, memcpy, n = stream.cuda_stream, copy_engine.memcpy_raw, len(sizes)
    k = 0
    try:
        if n <= head:  # one driver call, no slices
            memcpy(dsts, srcs, sizes, handle)
            return None
        for k, end in itertools.pairwise([0, *range(head, n, chunk), n]):
            memcpy(dsts[k:end], srcs[k:end], sizes[k:end], handle)
    except copy_engine.CopyEngineError as exc:
        exc.queued = k
        raise
    return None


_bound = threading.local()  # the devices whose context this thread has current, as _bind_context found it


def _bind_context(index: int) -> bool:
    """Whether device ``index``'s primary context is current on this thread, made so where none is. The driver's calls
    copy in the thread's current context, which the runtime binds at its first call needing one: a thread new to CUDA
    may have made none (a torch stream from its pool, say), and the driver then refuses the batch. Once per thread and
    device; False (the pass answers its runs, which the runtime queues) where another device's context is current or
    the driver says no."""
    try:
        from cuda.bindings import driver

        err, ctx = driver.cuCtxGetCurrent()
        if int(err) == 0 and not int(ctx):  # none current: the primary context, as the runtime would bind it
            err, dev = driver.cuDeviceGet(index)
            if int(err) == 0:
                err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
            if int(err) == 0:
                (err,) = driver.cuCtxSetCurrent(ctx)
                if int(err) != 0:
                    driver.cuDevicePrimaryCtxRelease(dev)
        if int(err) != 0:
            return False
        err, dev = driver.cuCtxGetDevice()
        if int(err) != 0 or int(dev) != index:
            return False
    except Exception:  # an unexpected binding
        return False
    _bound.__dict__[index] = True
    return True


def copy_error(call: str, err: int, queued: int) -> Exception:
    """The ``CopyEngineError`` of a driver call a native pass made (``err``, a ``CUresult``), with ``queued``: the
    runs queued before it (as :func:`copy_lists` raises it)."""
    copy_engine = _device_modules()[1]
    try:
        from cuda.bindings import driver

        name = driver.CUresult(err).name
    except Exception:  # no cuda-bindings, or a code it does not know
        name = "CUresult"
    exc = copy_engine.CopyEngineError(f"{call} failed: {name} ({err})")
    exc.queued = queued
    return exc


@functools.cache
def _batch_entry() -> tuple[int, int] | None:
    """:func:`kvstrata.ops.tensor_runs.batch_entry`, looked up once (no import statement per call)."""
    from kvstrata.ops import tensor_runs

    return tensor_runs.batch_entry()


@functools.cache
def _device_modules() -> tuple[Any, Any, Any, Any, Any]:
    """torch, :mod:`kvstrata.ops.copy_engine`, :func:`kvstrata.ops.current_stream`, torch's raw current-stream
    lookup (None where this torch lacks it) and its current-device lookup, imported at the first device call (a
    client without device calls never loads torch), then looked up with no import statement: a ``from`` import runs
    importlib's Python code each time, and :func:`start` and the first enqueue come before a call's first copy. The
    two lookups are torch's C functions, not ``torch.cuda.current_stream`` / ``current_device``, whose Python layers
    (a stream object built, the lazy-init checks) ran each call before the first copy; a device call has met a CUDA
    tensor, so CUDA is initialised by then."""
    import torch

    from kvstrata.ops import copy_engine, current_stream

    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    current_index = getattr(torch._C, "_cuda_getDevice", None) or (lambda: torch.cuda.current_device())
    return torch, copy_engine, current_stream, raw_stream, current_index


def _raw_bytes(addr: int, n: int) -> Any:
    """A uint8 CPU tensor over ``n`` bytes at ``addr`` (memory kept alive by its owner)."""
    import torch

    return torch.frombuffer((ctypes.c_ubyte * n).from_address(addr), dtype=torch.uint8)


def _torch_copies(runs: Runs, device: Any) -> None:
    """Without cuda-bindings: one ``copy_`` per tensor, between its bytes and a view of the host bytes."""
    import torch

    for piece, host, to_host in runs.pieces:
        host_view = _raw_bytes(host, piece[1])
        dev_view = piece[3].detach().reshape(-1).view(torch.uint8)
        if to_host:
            host_view.copy_(dev_view, non_blocking=True)
        else:
            dev_view.copy_(host_view, non_blocking=True)
    # the host views are pinned memory (registered segments): the copies are asynchronous DMA


class Registrations:
    """Which shared segments this client registered with CUDA (once each, cached; refusals too), and the segments
    the worker *retired* (emptied for a value larger than a segment, their memory given back to the kernel:
    :mod:`kvstrata.store.tiers.memory`), whose registration goes too.

    A registration page-locks the segment's pages: as long as it stands, the kernel cannot take them back, whatever
    the worker does. So a retired segment is unregistered (and the hook given to :meth:`retire` called, which
    unmaps it) once nothing of this process can still copy from it:

    * the calls that may copy from a placement hint (advice read from the worker's table with no lease: the one
      kind of copy that can read a segment the worker emptied meanwhile) bracket that work with :meth:`enter` /
      :meth:`exit`; every call that entered before the retirement was heard of has exited,
    * and then the copy streams have run past an event recorded after that (a call's copies may still run after it
      returned, an async call's until its completion thread saw them land).

    Calls started later never read the segment: the connection took it out of the places a hint may point to
    (``segment_limits``) when it heard of the retirement, and :meth:`ensure` never registers it again. The check
    runs at each :meth:`exit` and :meth:`ensure` while a retirement waits (one attribute test otherwise)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: dict[int, tuple[int, bool]] = {}  # segment index -> (address, registered)
        #: segment index -> address, of every segment seen (a native pass's ``bases``: a segment it does not find there
        #: is one to register before its first copy)
        self.bases: dict[int, int] = {}
        self._retired: set[int] = set()  # segments the worker retired: never registered again
        # retirements heard of (retire(), called under the connection's locks, takes no lock: it appends here) ...
        self._heard: collections.deque[tuple[list[int], Any]] = collections.deque()
        # ... and taken on under the lock: [epoch, indices, hook, the copy streams' events (None: not recorded yet)]
        self._retiring: list[list[Any]] = []
        self._epoch = 0  # bumped by each retirement heard of
        self._calls: dict[int, int] = {}  # epoch -> hint-reading calls that entered in it and have not exited

    def ensure(self, segments: Any, address_of: Any, nbytes_of: Any) -> None:
        """Register the segments of ``segments`` (indices) not seen yet; a no-op for the others (a retired one is
        never registered: a stale hint's copy from it reads pageable memory, and its answer is discarded)."""
        if self._heard or self._retiring:
            self.reap()
        state = self._state
        for index in segments:
            if index in state:
                continue
            with self._lock:
                if index not in state and index not in self._retired:
                    addr = address_of(index)
                    state[index] = (addr, register_segment(addr, nbytes_of(index)))
                    self.bases[index] = addr  # after the registration: a pass finding it here may copy from it

    # -- retired segments -------------------------------------------------------------------------------------
    def enter(self) -> int:
        """A call that may copy from placement hints begins: a token for :meth:`exit`."""
        if self._heard or self._retiring:
            self.reap()
        with self._lock:
            epoch = self._epoch
            self._calls[epoch] = self._calls.get(epoch, 0) + 1
            return epoch

    def exit(self, epoch: int) -> None:
        """The call :meth:`enter` answered ``epoch`` to queued its last copy (they may still run)."""
        with self._lock:
            left = self._calls[epoch] - 1
            if left:
                self._calls[epoch] = left
            else:
                del self._calls[epoch]
        if self._heard or self._retiring:
            self.reap()

    def retire(self, indices: list[int], hook: Any = None) -> None:
        """The worker retired segments ``indices``: unregister them, then call ``hook(index)`` for each (None: no
        hook), once nothing of this process can copy from them (the class docstring): at once where nothing holds
        them up, else at a later :meth:`enter`, :meth:`exit` or :meth:`ensure`. Never waits for a lock: callable from
        any thread, under the caller's locks (the connection's, the store's)."""
        self._retired.update(indices)  # ensure() registers none of them from now on
        self._heard.append((list(indices), hook))
        self.reap(wait=False)

    def reap(self, *, wait: bool = True) -> int:
        """Finish the retirements nothing holds up any more; how many segments were unregistered or let go.
        ``wait=False``: none where another thread holds the lock (it may be registering a segment, asking the worker
        under the connection's lock the caller holds)."""
        if not self._lock.acquire(wait):
            return 0
        try:
            done = self._reap_locked()
        finally:
            self._lock.release()
        gone = 0
        for indices, hook in done:  # (outside the lock: the hook unmaps)
            gone += len(indices)
            if hook is not None:
                for index in indices:
                    hook(index)
        return gone

    def _reap_locked(self) -> list[tuple[list[int], Any]]:
        """:meth:`reap` under the lock: the retirements done, with their hooks (called after the lock goes)."""
        done: list[tuple[list[int], Any]] = []
        while self._heard:  # calls that entered before this are held to have read hints into these segments
            indices, hook = self._heard.popleft()
            self._retiring.append([self._epoch, indices, hook, None])
            self._epoch += 1
        oldest = min(self._calls, default=self._epoch)
        for entry in list(self._retiring):
            epoch, indices, hook, events = entry
            if oldest <= epoch:
                break  # a call that may have read a hint into these segments before they were heard of
            if events is None:
                events = entry[3] = _copy_stream_events()  # what those calls queued runs before these
            if not all(e.query() for e in events):
                break
            self._retiring.remove(entry)
            for index in indices:
                addr, registered = self._state.pop(index, (0, False))
                self.bases.pop(index, None)
                if registered:
                    unregister_segment(addr)
            done.append((indices, hook))
        return done

    @property
    def retiring(self) -> int:
        """Retired segments whose registration or mapping has not gone yet."""
        return sum(len(entry[1]) for entry in self._retiring) + sum(len(got[0]) for got in list(self._heard))

    def undo(self) -> None:
        """Unregister every segment this client registered (before the segments are unmapped)."""
        with self._lock:
            for addr, registered in self._state.values():
                if registered:
                    unregister_segment(addr)
            self._state.clear()
            self.bases.clear()
            self._retiring.clear()
            self._heard.clear()


def _copy_stream_events() -> list[Any]:
    """An event recorded now on each of this process's copy streams (:func:`start`): done when every copy queued
    on them so far has run. None exist without CUDA, or before the first device call."""
    if not _copy_streams:
        return []
    import torch

    events = []
    for stream in list(_copy_streams.values()):
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    return events


def register_segment(addr: int, nbytes: int) -> bool:
    """Register a mapped segment with CUDA (one use in :mod:`kvstrata.memory`'s registry).

    Returns False, with a warning, where CUDA refuses (pinnable memory exhausted): copies stay correct
    at pageable speed, and the caller must not :func:`unregister_segment` it. No-op (False) without CUDA.
    """
    import torch

    from kvstrata.errors import CapacityError
    from kvstrata.memory import register

    if not torch.cuda.is_available():
        return False
    try:
        register(addr, nbytes)
    except CapacityError as exc:
        log.warning("shared segment not registered with CUDA (%s): copies run at pageable speed", exc)
        return False
    return True


def unregister_segment(addr: int) -> None:
    """Undo one successful :func:`register_segment`, before the mapping goes away."""
    from kvstrata.memory import unregister

    unregister(addr)

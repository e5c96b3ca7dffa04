"""Copies on the DMA engines, zero SMs: ``cudaMemcpyBatchAsync`` through cuda-bindings.

Descriptors adjacent on both sides are merged first (:func:`merge_runs`), since the copy engine pays per
descriptor (~0.7 us of host time and a per-copy setup on the device). Where cuda-bindings or the batch
call is missing, or the stream is being captured into a CUDA graph, each merged run is one
``cudaMemcpyAsync`` instead.

The batch call refuses the legacy default stream; :func:`memcpy_batch` then runs on an internal side
stream joined to the caller's stream with events (never a host synchronisation).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvstrata.errors import InvalidValue, KvstrataError


class CopyEngineError(KvstrataError):
    """A CUDA copy call failed (the message names the call and the CUDA error)."""


def merge_runs(
    src: np.ndarray, dst: np.ndarray, size: int, keys: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge equal-size copies ``src[k] -> dst[k]`` (in order) that continue each other on both sides
    (and have equal ``keys``, when given: runs never cross separate allocations).

    Returns ``(src, dst, sizes)`` of the merged runs. Example::

        >>> merge_runs(np.array([0, 8, 32]), np.array([100, 108, 116]), 8)[2].tolist()
        [16, 8]
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if src.size == 0:
        return src, dst, np.zeros(0, dtype=np.int64)
    cont = (src[1:] == src[:-1] + size) & (dst[1:] == dst[:-1] + size)
    if keys is not None:
        keys = np.asarray(keys)
        cont &= keys[1:] == keys[:-1]
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lengths = np.diff(np.append(starts, src.size))
    return src[starts], dst[starts], lengths.astype(np.int64) * size


@functools.cache
def _runtime():
    """cuda-bindings' runtime module, or None where it is not installed."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime  # cuda-python < 12.6 layout
        except ImportError:
            return None
    return runtime


def has_batch_api() -> bool:
    """True when ``cudaMemcpyBatchAsync`` is callable here (cuda-bindings >= 12.8 and a CUDA device)."""
    rt = _runtime()
    return rt is not None and hasattr(rt, "cudaMemcpyBatchAsync") and torch.cuda.is_available()


def _check(result: object, call: str) -> object:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise CopyEngineError(f"{call} failed: {err!r}")
    return result


_attr_lock = threading.Lock()
_attrs: list[object] = []


def _batch_attrs(rt) -> list[object]:
    with _attr_lock:
        if not _attrs:
            attr = rt.cudaMemcpyAttributes()
            attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            _attrs.append(attr)
        return _attrs


_side: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _side:
        _side[idx] = torch.cuda.Stream(device=idx)
    return _side[idx]


def memcpy_batch(
    dsts: Sequence[int] | np.ndarray,
    srcs: Sequence[int] | np.ndarray,
    sizes: Sequence[int] | np.ndarray,
    *,
    device: torch.device | None = None,
    use_batch: bool | None = None,
) -> int:
    """Copy ``sizes[k]`` bytes ``srcs[k] -> dsts[k]`` (raw addresses, any direction) on the copy engines,
    asynchronously on the caller's current stream; returns the number of descriptors issued.

    ``use_batch=None`` uses ``cudaMemcpyBatchAsync`` where available (and not under graph capture), else
    one ``cudaMemcpyAsync`` per descriptor. Pinned/registered host memory is needed for asynchrony.
    """
    rt = _runtime()
    if rt is None:
        raise CopyEngineError("copy_engine needs cuda-bindings (pip install cuda-bindings)")
    dsts = np.asarray(dsts, dtype=np.int64)
    srcs = np.asarray(srcs, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    n = int(sizes.size)
    if not (dsts.size == srcs.size == n):
        raise InvalidValue(f"srcs/dsts/sizes: lengths differ ({srcs.size}, {dsts.size}, {n})")
    if n == 0:
        return 0
    device = device or torch.device("cuda", torch.cuda.current_device())
    cur = torch.cuda.current_stream(device)
    capturing = torch.cuda.is_current_stream_capturing()
    if use_batch is None:
        use_batch = hasattr(rt, "cudaMemcpyBatchAsync") and not capturing and n > 1
    legacy_default = cur.cuda_stream == 0
    stream = _side_stream(device) if (use_batch and legacy_default) else cur
    if stream is not cur:  # fork: the side stream waits for the caller's prior work
        stream.wait_stream(cur)
    handle = stream.cuda_stream
    if use_batch:
        _check(
            rt.cudaMemcpyBatchAsync(dsts.tolist(), srcs.tolist(), sizes.tolist(), n, _batch_attrs(rt), [0], 1, handle),
            "cudaMemcpyBatchAsync",
        )
    else:
        kind = rt.cudaMemcpyKind.cudaMemcpyDefault
        for d, s, z in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            _check(rt.cudaMemcpyAsync(d, s, z, kind, handle), "cudaMemcpyAsync")
    if stream is not cur:  # join: the caller's later work waits for the copies
        cur.wait_stream(stream)
    return n


def memcpy_raw(dsts: list[int], srcs: list[int], sizes: list[int], stream_handle: int) -> None:
    """``memcpy_batch`` without its stream handling, for callers that own a side stream: copy
    ``sizes[k]`` bytes ``srcs[k] -> dsts[k]`` on the raw CUDA stream ``stream_handle`` (not the legacy
    default stream, not being captured), whose device must be the calling thread's current device.

    One ``cudaMemcpyAsync`` for one pair, one ``cudaMemcpyBatchAsync`` for more. On the H200 machine one
    4 KiB pair cost 2.8 us of host time this way against ~10 us through :func:`memcpy_batch` and another
    ~9 us for entering and leaving ``torch.cuda.stream``. The calls and their fixed arguments are looked up
    once (:func:`_raw_calls`), not per call: a device call issues a batch every 16 runs.
    """
    n = len(sizes)
    if not (len(dsts) == len(srcs) == n):
        raise InvalidValue(f"srcs/dsts/sizes: lengths differ ({len(srcs)}, {len(dsts)}, {n})")
    one, batch, kind, attrs = _raw_calls()
    if n == 1:
        err = one(dsts[0], srcs[0], sizes[0], kind, stream_handle)[0]
        if err:
            raise CopyEngineError(f"cudaMemcpyAsync failed: {err!r}")
    elif n:
        if batch is None:
            for d, s, z in zip(dsts, srcs, sizes):
                _check(one(d, s, z, kind, stream_handle), "cudaMemcpyAsync")
            return
        err = batch(dsts, srcs, sizes, n, attrs, _ATTR_IDX, 1, stream_handle)[0]
        if err:
            raise CopyEngineError(f"cudaMemcpyBatchAsync failed: {err!r}")


_ATTR_IDX = [0]  # every descriptor uses the one attribute set


@functools.cache
def _raw_calls() -> tuple:
    """(cudaMemcpyAsync, cudaMemcpyBatchAsync or None, cudaMemcpyDefault, batch attributes) of cuda-bindings."""
    rt = _runtime()
    if rt is None:
        raise CopyEngineError("copy_engine needs cuda-bindings (pip install cuda-bindings)")
    batch = getattr(rt, "cudaMemcpyBatchAsync", None)
    return rt.cudaMemcpyAsync, batch, rt.cudaMemcpyKind.cudaMemcpyDefault, _batch_attrs(rt) if batch else None


def stream_wait(event: int, stream: int, waiter: int) -> bool:
    """``waiter.wait_stream(stream)`` on raw handles, through the CUDA event ``event`` (raw, created already): the
    event recorded on ``stream``, and ``waiter`` made to wait for it, in two runtime calls. The wait takes the
    event's state when it is queued, so recording ``event`` again later never changes what it waits for. False
    where cuda-bindings is missing (the caller then uses torch's ``Event.record`` and ``Stream.wait_event``,
    whose Python wrappers cost ~5 us together on the H200 machine against ~2 for the two calls alone)."""
    calls = _event_calls()
    if calls is None:
        return False
    record, wait = calls
    err = record(event, stream)[0]
    if err:
        raise CopyEngineError(f"cudaEventRecord failed: {err!r}")
    err = wait(waiter, event, 0)[0]
    if err:
        raise CopyEngineError(f"cudaStreamWaitEvent failed: {err!r}")
    return True


def stream_idle(stream: int) -> bool:
    """Whether everything queued on the raw CUDA stream ``stream`` so far has completed (one ``cudaStreamQuery``);
    False where it has not, where the query fails, or where cuda-bindings is missing."""
    query = _query_call()
    return query is not None and not query(stream)[0]


@functools.cache
def _query_call():
    """cuda-bindings' ``cudaStreamQuery``, or None."""
    rt = _runtime()
    return None if rt is None else rt.cudaStreamQuery


@functools.cache
def _event_calls() -> tuple | None:
    """(cudaEventRecord, cudaStreamWaitEvent) of cuda-bindings, or None."""
    rt = _runtime()
    return None if rt is None else (rt.cudaEventRecord, rt.cudaStreamWaitEvent)


def copy_runs_torch(
    dst_flat: torch.Tensor, dst_off: np.ndarray, src_flat: torch.Tensor, src_off: np.ndarray, sizes: np.ndarray
) -> None:
    """One ``copy_`` per run between flat uint8 tensors (byte offsets): the fallback without cuda-bindings,
    and the CPU implementation."""
    for d, s, z in zip(np.asarray(dst_off).tolist(), np.asarray(src_off).tolist(), np.asarray(sizes).tolist()):
        dst_flat[d : d + z].copy_(src_flat[s : s + z], non_blocking=True)


__all__ = [
    "CopyEngineError",
    "copy_runs_torch",
    "has_batch_api",
    "memcpy_batch",
    "memcpy_raw",
    "merge_runs",
    "stream_idle",
    "stream_wait",
]

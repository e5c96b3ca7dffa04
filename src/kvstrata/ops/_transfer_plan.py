"""Launch plans for the eager ``transfer_blocks`` path, and the per-direction lanes of a device.

One request's blocks (32 layers x K/V, 64 chunks) move in ~30 us on an H200; the Python around the
copy used to cost 55-150 us (argument checks, the calibration lookup, a ``Geometry``, a device guard,
Triton's argument binding, two pinned id uploads). A :class:`TransferPlan` holds what depends only on
the *signature* of a call -- the layout's segment addresses and strides, the pool's address and shape,
the number of blocks, the direction, the method (``auto`` resolved), ``num_ctas`` -- and later calls
with that signature go straight to the launch:

* ``zero_copy``: the compiled Triton kernel is launched directly with raw addresses
  (``CompiledKernel[grid](*args, stream=...)``), the ids of host-side lists written into a small
  pinned, device-mapped slot that the kernel reads in place (no upload, no allocation);
* ``copy_engine``: segment bases and host offsets are precomputed arrays; a call is a few numpy ops
  and one ``cudaMemcpyBatchAsync``.

Validity: the key holds every address and size the plan uses (a buffer freed and reallocated
elsewhere gets a new plan); a plan whose host pool the registry vouched for is rebuilt when the
registry changes (``registry_generation``), one for memory pinned by torch asks ``is_pinned()``
again per call. Plans hold no tensors. Per-call checks (id ranges, duplicates) are never cached.

Lanes: each (device, direction) keeps ``LANE_SLOTS`` id slots with one CUDA event each; the event
of a call's slot is recorded after its copy, so a slot is rewritten only once the kernel that read
it has finished, and the newest event says whether that direction has a transfer in flight (what
``auto`` asks before choosing, see ``calibration.choose_method(concurrent=...)``).
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any

import numpy as np
import torch

from kvstrata.ops._common import PlanCache, current_stream, direct_launch
from kvstrata.ops.chunk_copy import _copy_chunks_kernel, copy_chunks_shape

log = logging.getLogger(__name__)

MAX_PLANS = 512  # signatures kept; the cache is emptied past this (plans are cheap to rebuild)
LANE_SLOTS = 64  # calls per direction whose host-side ids can be in flight at once
LANE_IDS = 1024  # ids per list in one slot (longer lists are uploaded the old way)

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_state = {"fast": _raw_stream is not None}  # cleared for the process if a direct launch ever fails


class TransferPlan:
    """Everything one signature of ``transfer_blocks`` decides; ``run`` with this call's ids."""

    __slots__ = (
        "chunk_words",
        "constexprs",
        "ctas",
        "dev_base",
        "device",
        "device_index",
        "direction",
        "fast_args",
        "g",
        "generation",
        "host_dev_base",
        "host_seg_off",
        "method",
        "n",
        "nprog",
        "recheck_pinned",
        "runners",
        "seg_table_ptr",
        "to_host",
    )

    def __init__(self, method: str, direction: str, n: int, g: Any, device: torch.device, generation: int) -> None:
        self.method = method
        self.direction = direction
        self.to_host = direction == "d2h"
        self.n = n
        self.g = g
        self.device = device
        self.device_index = device.index if device.type == "cuda" else None
        self.generation = generation
        self.recheck_pinned = False
        self.runners: dict[tuple[bool, bool], Any] = {}
        # copy_engine: per segment, device base and host offset (block_first order = (block, seg))
        self.dev_base = np.asarray(g.seg_ptrs, dtype=np.int64)
        self.host_seg_off = g.host_base + np.arange(g.nseg, dtype=np.int64) * g.host_seg_stride
        self.ctas = 0
        self.nprog = 0
        self.chunk_words = 0
        self.constexprs: dict[str, Any] = {}
        self.seg_table_ptr = 0
        self.host_dev_base = 0
        self.fast_args: list[Any] | None = None

    def set_kernel_shape(self, num_ctas: int, seg_table_ptr: int, host_dev_base: int) -> None:
        self.nprog, self.chunk_words, self.constexprs = copy_chunks_shape(
            n_blocks=self.n, nseg=self.g.nseg, chunk_bytes=self.g.chunk, align=self.g.align, num_ctas=num_ctas
        )
        self.seg_table_ptr = seg_table_ptr
        self.host_dev_base = host_dev_base

    # ------------------------------------------------------------------------------ zero_copy
    def kernel_args(self, dev_ids: Any, host_ids: Any, seg_table: Any) -> list[Any]:
        """Every kernel parameter in signature order (what Triton's own launch passes the launcher)."""
        g = self.g
        values = {
            "seg_ptrs": seg_table,
            "dev_ids": dev_ids,
            "other_ids": host_ids,
            "other_base": self.host_dev_base,
            "n_blocks": self.n,
            "seg_lo": 0,
            "dev_block_stride": g.dev_block_stride,
            "other_block_stride": g.host_block_stride,
            "other_seg_stride": g.host_seg_stride,
            "nprog": self.nprog,
            "nseg": g.nseg,
            "chunk": self.chunk_words,
            "TO_OTHER": self.to_host,
            **self.constexprs,
        }
        return [values[name] for name in _arg_names()]

    def launch(self, dev_ids: Any, host_ids: Any, seg_table: torch.Tensor) -> None:
        """Enqueue the in-place kernel. Ids are tensors (the Triton interpreter on CPU) or, on CUDA,
        ``(device address, thunk giving a CUDA tensor)`` pairs: the address feeds the direct launch of a
        compiled kernel, the tensor the first (compiling) launch of each specialization."""
        if self.device_index is None:  # Triton interpreter on CPU tensors
            _copy_chunks_kernel[(self.nprog,)](*self.kernel_args(dev_ids, host_ids, seg_table), num_warps=_warps())
            return
        (dptr, dev_tensor), (hptr, host_tensor) = dev_ids, host_ids
        spec = (dptr % 16 == 0, hptr % 16 == 0)  # Triton specializes pointers on 16-byte alignment
        runner = self.runners.get(spec)
        if runner is not None and _state["fast"]:
            try:
                if self.fast_args is None:  # every argument but the two id addresses is fixed for the plan
                    self.fast_args = self.kernel_args(0, 0, self.seg_table_ptr)
                args = self.fast_args.copy()
                args[_ARG_IDS[0]], args[_ARG_IDS[1]] = dptr, hptr
                runner(args, _raw_stream(self.device_index))
                return
            except Exception as exc:  # an incompatible Triton: Triton's own launch path from now on
                _state["fast"] = False
                log.warning("transfer_blocks: direct kernel launch failed (%r); using Triton's launch path", exc)
        args = self.kernel_args(dev_tensor(), host_tensor(), seg_table)
        compiled = _copy_chunks_kernel[(self.nprog,)](*args, num_warps=_warps())
        if compiled is not None and _state["fast"]:
            try:
                self.runners[spec] = direct_launch(compiled, self.nprog)
            except Exception as exc:  # a Triton without the runner API
                log.debug("transfer_blocks: no direct launch (%r)", exc)
                _state["fast"] = False

    def usable(self, pool_tensor: torch.Tensor, generation: int) -> bool:
        """Still describes the memory it was built for (see the module docstring)."""
        return self.generation == generation and (not self.recheck_pinned or pool_tensor.is_pinned())

    # ---------------------------------------------------------------------------- copy_engine
    def runs(self, dev_ids: np.ndarray, host_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Merged (device address, host address, bytes) runs of this call, in the host pool's order."""
        from kvstrata.ops.copy_engine import merge_runs

        g = self.g
        d = dev_ids.astype(np.int64, copy=False)
        h = host_ids.astype(np.int64, copy=False)
        if g.block_first:  # (block, seg)
            da = self.dev_base[None, :] + d[:, None] * g.dev_block_stride
            ha = self.host_seg_off[None, :] + h[:, None] * g.host_block_stride
            keys = np.broadcast_to(np.arange(g.nseg)[None, :], da.shape)
        else:  # (seg, block)
            da = self.dev_base[:, None] + d[None, :] * g.dev_block_stride
            ha = self.host_seg_off[:, None] + h[None, :] * g.host_block_stride
            keys = np.broadcast_to(np.arange(g.nseg)[:, None], da.shape)
        if self.n == 1:  # one block: chunks of different segments never continue each other's keys
            return da.reshape(-1), ha.reshape(-1), np.full(g.nseg, g.chunk, dtype=np.int64)
        return merge_runs(da.reshape(-1), ha.reshape(-1), g.chunk, keys=keys.reshape(-1))


def _warps() -> int:
    from kvstrata.ops import chunk_copy

    return chunk_copy.NUM_WARPS


_ARG_IDS: list[int] = []  # positions of dev_ids and other_ids in _arg_names()
_ARG_NAMES: list[tuple[str, ...]] = []


def _arg_names() -> tuple[str, ...]:
    if not _ARG_NAMES:
        names = tuple(inspect.signature(_copy_chunks_kernel.fn).parameters)
        _ARG_IDS.extend((names.index("dev_ids"), names.index("other_ids")))
        _ARG_NAMES.append(names)
    return _ARG_NAMES[0]


# ------------------------------------------------------------------------------------------ cache
_plans = PlanCache(MAX_PLANS)


def get_plan(key: tuple) -> TransferPlan | None:
    return _plans.get(key)


def put_plan(key: tuple, plan: TransferPlan) -> None:
    _plans.put(key, plan)


def clear_plans() -> None:
    """Forget every cached plan (tests; after changing ``chunk_copy`` tunables)."""
    _plans.clear()


def plan_count() -> int:
    return len(_plans)


# ------------------------------------------------------------------------------------------ lanes
class Lane:
    """One (device, direction): pinned, device-mapped id slots, an event per slot, the newest event."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ids = torch.empty(LANE_SLOTS * 2 * LANE_IDS, dtype=torch.int64, pin_memory=True)
        self.ids_np = self.ids.numpy()
        self.base = self.ids.data_ptr()  # under UVA a pinned host address is its device address
        self.events = [torch.cuda.Event() for _ in range(LANE_SLOTS)]
        self.recorded = [False] * LANE_SLOTS
        self.next = 0
        self.last: torch.cuda.Event | None = None
        self.method: str | None = None  # of the newest transfer (what ``auto`` the other way pairs with)
        self.lock = threading.Lock()

    def acquire(self) -> int | None:
        """A free slot (its previous reader has finished), or None when all are in flight."""
        with self.lock:
            k = self.next
            if self.recorded[k] and not self.events[k].query():
                return None
            self.next = (k + 1) % LANE_SLOTS
            self.recorded[k] = False
            return k

    def mark(self, k: int | None, stream: torch.cuda.Stream, method: str | None = None) -> None:
        """After the call's work is enqueued on ``stream``: its slot's event (or a fresh one) records it."""
        self.method = method
        if k is None:
            ev = torch.cuda.Event()
            ev.record(stream)
        else:
            ev = self.events[k]
            ev.record(stream)
            self.recorded[k] = True
        self.last = ev

    def busy(self) -> bool:
        """True while this direction's newest transfer has not finished on the device."""
        ev = self.last
        return ev is not None and not ev.query()


_lanes: dict[tuple[int, str], Lane] = {}
_lanes_lock = threading.Lock()


def lane(device: torch.device, direction: str) -> Lane:
    key = (device.index, direction)
    got = _lanes.get(key)
    if got is None:
        with _lanes_lock:
            got = _lanes.get(key)
            if got is None:
                got = _lanes[key] = Lane(device)
    return got


def other_direction_busy(device: torch.device, direction: str) -> bool:
    """Whether a transfer in the opposite direction is in flight on ``device`` (False off CUDA)."""
    if device.type != "cuda":
        return False
    return other_direction_method(device, direction) is not None


def other_direction_method(device: torch.device, direction: str) -> str | None:
    """The method of the transfer in the opposite direction in flight on ``device``, None when there is none
    ("unknown" for a transfer marked without one)."""
    if device.type != "cuda":
        return None
    got = _lanes.get((device.index, "h2d" if direction == "d2h" else "d2h"))
    if got is None or not got.busy():
        return None
    return got.method or "unknown"


__all__ = ["LANE_IDS", "LANE_SLOTS", "MAX_PLANS", "Lane", "TransferPlan", "clear_plans", "current_stream", "lane",
           "other_direction_busy", "other_direction_method", "plan_count"]  # fmt: skip

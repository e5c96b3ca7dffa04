"""Launch plans of the ``staging`` method: one call's pieces decided once per signature, issued cheaply.

A store and a load at once overlap only as far as the second call's first DMA starts soon after the
first call's: every microsecond of host time the first call spends issuing delays the other direction
(H200, 128 MiB each way at 32 KiB chunks: 1.2 ms of host issue per call cost 0.25 of the two-way
ceiling, ``tools/probe_store_load_host.py``). The host time per piece went to Triton's JIT dispatch,
``torch.cuda.current_stream`` / device-index lookups, ``with torch.cuda.stream(...)`` twice, two fresh
events, numpy over every chunk and a ``copy_`` per run. A :class:`StagingPlan` keeps what depends only
on the call's *signature* (geometry, block count, ring shape, direction, CTAs, id dtype): the pieces,
each piece's kernel arguments and directly launchable compiled kernel, and per (device, direction) a
:class:`Side` keeps the two streams' raw handles and reusable events. Per call what is left is the
host-order runs of each piece (numpy over *blocks*, not chunks, where a block's segments are adjacent in
the pool), one direct kernel launch and one ``cudaMemcpyAsync`` (or batch) per piece on raw handles,
and event records/waits.

Event reuse is safe because ``cudaStreamWaitEvent`` captures the event's state when called: the fork, a
piece's ready event and the joins are waited on within the step that records them (under the side's
lock), and a slot's done event, waited on a few pieces later, is only ever re-recorded meanwhile on the
same stream, later, by another call of the same direction (they share the side's streams) -- so a wait
covers more work, never less.
Under CUDA graph capture the same sequence is captured (no lane, no batch copy: one
``cudaMemcpyAsync`` per run).
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any

import numpy as np
import torch

from kvstrata.ops import chunk_copy
from kvstrata.ops._common import PlanCache, direct_launch
from kvstrata.ops.chunk_copy import _copy_chunks_kernel, copy_chunks_shape

log = logging.getLogger(__name__)

MAX_PLANS = 256
SMALL_RUNS = 64  # units per piece up to which runs are merged in plain Python
_state = {"fast": True}  # cleared for the process if a direct launch ever fails


class Piece:
    """One slot's worth of a call: blocks ``[b0, b1)`` x segments ``[s0, s1)``, packed in host order."""

    __slots__ = ("args", "b0", "b1", "nb", "nprog", "ns", "runners", "s0", "s1", "sbs", "slot", "sss")

    def __init__(self, b0: int, b1: int, s0: int, s1: int, slot: int, sbs: int, sss: int) -> None:
        self.b0, self.b1, self.s0, self.s1, self.slot = b0, b1, s0, s1, slot
        self.nb, self.ns = b1 - b0, s1 - s0
        self.sbs, self.sss = sbs, sss
        self.nprog = 0
        self.args: list[Any] = []
        self.runners: dict[tuple[bool, ...], Any] = {}


class StagingPlan:
    """The pieces of one signature of ``staging_transfer`` and how each is launched (see the module docstring)."""

    def __init__(self, g: Any, n_blocks: int, slot_bytes: int, nslots: int, to_host: bool, num_ctas: int) -> None:
        self.g, self.n, self.to_host = g, n_blocks, to_host
        per_block = g.nseg * g.chunk
        if per_block <= slot_bytes:
            step = slot_bytes // per_block
            spans = [(b, min(b + step, n_blocks), 0, g.nseg) for b in range(0, n_blocks, step)]
        else:
            segs = max(1, slot_bytes // g.chunk)
            spans = [(b, b + 1, s, min(s + segs, g.nseg)) for b in range(n_blocks) for s in range(0, g.nseg, segs)]
        self.biggest = max((b1 - b0) * (s1 - s0) for b0, b1, s0, s1 in spans) * g.chunk
        self.nslots = min(nslots, len(spans))
        self.ring_bytes = self.nslots * self.biggest
        self.max_nb = max(b1 - b0 for b0, b1, _, _ in spans)
        # A block's segments [s0, s1) are one run in the pool when its segments are adjacent there (block_first
        # pools as kvstrata allocates them): runs are then found per block, not per chunk.
        self.block_runs = g.block_first and g.host_seg_stride == g.chunk
        self.pieces = []
        for p, (b0, b1, s0, s1) in enumerate(spans):
            sbs, sss = ((s1 - s0) * g.chunk, g.chunk) if g.block_first else (g.chunk, (b1 - b0) * g.chunk)
            piece = Piece(b0, b1, s0, s1, p % self.nslots, sbs, sss)
            nprog, chunk_words, constexprs = copy_chunks_shape(
                n_blocks=piece.nb, nseg=piece.ns, chunk_bytes=g.chunk, align=g.align, num_ctas=num_ctas
            )
            piece.nprog = nprog
            values = {"seg_ptrs": 0, "dev_ids": 0, "other_ids": 0, "other_base": 0, "n_blocks": piece.nb,
                      "seg_lo": s0, "dev_block_stride": g.dev_block_stride, "other_block_stride": sbs,
                      "other_seg_stride": sss, "nprog": nprog, "nseg": piece.ns, "chunk": chunk_words,
                      "TO_OTHER": to_host, **constexprs}  # fmt: skip
            piece.args = [values[name] for name in _arg_names()]
            self.pieces.append(piece)

    def runs(self, piece: Piece, host_ids: np.ndarray, host_base: int) -> tuple[list[int], list[int], list[int]]:
        """(staging offset, host address, bytes) of the piece's merged runs, staging order = pool order, for a
        pool at ``host_base`` (not part of the plan: a block transfer's host block changes call by call).

        Staging is packed in pool order, so units that follow each other on the host are one run."""
        g = self.g
        if self.block_runs:  # one unit per block: its segments [s0, s1)
            unit = piece.ns * g.chunk
            base = host_base + piece.s0 * g.host_seg_stride
            if piece.nb <= SMALL_RUNS:  # Python beats numpy's per-call overhead on a few values
                hbs = g.host_block_stride
                return _merge_list([base + h * hbs for h in host_ids[piece.b0 : piece.b1].tolist()], unit)
            return _merge_array(base + host_ids[piece.b0 : piece.b1].astype(np.int64) * g.host_block_stride, unit)
        h = host_ids[piece.b0 : piece.b1].astype(np.int64) * g.host_block_stride
        s = np.arange(piece.s0, piece.s1, dtype=np.int64) * g.host_seg_stride
        addr = h[:, None] + s[None, :] if g.block_first else s[:, None] + h[None, :]  # (block, seg) / (seg, block)
        return _merge_array(host_base + addr.reshape(-1), g.chunk)

    def launch(self, piece: Piece, seg_table: torch.Tensor, dev_ids: torch.Tensor, slot_ids: torch.Tensor,
               slot_ptr: int, stream: torch.cuda.Stream, handle: int) -> None:  # fmt: skip
        """Enqueue the piece's chunk copy on ``stream`` (raw handle ``handle``): the compiled kernel directly once
        this piece has been launched through Triton with the same pointer alignments."""
        dev_ptr = dev_ids.data_ptr() + piece.b0 * dev_ids.element_size()
        ptrs = (seg_table.data_ptr(), dev_ptr, slot_ids.data_ptr(), slot_ptr)
        spec = tuple(x % 16 == 0 for x in ptrs)  # Triton specializes pointers and ints on 16-byte divisibility
        runner = piece.runners.get(spec)
        if runner is not None and _state["fast"]:
            args = piece.args.copy()
            for i, x in zip(_ARG_PTRS, ptrs):
                args[i] = x
            try:
                runner(args, handle)
                return
            except Exception as exc:  # an incompatible Triton: Triton's own launch path from now on
                _state["fast"] = False
                log.warning("staging: direct kernel launch failed (%r); using Triton's launch path", exc)
        args = piece.args.copy()
        for i, x in zip(_ARG_PTRS, (seg_table, dev_ids[piece.b0 : piece.b1], slot_ids, slot_ptr)):
            args[i] = x
        with torch.cuda.stream(stream):
            compiled = _copy_chunks_kernel[(piece.nprog,)](*args, num_warps=chunk_copy.NUM_WARPS)
        if compiled is not None and _state["fast"]:
            try:
                piece.runners[spec] = _runner(compiled, piece.nprog)
            except Exception as exc:  # a Triton without the runner API
                log.debug("staging: no direct launch (%r)", exc)
                _state["fast"] = False


def _merge_list(addr: list[int], unit: int) -> tuple[list[int], list[int], list[int]]:
    """Runs of consecutive ``unit``-byte units at host addresses ``addr`` (staging offsets ``i * unit``)."""
    starts = [0]
    for i in range(1, len(addr)):
        if addr[i] != addr[i - 1] + unit:
            starts.append(i)
    ends = [*starts[1:], len(addr)]
    return [i * unit for i in starts], [addr[i] for i in starts], [(e - i) * unit for i, e in zip(starts, ends)]


def _merge_array(addr: np.ndarray, unit: int) -> tuple[list[int], list[int], list[int]]:
    """:func:`_merge_list` for many units, in numpy."""
    brk = np.flatnonzero(addr[1:] != addr[:-1] + unit) + 1
    if brk.size == 0:
        return [0], [int(addr[0])], [addr.size * unit]
    starts = np.concatenate(([0], brk))
    ends = np.append(brk, addr.size)
    return (starts * unit).tolist(), addr[starts].tolist(), ((ends - starts) * unit).tolist()


_runners: dict[tuple[int, int], tuple[Any, Any]] = {}  # (id(compiled), programs) -> (compiled, fire)


def _runner(compiled: Any, nprog: int) -> Any:
    """``direct_launch(compiled, nprog)``, shared by every plan launching that kernel on that grid (building
    one inspects the launcher; plans are rebuilt when a block transfer's pool moves)."""
    key = (id(compiled), nprog)
    got = _runners.get(key)
    if got is None or got[0] is not compiled:
        if len(_runners) >= 4 * MAX_PLANS:
            _runners.clear()
        got = _runners[key] = (compiled, direct_launch(compiled, nprog))
    return got[1]


_ARG_PTRS: list[int] = []  # positions of seg_ptrs, dev_ids, other_ids, other_base in _arg_names()
_ARG_NAMES: list[tuple[str, ...]] = []


def _arg_names() -> tuple[str, ...]:
    if not _ARG_NAMES:
        names = tuple(inspect.signature(_copy_chunks_kernel.fn).parameters)
        _ARG_PTRS.extend(names.index(n) for n in ("seg_ptrs", "dev_ids", "other_ids", "other_base"))
        _ARG_NAMES.append(names)
    return _ARG_NAMES[0]


_plans = PlanCache(MAX_PLANS)


def get_plan(g: Any, n_blocks: int, slot_bytes: int, nslots: int, to_host: bool, num_ctas: int, *,
             device_index: int, id_dtype: torch.dtype) -> StagingPlan:  # fmt: skip
    """The cached plan of this signature (built on first use). The device and the id dtype are part of it:
    its compiled kernels belong to one device and were specialized for one id type; the host pool's address
    is not (see :meth:`StagingPlan.runs`)."""
    key = (g.seg_ptrs, g.chunk, g.dev_block_stride, g.host_block_stride, g.host_seg_stride, g.block_first, g.align,
           n_blocks, slot_bytes, nslots, to_host, num_ctas, device_index, id_dtype)  # fmt: skip
    plan = _plans.get(key)
    if plan is None:
        plan = StagingPlan(g, n_blocks, slot_bytes, nslots, to_host, num_ctas)
        _plans.put(key, plan)
    return plan


def clear_plans() -> None:
    """Forget every cached plan (tests; after changing ``chunk_copy`` tunables)."""
    _plans.clear()


def plan_count() -> int:
    return len(_plans)


class Events:
    """The events one call records: fork, piece ready, slot done (per slot), joins. Reused call after call."""

    def __init__(self) -> None:
        self.fork = torch.cuda.Event()
        self.ready = torch.cuda.Event()
        self.joins = (torch.cuda.Event(), torch.cuda.Event())
        self.done: list[torch.cuda.Event] = []

    def slots(self, n: int) -> list[torch.cuda.Event]:
        while len(self.done) < n:
            self.done.append(torch.cuda.Event())
        return self.done


class Side:
    """One (device, direction): the high-priority kernel stream, the copy stream, reusable events, a lock.

    One pair of streams per direction, so a store and a load at once use both DMA directions."""

    def __init__(self, index: int) -> None:
        _, highest = torch.cuda.Stream.priority_range()
        self.kernel = torch.cuda.Stream(device=index, priority=highest)
        self.copy = torch.cuda.Stream(device=index)
        self.kernel_handle = self.kernel.cuda_stream
        self.copy_handle = self.copy.cuda_stream
        self.lock = threading.Lock()
        self.events = Events()


_sides: dict[tuple[int, bool], Side] = {}
_sides_lock = threading.Lock()


def side(index: int, to_host: bool) -> Side:
    key = (index, to_host)
    got = _sides.get(key)
    if got is None:
        with _sides_lock:
            got = _sides.get(key)
            if got is None:
                got = _sides[key] = Side(index)
    return got


__all__ = ["MAX_PLANS", "Events", "Piece", "Side", "StagingPlan", "clear_plans", "get_plan", "plan_count", "side"]

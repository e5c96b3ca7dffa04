"""The ``staging`` method: gather on the device into a small staging ring, DMA each piece (and the reverse).

D2H, per piece (a range of blocks, all segments -- or one block, a range of segments, when a block is
larger than a slot): the chunk-copy kernel packs the piece into a ring slot in *host order* on a
high-priority stream, then the copy engines move it to the host, one DMA per run that is contiguous on
the host (consecutive host blocks in ``block_first`` merge into one run). H2D is the mirror image. The
kernel of piece ``i+1`` overlaps the DMA of piece ``i``; slot reuse is ordered by events.

Each call is issued from a launch plan cached per signature (:mod:`kvstrata.ops._staging_plan`): the
compiled kernel launched directly, DMA on raw stream handles, events reused, so one call's host time
no longer delays a transfer the other way issued right after it.

Why a high-priority stream: beside a saturating GEMM, normal-priority gather CTAs wait for SMs and the
DMA engines idle (measured: 33 GB/s instead of 55). The kernels are short (device-to-device at TB/s),
so running them first costs the model little. Everything is forked from and joined back to the
caller's stream with events: no host synchronisation.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.errors import InvalidValue
from kvstrata.ops import _staging_plan as _sp
from kvstrata.ops import copy_engine
from kvstrata.ops._common import current_stream
from kvstrata.ops.chunk_copy import launch_copy_chunks

# Ring geometry. Pieces must be large: each costs host time (planning, a kernel launch, a DMA, events):
# ~150-300 us on the H200 machine before launch plans (kvstrata.ops._staging_plan), when 8 MiB pieces
# (150 us of DMA) left the copy engine idle half the time at 32 KiB chunks (28 GB/s) and 32 MiB x 3
# reached 47-50 GB/s at 2 KiB-2 MiB chunks (tools/tune_transfer.py, 2026-11-29). The ring is taken from
# torch's caching allocator per call (or is the caller's buffer).
SLOT_BYTES = int(os.environ.get("KVSTRATA_STAGING_SLOT_MB", "32")) << 20
NUM_SLOTS = int(os.environ.get("KVSTRATA_STAGING_SLOTS", "3"))


@dataclass(frozen=True)
class Geometry:
    """Everything a method needs about one call (device side, host side), as plain numbers."""

    seg_ptrs: tuple[int, ...]
    chunk: int
    dev_block_stride: int
    host_base: int  # address of the host pool's first byte (host == device address under UVA)
    host_block_stride: int
    host_seg_stride: int
    block_first: bool
    align: int

    @property
    def nseg(self) -> int:
        return len(self.seg_ptrs)


def side_streams(device: torch.device, to_host: bool) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """(high-priority kernel stream, copy stream) of ``device`` for one direction, created once.

    One pair per direction, so a store and a load running at the same time use both DMA directions."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _sp.side(idx, to_host)
    return s.kernel, s.copy


_aranges: dict[torch.device, torch.Tensor] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` int32 on ``device``, cached (no kernel launch per call; stable under graph capture)."""
    have = _aranges.get(device)
    if have is not None and have.numel() >= n:
        return have[:n]
    t = torch.arange(max(n, 4096), dtype=torch.int32, device=device)
    if not torch.cuda.is_current_stream_capturing():
        _aranges[device] = t
    return t[:n]


def staging_transfer(
    g: Geometry,
    seg_table: torch.Tensor,
    dev_ids: torch.Tensor,
    host_ids: np.ndarray,
    host_flat: torch.Tensor,
    *,
    to_host: bool,
    num_ctas: int,
    slot_bytes: int | None = None,
    num_slots: int | None = None,
    ring: torch.Tensor | None = None,
) -> None:
    """Run the pipelined staging copy for ``len(host_ids)`` blocks (``dev_ids`` on the device).

    ``ring``: the caller's device buffer (contiguous, at least one chunk) to stage through instead of one
    from torch's caching allocator; split into up to ``num_slots`` slots. The caller's stream is joined
    after the last use, so the caller may reuse it in stream order."""
    for _ in staging_steps(g, seg_table, dev_ids, host_ids, host_flat, to_host=to_host, num_ctas=num_ctas,
                           slot_bytes=slot_bytes, num_slots=num_slots, ring=ring):  # fmt: skip
        pass


def staging_steps(
    g: Geometry,
    seg_table: torch.Tensor,
    dev_ids: torch.Tensor,
    host_ids: np.ndarray,
    host_flat: torch.Tensor,
    *,
    to_host: bool,
    num_ctas: int,
    slot_bytes: int | None = None,
    num_slots: int | None = None,
    ring: torch.Tensor | None = None,
) -> Iterator[None]:
    """:func:`staging_transfer` one piece per step: a generator that enqueues a piece at each ``next()`` (the
    first step also forks from the current stream of that moment, the last joins it back).

    Two calls in opposite directions stepped in turn start their DMAs one piece's host time apart, where
    two calls one after the other start them a whole call apart (``calibration.store_and_load``)."""
    n_blocks = int(host_ids.size)
    if n_blocks == 0:
        return
    device = seg_table.device
    nslots = max(1, num_slots or NUM_SLOTS)
    if ring is not None:
        ring = ring.reshape(-1).view(torch.uint8)
        if ring.numel() < g.chunk:
            raise InvalidValue(f"staging: {ring.numel()} bytes, smaller than one {g.chunk}-byte chunk")
        nslots = min(nslots, ring.numel() // g.chunk)
        slot_bytes = ring.numel() // nslots
    slot_bytes = max(slot_bytes or SLOT_BYTES, g.chunk)
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else -1
    plan = _sp.get_plan(g, n_blocks, slot_bytes, nslots, to_host, num_ctas, device_index=index,
                        id_dtype=dev_ids.dtype)  # fmt: skip
    if ring is None:
        # On the caller's stream, which joins both side streams before any later allocation there can
        # reuse the memory: no record_stream needed (and none inside CUDA graph capture).
        ring = torch.empty(plan.ring_bytes, dtype=torch.uint8, device=device)
    if cuda:
        yield from _issue_cuda(plan, seg_table, dev_ids, host_ids, g.host_base, host_flat, ring, device, index)
        return
    slot_ids = torch.arange(plan.max_nb, dtype=torch.int32, device=device)
    stepping = True
    for piece in plan.pieces:  # CPU (Triton interpreter): the same pieces and runs, in program order
        slot = ring[piece.slot * plan.biggest : (piece.slot + 1) * plan.biggest]
        stage_off, host_addr, sizes = plan.runs(piece, host_ids, g.host_base)
        host_off = np.asarray(host_addr, dtype=np.int64) - host_flat.data_ptr()
        if not to_host:
            copy_engine.copy_runs_torch(slot, stage_off, host_flat, host_off, sizes)
        launch_copy_chunks(
            seg_table, dev_ids[piece.b0 : piece.b1], slot_ids, slot.data_ptr(), n_blocks=piece.nb, nseg=piece.ns,
            seg_lo=piece.s0, chunk_bytes=g.chunk, dev_block_stride=g.dev_block_stride, other_block_stride=piece.sbs,
            other_seg_stride=piece.sss, to_other=to_host, align=g.align, num_ctas=num_ctas,
        )  # fmt: skip
        if to_host:
            copy_engine.copy_runs_torch(host_flat, host_off, slot, stage_off, sizes)
        if stepping:
            try:
                yield
            except GeneratorExit:  # closed early: the rest at once (see _issue_cuda)
                stepping = False


def _issue_cuda(plan, seg_table, dev_ids, host_ids, host_base, host_flat, ring, device, index) -> Iterator[None]:
    """Enqueue the pieces (see :mod:`kvstrata.ops._staging_plan`), one per step: D2H kernel then DMA, H2D the
    reverse, slot reuse ordered by events, forked from and joined to the caller's stream.

    The side's lock is held within a step, never across one: calls of one direction stepped in turn (one
    thread or several) may re-record each other's events, but only on the stream the waiter recorded on,
    later -- a wait then covers more work, never less."""
    to_host = plan.to_host
    cur = current_stream(index)
    sd = _sp.side(index, to_host)
    slot_ids = _arange(plan.max_nb, device)  # on the caller's stream, before the fork
    ring_ptr = ring.data_ptr()
    dma = _Dma(host_flat, ring, plan, sd.copy, sd.copy_handle, to_host)
    ks, cs, kh = sd.kernel, sd.copy, sd.kernel_handle
    first, second = (ks, cs) if to_host else (cs, ks)
    last = len(plan.pieces) - 1
    # Under graph capture, events of their own: the side's are never left recorded inside a graph.
    ev = _sp.Events() if dma.capturing else sd.events
    stepping = True
    for p, piece in enumerate(plan.pieces):
        slot_ptr = ring_ptr + piece.slot * plan.biggest
        runs = plan.runs(piece, host_ids, host_base)
        with sd.lock:
            done = ev.slots(plan.nslots)
            if p == 0:
                ev.fork.record(cur)
                ks.wait_event(ev.fork)
                cs.wait_event(ev.fork)
            if p >= plan.nslots:  # the slot's previous piece must have left it
                first.wait_event(done[piece.slot])
            if to_host:
                plan.launch(piece, seg_table, dev_ids, slot_ids, slot_ptr, ks, kh)
            else:
                dma(piece, slot_ptr, runs)
            ev.ready.record(first)
            second.wait_event(ev.ready)
            if to_host:
                dma(piece, slot_ptr, runs)
            else:
                plan.launch(piece, seg_table, dev_ids, slot_ids, slot_ptr, ks, kh)
            if p + plan.nslots <= last:
                done[piece.slot].record(second)
            if p == last:
                ev.joins[0].record(ks)
                ev.joins[1].record(cs)
                cur.wait_event(ev.joins[0])
                cur.wait_event(ev.joins[1])
        if p < last and stepping:
            try:
                yield
            except GeneratorExit:
                # Closed early (``close()``, or an abandoned generator collected): enqueue the rest at once, so a
                # call is never left half issued and unjoined while its ring goes back to the allocator.
                stepping = False


class _Dma:
    """A piece's runs on the copy stream: raw ``cudaMemcpyAsync`` (one run; each run under graph capture,
    where the batch call is not capturable) or one ``cudaMemcpyBatchAsync``; torch copies where
    cuda-bindings is missing."""

    def __init__(self, host_flat, ring, plan, stream, handle, to_host) -> None:
        self.host_flat, self.ring, self.plan, self.stream, self.handle = host_flat, ring, plan, stream, handle
        self.to_host = to_host
        self.rt = copy_engine._runtime()
        self.capturing = torch.cuda.is_current_stream_capturing()

    def __call__(self, piece, slot_ptr: int, runs) -> None:
        stage_off, host_addr, sizes = runs
        if self.rt is None:
            plan, flat = self.plan, self.host_flat
            slot = self.ring[piece.slot * plan.biggest : (piece.slot + 1) * plan.biggest]
            host_off = np.asarray(host_addr, dtype=np.int64) - flat.data_ptr()
            with torch.cuda.stream(self.stream):
                if self.to_host:
                    copy_engine.copy_runs_torch(flat, host_off, slot, stage_off, sizes)
                else:
                    copy_engine.copy_runs_torch(slot, stage_off, flat, host_off, sizes)
            return
        stage = [slot_ptr + x for x in stage_off]
        dst, src = (host_addr, stage) if self.to_host else (stage, host_addr)
        if len(dst) > 1 and self.capturing:
            for d, s, z in zip(dst, src, sizes):
                copy_engine.memcpy_raw([d], [s], [z], self.handle)
            return
        copy_engine.memcpy_raw(dst, src, sizes, self.handle)


__all__ = ["NUM_SLOTS", "SLOT_BYTES", "Geometry", "side_streams", "staging_steps", "staging_transfer"]

"""The ``staging`` method: gather on the device into a small staging ring, DMA each piece (and the reverse).

D2H, per piece (a range of blocks, all segments -- or one block, a range of segments, when a block is
larger than a slot): the chunk-copy kernel packs the piece into a ring slot in *host order* on a
high-priority stream, then the copy engines move it to the host, one DMA per run that is contiguous on
the host (consecutive host blocks in ``block_first`` merge into one run). H2D is the mirror image. The
kernel of piece ``i+1`` overlaps the DMA of piece ``i``; slot reuse is ordered by events.

Why a high-priority stream: beside a saturating GEMM, normal-priority gather CTAs wait for SMs and the
DMA engines idle (measured: 33 GB/s instead of 55). The kernels are short (device-to-device at TB/s),
so running them first costs the model little. Everything is forked from and joined back to the
caller's stream with events: no host synchronisation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.ops import copy_engine
from kvstrata.ops.chunk_copy import launch_copy_chunks

# Ring geometry. Pieces must be large: each costs ~150-300 us of host time (planning, a kernel launch,
# a DMA, events) on the H200 machine, so 8 MiB pieces (150 us of DMA) left the copy engine idle half
# the time at 32 KiB chunks (28 GB/s), while 32 MiB x 3 reached 47-50 GB/s at 2 KiB-2 MiB chunks
# (tools/tune_transfer.py, 2026-11-29). The ring is taken from torch's caching allocator per call
# (or is the caller's buffer).
SLOT_BYTES = int(os.environ.get("KVSTRATA_STAGING_SLOT_MB", "32")) << 20
NUM_SLOTS = int(os.environ.get("KVSTRATA_STAGING_SLOTS", "3"))
BATCH_RUNS = 8  # above this many DMA runs per piece, use one cudaMemcpyBatchAsync


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


_streams: dict[tuple[int, bool], tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}


def side_streams(device: torch.device, to_host: bool) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """(high-priority kernel stream, copy stream) of ``device`` for one direction, created once.

    One pair per direction, so a store and a load running at the same time use both DMA directions."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, to_host)
    if key not in _streams:
        _, highest = torch.cuda.Stream.priority_range()
        _streams[key] = (torch.cuda.Stream(device=idx, priority=highest), torch.cuda.Stream(device=idx))
    return _streams[key]


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


def _pieces(n_blocks: int, g: Geometry, slot_bytes: int) -> list[tuple[int, int, int, int]]:
    """(block lo, block hi, seg lo, seg hi) pieces, each fitting one slot."""
    per_block = g.nseg * g.chunk
    if per_block <= slot_bytes:
        step = slot_bytes // per_block
        return [(b, min(b + step, n_blocks), 0, g.nseg) for b in range(0, n_blocks, step)]
    segs = max(1, slot_bytes // g.chunk)
    return [(b, b + 1, s, min(s + segs, g.nseg)) for b in range(n_blocks) for s in range(0, g.nseg, segs)]


def _piece_layout(g: Geometry, nb: int, ns: int) -> tuple[int, int]:
    """Staging (block stride, seg stride) of a piece: the host pool's order, packed."""
    return (ns * g.chunk, g.chunk) if g.block_first else (g.chunk, nb * g.chunk)


def _host_runs(g: Geometry, host_ids: np.ndarray, piece: tuple[int, int, int, int]):
    """Runs (staging offset, host address, bytes) of a piece, staging order = host pool order."""
    b0, b1, s0, s1 = piece
    h = host_ids[b0:b1].astype(np.int64)
    s = np.arange(s0, s1, dtype=np.int64)
    if g.block_first:  # order (block, seg)
        addr = g.host_base + h[:, None] * g.host_block_stride + s[None, :] * g.host_seg_stride
    else:  # order (seg, block)
        addr = g.host_base + s[:, None] * g.host_seg_stride + h[None, :] * g.host_block_stride
    addr = addr.reshape(-1)
    stage = np.arange(addr.size, dtype=np.int64) * g.chunk
    return copy_engine.merge_runs(stage, addr, g.chunk)


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
    n_blocks = int(host_ids.size)
    if n_blocks == 0:
        return
    device = seg_table.device
    nslots = max(1, num_slots or NUM_SLOTS)
    if ring is not None:
        ring = ring.reshape(-1).view(torch.uint8)
        if ring.numel() < g.chunk:
            raise ValueError(f"staging: {ring.numel()} bytes, smaller than one {g.chunk}-byte chunk")
        nslots = min(nslots, ring.numel() // g.chunk)
        slot_bytes = ring.numel() // nslots
    slot_bytes = max(slot_bytes or SLOT_BYTES, g.chunk)
    pieces = _pieces(n_blocks, g, slot_bytes)
    biggest = max((p[1] - p[0]) * (p[3] - p[2]) for p in pieces) * g.chunk
    nslots = min(nslots, len(pieces))
    cuda = device.type == "cuda"
    max_nb = max(p[1] - p[0] for p in pieces)
    if cuda:
        cur = torch.cuda.current_stream(device)
        ks, cs = side_streams(device, to_host)
        ks.wait_stream(cur)
        cs.wait_stream(cur)
        if ring is None:
            # On the caller's stream, which joins both side streams before any later allocation there can
            # reuse the memory: no record_stream needed (and none inside CUDA graph capture).
            ring = torch.empty(nslots * biggest, dtype=torch.uint8, device=device)
        with torch.cuda.stream(ks):
            slot_ids = _arange(max_nb, device)
    else:
        if ring is None:
            ring = torch.empty(nslots * biggest, dtype=torch.uint8, device=device)
        slot_ids = torch.arange(max_nb, dtype=torch.int32, device=device)
    free: list[torch.cuda.Event | None] = [None] * nslots
    host_dev_base = host_flat.data_ptr()  # DMA uses the host address (copy engines, UVA)

    for p, piece in enumerate(pieces):
        k = p % nslots
        b0, b1, s0, s1 = piece
        nb, ns = b1 - b0, s1 - s0
        slot = ring[k * biggest : (k + 1) * biggest]
        sbs, sss = _piece_layout(g, nb, ns)
        stage_off, host_addr, sizes = _host_runs(g, host_ids, piece)
        host_off = host_addr - host_dev_base

        def kernel(slot=slot, b0=b0, b1=b1, s0=s0, ns=ns, sbs=sbs, sss=sss) -> None:
            launch_copy_chunks(
                seg_table, dev_ids[b0:b1], slot_ids, slot.data_ptr(),
                n_blocks=b1 - b0, nseg=ns, seg_lo=s0, chunk_bytes=g.chunk, dev_block_stride=g.dev_block_stride,
                other_block_stride=sbs, other_seg_stride=sss, to_other=to_host, align=g.align, num_ctas=num_ctas,
            )  # fmt: skip

        def dma(slot=slot, stage_off=stage_off, host_off=host_off, sizes=sizes) -> None:
            if cuda and sizes.size > BATCH_RUNS and copy_engine.has_batch_api():
                a, b = (host_off + host_dev_base, stage_off + slot.data_ptr())
                dst, src = (a, b) if to_host else (b, a)
                copy_engine.memcpy_batch(dst, src, sizes, device=device)
            elif to_host:
                copy_engine.copy_runs_torch(host_flat, host_off, slot, stage_off, sizes)
            else:
                copy_engine.copy_runs_torch(slot, stage_off, host_flat, host_off, sizes)

        if not cuda:
            (kernel(), dma()) if to_host else (dma(), kernel())
            continue
        first, second = ((ks, kernel), (cs, dma)) if to_host else ((cs, dma), (ks, kernel))
        if free[k] is not None:
            first[0].wait_event(free[k])
        with torch.cuda.stream(first[0]):
            first[1]()
        ready = torch.cuda.Event()
        ready.record(first[0])
        second[0].wait_event(ready)
        with torch.cuda.stream(second[0]):
            second[1]()
        done = torch.cuda.Event()
        done.record(second[0])
        free[k] = done
    if cuda:
        cur.wait_stream(ks)
        cur.wait_stream(cs)


__all__ = ["NUM_SLOTS", "SLOT_BYTES", "Geometry", "side_streams", "staging_transfer"]

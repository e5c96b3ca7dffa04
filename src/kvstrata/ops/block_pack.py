"""``pack_blocks`` / ``unpack_blocks``: a paged KV cache's blocks to and from one contiguous buffer on the device.

Block ``i`` of the list, every segment (layer x K/V) in the layout's order, becomes row ``i`` of a
``[n, block_bytes]`` uint8 buffer (``pack_blocks``), or is written back from it (``unpack_blocks``): the
block-first format a host pool and kvstrata's stored KV blocks use.

Why: a block of a real model is many small pieces (Llama-3-8B, 16-token blocks: 64 pieces of 32 KiB). Handed to
the copy engine one by one they crawl (~8 us a piece on the H200: 7.8 GB/s of a 55 GB/s link,
``kvstrata bench prefix``); packed first, at device-memory speed, each block is one 2 MiB DMA at line rate. The
copy is :mod:`kvstrata.ops.chunk_copy`'s kernel with the other side a device buffer. :func:`pack_blocks_reference`
is the same in plain torch (the CPU path, and the tests' reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstrata.errors import InvalidType, InvalidValue
from kvstrata.ops._common import interpreting
from kvstrata.ops.chunk_copy import alignment, default_ctas, launch_copy_chunks
from kvstrata.ops.kv_layout import KVLayout


def pack_blocks(layout: KVLayout, block_ids: Sequence[int] | torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy blocks ``block_ids`` of ``layout`` into rows of ``out`` (uint8 ``[>= n, block_bytes]``, contiguous, on
    the layout's device); returns ``out[:n]``. Queued on the current stream."""
    return _run(layout, block_ids, out, to_buffer=True)


def unpack_blocks(layout: KVLayout, block_ids: Sequence[int] | torch.Tensor, src: torch.Tensor) -> None:
    """Copy rows of ``src`` (as :func:`pack_blocks` wrote them) into blocks ``block_ids`` of ``layout``. Queued on
    the current stream."""
    _run(layout, block_ids, src, to_buffer=False)


def pack_blocks_reference(layout: KVLayout, block_ids: Sequence[int], out: torch.Tensor, *, to_buffer: bool) -> None:
    """:func:`pack_blocks` (``to_buffer``) or :func:`unpack_blocks` in plain torch, segment by segment."""
    chunk = layout.chunk_bytes
    for i, b in enumerate(block_ids):
        for s, view in enumerate(layout.seg_views):
            if to_buffer:
                out[i, s * chunk : (s + 1) * chunk].copy_(view[b])
            else:
                view[b].copy_(out[i, s * chunk : (s + 1) * chunk])


def _run(layout: KVLayout, block_ids: Sequence[int] | torch.Tensor, buf: torch.Tensor, *, to_buffer: bool):
    name = "out" if to_buffer else "src"
    ids = _check_ids(block_ids, layout.num_blocks)
    n = len(ids)
    if not isinstance(buf, torch.Tensor):
        raise InvalidType(f"{name}: must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != layout.block_bytes or not buf.is_contiguous():
        raise InvalidValue(
            f"{name}: must be a contiguous uint8 [n, {layout.block_bytes}] tensor, got {buf.dtype} "
            f"{tuple(buf.shape)}{'' if buf.is_contiguous() else ' (not contiguous)'}"
        )
    if buf.shape[0] < n:
        raise InvalidValue(f"{name}: {buf.shape[0]} rows for {n} blocks")
    if buf.device != layout.device:
        raise InvalidValue(f"{name}: on {buf.device}, the KV cache on {layout.device}")
    if n == 0:
        return buf[:0]
    if layout.device.type != "cuda" and not interpreting():
        pack_blocks_reference(layout, ids, buf, to_buffer=to_buffer)
        return buf[:n]
    dev_ids = torch.tensor(ids, dtype=torch.int64)
    rows = torch.arange(n, dtype=torch.int64)
    if layout.device.type == "cuda":
        dev_ids = dev_ids.pin_memory().to(layout.device, non_blocking=True)
        rows = rows.to(layout.device, non_blocking=True)
    base = buf.data_ptr()
    launch_copy_chunks(
        layout.seg_ptr_table,
        dev_ids,
        rows,
        base,
        n_blocks=n,
        nseg=layout.num_segments,
        chunk_bytes=layout.chunk_bytes,
        dev_block_stride=layout.block_stride,
        other_block_stride=layout.block_bytes,
        other_seg_stride=layout.chunk_bytes,
        to_other=to_buffer,
        align=alignment(layout.align, base, layout.block_bytes),
        num_ctas=default_ctas(layout.device),
    )
    return buf[:n]


def _check_ids(block_ids: Sequence[int] | torch.Tensor, num_blocks: int) -> list[int]:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
            raise InvalidValue(f"block_ids: a 1-D integer tensor, got {block_ids.dtype} {tuple(block_ids.shape)}")
        ids = block_ids.tolist()
    else:
        ids = list(block_ids)
    for i, b in enumerate(ids):
        if type(b) is not int:
            raise InvalidType(f"block_ids[{i}]: must be an int, got {type(b).__name__}")
        if not 0 <= b < num_blocks:
            raise InvalidValue(f"block_ids[{i}]: {b} is outside the cache's {num_blocks} blocks")
    return ids


__all__ = ["pack_blocks", "pack_blocks_reference", "unpack_blocks"]

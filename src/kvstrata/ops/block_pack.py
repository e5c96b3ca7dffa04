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


def pack_blocks(
    layout: KVLayout, block_ids: Sequence[int] | torch.Tensor, out: torch.Tensor, *, check: bool = True
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of ``layout`` into rows of ``out`` (uint8 ``[>= n, block_bytes]``, contiguous, on
    the layout's device); returns ``out[:n]``. Queued on the current stream. Also
    ``torch.ops.kvstrata.pack_blocks`` (for ``torch.compile`` and CUDA graphs: pass ids already on the device and
    ``check=False``, since checking their values costs a sync)."""
    return _run(layout, block_ids, out, to_buffer=True, check=check)


def unpack_blocks(
    layout: KVLayout, block_ids: Sequence[int] | torch.Tensor, src: torch.Tensor, *, check: bool = True
) -> None:
    """Copy rows of ``src`` (as :func:`pack_blocks` wrote them) into blocks ``block_ids`` of ``layout``. Queued on
    the current stream. Also ``torch.ops.kvstrata.unpack_blocks``."""
    _run(layout, block_ids, src, to_buffer=False, check=check)


def pack_blocks_reference(layout: KVLayout, block_ids: Sequence[int], out: torch.Tensor, *, to_buffer: bool) -> None:
    """:func:`pack_blocks` (``to_buffer``) or :func:`unpack_blocks` in plain torch, segment by segment."""
    chunk = layout.chunk_bytes
    for i, b in enumerate(block_ids):
        for s, view in enumerate(layout.seg_views):
            if to_buffer:
                out[i, s * chunk : (s + 1) * chunk].copy_(view[b])
            else:
                view[b].copy_(out[i, s * chunk : (s + 1) * chunk])


def _run(layout: KVLayout, block_ids: Sequence[int] | torch.Tensor, buf: torch.Tensor, *, to_buffer: bool, check: bool):
    name = "out" if to_buffer else "src"
    if check or not isinstance(block_ids, torch.Tensor):
        ids = torch.tensor(_check_ids(block_ids, layout.num_blocks), dtype=torch.int64)
    else:
        ids = block_ids
    _check_buffer(layout, buf, ids, name)
    if ids.numel() == 0:
        return buf[:0]
    if layout.device.type == "cuda" and ids.device != layout.device:
        ids = (
            ids.pin_memory().to(layout.device, non_blocking=True) if ids.device.type == "cpu" else ids.to(layout.device)
        )
    tensors, table, ptrs, owners, offsets = layout.op_args()
    geom = [layout.num_segments, layout.chunk_bytes, layout.block_stride, layout.block_bytes, layout.align]
    op = torch.ops.kvstrata.pack_blocks if to_buffer else torch.ops.kvstrata.unpack_blocks
    op(tensors, table, ptrs, owners, offsets, buf, ids, geom)
    return buf[: ids.numel()]


def _check_buffer(layout: KVLayout, buf: object, ids: torch.Tensor, name: str) -> None:
    """What both ops check of their buffer and ids (kinds and shapes only: no sync)."""
    if not isinstance(buf, torch.Tensor):
        raise InvalidType(f"{name}: must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != layout.block_bytes or not buf.is_contiguous():
        raise InvalidValue(
            f"{name}: must be a contiguous uint8 [n, {layout.block_bytes}] tensor, got {buf.dtype} "
            f"{tuple(buf.shape)}{'' if buf.is_contiguous() else ' (not contiguous)'}"
        )
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise InvalidValue(f"block_ids: a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
    if buf.shape[0] < ids.shape[0]:
        raise InvalidValue(f"{name}: {buf.shape[0]} rows for {ids.shape[0]} blocks")
    if buf.device != layout.device:
        raise InvalidValue(f"{name}: on {buf.device}, the KV cache on {layout.device}")


def _pack_impl(
    dev_tensors: list[torch.Tensor],
    seg_table: torch.Tensor,
    seg_ptrs: list[int],
    seg_owner: list[int],
    seg_offset: list[int],
    buf: torch.Tensor,
    ids: torch.Tensor,
    geom: list[int],
    to_buffer: bool,
) -> None:
    """Body of both ops. ``geom`` = [segments, chunk bytes, device block stride, block bytes, device alignment]."""
    nseg, chunk, block_stride, block_bytes, align = geom
    n = ids.numel()
    if n == 0:
        return
    # Under torch.compile the cache may arrive as functionalization clones: address those, not the originals.
    seg_ptrs_now = [dev_tensors[o].data_ptr() + off for o, off in zip(seg_owner, seg_offset)]
    device = dev_tensors[0].device
    if seg_ptrs_now != list(seg_ptrs):
        seg_table = torch.tensor(seg_ptrs_now, dtype=torch.int64).to(device)
    if device.type != "cuda" and not interpreting():  # the CPU path: the same copies in plain torch
        storages = [torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()) for t in dev_tensors]
        for i, b in enumerate(ids.tolist()):
            for s, ptr in enumerate(seg_ptrs_now):
                whole = storages[seg_owner[s]]
                start = ptr - whole.data_ptr() + b * block_stride
                dev, row = whole[start : start + chunk], buf[i, s * chunk : (s + 1) * chunk]
                (row if to_buffer else dev).copy_(dev if to_buffer else row)
        return
    ids = ids.to(device=device, dtype=torch.int64)
    rows = torch.arange(n, dtype=torch.int64, device=device)
    base = buf.data_ptr()
    launch_copy_chunks(
        seg_table,
        ids,
        rows,
        base,
        n_blocks=n,
        nseg=nseg,
        chunk_bytes=chunk,
        dev_block_stride=block_stride,
        other_block_stride=block_bytes,
        other_seg_stride=chunk,
        to_other=to_buffer,
        align=alignment(align, base, block_bytes),
        num_ctas=default_ctas(device),
    )


@torch.library.custom_op("kvstrata::pack_blocks", mutates_args=("buf",))
def _pack_op(
    dev_tensors: list[torch.Tensor],
    seg_table: torch.Tensor,
    seg_ptrs: list[int],
    seg_owner: list[int],
    seg_offset: list[int],
    buf: torch.Tensor,
    ids: torch.Tensor,
    geom: list[int],
) -> None:
    _pack_impl(dev_tensors, seg_table, seg_ptrs, seg_owner, seg_offset, buf, ids, geom, True)


@torch.library.custom_op("kvstrata::unpack_blocks", mutates_args=("dev_tensors",))
def _unpack_op(
    dev_tensors: list[torch.Tensor],
    seg_table: torch.Tensor,
    seg_ptrs: list[int],
    seg_owner: list[int],
    seg_offset: list[int],
    buf: torch.Tensor,
    ids: torch.Tensor,
    geom: list[int],
) -> None:
    _pack_impl(dev_tensors, seg_table, seg_ptrs, seg_owner, seg_offset, buf, ids, geom, False)


@_pack_op.register_fake
def _(dev_tensors, seg_table, seg_ptrs, seg_owner, seg_offset, buf, ids, geom) -> None:
    return None


@_unpack_op.register_fake
def _(dev_tensors, seg_table, seg_ptrs, seg_owner, seg_offset, buf, ids, geom) -> None:
    return None


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

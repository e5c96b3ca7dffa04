"""The one copy kernel behind ``transfer_blocks``: chunks between paged device segments and a strided pool.

Chunk ``(i, s)`` (block ``i`` of the list, segment ``seg_lo + s``) moves between

* device: ``seg_ptrs[seg_lo + s] + dev_ids[i] * dev_block_stride``
* other side: ``base + other_ids[i] * other_block_stride + s * other_seg_stride``

where the other side is the host pool itself (``zero_copy``: host memory read/written in place through
UVA) or a device staging slot (``staging``: gather/scatter at device speed, DMA separately).

Why it looks like this: SMs reading host memory are latency-bound over PCIe (~1-2 us), so each CTA
keeps ``tile_bytes`` in flight per iteration -- several chunks at once when chunks are small (a 2-D tile
``[ROWS chunks, TILE words]``), each thread issuing several 16-byte loads before its stores. The grid is
persistent (``num_ctas`` programs stride over the tiles), so ``num_ctas`` caps the SMs taken.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Tunables (first knobs to turn on a new GPU; see bench/transfer.py).
TILE_BYTES = 32768  # bytes in flight per CTA per iteration
NUM_WARPS = 8

_WORDS = {1: tl.int8, 2: tl.int16, 4: tl.int32}


@triton.jit
def _copy_chunks_kernel(
    seg_ptrs,
    dev_ids,
    other_ids,
    other_base,
    n_blocks,
    seg_lo,
    dev_block_stride,
    other_block_stride,
    other_seg_stride,
    nprog,
    nseg,  # segments per block in this launch
    chunk,  # words per chunk
    TILE: tl.constexpr,  # words per row of a tile (power of 2)
    ROWS: tl.constexpr,  # chunks per tile (power of 2)
    EVEN: tl.constexpr,  # chunk % TILE == 0: no column mask
    TO_OTHER: tl.constexpr,  # True: device -> other side; False: other side -> device
    WORD: tl.constexpr,
    ALIGN: tl.constexpr,  # bytes every address is a multiple of (vectorisation hint)
):
    pid = tl.program_id(0)
    n_rows = n_blocks * nseg
    n_groups = tl.cdiv(n_rows, ROWS)
    for g in range(pid, n_groups, nprog):
        r = g * ROWS + tl.arange(0, ROWS)
        rmask = r < n_rows
        i = r // nseg
        s = r % nseg
        d = tl.load(dev_ids + i, mask=rmask, other=0).to(tl.int64)
        o = tl.load(other_ids + i, mask=rmask, other=0).to(tl.int64)
        dev_addr = tl.load(seg_ptrs + seg_lo + s, mask=rmask, other=0) + d * dev_block_stride
        other_addr = other_base + o * other_block_stride + s.to(tl.int64) * other_seg_stride
        if TO_OTHER:
            src_addr = dev_addr
            dst_addr = other_addr
        else:
            src_addr = other_addr
            dst_addr = dev_addr
        src = tl.multiple_of(tl.multiple_of(src_addr, ALIGN).to(tl.pointer_type(WORD)), ALIGN)
        dst = tl.multiple_of(tl.multiple_of(dst_addr, ALIGN).to(tl.pointer_type(WORD)), ALIGN)
        for off in range(0, chunk, TILE):
            c = tl.max_contiguous(tl.multiple_of(off + tl.arange(0, TILE), TILE), TILE)
            if EVEN:  # noqa: SIM108 (constexpr branch, clearer in a kernel)
                m = rmask[:, None] & (c[None, :] >= 0)
            else:
                m = rmask[:, None] & (c[None, :] < chunk)
            x = tl.load(src[:, None] + c[None, :], mask=m)
            tl.store(dst[:, None] + c[None, :], x, mask=m)


def alignment(*values: int) -> int:
    """Largest power of two <= 16 dividing every value (addresses, strides, chunk size)."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    a = 16
    while a > 1 and g % a:
        a //= 2
    return a


def default_ctas(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def copy_chunks_shape(
    *, n_blocks: int, nseg: int, chunk_bytes: int, align: int, num_ctas: int, tile_bytes: int | None = None
) -> tuple[int, int, dict]:
    """(programs, chunk words, constexprs) of one launch: the shape, decided once per launch plan."""
    word = min(align, 4)
    chunk_words = chunk_bytes // word
    cap = max(1, (tile_bytes or TILE_BYTES) // word)
    tile = min(triton.next_power_of_2(chunk_words), cap)
    rows = max(1, min(cap // tile, triton.next_power_of_2(n_blocks * nseg)))
    n_groups = triton.cdiv(n_blocks * nseg, rows)
    nprog = max(1, min(num_ctas, n_groups))
    constexprs = {"TILE": tile, "ROWS": rows, "EVEN": chunk_words % tile == 0, "WORD": _WORDS[word], "ALIGN": align}
    return nprog, chunk_words, constexprs


def launch_copy_chunks(
    seg_table: torch.Tensor,
    dev_ids: torch.Tensor,
    other_ids: torch.Tensor,
    other_base: int,
    *,
    n_blocks: int,
    nseg: int,
    chunk_bytes: int,
    dev_block_stride: int,
    other_block_stride: int,
    other_seg_stride: int,
    to_other: bool,
    align: int,
    num_ctas: int,
    seg_lo: int = 0,
    tile_bytes: int | None = None,
):
    """Enqueue the chunk copy on the current stream (no host synchronisation); returns Triton's compiled
    kernel where it gives one (launch plans reuse it)."""
    if n_blocks == 0 or nseg == 0:
        return None
    nprog, chunk_words, constexprs = copy_chunks_shape(
        n_blocks=n_blocks, nseg=nseg, chunk_bytes=chunk_bytes, align=align, num_ctas=num_ctas, tile_bytes=tile_bytes
    )
    return _copy_chunks_kernel[(nprog,)](
        seg_table,
        dev_ids,
        other_ids,
        other_base,
        n_blocks,
        seg_lo,
        dev_block_stride,
        other_block_stride,
        other_seg_stride,
        nprog,
        nseg,
        chunk_words,
        TO_OTHER=to_other,
        num_warps=NUM_WARPS,
        **constexprs,
    )


__all__ = ["NUM_WARPS", "TILE_BYTES", "alignment", "copy_chunks_shape", "default_ctas", "launch_copy_chunks"]

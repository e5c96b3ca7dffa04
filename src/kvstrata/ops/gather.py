"""``gather``: ``out[i] = table[ids[i]]``, the table on the device or read in place from host memory.

Reads of host memory over PCIe by SMs need many bytes in flight, far more than writes, so each
program copies 2-D tiles of several rows at once (``TileConfig``), each thread issuing 16-byte loads
where alignment allows, and the default grid covers every SM several times.

Example::

    table = kvstrata.memory.alloc_pinned(n * 1024).view(torch.float16).view(n, 512)
    out = torch.empty(len(ids), 512, dtype=torch.float16, device="cuda")
    kvstrata.ops.gather(table, out, ids)          # table read in place over PCIe, ids anywhere
"""

import torch
import triton
import triton.language as tl

from kvstrata.memory.pinned import device_alias
from kvstrata.ops._common import (
    INDEX_DTYPES,
    TileConfig,
    as_words,
    check_dtype,
    check_ndim,
    check_no_overlap,
    check_optional_positive_int,
    check_tensor,
    launch_config,
    pinned_copy_to,
    runs_triton,
    vec_words,
    word_bytes_for,
)

TILE = TileConfig(tile_bytes=16384, max_row_bytes=4096, num_warps=4, ctas_per_sm=4)


@triton.jit
def _gather_kernel(
    table_ptr,
    out_ptr,
    ids_ptr,
    n_ids,
    n_table_rows,
    row_words,
    table_stride,
    out_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    VEC: tl.constexpr,
    EVEN_COLS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    col_tiles = tl.cdiv(row_words, BLOCK_WORDS)
    tiles = tl.cdiv(n_ids, BLOCK_ROWS) * col_tiles
    for tile in range(pid, tiles, nprog):
        row_tile = tile // col_tiles
        col_tile = tile - row_tile * col_tiles
        rows = row_tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < n_ids
        idx = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        # Out-of-range ids (possible only with check=False) leave their row of ``out`` untouched.
        row_ok = row_ok & (idx >= 0) & (idx < n_table_rows)
        cols = col_tile * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
        src_rows = tl.multiple_of(idx * table_stride, VEC)
        dst_rows = tl.multiple_of(rows.to(tl.int64) * out_stride, VEC)
        if EVEN_COLS:  # noqa: SIM108 (constexpr branch: no mask math along columns)
            mask = row_ok[:, None]
        else:
            mask = row_ok[:, None] & (cols < row_words)[None, :]
        values = tl.load(table_ptr + src_rows[:, None] + cols[None, :], mask=mask)
        tl.store(out_ptr + dst_rows[:, None] + cols[None, :], values, mask=mask)


def _launch(table: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, num_ctas: int | None) -> None:
    """Run ``_gather_kernel``; all three tensors are on one device (or CPU under the interpreter)."""
    elt = table.element_size()
    row_bytes = table.shape[1] * elt
    word = word_bytes_for(row_bytes, table.stride(0) * elt, out.stride(0) * elt, table.data_ptr(), out.data_ptr())
    table_w, out_w = as_words(table, word), as_words(out, word)
    row_words = row_bytes // word
    addrs = (table.data_ptr() // word, out.data_ptr() // word)
    vec = vec_words(word, row_words, table_w.stride(0), out_w.stride(0), *addrs)
    cfg = launch_config(ids.numel(), row_words, word, device=out.device, tile=TILE, num_ctas=num_ctas)
    _gather_kernel[(cfg.grid,)](
        table_w,
        out_w,
        ids,
        ids.numel(),
        table.shape[0],
        row_words,
        table_w.stride(0),
        out_w.stride(0),
        BLOCK_ROWS=cfg.block_rows,
        BLOCK_WORDS=cfg.block_words,
        VEC=vec,
        EVEN_COLS=row_words % cfg.block_words == 0,
        num_warps=cfg.num_warps,
    )


def gather_reference(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Plain-torch ``table[ids]`` for every supported dtype (bytes, so fp8 works on CPU too)."""
    rows = table.view(torch.uint8) if table.dtype != torch.uint8 else table
    return rows.index_select(0, ids.to(torch.int64)).view(table.dtype)


def _check_meta(table: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, num_ctas: int | None) -> None:
    """Everything checkable from shapes and dtypes (also runs on fake tensors under torch.compile)."""
    for name, t in (("table", table), ("out", out), ("ids", ids)):
        check_tensor(t, name)
    check_ndim(table, "table", 2)
    check_ndim(out, "out", 2)
    check_ndim(ids, "ids", 1)
    check_dtype(table, "table")
    check_dtype(ids, "ids", INDEX_DTYPES)
    if out.dtype != table.dtype:
        raise TypeError(f"out: dtype {out.dtype} differs from table's {table.dtype}")
    if tuple(out.shape) != (ids.shape[0], table.shape[1]):
        raise ValueError(f"out: expected shape {(ids.shape[0], table.shape[1])}, got {tuple(out.shape)}")
    for name, t in (("table", table), ("out", out)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: rows must be contiguous (stride {t.stride()})")
    check_optional_positive_int(num_ctas, "num_ctas")
    cuda = [t.device for t in (table, out) if t.device.type == "cuda"]
    if len(set(cuda)) > 1:
        raise ValueError(f"out: table and out are on different GPUs ({cuda[0]} and {cuda[1]})")
    if ids.device.type == "cuda" and cuda and ids.device != cuda[0]:
        raise ValueError(f"ids: on {ids.device}, the op runs on {cuda[0]}")


def _check_ids_range(ids: torch.Tensor, n_rows: int) -> None:
    if ids.numel() == 0:
        return
    lo, hi = torch.aminmax(ids)
    lo, hi = int(lo), int(hi)  # for device ids, the one host sync check=False avoids
    if lo < 0 or hi >= n_rows:
        raise ValueError(f"ids: values must lie in [0, {n_rows}), got min {lo} and max {hi}")


def _reachable(t: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    if t.device.type == "cuda":
        return t
    try:
        return device_alias(t, device)
    except ValueError as exc:
        raise ValueError(f"{name}: a host tensor must be in registered or pinned memory ({exc})") from exc


def _gather_impl(table: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, num_ctas: int | None, check: bool) -> None:
    _check_meta(table, out, ids, num_ctas)
    if check:
        _check_ids_range(ids, table.shape[0])
    if ids.numel() == 0 or table.shape[1] == 0:
        return
    if out.device.type == "cpu" and table.device.type == "cpu":
        check_no_overlap(table, out, "out")
        if runs_triton(table, out, ids):
            _launch(table, out, ids.contiguous(), num_ctas)
        else:
            out.copy_(gather_reference(table, ids))
        return
    device = out.device if out.device.type == "cuda" else table.device
    table_d = _reachable(table, "table", device)
    out_d = _reachable(out, "out", device)
    check_no_overlap(table_d, out_d, "out")
    ids_d = pinned_copy_to(ids.contiguous(), device)
    with torch.cuda.device(device):
        _launch(table_d, out_d, ids_d, num_ctas)


@torch.library.custom_op(
    "kvstrata::gather",
    mutates_args=("out",),
    schema="(Tensor table, Tensor(a!) out, Tensor ids, int? num_ctas, bool check) -> ()",
)
def _gather_op(table: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, num_ctas: int | None, check: bool) -> None:
    _gather_impl(table, out, ids, num_ctas, check)


@_gather_op.register_fake
def _(table: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, num_ctas: int | None, check: bool) -> None:
    _check_meta(table, out, ids, num_ctas)


def gather(
    table: torch.Tensor,
    out: torch.Tensor,
    ids: torch.Tensor,
    *,
    num_ctas: int | None = None,
    check: bool = True,
) -> torch.Tensor:
    """``out[i] = table[ids[i]]`` asynchronously on the current stream; returns ``out``.

    Args:
        table: ``[rows, width]``, on the GPU or in registered/pinned host memory (read in place).
            bf16, fp16, fp32, int8, uint8, fp8 (e4m3fn, e5m2); any width; rows contiguous.
        out: ``[len(ids), width]``, same dtype, on the GPU (or registered host memory).
        ids: int32 or int64, on the GPU or the host (host ids are copied without blocking).
        num_ctas: cap on the programs (SMs) the kernel occupies; default: every SM a few times.
        check: verify ``ids`` lie in range first (for GPU ids this costs a host sync; pass False
            for CUDA-graph capture; out-of-range ids then leave their rows of ``out`` untouched).

    All-CPU arguments run a CPU implementation (the Triton interpreter under ``TRITON_INTERPRET=1``).
    Raises TypeError/ValueError naming the argument before anything is written.
    """
    for name, t in (("table", table), ("out", out), ("ids", ids)):
        check_tensor(t, name)  # before the dispatcher, which would reject it with a less helpful message
    check_optional_positive_int(num_ctas, "num_ctas")
    if torch.compiler.is_compiling():
        torch.ops.kvstrata.gather(table, out, ids, num_ctas, bool(check))
    else:
        # Eager calls skip the dispatcher (~100 us of host time per call on the H200 machine, five
        # times the copy of 1,024 rows); torch.compile and export still see the registered op.
        _gather_impl(table, out, ids, num_ctas, bool(check))
    return out


__all__ = ["TILE", "gather", "gather_reference"]

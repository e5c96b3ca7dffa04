"""``gather``: ``out[i] = table[ids[i]]``, the table on the device or read in place from host memory.

Reads of host memory over PCIe by SMs need many bytes in flight, far more than writes, so each
program copies 2-D tiles of several rows at once (``TileConfig``), each thread issuing 16-byte loads
where alignment allows, and the default grid covers every SM several times.

A call's host work is most of its cost at small sizes (1,024 rows of 1 KiB move in ~20 us), so the
first call with a given table/out/ids signature builds a *launch plan* (all checks that depend only
on that signature, word sizes, grid, the compiled kernel) and later calls look it up and launch the
compiled kernel with raw addresses (see ``_gather_plan``).

Example::

    table = kvstrata.memory.alloc_pinned(n * 1024).view(torch.float16).view(n, 512)
    out = torch.empty(len(ids), 512, dtype=torch.float16, device="cuda")
    kvstrata.ops.gather(table, out, ids)          # table read in place over PCIe, ids anywhere
"""

import torch
import triton
import triton.language as tl

from kvstrata.errors import InvalidType, InvalidValue
from kvstrata.ops._common import (
    INDEX_DTYPES,
    PlanCache,
    TileConfig,
    check_dtype,
    check_ndim,
    check_optional_positive_int,
    check_tensor,
)
from kvstrata.ops._gather_plan import MAX_PLANS, GatherPlan, build_plan, plan_key

# From tools/tune_gather.py on the H200 (bench/results/tune_gather_h200.json): the best worst-case
# fraction of the best configuration over 1K/16K/128K rows of 1 KiB.
TILE = TileConfig(tile_bytes=16384, max_row_bytes=4096, num_warps=8, ctas_per_sm=8)

# How programs walk the tiles (tools/tune_gather.py sweeps them on a GPU):
#   persistent: a grid of SMs x ctas_per_sm programs, each looping over tiles;
#   prefetch:   the same, loading the next tile's ids before the current tile's rows, so the
#               dependent ids load (device or host memory) overlaps the PCIe row reads;
#   flat:       one program per tile (the hardware scheduler refills SMs as programs finish).
SCHEDULES = ("persistent", "prefetch", "flat")
SCHEDULE = "persistent"


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
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    col_tiles = tl.cdiv(row_words, BLOCK_WORDS)
    tiles = tl.cdiv(n_ids, BLOCK_ROWS) * col_tiles
    lanes = tl.arange(0, BLOCK_ROWS)
    if PREFETCH:
        first = (pid // col_tiles) * BLOCK_ROWS + lanes
        idx_next = tl.load(ids_ptr + first, mask=first < n_ids, other=0)
    for tile in range(pid, tiles, nprog):
        row_tile = tile // col_tiles
        col_tile = tile - row_tile * col_tiles
        rows = row_tile * BLOCK_ROWS + lanes
        row_ok = rows < n_ids
        if PREFETCH:
            idx = idx_next.to(tl.int64)
            ahead = ((tile + nprog) // col_tiles) * BLOCK_ROWS + lanes  # past the end: all masked
            idx_next = tl.load(ids_ptr + ahead, mask=ahead < n_ids, other=0)
        else:
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


def gather_reference(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Plain-torch ``table[ids]`` for every supported dtype (bytes, so fp8 works on CPU too)."""
    rows = table.view(torch.uint8) if table.dtype != torch.uint8 else table
    return rows.index_select(0, ids.to(torch.int64)).view(table.dtype)


def _check_meta(table: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, num_ctas: int | None) -> None:
    """Everything checkable from shapes and dtypes (also runs on fake tensors under torch.compile)."""
    for name, t in (("table", table), ("out", out), ("ids", ids)):
        check_tensor(t, name)
        if t.layout != torch.strided:
            raise InvalidType(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
        if t.device.type not in ("cpu", "cuda"):
            raise InvalidValue(f"{name}: expected a CPU or CUDA tensor, got one on {t.device}")
    if out.requires_grad:
        raise InvalidValue("out: requires grad, and gather writes into it (pass a tensor that does not)")
    check_ndim(table, "table", 2)
    check_ndim(out, "out", 2)
    check_ndim(ids, "ids", 1)
    check_dtype(table, "table")
    check_dtype(ids, "ids", INDEX_DTYPES)
    if out.dtype != table.dtype:
        raise InvalidType(f"out: dtype {out.dtype} differs from table's {table.dtype}")
    if tuple(out.shape) != (ids.shape[0], table.shape[1]):
        raise InvalidValue(f"out: expected shape {(ids.shape[0], table.shape[1])}, got {tuple(out.shape)}")
    for name, t in (("table", table), ("out", out)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise InvalidValue(f"{name}: rows must be contiguous (stride {t.stride()})")
    if out.shape[0] > 1 and out.shape[1] > 0 and out.stride(0) < out.shape[1]:
        raise InvalidValue(f"out: its rows overlap (row stride {out.stride(0)} < row length {out.shape[1]})")
    check_optional_positive_int(num_ctas, "num_ctas")
    cuda = [t.device for t in (table, out) if t.device.type == "cuda"]
    if len(set(cuda)) > 1:
        raise InvalidValue(f"out: table and out are on different GPUs ({cuda[0]} and {cuda[1]})")
    if ids.device.type == "cuda" and cuda and ids.device != cuda[0]:
        raise InvalidValue(f"ids: on {ids.device}, the op runs on {cuda[0]}")


def _check_ids_range(ids: torch.Tensor, n_rows: int) -> None:
    if ids.numel() == 0:
        return
    lo, hi = torch.aminmax(ids)
    lo, hi = int(lo), int(hi)  # for device ids, the one host sync check=False avoids
    if lo < 0 or hi >= n_rows:
        raise InvalidValue(f"ids: values must lie in [0, {n_rows}), got min {lo} and max {hi}")


_PLANS = PlanCache(MAX_PLANS)


def clear_plans() -> None:
    """Forget every cached launch plan (tests; after changing ``TILE`` or ``SCHEDULE`` it is not needed)."""
    _PLANS.clear()


def _plan(table: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, num_ctas: int | None) -> GatherPlan:
    """The cached plan of this call's signature, or a new one after every check (raising on bad input)."""
    try:
        key = plan_key(table, out, ids, num_ctas)
    except RuntimeError:  # no data pointer (a sparse tensor, say): let the checks name the argument
        _check_meta(table, out, ids, num_ctas)
        raise
    plan = _PLANS.get(key)
    if plan is not None and plan.usable(table, out, TILE, SCHEDULE):
        return plan
    _check_meta(table, out, ids, num_ctas)
    if SCHEDULE not in SCHEDULES:
        raise InvalidValue(f"SCHEDULE: expected one of {SCHEDULES}, got {SCHEDULE!r}")
    plan = build_plan(_gather_kernel, table, out, ids, num_ctas, TILE, SCHEDULE)
    _PLANS.put(key, plan)
    return plan


def _gather_impl(table: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, num_ctas: int | None, check: bool) -> None:
    plan = _plan(table, out, ids, num_ctas)
    if check:
        _check_ids_range(ids, table.shape[0])
    if plan.kind == "triton":
        plan.launch(_gather_kernel, table, out, ids)
    elif plan.kind == "reference":
        if check:
            out.copy_(gather_reference(table, ids))
        else:  # unchecked ids out of range leave their rows untouched, as the kernel does
            ok = (ids >= 0) & (ids < table.shape[0])
            rows = ok.nonzero().squeeze(1)
            out.index_copy_(0, rows.to(out.device), gather_reference(table, ids[rows]))


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
        ids: int32 or int64, on the GPU or the host (pinned host ids are read in place by the kernel,
            pageable ones staged through pinned memory without blocking).
        num_ctas: cap on the programs (SMs) the kernel occupies; default: every SM a few times.
        check: verify ``ids`` lie in range first (for GPU ids this costs a host sync; pass False
            for CUDA-graph capture; out-of-range ids then leave their rows of ``out`` untouched).

    All-CPU arguments run a CPU implementation (the Triton interpreter under ``TRITON_INTERPRET=1``).
    Raises TypeError/ValueError naming the argument before anything is written. Repeated calls with
    the same table/out (same memory, shape, strides, dtype) and ids dtype/length reuse a cached
    launch plan and cost a few microseconds of host time.
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


__all__ = ["SCHEDULE", "SCHEDULES", "TILE", "clear_plans", "gather", "gather_reference"]

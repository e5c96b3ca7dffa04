"""``kvstrata bench gather``: rows gathered from a host table into GPU memory, against the field's ways.

In one run, for each row size and row count:

* ``kvstrata``: :func:`kvstrata.ops.gather`, the table read in place over PCIe (ids on the GPU);
* ``kvstrata_host_ids``: the same with ids in pinned host memory;
* ``index_select_uva``: ``torch.index_select`` on a device view of the host table;
* ``cpu_gather_pinned``: CPU ``index_select`` into a pinned buffer, then one DMA;
* ``to_cuda``: ``table[ids].to("cuda")`` (pageable; what most code does);
* ``dma_same_bytes``: one pinned H2D copy of as many contiguous bytes as the rows hold (what the copy
  engine itself takes for these bytes: the floor of any gather at small sizes, where latency counts);
* ``dma_ceiling``: the rate of one large pinned H2D copy of the table (what PCIe can do), as time for
  these bytes.

Every method is timed two ways. ``wall_us``: one call and ``torch.cuda.synchronize()``, wall clock
(median), the same for every method; ``x_to_cuda`` is ``to_cuda``'s ``wall_us`` over the method's, a
like-for-like ratio. ``streamed_us`` (the methods that run on the device alone): ``STREAM_CALLS``
calls back to back per sample, CUDA events (:func:`kvstrata.bench._common.device_time` with ``calls`` > 1:
one call's host work overlaps the previous call's copy, as in an engine gathering continuously), the
figure ``GBps`` and ``of_ceiling`` use (the DMA ceiling is streamed too; ``GBps`` of the wall-timed
methods is from ``wall_us``). Issue 4's targets: >= 90% of the ceiling from 16,384 rows of 1 KiB
(streamed), >= 10x ``to_cuda`` at 1,024 rows (``x_to_cuda``: isolated calls both). A row whose result
was wrong meets no target. Without a GPU (or with ``--smoke``) a tiny version checks the plumbing.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

import torch

from kvstrata.bench._common import device_time, gbps, host_time, positive_ints, print_table, write_result

# Streamed rates: STREAM_CALLS back-to-back calls per timed sample, ceilings and baselines alike.
STREAM_CALLS = 4

TARGET_CEILING_RATIO = 0.90  # from 16,384 rows of 1 KiB
TARGET_SPEEDUP = 10.0  # over table[ids].to("cuda") at 1,024 rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (the CPU default): checks the plumbing")
    parser.add_argument("--quick", action="store_true", help="one 256 MiB table of 1 KiB rows (< 60 s on a GPU)")
    parser.add_argument(
        "--rows", type=positive_ints, default="1024,16384,131072", help="comma-separated row counts to gather"
    )
    parser.add_argument("--row-bytes", type=positive_ints, default="1024,4096", help="comma-separated row sizes (fp16)")
    parser.add_argument("--table-bytes", type=int, default=1 << 30, help="size of each table (default 1 GiB)")
    parser.add_argument("--tile-bytes", type=int, default=None, help="override the gather kernel's tile bytes")
    parser.add_argument("--num-warps", type=int, default=None, help="override the gather kernel's warps")
    parser.add_argument("--ctas-per-sm", type=int, default=None, help="override the default grid (SMs x this)")
    parser.add_argument("--num-ctas", type=int, default=None, help="cap the gather kernel's programs")
    parser.add_argument("--schedule", default=None, help="override the gather kernel's schedule (see SCHEDULES)")


def _apply_tile_overrides(args: argparse.Namespace) -> dict[str, int]:
    gather_mod = importlib.import_module("kvstrata.ops.gather")
    tile = gather_mod.TILE
    changes = {
        k: v
        for k, v in (("tile_bytes", args.tile_bytes), ("num_warps", args.num_warps), ("ctas_per_sm", args.ctas_per_sm))
        if v is not None
    }
    if changes:
        from dataclasses import replace

        gather_mod.TILE = replace(tile, **changes)
    if args.schedule is not None:
        if args.schedule not in gather_mod.SCHEDULES:
            raise SystemExit(f"--schedule: expected one of {gather_mod.SCHEDULES}, got {args.schedule!r}")
        gather_mod.SCHEDULE = args.schedule
    return {"tile_bytes": gather_mod.TILE.tile_bytes, "num_warps": gather_mod.TILE.num_warps,
            "ctas_per_sm": gather_mod.TILE.ctas_per_sm, "max_row_bytes": gather_mod.TILE.max_row_bytes,
            "schedule": gather_mod.SCHEDULE}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    tile = _apply_tile_overrides(args)
    gpu = torch.cuda.is_available() and not args.smoke
    if gpu:
        rows_list = args.rows
        row_sizes = [1024] if args.quick else args.row_bytes
        table_bytes = min(args.table_bytes, 256 << 20) if args.quick else args.table_bytes
        # samples per figure: a quick run takes as many (5 left single hiccups in medians, e.g. a 16 MiB DMA at 0.78
        # of its rate, and timed the to_cuda baseline, whose ratio is the target, only 3 times)
        iters = 20
        rows, ceilings = _run_gpu(rows_list, row_sizes, table_bytes, iters, args.num_ctas)
        name = "gather_quick" if args.quick else "gather"
    else:
        rows, ceilings = _run_smoke(), {}
        name = "gather_smoke"
    result: dict[str, Any] = {"tile": tile, "num_ctas": args.num_ctas, "ceilings_gbps": ceilings, "rows": rows}
    if gpu:
        result["targets"] = _targets(rows)
    path = write_result(name, result, args.out)
    _plot(rows, ceilings, path.with_suffix(".png"))
    print(f"results: {path}")
    columns = ["row_bytes", "rows", "method", "wall_us", "x_to_cuda", "streamed_us", "GBps", "of_ceiling", "correct"]
    print_table(rows, columns)
    if gpu:
        for target in result["targets"]:
            extra = ""
            if "dma_same_bytes_x_to_cuda" in target:
                extra = (
                    f" (isolated calls, wall clock; one DMA of the same bytes: {target['dma_same_bytes_x_to_cuda']}x;"
                    f" the gather reaches {target['of_dma_same_bytes']} of its rate)"
                )
            if "streamed_x_to_cuda" in target:
                extra += (
                    f"; streamed ({STREAM_CALLS} gathers back to back) against to_cuda isolated, not the target's"
                    f" figure: {target['streamed_x_to_cuda']}x"
                )
            print(f"target {target['name']}: {target['value']} (need {target['need']}) -> {target['status']}{extra}")
    return 0 if all(r.get("correct", True) for r in rows) else 1


def _run_gpu(
    rows_list: list[int], row_sizes: list[int], table_bytes: int, iters: int, num_ctas: int | None
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    from kvstrata.memory import alloc_pinned, device_view

    results: list[dict[str, Any]] = []
    ceilings: dict[str, float] = {}
    for row_bytes in row_sizes:
        n_table = table_bytes // row_bytes
        table = alloc_pinned(n_table * row_bytes).view(torch.float16).view(n_table, row_bytes // 2)
        view = device_view(table)
        view.view(torch.int16).random_(0, 30000)  # finite fp16 bit patterns, written over PCIe
        torch.cuda.synchronize()
        ceiling, t_ceil, ceil_bytes = _dma_ceiling(table, iters)
        ceilings[str(row_bytes)] = ceiling
        for n in rows_list:
            case = _measure_case(table, view, n, iters, num_ctas)
            add_ratios(case, ceiling)
            us = round(t_ceil * 1e6 * n * row_bytes / ceil_bytes, 1)  # the ceiling's time for these bytes
            case.append({"row_bytes": row_bytes, "rows": n, "method": "dma_ceiling", "wall_us": None,
                         "x_to_cuda": None, "streamed_us": us, "GBps": ceiling, "of_ceiling": 1.0})  # fmt: skip
            results.extend(case)
    return results, ceilings


def add_ratios(case: list[dict[str, Any]], ceiling: float) -> None:
    """``of_ceiling`` (``GBps`` over the streamed DMA ceiling) and ``x_to_cuda`` (``to_cuda``'s isolated wall time
    over the method's: both timed the same way) for one row count's rows."""
    base = next(r for r in case if r["method"] == "to_cuda")
    for r in case:
        r["of_ceiling"] = round(r["GBps"] / ceiling, 3)
        r["x_to_cuda"] = round(base["wall_us"] / r["wall_us"], 1)


def _dma_ceiling(table: torch.Tensor, iters: int) -> tuple[float, float, int]:
    """GB/s, seconds and bytes of one large pinned H2D copy (up to 256 MiB of the table)."""
    flat = table.view(-1).view(torch.uint8)
    nbytes = min(flat.numel(), 256 << 20)
    sink = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    seconds = device_time(lambda: sink.copy_(flat[:nbytes], non_blocking=True), iters=iters, calls=STREAM_CALLS)
    return gbps(nbytes, seconds), seconds, nbytes


def _measure_case(
    table: torch.Tensor, view: torch.Tensor, n: int, iters: int, num_ctas: int | None
) -> list[dict[str, Any]]:
    from kvstrata.ops import gather

    row_bytes = table.shape[1] * table.element_size()
    ids_dev = torch.randint(0, table.shape[0], (n,), device="cuda")
    ids_cpu = ids_dev.cpu()
    ids_pinned = ids_cpu.pin_memory()
    out = torch.empty(n, table.shape[1], dtype=table.dtype, device="cuda")
    staging = torch.empty(n, table.shape[1], dtype=table.dtype, pin_memory=True)
    expected = table[ids_cpu]
    flat = table.view(-1).view(torch.uint8)[: n * row_bytes]
    sink = torch.empty(n * row_bytes, dtype=torch.uint8, device="cuda")

    def cpu_gather_pinned() -> None:
        torch.index_select(table, 0, ids_cpu, out=staging)
        out.copy_(staging, non_blocking=True)
        torch.cuda.synchronize()

    def to_cuda() -> None:
        out.copy_(table[ids_cpu].to("cuda"))
        torch.cuda.synchronize()

    methods = {  # name -> (callable, timed with CUDA events (True) or wall clock (False))
        "kvstrata": (lambda: gather(table, out, ids_dev, num_ctas=num_ctas, check=False), True),
        "kvstrata_host_ids": (lambda: gather(table, out, ids_pinned, num_ctas=num_ctas, check=False), True),
        "index_select_uva": (lambda: torch.index_select(view, 0, ids_dev, out=out), True),
        "cpu_gather_pinned": (cpu_gather_pinned, False),
        "to_cuda": (to_cuda, False),
        "dma_same_bytes": (lambda: sink.copy_(flat, non_blocking=True), True),
    }
    case: list[dict[str, Any]] = []
    for method, (fn, on_device) in methods.items():
        out.zero_()
        fn()
        torch.cuda.synchronize()
        correct = torch.equal(sink.cpu(), flat) if method == "dma_same_bytes" else torch.equal(out.cpu(), expected)

        def isolated(fn=fn) -> None:
            fn()
            torch.cuda.synchronize()

        wall = host_time(isolated, iters=iters)
        streamed = device_time(fn, iters=iters, calls=STREAM_CALLS) if on_device else None
        case.append({"row_bytes": row_bytes, "rows": n, "method": method, "wall_us": round(wall * 1e6, 1),
                     "streamed_us": None if streamed is None else round(streamed * 1e6, 1),
                     "GBps": gbps(n * row_bytes, wall if streamed is None else streamed),
                     "correct": correct})  # fmt: skip
    return case


def _run_smoke() -> list[dict[str, Any]]:
    """Tiny CPU (or GPU) run of the same plumbing: kvstrata beside ``table[ids]``, results checked."""
    from kvstrata.memory import alloc_pinned
    from kvstrata.ops import gather

    width, n_table = 64, 512
    table = alloc_pinned(n_table * width * 2, numa=None).view(torch.float16).view(n_table, width)
    table.copy_(torch.randn(n_table, width).half())
    results = []
    for n in (16, 64):
        results.extend(_smoke_case(table, n, gather))
    return results


def _smoke_case(table: torch.Tensor, n: int, gather) -> list[dict[str, Any]]:
    ids = torch.randint(0, table.shape[0], (n,))
    out = torch.zeros(n, table.shape[1], dtype=table.dtype)
    row_bytes = table.shape[1] * table.element_size()
    rows = []
    for method, fn in (("kvstrata", lambda: gather(table, out, ids)), ("reference", lambda: out.copy_(table[ids]))):
        out.zero_()
        fn()
        correct = torch.equal(out, table[ids])
        seconds = host_time(fn, warmup=1, iters=3)
        rows.append({"row_bytes": row_bytes, "rows": n, "method": method, "wall_us": round(seconds * 1e6, 1),
                     "GBps": gbps(n * row_bytes, seconds), "correct": correct})  # fmt: skip
    return rows


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 4's targets from this run's rows. A row whose result was wrong counts for none: its target is missed."""

    def pick(method: str, row_bytes: int, pred) -> list[dict[str, Any]]:
        return [r for r in rows if r["method"] == method and r["row_bytes"] == row_bytes and pred(r["rows"])]

    def status(met: bool, picked: list[dict[str, Any]]) -> str:
        if not all(r.get("correct", True) for r in picked):
            return "missed (wrong results)"
        return "met" if met else "missed"

    out = []
    big = pick("kvstrata", 1024, lambda n: n >= 16384)
    if big:
        worst = min(r["of_ceiling"] for r in big)
        out.append({"name": "of_ceiling_from_16384_rows_1KiB", "value": worst, "need": TARGET_CEILING_RATIO,
                    "status": status(worst >= TARGET_CEILING_RATIO, big)})  # fmt: skip
    small = pick("kvstrata", 1024, lambda n: n == 1024)
    if small:
        x = small[0]["x_to_cuda"]
        base = pick("to_cuda", 1024, lambda n: n == 1024)
        target = {"name": "speedup_vs_to_cuda_at_1024_rows_1KiB", "value": x, "need": TARGET_SPEEDUP,
                  "status": status(x >= TARGET_SPEEDUP, small)}  # fmt: skip
        if base and small[0].get("streamed_us"):  # not the target's figure: the gather streamed, to_cuda isolated
            target["streamed_x_to_cuda"] = round(base[0]["wall_us"] / small[0]["streamed_us"], 1)
        floor = pick("dma_same_bytes", 1024, lambda n: n == 1024)
        if floor:  # what the copy engine alone reaches for the same bytes: no gather can beat it
            target["dma_same_bytes_x_to_cuda"] = floor[0]["x_to_cuda"]
            target["of_dma_same_bytes"] = round(floor[0]["wall_us"] / small[0]["wall_us"], 3)
        out.append(target)
    return out


def _plot(rows: list[dict[str, Any]], ceilings: dict[str, float], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (pip install matplotlib)")
        return
    sizes = sorted({r["row_bytes"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        methods = sorted({r["method"] for r in rows if r["row_bytes"] == size and r["method"] != "dma_ceiling"})
        for method in methods:
            pts = sorted((r["rows"], r["GBps"]) for r in rows if r["row_bytes"] == size and r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        if str(size) in ceilings:
            ax.axhline(ceilings[str(size)], color="k", linestyle="--", label="DMA ceiling")
        ax.set_xscale("log")
        ax.set_xlabel("rows gathered")
        ax.set_ylabel("GB/s")
        ax.set_title(f"gather, {size}-byte rows")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


__all__ = ["add_arguments", "run"]

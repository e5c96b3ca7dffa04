"""Sweep gather's schedules and tile shapes on one GPU in one short run; print tables, write JSON.

    PYTHONPATH=src python tools/tune_gather.py [--out DIR] [--rows 1024,16384,131072] [--quick]

Measures, in the same run and with the same streamed CUDA-event timing as ``kvstrata bench gather``
(``STREAM_CALLS`` back-to-back calls per sample, median after warm-up):

* the DMA ceiling (one large pinned H2D copy) and ``torch.index_select`` on a UVA alias of the table;
* every (schedule, tile_bytes, num_warps, ctas_per_sm) of the sweep, each checked exactly against
  ``table[ids]`` before it is timed;
* the host cost of one eager call with ``check=False`` (launch plan cached, and rebuilt every call),
  against ``index_select``'s, from ``perf_counter`` over many calls without synchronising.

A tuning aid, not a benchmark: pick the winner, set ``TILE``/``SCHEDULE`` in ``kvstrata.ops.gather``,
and confirm with ``kvstrata bench gather --quick``. 1 KiB fp16 rows from a 256 MiB pinned table; the
whole sweep should take about a minute on an H200 (much of it compiling the 16 kernel variants).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import time
from typing import Any

import torch

from kvstrata.bench._common import device_time, gbps, print_table, write_result
from kvstrata.memory import alloc_pinned, device_view
from kvstrata.ops import gather
from kvstrata.ops._common import TileConfig

gather_mod = importlib.import_module("kvstrata.ops.gather")  # the package attribute `gather` is the function
STREAM_CALLS = 4  # as in kvstrata.bench.gather
ROW_BYTES = 1024


def _sweep(quick: bool) -> list[tuple[str, int, int, int]]:
    tiles, warps, per_sm = ((4096, 8192, 16384, 32768), (4, 8), (2, 4, 8)) if not quick else ((16384,), (4, 8), (4,))
    configs = []
    for schedule, tile_bytes, w in itertools.product(gather_mod.SCHEDULES, tiles, warps):
        for cps in per_sm if schedule != "flat" else (0,):  # flat: one program per tile, no per-SM cap
            configs.append((schedule, tile_bytes, w, cps))
    return configs


def _host_us(fn, calls: int) -> float:
    """Median host microseconds per call over a few batches (no synchronisation inside a batch)."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    samples.sort()
    return round(samples[len(samples) // 2], 2)


def _host_costs(table: torch.Tensor, alias: torch.Tensor) -> dict[str, float]:
    n = 1024
    ids = torch.randint(0, table.shape[0], (n,), device="cuda")
    ids_pinned = ids.cpu().pin_memory()
    out = torch.empty(n, table.shape[1], dtype=table.dtype, device="cuda")

    def miss() -> None:
        gather_mod.clear_plans()
        gather(table, out, ids, check=False)

    for _ in range(3):
        gather(table, out, ids, check=False)
        gather(table, out, ids_pinned, check=False)
    return {
        "kvstrata_plan_hit_device_ids": _host_us(lambda: gather(table, out, ids, check=False), 200),
        "kvstrata_plan_hit_pinned_host_ids": _host_us(lambda: gather(table, out, ids_pinned, check=False), 200),
        "kvstrata_plan_miss_device_ids": _host_us(miss, 50),
        "index_select_uva": _host_us(lambda: torch.index_select(alias, 0, ids, out=out), 200),
    }


def _case(table: torch.Tensor, alias: torch.Tensor, n: int, configs, iters: int, ceiling: float) -> list[dict]:
    ids = torch.randint(0, table.shape[0], (n,), device="cuda")
    out = torch.empty(n, table.shape[1], dtype=table.dtype, device="cuda")
    expected = alias.index_select(0, ids)
    nbytes = n * ROW_BYTES
    base_s = device_time(lambda: torch.index_select(alias, 0, ids, out=out), iters=iters, calls=STREAM_CALLS)
    base = {"rows": n, "schedule": "index_select_uva", "us": round(base_s * 1e6, 1), "GBps": gbps(nbytes, base_s)}
    base.update(of_ceiling=round(base["GBps"] / ceiling, 3), vs_index_select=1.0, correct=True)
    rows: list[dict[str, Any]] = [base]
    for schedule, tile_bytes, warps, cps in configs:
        gather_mod.SCHEDULE = schedule
        gather_mod.TILE = TileConfig(tile_bytes=tile_bytes, max_row_bytes=4096, num_warps=warps, ctas_per_sm=cps or 1)
        row = {"rows": n, "schedule": schedule, "tile_bytes": tile_bytes, "warps": warps, "ctas_per_sm": cps or "-"}
        try:
            out.zero_()
            gather(table, out, ids, check=False)
            torch.cuda.synchronize()
            row["correct"] = bool(torch.equal(out, expected))
            seconds = device_time(lambda: gather(table, out, ids, check=False), iters=iters, calls=STREAM_CALLS)
        except Exception as exc:  # a variant that fails to compile or launch is reported, not fatal
            row.update(correct=False, error=repr(exc)[:200])
            rows.append(row)
            continue
        row.update(us=round(seconds * 1e6, 1), GBps=gbps(nbytes, seconds))
        row["of_ceiling"] = round(row["GBps"] / ceiling, 3)
        row["vs_index_select"] = round(base_s / seconds, 3)
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="folder for tune_gather.json (default $KVSTRATA_BENCH_OUT)")
    parser.add_argument("--rows", default="1024,16384,131072", help="comma-separated row counts")
    parser.add_argument("--quick", action="store_true", help="a handful of configs (a smoke run of the tool)")
    parser.add_argument("--iters", type=int, default=10, help="timed samples per config")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tune_gather needs a CUDA GPU")
        return 2
    started = time.perf_counter()
    default = (gather_mod.SCHEDULE, gather_mod.TILE)
    table_rows = (256 << 20) // ROW_BYTES
    table = alloc_pinned(table_rows * ROW_BYTES).view(torch.float16).view(table_rows, ROW_BYTES // 2)
    alias = device_view(table)
    alias.view(torch.int16).random_(0, 30000)  # finite fp16 bit patterns, written over PCIe
    flat = table.view(-1).view(torch.uint8)[: 64 << 20]
    sink = torch.empty(flat.numel(), dtype=torch.uint8, device="cuda")
    ceil_s = device_time(lambda: sink.copy_(flat, non_blocking=True), iters=args.iters, calls=STREAM_CALLS)
    ceiling = flat.numel() / ceil_s / 1e9
    host = _host_costs(table, alias)
    configs = _sweep(args.quick)
    results: list[dict[str, Any]] = []
    try:
        for n in (int(x) for x in args.rows.split(",") if x.strip()):
            results.extend(_case(table, alias, n, configs, args.iters, ceiling))
    finally:
        gather_mod.SCHEDULE, gather_mod.TILE = default
    d_sched, d_tile = default
    for r in results:
        r["default"] = "*" if (r.get("schedule"), r.get("tile_bytes"), r.get("warps"), r.get("ctas_per_sm")) == (
            d_sched, d_tile.tile_bytes, d_tile.num_warps, d_tile.ctas_per_sm) else ""  # fmt: skip
    record = {"ceiling_gbps": round(ceiling, 2), "host_us_per_call_1024_rows": host, "results": results,
              "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    path = write_result("tune_gather", record, args.out)
    columns = ["rows", "schedule", "tile_bytes", "warps", "ctas_per_sm", "us", "GBps", "of_ceiling",
               "vs_index_select", "correct", "default"]  # fmt: skip
    for n in sorted({r["rows"] for r in results}):
        ranked = sorted((r for r in results if r["rows"] == n), key=lambda r: -r.get("GBps", 0.0))
        shown = ranked[:8] + [r for r in ranked[8:] if r["default"] or r["schedule"] == "index_select_uva"]
        print(f"\n{n} rows of {ROW_BYTES} B (ceiling {ceiling:.2f} GB/s); best first, then default and baseline:")
        print_table(shown, columns)
    print(f"\nhost us per eager call, 1,024 rows: {host}")
    bad = [r for r in results if not r.get("correct")]
    print(f"\n{len(results)} measurements, {len(bad)} incorrect or failed; {record['seconds']} s; results: {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

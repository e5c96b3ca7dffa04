"""Timeline of one mget_h2d / mset_d2h of 64 x 1 MiB through a real worker (GPU machine): for each stage,
when the host queued its copies and when the device started and finished them, relative to the call's
start, next to the call's total and the DMA ceiling. Shows whether the copy engines wait for the host.
``--profile``: then a cProfile of 20 more calls of each (top functions by own time). ``--first-stage-mib N``,
``--first-batch-runs N``: try other values of ``device.FIRST_STAGE_BYTES`` / ``device.FIRST_BATCH_RUNS``.

    PYTHONPATH=src python3 tools/trace_store_device.py [--profile] [--first-stage-mib 4] [--first-batch-runs 2]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
from _copy_trace import kept_client

import kvstrata
from kvstrata.client import device


def _option(name: str) -> int | None:
    args = sys.argv[1:]
    return int(args[args.index(name) + 1]) if name in args else None


def main() -> None:
    n, size = 64, 1 << 20
    if (mib := _option("--first-stage-mib")) is not None:
        device.FIRST_STAGE_BYTES = mib << 20
    if (runs := _option("--first-batch-runs")) is not None:
        device.FIRST_BATCH_RUNS = runs
    print(f"first stage {device.FIRST_STAGE_BYTES >> 20} MiB, first batch {device.FIRST_BATCH_RUNS} runs")
    rows: list[tuple] = []
    real = device.enqueue

    def traced(runs, dev, stream, **kw):
        t0 = time.perf_counter()
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        if stream is not None:
            e0.record(stream)
        real(runs, dev, stream, **kw)
        if stream is not None:
            e1.record(stream)
        rows.append((t0, time.perf_counter(), e0, e1, len(runs.device)))

    device.enqueue = traced
    with kept_client("k") as (kv, keys, src, dst):
        host = torch.empty(n * size, dtype=torch.uint8).pin_memory()
        big = torch.empty(n * size, dtype=torch.uint8, device="cuda")
        writer = kvstrata.connect(kv.address)
        for label, fn in (
            ("mget_h2d cached", lambda it: kv.mget_h2d(keys, dst)),
            ("mget_h2d after a rewrite", lambda it: kv.mget_h2d(keys, dst)),
            ("mget_h2d after another client's rewrite", lambda it: kv.mget_h2d(keys, dst)),
            ("mset_d2h", lambda it: kv.mset_d2h([f"p/{it}/{i}" for i in range(n)], src)),
            ("one 64 MiB copy_", lambda it: big.copy_(host, non_blocking=True)),
        ):
            totals, last = [], None
            for it in range(12):
                if label.endswith("after a rewrite"):  # the keys changed: their kept leases are stale
                    kv.delete(keys)
                    kv.mset_d2h(keys, src)
                elif label.endswith("client's rewrite"):  # written by another process (prefill, say)
                    writer.delete(keys)
                    writer.mset_d2h(keys, src)
                    writer.exists(keys[:1])  # its answer comes once the objects are visible to all
                torch.cuda.synchronize()
                rows.clear()
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                fn(it)
                if label.startswith("one"):
                    torch.cuda.synchronize()
                totals.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                last = (t0, start, list(rows))
                if label == "mset_d2h":
                    kv.delete([f"p/{it}/{i}" for i in range(n)])
            print(f"== {label}: median {statistics.median(totals[2:]) * 1e6:.0f} us "
                  f"(64 MiB at 55 GB/s: 1220 us)")  # fmt: skip
            if "--profile" in sys.argv[1:]:
                prof = cProfile.Profile()
                prof.enable()
                for it in range(100, 120):
                    fn(it)
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
                print("\n".join(out.getvalue().splitlines()[4:30]))
            t0, start, rs = last
            for h0, h1, e0, e1, nruns in rs:
                q0, q1 = (h0 - t0) * 1e6, (h1 - t0) * 1e6
                d0, d1 = start.elapsed_time(e0) * 1e3, start.elapsed_time(e1) * 1e3
                print(f"  stage, {nruns:2d} runs: host {q0:7.1f}..{q1:7.1f} us, device {d0:7.1f}..{d1:7.1f} us")


if __name__ == "__main__":
    main()

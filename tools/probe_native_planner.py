"""A kept ``mget_h2d`` and a reserved ``mset_d2h`` (fresh keys) with their copies planned by the Python loop or
natively (``kvstrata.ops.tensor_runs``; a cold read, of keys just rewritten, through the placement table's one pass
too), switched call by call in one process (GPU machine, one real worker, one client), for keys of several sizes:
64 x 1 MiB (bench store's row), 256 x 256 KiB and 256 x 64 KiB (KV-cache blocks; 256 is as many keys as the
local-read cache keeps). Each call follows a one-key request, as bench store's do; the reads go into separate
destination tensors. Per shape, case and variant: the median call against one pinned ``copy_`` of the same bytes that
way (the ceiling), and the host's time from the call's start to its first and to its last copy batch (when the DMA
can start, and when the host is done queueing). The host's loop speed before and after.

The variants (``--variants a,b,...``; default: the last four):

* ``python loop``: no native pass; ``native lists``: the passes answer their runs, queued through cuda-bindings
  (``batching.NATIVE_COPIES`` off);
* ``py lookup``: the passes queue their own copies, the placement table read in Python (``placements.NATIVE_LOOKUP``
  off), a kept read's cache lookup and the copy stream's join in Python (``local_reads.NATIVE_PREFIX``,
  ``device.NATIVE_JOIN`` off);
* ``py prefix+join``: the same with the table read natively (session 29's code);
* ``py join``: the kept read's cache lookup native too; ``all native``: the join too.

    PYTHONPATH=src python3 tools/probe_native_planner.py [--rounds 100] [--variants NAMES]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

import kvstrata
from kvstrata.bench._common import device_time, python_loop_us
from kvstrata.bench.store import _start_worker
from kvstrata.client import batching, device, local_reads
from kvstrata.ops import copy_engine, tensor_runs
from kvstrata.store import placements

SHAPES = ((64, 1 << 20), (256, 256 << 10), (256, 64 << 10))


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 100
    if tensor_runs.native(wait=True) is None:
        raise SystemExit("the native planner did not build")
    if tensor_runs.batch_entry() is None:
        raise SystemExit("the driver's cuMemcpyBatchAsync was not found")
    last_batch: list[float] = []

    def timed(fn):  # the time each batch call (or native pass that queued its own) returned
        def call(*args, **kwargs):
            got = fn(*args, **kwargs)
            last_batch.append(time.perf_counter())
            return got

        return call

    copy_engine.memcpy_raw = timed(copy_engine.memcpy_raw)
    native = types.SimpleNamespace(
        **{name: getattr(tensor_runs, name) for name in ("native", "plan", "lay_out", "CUT", "DONE", "NO_BASE")},
        plan_copy=timed(tensor_runs.plan_copy),
        lay_out_copy=timed(tensor_runs.lay_out_copy),
    )
    # (planner, whether its passes queue their own copies, whether the placement table, a kept read's cache lookup and
    # the copy stream's join go natively)
    every = {
        "python loop": (None, False, False, False, False),
        "native lists": (native, False, True, False, False),
        "py lookup": (native, True, False, False, False),
        "py prefix+join": (native, True, True, False, False),
        "py join": (native, True, True, True, False),
        "all native": (native, True, True, True, True),
    }
    names = sys.argv[sys.argv.index("--variants") + 1].split(",") if "--variants" in sys.argv else list(every)[2:]
    planners = {name: every[name] for name in names}
    loops = [python_loop_us()]
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 4 << 30)
        try:
            with kvstrata.connect(address) as kv:
                for n, size in SHAPES:
                    host = torch.empty(n * size, dtype=torch.uint8).pin_memory()
                    big = torch.empty(n * size, dtype=torch.uint8, device="cuda")
                    h2d = device_time(lambda: big.copy_(host, non_blocking=True), iters=30)
                    ceiling = {
                        "mget_h2d kept": h2d,
                        "mget_h2d cold": h2d,
                        "mset_d2h": device_time(lambda: host.copy_(big, non_blocking=True), iters=30),
                    }
                    src = [[torch.randn(size // 4, device="cuda")] for _ in range(n)]
                    dst = [[torch.empty_like(t[0])] for t in src]
                    keys = [f"np/{size}/{i}" for i in range(n)]
                    assert kv.mset_d2h(keys, src) == [None] * n
                    kv.mget_h2d(keys, dst)
                    got: dict[tuple[str, str], list[tuple[float, float]]] = {
                        (case, name): [] for case in ceiling for name in planners
                    }
                    for it in range(rounds + 3):
                        # Rotated round by round, so each variant is as often the first call after the previous
                        # case's (a fixed order reversed every other round favoured the middle ones: session 30)
                        order = list(planners.items())
                        order = order[it % len(order) :] + order[: it % len(order)]
                        for case in ceiling:
                            for name, (planner, copies, lookup, prefix, join) in order:
                                batching.planner = lambda planner=planner: planner
                                batching.NATIVE_COPIES = copies
                                placements.NATIVE_LOOKUP = lookup
                                local_reads.NATIVE_PREFIX = prefix
                                device.NATIVE_JOIN = join
                                fresh = [f"npw/{size}/{it}/{i}" for i in range(n)]
                                if case == "mget_h2d cold":  # rewritten: the placement table's one pass reads them
                                    kv.delete(keys)
                                    assert kv.mset_d2h(keys, src) == [None] * n
                                kv.exists(keys[:1])
                                torch.cuda.synchronize()
                                last_batch.clear()
                                t0 = time.perf_counter()
                                res = kv.mset_d2h(fresh, src) if case == "mset_d2h" else kv.mget_h2d(keys, dst)
                                t1 = time.perf_counter()
                                assert res == [None] * n, res
                                if case == "mset_d2h":
                                    kv.delete(fresh)
                                if it >= 3:
                                    got[(case, name)].append((t1 - t0, last_batch[0] - t0, last_batch[-1] - t0))
                    assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
                    kv.delete(keys)
                    print(f"{n} x {size >> 10} KiB: one {n * size >> 20} MiB copy H2D / D2H", end="")
                    print(f" {ceiling['mget_h2d kept'] * 1e6:.0f} / {ceiling['mset_d2h'] * 1e6:.0f} us")
                    for (case, name), rows in got.items():
                        top = ceiling[case]
                        call, first, queued = (statistics.median(c) for c in zip(*rows))
                        q1, _, q3 = statistics.quantiles([r[0] for r in rows], n=4)
                        print(
                            f"  {case:13s} {name:22s} call {call * 1e6:6.0f} us ({top / call:.3f} of the ceiling;"
                            f" quartiles {top / q3:.3f}-{top / q1:.3f}), batches queued at {first * 1e6:4.0f} /"
                            f" {queued * 1e6:5.0f} us"
                        )
        finally:
            proc.terminate()
            proc.wait()
    loops.append(python_loop_us())
    print(f"python_loop_us before / after {loops[0]:.1f} / {loops[1]:.1f}")


if __name__ == "__main__":
    main()

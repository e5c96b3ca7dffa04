"""Cold ``mget_h2d`` of 64 x 1 MiB (GPU machine), variants switched call by call so every one sees the same host
speed (the GPU host's Python speed drifts 2x between machine draws and within runs): the keys read before and
unchanged (leases kept: no request), right after this client rewrote them, and right after another client did;
each cold case with the table-first read on and off (``device_calls.TABLE_FIRST``); against one 64 MiB pinned
``copy_``. Median and quartiles of the wall time over ``--iters`` rounds, and the ratio of the copy's median to
each.

    PYTHONPATH=src python3 tools/probe_cold_ab.py [--iters 60]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvstrata
from kvstrata.bench.store import _start_worker
from kvstrata.client import device_calls

N, SIZE = 64, 1 << 20


def main() -> None:
    if not hasattr(device_calls, "TABLE_FIRST"):
        raise SystemExit("session 22 folded the table-first read into kvstrata.client.placed_reads (no switch left): "
                         "run this tool at a commit before it, e.g. 11aa0aa")  # fmt: skip
    iters = int(sys.argv[sys.argv.index("--iters") + 1]) if "--iters" in sys.argv else 60
    gpu = torch.cuda.is_available()  # without one (a smoke run): CPU tensors, and a CPU copy for the "ceiling"
    where = "cuda" if gpu else "cpu"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    host = torch.empty(N * SIZE, dtype=torch.uint8)
    host = host.pin_memory() if gpu else host
    big = torch.empty(N * SIZE, dtype=torch.uint8, device=where)
    cases = {  # name: (rewritten by, table first)
        "kept leases": (None, True),
        "own rewrite, table first": ("self", True),
        "own rewrite, stage by stage": ("self", False),
        "another client's rewrite, table first": ("other", True),
        "another client's rewrite, stage by stage": ("other", False),
        "one 64 MiB copy_": ("copy", True),
    }
    times: dict[str, list[float]] = {c: [] for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 4 << 30)
        try:
            with kvstrata.connect(address) as kv, kvstrata.connect(address) as writer:
                src = [[torch.randn(SIZE // 4, device=where)] for _ in range(N)]
                dst = [[torch.empty_like(t[0])] for t in src]
                keys = [f"cold/{i}" for i in range(N)]
                kv.mset_d2h(keys, src)
                kv.mset_d2h(["cold/reserve"], src[:1])  # this client's rewrites go through its reservation
                for it in range(iters + 3):
                    for name, (by, first) in cases.items():
                        device_calls.TABLE_FIRST = first
                        if by == "self":
                            kv.delete(keys)
                            kv.mset_d2h(keys, src)
                        elif by == "other":
                            writer.delete(keys)
                            writer.mset_d2h(keys, src)
                            writer.exists(keys[:1])  # its objects are visible to all by this answer
                        sync()
                        t0 = time.perf_counter()
                        if by == "copy":
                            big.copy_(host, non_blocking=True)
                            sync()
                        else:
                            kv.mget_h2d(keys, dst)
                        if it >= 3:
                            times[name].append(time.perf_counter() - t0)
                device_calls.TABLE_FIRST = True
                assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
        finally:
            proc.terminate()
    copy = statistics.median(times["one 64 MiB copy_"])
    print(f"{iters} rounds, each case once per round in turn; one 64 MiB copy_ {copy * 1e6:.0f} us")
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        med = statistics.median(ts)
        spread = f"({q[0] * 1e6:5.0f}..{q[2] * 1e6:5.0f})"
        print(f"{name:45s} median {med * 1e6:6.0f} us {spread}  {copy / med:.3f} of the copy")


if __name__ == "__main__":
    main()

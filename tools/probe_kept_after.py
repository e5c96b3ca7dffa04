"""A kept ``mget_h2d`` of 64 x 1 MiB (GPU machine, real worker) right after a request to the worker (its connection
thread then busy-polls for a while, as in bench store's rounds) and after 2 ms of quiet (it sleeps), switched call
by call: whether a polling worker thread slows the client's host work. Median and p90 us of each, the client on
whatever CPU the kernel gives it, then pinned to each of a few CPUs in turn.

    PYTHONPATH=src python3 tools/probe_kept_after.py [--calls 60]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvstrata
from kvstrata.bench._common import device_time
from kvstrata.bench.store import _start_worker

N, SIZE = 64, 1 << 20


def main() -> None:
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 60
    host = torch.empty(N * SIZE, dtype=torch.uint8).pin_memory()
    big = torch.empty(N * SIZE, dtype=torch.uint8, device="cuda")
    ceiling = device_time(lambda: big.copy_(host, non_blocking=True))
    print(f"one 64 MiB copy_ host to device: {ceiling * 1e6:.0f} us")
    cpus = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 2 << 30)
        try:
            with kvstrata.connect(address) as kv:
                src = [[torch.randn(SIZE // 4, device="cuda")] for _ in range(N)]
                dst = [[torch.empty_like(t[0])] for t in src]
                keys = [f"ka/{i}" for i in range(N)]
                assert kv.mset_d2h(keys, src) == [None] * N
                kv.mget_h2d(keys, dst)
                for where in ["any", *cpus[1 :: max(1, len(cpus) // 4)]]:
                    os.sched_setaffinity(0, set(cpus) if where == "any" else {where})
                    times: dict[str, list[float]] = {"after a request": [], "after 2 ms quiet": []}
                    for it in range(calls + 3):
                        for case, ts in times.items():
                            if case == "after a request":
                                kv.exists(keys[:1])
                            else:
                                time.sleep(0.002)
                            t0 = time.perf_counter()
                            kv.mget_h2d(keys, dst)
                            if it >= 3:
                                ts.append(time.perf_counter() - t0)
                    parts = []
                    for case, ts in times.items():
                        ts.sort()
                        med = statistics.median(ts)
                        parts.append(
                            f"{case} {med * 1e6:.0f} us ({ceiling / med:.3f}), p90 {ts[int(0.9 * len(ts))] * 1e6:.0f}"
                        )
                    print(f"client on cpu {where}: " + "; ".join(parts))
                os.sched_setaffinity(0, set(cpus))
        finally:
            proc.terminate()


if __name__ == "__main__":
    main()

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
import time

from _copy_trace import ceilings, kept_client


def main() -> None:
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 60
    ceiling = ceilings()["h2d"]
    print(f"one 64 MiB copy_ host to device: {ceiling * 1e6:.0f} us")
    cpus = sorted(os.sched_getaffinity(0))
    with kept_client("ka") as (kv, keys, _, dst):
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
                parts.append(f"{case} {med * 1e6:.0f} us ({ceiling / med:.3f}), p90 {ts[int(0.9 * len(ts))] * 1e6:.0f}")
            print(f"client on cpu {where}: " + "; ".join(parts))
        os.sched_setaffinity(0, set(cpus))


if __name__ == "__main__":
    main()

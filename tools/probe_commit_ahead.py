"""A reserved ``mset_d2h`` of 64 x 1 MiB through a real worker (GPU machine) with its commit ahead of the copies
while later stages are queued (``device_calls.COMMIT_AHEAD_STAGES``) on and off, switched call by call so both
see the same host: each setting's median and p90 wall time, and how long the call waited for the worker's last
commit answer after sending it (``commit_finish``), against one 64 MiB ``copy_`` device to host.

    PYTHONPATH=src python3 tools/probe_commit_ahead.py [--calls 200]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvstrata
from kvstrata.bench._common import device_time
from kvstrata.bench.store import _start_worker
from kvstrata.client import device_calls

N, SIZE = 64, 1 << 20


def main() -> None:
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 200
    settings = (0, device_calls.COMMIT_AHEAD_STAGES)
    host = torch.empty(N * SIZE, dtype=torch.uint8).pin_memory()
    big = torch.empty(N * SIZE, dtype=torch.uint8, device="cuda")
    ceiling = device_time(lambda: host.copy_(big, non_blocking=True))
    print(f"one 64 MiB copy_ device to host: {ceiling * 1e6:.0f} us; settings {settings}, {calls} calls each")
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 4 << 30)
        try:
            with kvstrata.connect(address) as kv:
                src = [[torch.randn(SIZE // 4, device="cuda")] for _ in range(N)]
                backend = kv._backend
                real_finish = backend.commit_finish
                waits: list[float] = []

                def timed_finish(token):
                    t0 = time.perf_counter()
                    try:
                        return real_finish(token)
                    finally:
                        waits.append(time.perf_counter() - t0)

                backend.commit_finish = timed_finish
                times: dict[int, list[float]] = {c: [] for c in settings}
                last_wait: dict[int, list[float]] = {c: [] for c in settings}
                for it in range(calls + 5):
                    for c in settings:
                        device_calls.COMMIT_AHEAD_STAGES = c
                        keys = [f"ca/{c}/{it}/{i}" for i in range(N)]
                        torch.cuda.synchronize()
                        waits.clear()
                        t0 = time.perf_counter()
                        assert kv.mset_d2h(keys, src) == [None] * N
                        t = time.perf_counter() - t0
                        kv.delete(keys)
                        if it >= 5:
                            times[c].append(t)
                            last_wait[c].append(waits[-1] if waits else 0.0)
        finally:
            proc.terminate()
    for c in settings:
        ts = sorted(times[c])
        med, p90 = statistics.median(ts), ts[int(0.9 * len(ts))]
        print(
            f"COMMIT_AHEAD_STAGES={c}: median {med * 1e6:.0f} us ({ceiling / med:.3f} of the copy), "
            f"p90 {p90 * 1e6:.0f} us; last commit answer waited for {statistics.median(last_wait[c]) * 1e6:.0f} us "
            f"(median)"
        )


if __name__ == "__main__":
    main()

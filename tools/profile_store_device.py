"""Where does one ``mget_h2d`` / ``mset_d2h`` of 64 x 1 MiB spend its host time? (GPU machine.)

Starts a real worker, then times each call (wall) and profiles 20 of each with cProfile; prints the
top functions by own time and by cumulative time.

    PYTHONPATH=src python3 tools/profile_store_device.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

import kvstrata
from kvstrata.bench.store import _start_worker


def main() -> None:
    n, size = 64, 1 << 20
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 4 << 30)
        try:
            with kvstrata.connect(address) as kv:
                src = [[torch.randn(size // 4, device="cuda")] for _ in range(n)]
                dst = [[torch.empty_like(t[0])] for t in src]
                keys = [f"k/{i}" for i in range(n)]
                kv.mset_d2h(keys, src)
                for _ in range(3):
                    kv.mget_h2d(keys, dst)

                def put(it: int) -> None:
                    ks = [f"p/{it}/{i}" for i in range(n)]
                    kv.mset_d2h(ks, src)

                for label, fn in (
                    ("mget_h2d cached", lambda it: kv.mget_h2d(keys, dst)),
                    ("mget_h2d after change", lambda it: (kv.set("chg", b"x"), kv.mget_h2d(keys, dst))),
                    ("mset_d2h", put),
                ):
                    walls = []
                    for it in range(10):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        fn(it)
                        walls.append(time.perf_counter() - t0)
                    prof = cProfile.Profile()
                    prof.enable()
                    for it in range(10, 30):
                        fn(it)
                    prof.disable()
                    print(
                        f"\n===== {label}: wall median {statistics.median(walls) * 1e3:.3f} ms "
                        f"(64 MiB at 54 GB/s = 1.24 ms)"
                    )
                    for key in ("tottime", "cumulative"):
                        s = io.StringIO()
                        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(25)
                        print(s.getvalue()[-6000:])
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()

"""Per-call cost of the client's batched host<->device calls through a real worker process.

    PYTHONPATH=src python bench/store_client_calls.py [--keys 64] [--sizes 4KiB,1MiB] [--iters 200] [--profile]

Starts a ``kvstrata worker`` process, then times ``mget_h2d`` and ``mset_d2h`` of ``--keys`` keys in
this process (median of ``--iters`` calls after warm-up). With CUDA the tensors are on the GPU; without
it they are CPU tensors and the copy is a memcpy, so what is left is the call's own overhead (round
trips, Python, leases). The same bytes copied by one ``torch._foreach_copy_`` (CPU) or one pinned
``copy_`` (CUDA) are timed in the same run as the floor; ``overhead_us`` is call minus floor.
``--profile`` prints a cProfile of the mget_h2d loop at the last size.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvstrata
from kvstrata.bench._common import print_table, write_result
from kvstrata.units import parse_size


def _median_us(fn, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _floor(lists_src, lists_dst, device: str) -> callable:
    src = [t for ts in lists_src for t in ts]
    dst = [t for ts in lists_dst for t in ts]
    if device == "cpu":
        return lambda: torch._foreach_copy_(dst, src)
    host = torch.empty(sum(t.numel() * t.element_size() for t in src), dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device=device)

    def copy() -> None:
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    return copy


def measure(address: str, n: int, size: int, iters: int, device: str, profile: bool) -> list[dict]:
    rows = []
    with kvstrata.connect(address, timeout=30) as kv:
        src = [[torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)] for _ in range(n)]
        keys = [f"calls/{size}/{i}" for i in range(n)]
        kv.delete(keys)
        assert kv.mset_d2h(keys, src) == [None] * n
        dst = [[torch.empty_like(t[0])] for t in src]
        get = _median_us(lambda: kv.mget_h2d(keys, dst), iters)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
        floor = _median_us(_floor(src, dst, device), iters)
        counter = iter(range(10**9))

        def put() -> None:
            ks = [f"calls/w/{next(counter)}/{i}" for i in range(n)]
            res = kv.mset_d2h(ks, src)
            assert res == [None] * n, res[:3]
            kv.delete(ks)

        # mset_d2h needs fresh keys each call (write-once): time it with the delete and subtract the delete
        delete_only = _median_us(lambda: kv.delete([f"calls/none/{i}" for i in range(n)]), iters)
        put_del = _median_us(put, iters)
        for op, t in (("mget_h2d", get), ("mset_d2h", put_del - delete_only)):
            rows.append(
                {
                    "op": op,
                    "keys": n,
                    "size": size,
                    "device": device,
                    "call_us": round(t, 1),
                    "floor_us": round(floor, 1),
                    "overhead_us": round(t - floor, 1),
                }
            )
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(iters):
                kv.mget_h2d(keys, dst)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        kv.delete(keys)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=64)
    ap.add_argument("--sizes", default="4KiB,1MiB")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="kvstrata-calls-"))
    sock = tmp / "w.sock"
    memory = max(sizes) * args.keys * 4 + (256 << 20)
    cmd = [sys.executable, "-m", "kvstrata.cli.main", "worker", "--socket", str(sock), "--memory", str(memory)]
    worker = subprocess.Popen([*cmd, "--disk-dir", "", "--log-level", "warning"])
    try:
        kvstrata.connect(f"unix://{sock}", timeout=60).close()
        rows = []
        for i, size in enumerate(sizes):
            rows += measure(f"unix://{sock}", args.keys, size, args.iters, device, args.profile and i == len(sizes) - 1)
    finally:
        worker.terminate()
        worker.wait(30)
    path = write_result("store_client_calls", {"rows": rows}, args.out)
    print(f"results: {path}")
    print_table(rows, ["op", "keys", "size", "device", "call_us", "floor_us", "overhead_us"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

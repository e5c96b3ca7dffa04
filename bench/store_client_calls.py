"""Per-call cost of the client's batched host<->device calls through a real worker process.

    PYTHONPATH=src python bench/store_client_calls.py [--keys 64] [--sizes 4KiB,1MiB] [--iters 200] [--profile]

Starts a ``kvstrata worker`` process, then times ``mget_h2d`` and ``mset_d2h`` of ``--keys`` keys in
this process (median of ``--iters`` calls after warm-up). With CUDA the tensors are on the GPU; without
it they are CPU tensors and the copy is a memcpy. ``mget_h2d`` is timed twice: keys read before and
unchanged since (their leases kept by the client: no round trip) and right after a write elsewhere
(one round trip). On the CPU the copies' own time is measured inside each call (``copy_us``, the
time in ``kvstrata.client.device.enqueue``) and ``overhead_us`` is the rest: round trips, Python,
leases. With CUDA the copies are asynchronous: ``floor_us`` is one pinned ``copy_`` of the same
bytes, timed in the same run, and ``overhead_us`` is the call minus that floor.
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
from kvstrata.client import device as client_device
from kvstrata.units import parse_size

_in_copies = [0.0]
_run = client_device.enqueue


def _timed_run(*args, **kwargs):
    t0 = time.perf_counter()
    try:
        return _run(*args, **kwargs)
    finally:
        _in_copies[0] += time.perf_counter() - t0


client_device.enqueue = _timed_run  # kvstrata.client.device_calls calls it through the module


def _median_us(fn, iters: int, warmup: int = 5) -> float:
    """Median microseconds per call (its time inside the copies is left in ``_last_copy_us``)."""
    global _last_copy_us
    for _ in range(warmup):
        fn()
    times, copies = [], []
    for _ in range(iters):
        _in_copies[0] = 0.0
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        copies.append(_in_copies[0])
    _last_copy_us = statistics.median(copies) * 1e6
    return statistics.median(times) * 1e6


_last_copy_us = 0.0


def _floor(nbytes: int, device: str) -> callable:
    """One pinned H2D ``copy_`` of ``nbytes``, host-timed with its synchronisation like the calls."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
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
        get_copy = _last_copy_us
        assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
        floor = _median_us(_floor(n * size, device), iters) if device != "cpu" else None
        # After any change on the worker the client's cached leases are void: one round trip.
        times, copies = [], []
        for _ in range(iters + 5):
            kv.set("calls/bump", b"x")
            _in_copies[0] = 0.0
            t0 = time.perf_counter()
            kv.mget_h2d(keys, dst)
            times.append(time.perf_counter() - t0)
            copies.append(_in_copies[0])
        get_rt, get_rt_copy = statistics.median(times[5:]) * 1e6, statistics.median(copies[5:]) * 1e6
        counter = iter(range(10**9))

        def put() -> None:
            ks = [f"calls/w/{next(counter)}/{i}" for i in range(n)]
            res = kv.mset_d2h(ks, src)
            assert res == [None] * n, res[:3]
            kv.delete(ks)

        # mset_d2h needs fresh keys each call (write-once): time it with the delete and subtract the delete
        delete_only = _median_us(lambda: kv.delete([f"calls/none/{i}" for i in range(n)]), iters)
        put_del = _median_us(put, iters)
        calls = (
            ("mget_h2d", get, get_copy),
            ("mget_h2d after a change", get_rt, get_rt_copy),
            ("mset_d2h", put_del - delete_only, _last_copy_us),
        )
        for op, t, copy_us in calls:
            rows.append(
                {
                    "op": op,
                    "keys": n,
                    "size": size,
                    "device": device,
                    "call_us": round(t, 1),
                    "copy_us": round(copy_us, 1) if device == "cpu" else None,
                    "floor_us": None if floor is None else round(floor, 1),
                    "overhead_us": round(t - (copy_us if device == "cpu" else floor), 1),
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
    memory = max(max(sizes) * args.keys * 16 * 2, 256 << 20)  # room for the client's cache (memory / 16)
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
    print_table(rows, ["op", "keys", "size", "device", "call_us", "copy_us", "floor_us", "overhead_us"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

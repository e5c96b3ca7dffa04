"""Where a device call's host time goes, step by step (GPU machine; CPU tensors without one): the entry and exit
of each of the client's steps in one ``mget_h2d`` of 64 x 1 MiB whose leases this client kept, and one
``mset_d2h`` of 64 fresh keys, through a real worker. Microseconds from the call's start, the median of
``--iters`` calls for each position of the steps' most common sequence.

    PYTHONPATH=src python3 tools/probe_first_copy.py [--iters 200] [--keys 64]
"""

from __future__ import annotations

import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvstrata
from kvstrata.bench.store import _start_worker
from kvstrata.client import device, device_calls, local_reads, remote, reservation
from kvstrata.client.client import Client
from kvstrata.ops import copy_engine

try:
    from kvstrata.client import kept_reads
except ImportError:  # before session 22
    kept_reads = None

marks: list[tuple[str, float]] = []


def _wrap(owner: object, name: str, label: str | None = None) -> None:
    real = getattr(owner, name)
    label = label or name
    static = isinstance(getattr(owner, "__dict__", {}).get(name), staticmethod)

    def traced(*args, **kwargs):
        marks.append((label, time.perf_counter()))
        try:
            return real(*args, **kwargs)
        finally:
            marks.append((label + " end", time.perf_counter()))

    setattr(owner, name, staticmethod(traced) if static else traced)


def _option(name: str, default: int) -> int:
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def _report(label: str, runs: list[list[tuple[str, float]]]) -> None:
    shapes = collections.Counter(tuple(m for m, _ in r) for r in runs)
    shape, count = shapes.most_common(1)[0]
    same = [r for r in runs if tuple(m for m, _ in r) == shape]
    print(f"== {label}: {count} of {len(runs)} calls took the most common path")
    for j, name in enumerate(shape):
        print(f"  {statistics.median(r[j][1] for r in same):8.1f} us  {name}")


def main() -> None:
    iters, n = _option("--iters", 200), _option("--keys", 64)
    size = 1 << 20
    cuda = torch.cuda.is_available()
    for name in ("check_key", "start", "enqueue", "mark", "stages"):
        _wrap(device, name)
    _wrap(device_calls.P, "check_keys")
    _wrap(copy_engine, "memcpy_raw")
    for name in ("acquire_start", "acquire_finish", "placement_hints", "settle", "acquire_send", "commit_start",
                 "commit_finish", "land", "linger", "mcreate_start"):  # fmt: skip
        _wrap(remote.RemoteBackend, name)
    _wrap(device_calls.DeviceCallsMixin, "_plan")
    _wrap(device_calls.DeviceCallsMixin, "_mget_h2d_queue")
    if kept_reads is not None:  # session 22 on: kept leases in one pass
        _wrap(remote.RemoteBackend, "kept_leases")
        _wrap(local_reads.LocalReads, "entries_prefix")
    if hasattr(copy_engine, "stream_wait"):
        _wrap(copy_engine, "stream_wait")
    _wrap(Client, "_release_leases")
    for name in ("take", "carve", "give"):
        _wrap(reservation.WriteReservation, name, f"reservation.{name}")
    if cuda:
        _wrap(torch.cuda.Event, "synchronize", "Event.synchronize")
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 2 << 30)
        try:
            with kvstrata.connect(address) as kv:
                where = "cuda" if cuda else "cpu"
                src = [[torch.randn(size // 4, device=where)] for _ in range(n)]
                dst = [[torch.empty_like(t[0])] for t in src]
                keys = [f"k/{i}" for i in range(n)]
                kv.mset_d2h(keys, src)
                kv.mget_h2d(keys, dst)
                reads, writes = [], []
                for it in range(iters):
                    for runs, fn in (
                        (reads, lambda: kv.mget_h2d(keys, dst)),
                        (writes, lambda: kv.mset_d2h([f"w/{it}/{i}" for i in range(n)], src)),
                    ):
                        marks.clear()
                        t0 = time.perf_counter()
                        fn()
                        t1 = time.perf_counter()
                        if it >= 10:
                            runs.append([(m, (t - t0) * 1e6) for m, t in marks] + [("return", (t1 - t0) * 1e6)])
                    kv.delete([f"w/{it}/{i}" for i in range(n)])
                _report(f"mget_h2d {n} x 1 MiB, leases kept ({where})", reads)
                _report(f"mset_d2h {n} x 1 MiB ({where})", writes)
        finally:
            proc.terminate()


if __name__ == "__main__":
    main()

"""Where a device call of 64 x 1 MiB spends the host time before its first copy batches (GPU machine, one real worker,
one client; a one-key request before each call, as bench store's rows have): ``--op kept``, a ``mget_h2d`` of keys
read before (leases kept), or ``--op mset``, a ``mset_d2h`` of fresh keys (deleted after each call). Each step the
call takes is wrapped to note when it began and ended: the key check, the lease lookup (and inside it the cache's
lookup and the look at the worker's socket), each key's tensor check and plan, the copy stream's start, each enqueue
and inside it the driver's batch call, each batch's end event (``mark``), the worker's lingering hint; where the
copies go through the native passes (``kvstrata.client.batching``), the kept path's call, the cache's native lookup
(``locations_prefix``), the passes' start (``native_copies``, the copy stream's start inside it) and each pass,
which queues its batch with the driver itself; a write's reservation take, segment address and registration check.
Printed, up to the ``--batches``-th batch queued: per step, the median of when it began (us after the call began) and
how long it took, and "gap" rows for the time between the steps (the call's own Python; 0 for steps inside others).
The wrappers cost ~0.3 us each; no CUDA event is recorded, unlike ``_copy_trace.CopyTrace``.

    PYTHONPATH=src python3 tools/probe_call_steps.py [--op kept] [--rounds 200] [--sleep-ms 0] [--batches 1]
"""

from __future__ import annotations

import collections
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _copy_trace import kept_client

from kvstrata.bench._common import python_loop_us
from kvstrata.client import batching, device, kept_reads, reservation
from kvstrata.ops import copy_engine
from kvstrata.server import protocol

Steps = list[tuple[str, float, float]]
BATCHES = ("driver batch", "native pass")  # the steps that end with a batch queued


def _timed(name: str, fn: Callable[..., Any], steps: Steps) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            steps.append((name, t, time.perf_counter()))

    return wrapper


def _arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main() -> None:
    op = _arg("--op", "kept")
    rounds, batches = int(_arg("--rounds", "200")), int(_arg("--batches", "1"))
    sleep_s = float(_arg("--sleep-ms", "0")) * 1e-3
    steps: Steps = []
    with kept_client("ks") as (kv, keys, src, dst):
        backend = kv._backend
        backend.linger = _timed("linger", backend.linger, steps)
        device.mark = _timed("mark", device.mark, steps)
        protocol.check_keys = _timed("check_keys", protocol.check_keys, steps)
        backend.kept_leases = _timed("kept_leases", backend.kept_leases, steps)
        # inside kept_leases: the cache's lookup, the look at the worker's socket
        backend._local.entries_prefix = _timed("entries_prefix", backend._local.entries_prefix, steps)
        backend._worker_there = _timed("worker_there", backend._worker_there, steps)
        backend._local.locations_prefix = _timed("locations_prefix", backend._local.locations_prefix, steps)
        for name in ("check_key", "plan", "start", "_join", "enqueue", "native_copies"):
            setattr(device, name, _timed(name, getattr(device, name), steps))
        copy_engine.memcpy_raw = _timed("driver batch", copy_engine.memcpy_raw, steps)
        # the native passes (kvstrata.client.batching): each queues its batch with the driver's call itself
        batching.NativePasses.plan = _timed("native pass", batching.NativePasses.plan, steps)
        batching.NativePasses.lay_out = _timed("native pass", batching.NativePasses.lay_out, steps)
        kept_reads.queue = _timed("kept_reads.queue", kept_reads.queue, steps)
        # a write's steps before its first pass: the reservation's take, the segment's address, the passes' start,
        # the segment's registration check
        reservation.WriteReservation.take = _timed("resv.take", reservation.WriteReservation.take, steps)
        backend.segment_address = _timed("segment_address", backend.segment_address, steps)
        passes_start = batching.NativePasses.start.__func__
        batching.NativePasses.start = classmethod(_timed("passes.start", passes_start, steps))
        kv._registrations.ensure = _timed("registrations", kv._registrations.ensure, steps)
        began: dict[str, list[float]] = collections.defaultdict(list)
        took: dict[str, list[float]] = collections.defaultdict(list)
        calls, firsts = [], []
        for it in range(rounds + 5):
            kv.exists(keys[:1])
            if sleep_s:
                time.sleep(sleep_s)
            fresh = [f"ks/{it}/{i}" for i in range(len(keys))]
            steps.clear()
            t0 = time.perf_counter()
            if op == "mset":
                assert kv.mset_d2h(fresh, src) == [None] * len(keys)
            else:
                kv.mget_h2d(keys, dst)
            t1 = time.perf_counter()
            if op == "mset":
                kv.delete(fresh)
            if it < 5:
                continue
            calls.append(t1 - t0)
            seen: collections.Counter[str] = collections.Counter()
            prev = t0
            for name, a, b in sorted(steps, key=lambda s: s[1]):
                if name in BATCHES and seen["batch"] == batches:
                    break  # up to the --batches-th batch
                seen[name] += 1
                if name in BATCHES:
                    seen["batch"] += 1
                label = f"{name} {seen[name]}" if seen[name] > 1 or name in ("check_key", "plan") else name
                took[f"gap before {label}"].append(max(0.0, a - prev))
                began[label].append(a - t0)
                took[label].append(b - a)
                prev = max(prev, b)
                if name in BATCHES and seen["batch"] == 1:
                    firsts.append(b - t0)
        torch.cuda.synchronize()
        assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
    print(f"{op}: host_loop_us {python_loop_us():.1f}; {rounds} calls, {sleep_s * 1e3:g} ms asleep before each")
    call, first = statistics.median(calls) * 1e6, statistics.median(firsts) * 1e6
    print(f"call {call:.0f} us, its first batch with the driver by {first:.0f} us (the enqueue holds the driver call)")
    for label, rows in took.items():
        at = began.get(label)
        start = f"at {statistics.median(at) * 1e6:6.1f}" if at else " " * 9
        print(f"  {label:22s} {start}  took {statistics.median(rows) * 1e6:6.1f} us")


if __name__ == "__main__":
    main()

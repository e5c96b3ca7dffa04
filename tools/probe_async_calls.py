"""Timeline of ``async_mget_h2d`` / ``async_mset_d2h`` with several calls in flight (GPU machine), as
``kvstrata bench store`` times them: 64 x 1 MiB per call, 4 calls submitted back to back, through a real
worker. Per call: the thread that ran it, when it started and returned on the host, when its copy
batches were queued (host) and ran (device, CUDA events), relative to the submission of the first call (an
async call in its two parts: its copies queued on the issuing thread, then waited for, and an ``mset_d2h``'s
objects committed, on the completion thread); then the device's idle gaps. Shows whether the copy engine
waits for the host between calls, and where. ``--tail``: also the waits of 20 us or more of the threads
running ``async_mset_d2h`` in the last round, in time order: for the connection's lock, for a stage's copies
to land (``synchronize``), and the worker requests (sent, answer read), to see what a call does between its
last copy and its return.

    PYTHONPATH=src python3 tools/probe_async_calls.py [--iters 8] [--in-flight 4] [--tail]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

import kvstrata
from kvstrata.bench.store import _start_worker
from kvstrata.client import device


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--tail", action="store_true", help="async_mset_d2h threads' waits of 20 us or more, in order")
    args = ap.parse_args()
    n, size, flight = 64, 1 << 20, args.in_flight
    batches: list[tuple] = []
    calls: list[tuple] = []
    real_enqueue = device.enqueue

    def traced(runs, dev, stream, **kw):
        h0 = time.perf_counter()
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        if stream is not None:
            e0.record(stream)
        real_enqueue(runs, dev, stream, **kw)
        if stream is not None:
            e1.record(stream)
        batches.append((threading.current_thread().name, h0, time.perf_counter(), e0, e1, len(runs.device)))

    device.enqueue = traced
    waits: list[tuple] = []  # (thread, what, host start, host end) of the --tail waits

    def timed(what: str, fn):
        def call(*a, **kw):
            h0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                h1 = time.perf_counter()
                if h1 - h0 >= 20e-6:
                    waits.append((threading.current_thread().name, what, h0, h1))

        return call

    class _TimedLock:  # the connection's lock, its waits timed
        def __init__(self, lock):
            self._lock = lock
            self.acquire, self.release, self.locked = timed("lock", lock.acquire), lock.release, lock.locked

        def __enter__(self):
            self.acquire()
            return self

        def __exit__(self, *exc):
            self._lock.release()

    class _TimedEvent:  # a stage's mark, its synchronize timed
        def __init__(self, event):
            self._event = event
            self.synchronize = timed("copies landed (synchronize)", event.synchronize)

        def __getattr__(self, name):
            return getattr(self._event, name)

    if args.tail:
        real_mark = device.mark
        device.mark = lambda stream: (lambda e: None if e is None else _TimedEvent(e))(real_mark(stream))
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 4 << 30)
        try:
            with kvstrata.connect(address) as kv:
                src = [[torch.randn(size // 4, device="cuda")] for _ in range(n)]
                keys = [f"k/{i}" for i in range(n)]
                kv.mset_d2h(keys, src)
                dsts = [[[torch.empty_like(t[0])] for t in src] for _ in range(flight)]
                real_get, real_put = kv.mget_h2d, kv.mset_d2h

                def stamped(fn, what):
                    def call(*a, **kw):
                        h0 = time.perf_counter()
                        try:
                            return fn(*a, **kw)
                        finally:
                            calls.append((what, threading.current_thread().name, h0, time.perf_counter()))

                    return call

                # the calls as a whole; an async mget_h2d's two parts (its copies queued, then waited for)
                kv.mget_h2d, kv.mset_d2h = stamped(real_get, "call"), stamped(real_put, "call")
                kv._mget_h2d_queue = stamped(kv._mget_h2d_queue, "copies queued")
                kv._complete = stamped(kv._complete, "completed")
                kv._complete_steps = stamped(kv._complete_steps, "completed")  # an async mset_d2h's second part
                kv.mget_h2d(keys, dsts[0])
                if args.tail:
                    backend = kv._backend
                    backend._lock = _TimedLock(backend._lock)
                    for name in ("mcreate_start", "mcreate_finish", "mseal_start", "mseal_finish", "commit_start",
                                 "commit_finish", "land", "tagged_reply"):  # fmt: skip
                        setattr(backend, name, timed(name, getattr(backend, name)))
                for label in ("async_mget_h2d", "async_mset_d2h"):
                    totals, last = [], None
                    for it in range(args.iters):
                        torch.cuda.synchronize()
                        batches.clear()
                        calls.clear()
                        waits.clear()
                        start = torch.cuda.Event(enable_timing=True)
                        start.record()
                        t0 = time.perf_counter()
                        if label == "async_mget_h2d":
                            futs = [kv.async_mget_h2d(keys, d) for d in dsts]
                        else:
                            fresh = [[f"p/{it}/{j}/{i}" for i in range(n)] for j in range(flight)]
                            futs = [kv.async_mset_d2h(ks, src) for ks in fresh]
                        for f in futs:
                            f.result()
                        totals.append(time.perf_counter() - t0)
                        torch.cuda.synchronize()
                        last = (t0, start, list(batches), list(calls), list(waits))
                        if label == "async_mset_d2h":
                            kv.delete([f"p/{it}/{j}/{i}" for j in range(flight) for i in range(n)])
                    dma = flight * n * size / 55e9 * 1e6
                    med = statistics.median(totals[2:]) * 1e6
                    print(f"== {label}, {flight} in flight: median {med:.0f} us per {flight} calls "
                          f"({flight} x 64 MiB at 55 GB/s: {dma:.0f} us)")  # fmt: skip
                    t0, start, bs, cs, ws = last
                    for what, th, h0, h1 in sorted(cs, key=lambda c: c[2]):
                        span = f"{(h0 - t0) * 1e6:8.1f} .. {(h1 - t0) * 1e6:8.1f} us"
                        print(f"  {what:>13} on {th[-20:]:>20}: host {span}")
                    spans = []
                    for th, h0, h1, e0, e1, nruns in bs:
                        d0, d1 = start.elapsed_time(e0) * 1e3, start.elapsed_time(e1) * 1e3
                        spans.append((d0, d1))
                        print(f"    {th[-20:]:>20} {nruns:2d} runs: host {(h0 - t0) * 1e6:8.1f}..{(h1 - t0) * 1e6:8.1f}"
                              f"  device {d0:8.1f}..{d1:8.1f}")  # fmt: skip
                    spans.sort()
                    gaps, end = [], spans[0][1] if spans else 0.0
                    for d0, d1 in spans[1:]:
                        if d0 > end + 5:
                            gaps.append((end, d0))
                        end = max(end, d1)
                    print(
                        f"  device busy from {spans[0][0]:.1f} to {end:.1f} us; idle gaps over 5 us: "
                        + (", ".join(f"{a:.0f}..{b:.0f}" for a, b in gaps) or "none")
                    )
                    if args.tail and label == "async_mset_d2h":
                        print("  waits of 20 us or more (host us from the first submission):")
                        for th, what, h0, h1 in sorted(ws, key=lambda w: w[2]):
                            print(f"    {th[-20:]:>20} {what:>28}: {(h0 - t0) * 1e6:8.1f} .. {(h1 - t0) * 1e6:8.1f}")
        finally:
            proc.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

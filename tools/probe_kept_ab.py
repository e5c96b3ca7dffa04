"""A kept ``mget_h2d`` of 64 x 1 MiB (GPU machine, one real worker, one client) under lease-lookup schedules
switched call by call, so every schedule sees the same host speed (the GPU host's vCPUs drift between ~0.55 and
full speed within seconds): where the call's chunks of kept leases end (``kept_reads.lookup_end``). Each call
follows a one-key request, as bench store's do. Per schedule: median wall time of the call against one 64 MiB
``copy_`` (the ceiling), the host's time to its first copy batch, and the copy stream's span from that batch to
its last byte (CUDA events), as fractions of the ceiling where they are times; the host's loop speed before/after.

    PYTHONPATH=src python3 tools/probe_kept_ab.py [--rounds 150]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvstrata
from kvstrata.bench._common import device_time, python_loop_us
from kvstrata.bench.store import _start_worker
from kvstrata.client import device, kept_reads
from kvstrata.ops import copy_engine

N, SIZE = 64, 1 << 20


def _ends(*cuts: int):
    """A ``lookup_end`` whose chunks end at ``cuts`` (then at the call's end)."""

    def lookup_end(looked: int, n: int) -> int:
        return min(n, next((c for c in cuts if c > looked), n))

    return lookup_end


SCHEDULES = {
    "all up front": _ends(),
    "2, 8, rest (main)": kept_reads.lookup_end,
    "2, 4, 8, 16, 32, rest": _ends(2, 4, 8, 16, 32),
    "2, rest": _ends(2),
    "2, 8, 24, rest": _ends(2, 8, 24),
}


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 150
    host = torch.empty(N * SIZE, dtype=torch.uint8).pin_memory()
    big = torch.empty(N * SIZE, dtype=torch.uint8, device="cuda")
    ceiling = device_time(lambda: big.copy_(host, non_blocking=True))
    batches: list[float] = []
    events: list[torch.cuda.Event] = []
    real_memcpy, real_mark = copy_engine.memcpy_raw, device.mark

    def traced(dsts, srcs, sizes, handle):
        batches.append(time.perf_counter())
        if not events:  # the copy stream's clock at its first batch
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.ExternalStream(handle))
            events.append(ev)
        return real_memcpy(dsts, srcs, sizes, handle)

    marks: list[torch.cuda.Event] = []

    def mark(stream):
        if stream is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            marks.append(ev)
        return real_mark(stream)

    copy_engine.memcpy_raw, device.mark = traced, mark
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 2 << 30)
        try:
            with kvstrata.connect(address) as kv:
                src = [[torch.randn(SIZE // 4, device="cuda")] for _ in range(N)]
                dst = [[torch.empty_like(t[0])] for t in src]
                keys = [f"kab/{i}" for i in range(N)]
                assert kv.mset_d2h(keys, src) == [None] * N
                kv.mget_h2d(keys, dst)
                loops = [python_loop_us()]
                got: dict[str, list[tuple[float, float, float]]] = {name: [] for name in SCHEDULES}
                for it in range(rounds + 3):
                    order = list(SCHEDULES.items())
                    if it % 2:
                        order.reverse()  # neither end of the round always first
                    for name, schedule in order:
                        kept_reads.lookup_end = schedule
                        kv.exists(keys[:1])
                        torch.cuda.synchronize()
                        batches.clear()
                        events.clear()
                        marks.clear()
                        t0 = time.perf_counter()
                        kv.mget_h2d(keys, dst)
                        t1 = time.perf_counter()
                        torch.cuda.synchronize()
                        span = events[0].elapsed_time(marks[-1]) * 1e-3
                        if it >= 3:
                            got[name].append((t1 - t0, batches[0] - t0, span))
                loops.append(python_loop_us())
                assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
                speeds = f"python_loop_us before / after {loops[0]:.1f} / {loops[1]:.1f}"
                print(f"one 64 MiB copy {ceiling * 1e6:.0f} us; {speeds}")
                for name, rows in got.items():
                    call, first, span = (statistics.median(c) for c in zip(*rows))
                    q1, _, q3 = statistics.quantiles([r[0] for r in rows], n=4)
                    print(
                        f"{name:24s} call {call * 1e6:6.0f} us ({ceiling / call:.3f} of the ceiling; quartiles"
                        f" {ceiling / q3:.3f}-{ceiling / q1:.3f}), first batch {first * 1e6:4.0f} us, stream span"
                        f" {ceiling / span:.3f}"
                    )
        finally:
            proc.terminate()


if __name__ == "__main__":
    main()

"""Where a device call's time goes beyond its DMA (GPU machine, real worker): a kept ``mget_h2d``, one right after
this client rewrote its keys (cold: the placement table's one pass) and a fresh ``mset_d2h`` of 64 x 1 MiB, each
after a one-key request as in bench store. Each call is split into the host's time to its first copy batch, to its
last batch, the copy stream's span from its first batch to its last byte (CUDA events: one recorded before the
first batch, one beside each of the call's marks), and the call's return. Medians over ``--calls`` calls, beside
one 64 MiB copy (the ceiling) and the host's loop speed (``python_loop_us``) before and after.

    PYTHONPATH=src python3 tools/probe_kept_split.py [--calls 100]
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
from kvstrata.client import device
from kvstrata.ops import copy_engine

N, SIZE = 64, 1 << 20


def main() -> None:
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 100
    host = torch.empty(N * SIZE, dtype=torch.uint8).pin_memory()
    big = torch.empty(N * SIZE, dtype=torch.uint8, device="cuda")
    h2d = device_time(lambda: big.copy_(host, non_blocking=True))
    d2h = device_time(lambda: host.copy_(big, non_blocking=True))
    print(f"one 64 MiB copy: host to device {h2d * 1e6:.0f} us, device to host {d2h * 1e6:.0f} us")
    batches: list[float] = []
    events: list[torch.cuda.Event] = []
    real = copy_engine.memcpy_raw

    def traced(dsts, srcs, sizes, handle):
        if not events:  # the copy stream's clock at its first batch
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.ExternalStream(handle))
            events.append(ev)
        # After the event (until session 23 before it: the event's own ~20-35 us then counted as time after the
        # last byte, call - first batch - span)
        batches.append(time.perf_counter())
        return real(dsts, srcs, sizes, handle)

    copy_engine.memcpy_raw = traced
    marks: list[torch.cuda.Event] = []
    real_mark = device.mark

    def mark(stream):  # the call's marks: the last one follows every copy of the call
        if stream is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            marks.append(ev)
        return real_mark(stream)

    device.mark = mark
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 2 << 30)
        try:
            with kvstrata.connect(address) as kv:
                src = [[torch.randn(SIZE // 4, device="cuda")] for _ in range(N)]
                dst = [[torch.empty_like(t[0])] for t in src]
                keys = [f"ks/{i}" for i in range(N)]
                assert kv.mset_d2h(keys, src) == [None] * N
                kv.mget_h2d(keys, dst)
                loops = [python_loop_us()]
                rows: dict[str, list[tuple[float, ...]]] = {"mget_h2d kept": [], "mget_h2d cold": [], "mset_d2h": []}
                for it in range(calls + 3):
                    for case, out in rows.items():
                        fresh = [f"kw/{it}/{i}" for i in range(N)]
                        if case == "mget_h2d cold":  # rewritten by this client: the placement table's one pass
                            kv.delete(keys)
                            assert kv.mset_d2h(keys, src) == [None] * N
                        kv.exists(keys[:1])  # a request just before the call, as in bench store
                        torch.cuda.synchronize()
                        batches.clear()
                        events.clear()
                        marks.clear()
                        t0 = time.perf_counter()
                        if case == "mset_d2h":
                            kv.mset_d2h(fresh, src)
                        else:
                            kv.mget_h2d(keys, dst)
                        t1 = time.perf_counter()
                        torch.cuda.synchronize()
                        span = events[0].elapsed_time(marks[-1]) * 1e3 if events and marks else float("nan")
                        if case == "mset_d2h":
                            kv.delete(fresh)
                        if it >= 3:
                            out.append(((batches[0] - t0) * 1e6, (batches[-1] - t0) * 1e6, span, (t1 - t0) * 1e6))
                loops.append(python_loop_us())
                print(f"python_loop_us before / after: {loops[0]:.1f} / {loops[1]:.1f}")
                for case, out in rows.items():
                    first, last, span, total = (statistics.median(c) for c in zip(*out))
                    ceiling = h2d if case.startswith("mget") else d2h
                    print(
                        f"{case}: first batch at {first:.0f} us, last batch at {last:.0f}, copy stream busy {span:.0f}"
                        f" from the first batch, call {total:.0f} ({ceiling * 1e6 / total:.3f} of the ceiling;"
                        f" the stream's span {ceiling * 1e6 / span:.3f})"
                    )
        finally:
            proc.terminate()


if __name__ == "__main__":
    main()

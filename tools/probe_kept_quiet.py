"""Where a kept ``mget_h2d`` of 64 x 1 MiB loses time after the client was quiet (GPU machine, one real worker, one
client). Session 21 and 24's ``probe_kept_after`` found such a call 50-100 us slower after 2 ms of sleep than right
after a request; this tells the host's share from the device's. Before each call, switched call by call (so each sees
the same host speed):

* ``request``: a one-key request (the worker's and the client's threads poll for a while after it);
* ``sleep``: 2 ms asleep (the client's vCPU may idle; the GPU and its link idle too);
* ``busy``: 2 ms of a busy loop in Python (the vCPU runs; the GPU and its link idle);
* ``sleep + dma``: 2 ms asleep while the copy engine moves 32 MiB host to device, ending just before the call (the GPU
  and its link busy, the vCPU idle).

Per case, medians: the call, the host's time to its first copy batch, the copy stream's span from that batch to the
last byte (``tools/_copy_trace.CopyTrace``), and what is left after the last byte.

    PYTHONPATH=src python3 tools/probe_kept_quiet.py [--rounds 100]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from _copy_trace import SIZE, CopyTrace, ceilings, kept_client

QUIET_S = 2e-3


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 100
    ceiling = ceilings()["h2d"]
    host = torch.empty(32 * SIZE, dtype=torch.uint8).pin_memory()
    big = torch.empty(32 * SIZE, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    trace = CopyTrace()
    with kept_client("kq") as (kv, keys, src, dst):

        def dma_then_sleep() -> None:
            with torch.cuda.stream(side):
                big.copy_(host, non_blocking=True)  # ~0.6 ms of DMA at 55 GB/s: it ends inside the sleep
            time.sleep(QUIET_S)
            side.synchronize()

        cases = {
            "request": lambda: kv.exists(keys[:1]),
            "sleep": lambda: time.sleep(QUIET_S),
            "busy": lambda: _busy(QUIET_S),
            "sleep + dma": dma_then_sleep,
        }
        got: dict[str, list[tuple[float, float, float, float]]] = {c: [] for c in cases}
        for it in range(rounds + 3):
            order = list(cases.items())
            if it % 2:
                order.reverse()
            for name, before in order:
                torch.cuda.synchronize()
                before()
                trace.clear()
                t0 = time.perf_counter()
                kv.mget_h2d(keys, dst)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                first, span = trace.batches[0] - t0, trace.span()
                if it >= 3:
                    got[name].append((t1 - t0, first, span, t1 - t0 - first - span))
        assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
        print(f"one 64 MiB copy {ceiling * 1e6:.0f} us; {rounds} calls per case")
        for name, rows in got.items():
            call, first, span, after = (statistics.median(c) * 1e6 for c in zip(*rows))
            print(
                f"{name:12s} call {call:5.0f} us ({ceiling * 1e6 / call:.3f} of the ceiling), first batch {first:4.0f},"
                f" span {span:5.0f}, after the last byte {after:4.0f}"
            )


if __name__ == "__main__":
    main()

"""The end of a kept ``mget_h2d`` of 64 x 1 MiB (GPU machine, one real worker, one client): how long after its last
byte lands the call returns, with the wait for the copies' end event done three ways, switched call by call (so each
sees the same host speed): torch's ``Event.synchronize`` (what the client does), a Python loop on ``Event.query``,
and the runtime's ``cudaEventSynchronize`` on the raw handle (cuda-bindings). Per call: the host's time to its first
copy batch, the copy stream's span from that batch to the last byte (CUDA events), when the wait began and ended,
and the call's return. The last byte's host time is taken as first batch + span (the span's first event is recorded
just before the first batch is handed to the driver), so "wake" = wait's end - that, "after" = return - wait's end.
Medians per way; each call follows a one-key request, as bench store's do.

    PYTHONPATH=src python3 tools/probe_kept_tail.py [--rounds 150]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from _copy_trace import CopyTrace, ceilings, kept_client

from kvstrata.bench._common import python_loop_us


def _runtime_sync():
    from cuda.bindings import runtime

    def wait(event: torch.cuda.Event) -> None:
        err = runtime.cudaEventSynchronize(event.cuda_event)[0]
        assert not err, err

    return wait


def _query_loop(event: torch.cuda.Event) -> None:
    while not event.query():
        pass


WAYS = {"Event.synchronize": torch.cuda.Event.synchronize, "query loop": _query_loop}


class _Timed:
    """The call's end event, waited for the chosen way, with the wait's start and end times noted."""

    def __init__(self, event: torch.cuda.Event, wait, log: list[float]) -> None:
        self.event, self.wait, self.log = event, wait, log

    def synchronize(self) -> None:
        self.log.append(time.perf_counter())
        self.wait(self.event)
        self.log.append(time.perf_counter())

    def query(self) -> bool:
        return self.event.query()


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 150
    try:
        WAYS["cudaEventSynchronize"] = _runtime_sync()
    except ImportError:
        print("no cuda-bindings: two ways only")
    ceiling = ceilings()["h2d"]
    waits: list[float] = []
    way = [WAYS["Event.synchronize"]]
    trace = CopyTrace(wrap=lambda ev: _Timed(ev, way[0], waits))
    with kept_client("kt") as (kv, keys, src, dst):
        loops = [python_loop_us()]
        got: dict[str, list[tuple[float, ...]]] = {name: [] for name in WAYS}
        for it in range(rounds + 3):
            order = list(WAYS.items())
            if it % 2:
                order.reverse()
            for name, wait in order:
                way[0] = wait
                kv.exists(keys[:1])
                torch.cuda.synchronize()
                trace.clear()
                waits.clear()
                t0 = time.perf_counter()
                kv.mget_h2d(keys, dst)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                first = trace.batches[0]
                last_byte = first + trace.span()
                if it >= 3:
                    got[name].append(
                        (t1 - t0, first - t0, trace.span(), waits[0] - t0, waits[-1] - last_byte, t1 - waits[-1])
                    )
        loops.append(python_loop_us())
        assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
        speeds = f"python_loop_us before / after {loops[0]:.1f} / {loops[1]:.1f}"
        print(f"one 64 MiB copy {ceiling * 1e6:.0f} us; {speeds}")
        for name, rows in got.items():
            call, first, span, wait_from, wake, after = (statistics.median(c) * 1e6 for c in zip(*rows))
            print(
                f"{name:22s} call {call:5.0f} us ({ceiling * 1e6 / call:.3f} of the ceiling), first batch"
                f" {first:4.0f}, span {span:5.0f}, wait from {wait_from:5.0f}, wake {wake:4.0f},"
                f" after {after:4.0f}"
            )


if __name__ == "__main__":
    main()

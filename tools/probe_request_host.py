"""Host cost of each step of one eager ``transfer_blocks`` request (1 block x 32 layers x K/V of 16 KiB), on
the GPU machine: each step timed alone over many calls (no profiler inflation), beside the whole call.

    PYTHONPATH=src python3 tools/probe_request_host.py
"""

from __future__ import annotations

import cProfile
import importlib
import io
import pstats
import statistics
import time

import torch

from kvstrata.bench.transfer import Setup
from kvstrata.ops import _transfer_plan as P

TB = importlib.import_module("kvstrata.ops.transfer_blocks")  # the package re-exports the function by that name


def timed(label: str, fn, iters: int = 3000) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) / iters)
        torch.cuda.synchronize()
    us = statistics.median(samples) * 1e6
    print(f"{label:60s} {us:7.2f} us")
    return us


def host_per_call(label: str, fn, iters: int = 400) -> None:
    """Host time of isolated calls (the device drained between them, outside the timing), then a cProfile
    of the same loop: what one request's call costs, not a queue's throughput."""
    ts = []
    for i in range(iters + 50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if i >= 50:
            ts.append(time.perf_counter() - t0)
    print(f"{label:60s} {statistics.median(ts) * 1e6:7.2f} us per isolated call (host)")
    prof = cProfile.Profile()
    for _ in range(iters):
        torch.cuda.synchronize()
        prof.enable()
        fn()
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    print("\n".join(out.getvalue().splitlines()[6:24]))


def main() -> None:
    dev = torch.device("cuda:0")
    s = Setup(32, 16 * 1024, 64 * 16 * 1024)
    for method, host_ids in (("zero_copy", "device ids"), ("auto", "device ids")):
        d_ids, h_ids = (x[:1] for x in s.ids("zero_copy"))
        for direction in ("d2h", "h2d"):
            timed(
                f"transfer_blocks {method} {direction} ({host_ids})",
                lambda m=method, d=direction: TB.transfer_blocks(
                    s.layout, s.pool, d_ids, h_ids, direction=d, method=m, check=False
                ),
                iters=1000,
            )
    d_ids, h_ids = (x[:1] for x in s.ids("zero_copy"))
    for method in ("zero_copy", "auto"):
        host_per_call(
            f"{method} d2h",
            lambda m=method: TB.transfer_blocks(s.layout, s.pool, d_ids, h_ids, direction="d2h", method=m, check=False),
        )
    cpu_ids = [int(s.dev_ids[0])], [0]
    timed("transfer_blocks zero_copy d2h (host list ids)",
          lambda: TB.transfer_blocks(s.layout, s.pool, *cpu_ids, direction="d2h", method="zero_copy", check=False),
          iters=1000)  # fmt: skip
    stream = torch.cuda.current_stream()
    ev = torch.cuda.Event()
    timed("torch.cuda.current_device()", torch.cuda.current_device)
    timed("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing)
    timed("torch._C._cuda_isCurrentStreamCapturing()", torch._C._cuda_isCurrentStreamCapturing)
    timed("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev))
    timed("torch._C._cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0))
    timed("Event.record(stream)", lambda: ev.record(stream))
    timed("Event.query()", ev.query)
    timed("_eager_ids(device tensor) x2", lambda: (TB._eager_ids(d_ids, "a"), TB._eager_ids(h_ids, "b")))
    lane = P.lane(dev, "d2h")

    def lane_cycle():
        k = lane.acquire()
        lane.mark(k, stream, "zero_copy")

    timed("lane.acquire + lane.mark", lane_cycle)
    timed("P.other_direction_method", lambda: P.other_direction_method(dev, "d2h"))
    timed(
        "_kernel_ids(device tensor) x2",
        lambda: (
            TB._kernel_ids(d_ids, "a", None, None, 0, dev, False),
            TB._kernel_ids(h_ids, "b", None, None, 1, dev, False),
        ),
    )
    plan = next(p for p in P._plans.values() if p.method == "zero_copy" and p.direction == "d2h")
    d = TB._kernel_ids(d_ids, "a", None, None, 0, dev, False)
    h = TB._kernel_ids(h_ids, "b", None, None, 1, dev, False)
    timed("plan.launch (direct Triton runner)", lambda: plan.launch(d, h, s.layout.seg_ptr_table))
    timed("plan.usable", lambda: plan.usable(s.pool.tensor, TB.registry_generation()))
    timed("torch.cuda.synchronize() idle", torch.cuda.synchronize)


if __name__ == "__main__":
    main()

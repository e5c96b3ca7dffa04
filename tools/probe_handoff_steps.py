"""The host cost of each primitive on the 4 KiB hand-off's path, one process, median of many calls.

``tools/probe_handoff.py --trace`` shows where a hand-off's time goes step by step; this prints what the
primitives under those steps cost alone on this host (CUDA calls, the export cache, packing, a datagram),
so a step far above its primitives is kvstrata's own overhead and one near them is the host's. Also a
plain-Python loop as a speed index, to compare hosts (run it with ``--cpu-only`` on a machine without a GPU).

    PYTHONPATH=src python3 tools/probe_handoff_steps.py [--reps 2000] [--cpu-only]
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable

import msgpack


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median microseconds of one ``fn()`` over ``reps`` calls (after 50 untimed)."""
    for _ in range(50):
        fn()
    out = []
    clock = time.perf_counter
    for _ in range(reps):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return statistics.median(out) * 1e6


def host_rows(reps: int) -> dict[str, float]:
    ring: collections.deque = collections.deque(maxlen=4096)

    def loop() -> None:
        for _ in range(1000):
            pass

    def stamp() -> None:
        ring.append((time.perf_counter(), threading.current_thread().name, "step"))

    record = {"key": "k", "tensors": [{"shape": [4096], "dtype": "uint8"}], "handles": [{"handle": bytes(64)}]}
    shared = msgpack.packb(record)
    a = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"\0kvstrata-steps/{os.getpid()}".encode()
    a.bind(name)
    b = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    payload = msgpack.packb((1, "k", "t1", shared))

    def datagram() -> None:
        b.sendto(payload, name)
        a.recv(4096)

    return {
        "python loop of 1000 (host speed index)": timed(loop, reps),
        "trace stamp": timed(stamp, reps),
        "msgpack.packb of an offer": timed(lambda: msgpack.packb((1, "k", "t1", shared)), reps),
        "msgpack.unpackb of an offer": timed(lambda: msgpack.unpackb(payload), reps),
        "unix datagram send + recv (one process)": timed(datagram, reps),
    }


def gpu_rows(reps: int) -> dict[str, float]:
    import torch

    from kvstrata.devobj._core import specs_of
    from kvstrata.devobj.ipc import export_tensor
    from kvstrata.ops import current_stream
    from kvstrata.ops.copy_engine import memcpy_raw

    torch.cuda.set_device(0)
    src = torch.zeros(4096, dtype=torch.uint8, device=0)
    dst = torch.empty_like(src)
    side = torch.cuda.Stream(0)
    ev = torch.cuda.Event()
    torch.cuda.synchronize()
    handle = side.cuda_stream
    sp, dp = src.data_ptr(), dst.data_ptr()
    export_tensor(src)

    def memcpy_and_poll() -> None:
        memcpy_raw([dp], [sp], [4096], handle)
        while not side.query():
            pass

    def torch_copy_and_poll() -> None:
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        while not side.query():
            pass

    def torch_copy_call() -> None:
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)

    rows = {
        "ops.current_stream(0)": timed(lambda: current_stream(0), reps),
        "torch.cuda.current_stream(0)": timed(lambda: torch.cuda.current_stream(0), reps),
        "stream.query() (idle)": timed(side.query, reps),
        "event.record + event.query": timed(lambda: (ev.record(side), ev.query()), reps),
        "export_tensor (cache hit)": timed(lambda: export_tensor(src), reps),
        "specs_of (cached)": timed(lambda: specs_of([src]), reps),
        "memcpy_raw 4 KiB call (same GPU)": timed(lambda: memcpy_raw([dp], [sp], [4096], handle), reps),
        "memcpy_raw 4 KiB + stream poll (same GPU)": timed(memcpy_and_poll, reps),
        "torch copy_ 4 KiB call on a side stream": timed(torch_copy_call, reps),
        "torch copy_ 4 KiB + stream poll": timed(torch_copy_and_poll, reps),
    }
    side.synchronize()
    if torch.cuda.device_count() > 1:
        far = torch.empty(4096, dtype=torch.uint8, device=1)
        torch.cuda.synchronize(1)
        with torch.cuda.device(1):
            s1 = torch.cuda.Stream(1)
            h1, fp = s1.cuda_stream, far.data_ptr()
            # the peer pull of the hand-off GPU0 -> GPU1 (peer access enabled by torch's first copy)
            far.copy_(src)
            rows["memcpy_raw 4 KiB call (GPU0 -> GPU1, pulled by GPU1)"] = timed(
                lambda: memcpy_raw([fp], [sp], [4096], h1), reps
            )
            s1.synchronize()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--cpu-only", action="store_true", help="the host rows only (no GPU)")
    args = ap.parse_args()
    rows = host_rows(args.reps)
    if not args.cpu_only:
        rows.update(gpu_rows(args.reps))
    print(f"median us per call, {args.reps} calls, pid {os.getpid()}")
    for name, us in rows.items():
        print(f"{us:10.2f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

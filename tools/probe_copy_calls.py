"""Host cost of the calls that queue a device call's copies (GPU machine): cuda-bindings' batch call as the
client uses it (``copy_engine.memcpy_raw``), the same runtime calls through ctypes on the process's own
libcudart, one ``cudaMemcpyAsync`` per run, the client's whole ``device.enqueue`` and ``device.start`` (since
session 21 its record and wait go by raw handle: ``copy_engine.stream_wait``, timed alone too).
Median microseconds of host time per call, the stream drained before each (so each call finds the copy
engine idle, as a call's first stage does).

    PYTHONPATH=src python3 tools/probe_copy_calls.py [--iters 300]
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time

import torch

from kvstrata.client import device
from kvstrata.ops import copy_engine


def _cudart() -> ctypes.CDLL:
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    if not paths:
        raise SystemExit("no libcudart mapped in this process (torch links it statically?)")
    return ctypes.CDLL(sorted(paths)[0])


class _Attrs(ctypes.Structure):
    _fields_ = [("order", ctypes.c_int), ("src", ctypes.c_int * 2), ("dst", ctypes.c_int * 2), ("flags", ctypes.c_uint)]


def main() -> None:
    iters = int(sys.argv[sys.argv.index("--iters") + 1]) if "--iters" in sys.argv else 300
    torch.cuda.init()
    size, most = 1 << 20, 16
    host = torch.empty((most + 1) * size, dtype=torch.uint8).pin_memory()  # room for the runs' 4 KiB shifts
    dev = torch.empty(most * size, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    handle = stream.cuda_stream
    rt = _cudart()
    version = ctypes.c_int()
    rt.cudaRuntimeGetVersion(ctypes.byref(version))
    print(f"libcudart {version.value}, torch {torch.__version__}")
    attrs = _Attrs(1, (0, 0), (0, 0), 0)  # srcAccessOrder = stream
    idx = (ctypes.c_size_t * 1)(0)
    batch = rt.cudaMemcpyBatchAsync
    one = rt.cudaMemcpyAsync
    one.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    if version.value >= 13000:
        batch.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                  ctypes.c_void_p]  # fmt: skip
        tail: tuple = ()
    else:  # 12.8-12.9: a failIdx before the stream
        batch.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                  ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
        tail = (ctypes.byref(ctypes.c_size_t()),)
    arrays = (ctypes.c_uint64 * most)()
    arrays2 = (ctypes.c_uint64 * most)()
    sizes = (ctypes.c_size_t * most)()
    attrs_p, idx_p = ctypes.addressof(attrs), ctypes.addressof(idx)

    def ctypes_batch(dsts: list[int], srcs: list[int], szs: list[int]) -> None:
        n = len(szs)
        arrays[:n] = dsts
        arrays2[:n] = srcs
        sizes[:n] = szs
        err = batch(arrays, arrays2, sizes, n, attrs_p, idx_p, 1, *tail, handle)
        if err:
            raise RuntimeError(f"cudaMemcpyBatchAsync: {err}")

    def ctypes_loop(dsts: list[int], srcs: list[int], szs: list[int]) -> None:
        for d, s, z in zip(dsts, srcs, szs):
            if one(d, s, z, 4, handle):
                raise RuntimeError("cudaMemcpyAsync")

    def timed(fn, *args) -> float:
        ts = []
        for _ in range(iters):
            stream.synchronize()
            t0 = time.perf_counter()
            fn(*args)
            ts.append(time.perf_counter() - t0)
        stream.synchronize()
        return statistics.median(ts[20:]) * 1e6

    hp, dp = host.data_ptr(), dev.data_ptr()
    with torch.cuda.stream(stream):
        for n in (1, 2, 4, 16):
            dsts, srcs, szs = [dp + i * size for i in range(n)], [hp + i * size for i in range(n)], [size] * n
            raw = timed(copy_engine.memcpy_raw, dsts, srcs, szs, handle)
            cb = timed(ctypes_batch, dsts, srcs, szs) if n > 1 else float("nan")
            cl = timed(ctypes_loop, dsts, srcs, szs)
            runs = device.new_runs()
            for i in range(n):
                device.plan([(dp + i * size, size, True, dev, 0)], hp + i * size + (i * 4096), False, runs, 0)
            enq = timed(device.enqueue, runs, dev.device, stream)
            print(f"{n:2d} runs of 1 MiB: memcpy_raw {raw:6.1f} us, ctypes batch {cb:6.1f}, "
                  f"ctypes one per run {cl:6.1f}, device.enqueue ({len(runs.device)} runs) {enq:6.1f}")  # fmt: skip
    event = torch.cuda.Event()
    ev = ctypes.c_void_p(event.cuda_event) if event.cuda_event else None
    start = timed(device.start, dev.device, None)
    print(f"device.start: {start:.1f} us")
    if ev is None:
        event.record(stream)
        ev = ctypes.c_void_p(event.cuda_event)
    rec, wait = rt.cudaEventRecord, rt.cudaStreamWaitEvent
    rec.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    cur = torch.cuda.current_stream().cuda_stream

    def raw_start() -> None:
        rec(ev, cur)
        wait(handle, ev, 0)

    print(f"ctypes cudaEventRecord + cudaStreamWaitEvent: {timed(raw_start):.1f} us")
    if hasattr(copy_engine, "stream_wait"):
        waited = timed(copy_engine.stream_wait, ev.value, cur, handle)
        print(f"copy_engine.stream_wait (cuda-bindings cudaEventRecord + cudaStreamWaitEvent): {waited:.1f} us")
    print(f"torch.cuda.current_device(): {timed(torch.cuda.current_device):.2f} us")


if __name__ == "__main__":
    main()

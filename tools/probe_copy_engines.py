"""Does spreading a device call's copy batches over several streams (copy engines) shorten its DMA (GPU machine)?

A 64 x 1 MiB ``mget_h2d`` / ``mset_d2h`` moves its bytes as 64 descriptors in batches of 2, 4, 8, 16, 16, 16, 2
(``kvstrata.client.kept_reads``) on one copy stream. Its stream span runs 2-4% over one 64 MiB copy (session 22-24),
partly per-descriptor cost on the copy engine. This times, from a ``cudaHostRegister`` ed range (as the worker's
segments are) to 64 separate 1 MiB device tensors (as the bench's), with CUDA events around the issue (span) and the
host's clock to the end of a synchronize (wall), round by round:

- ``one 64 MiB copy``: the pinned ceiling, as the bench measures it (torch ``copy_``);
- ``64 runs, 1 stream``: the kept read's batches on one stream (what the client does now);
- ``64 runs, 2 streams`` / ``3 streams``: the same batches dealt to the streams in turn;
- ``64 runs, 1 batch``: one ``cudaMemcpyBatchAsync`` of all 64;
- ``2 x 32 MiB, 2 streams``: the ceiling split over two streams (is one copy engine the limit?).

Both directions. Medians of ``--iters`` rounds in us, and of the ceiling.

    PYTHONPATH=src python3 tools/probe_copy_engines.py [--iters 100]
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import statistics
import sys
import time

import torch

from kvstrata.memory import register, unregister
from kvstrata.ops import copy_engine

SIZE = 1 << 20
N = 64
CUTS = (2, 4, 8, 16, 16, 16, 2)  # the kept read's batches of 64 runs


def batches(runs: list[tuple[int, int, int]], cuts: tuple[int, ...]) -> list[list[tuple[int, int, int]]]:
    out, k = [], 0
    for c in cuts:
        out.append(runs[k : k + c])
        k += c
    assert k == len(runs)
    return out


def engines() -> object:
    """The device's copy engines as CUDA reports them (cudaDevAttrAsyncEngineCount), or '?'."""
    try:
        from cuda.bindings import runtime as rt

        err, count = rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrAsyncEngineCount, 0)
        return count if not int(err) else "?"
    except Exception as exc:  # a probe: say what failed
        return f"? ({exc})"


def main() -> None:
    iters = int(sys.argv[sys.argv.index("--iters") + 1]) if "--iters" in sys.argv else 100
    torch.cuda.init()
    region = mmap.mmap(-1, N * SIZE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    register(base, N * SIZE)
    ctypes.memset(base, 1, N * SIZE)
    tensors = [torch.empty(SIZE // 4, device="cuda") for _ in range(N)]
    pinned = torch.empty(N * SIZE, dtype=torch.uint8).pin_memory()
    flat = torch.empty(N * SIZE, dtype=torch.uint8, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(3)]
    caller = torch.cuda.current_stream()
    print(f"device: {torch.cuda.get_device_name()}, async engines: {engines()}")

    def runs(to_host: bool) -> list[tuple[int, int, int]]:
        out = []
        for i, t in enumerate(tensors):
            host, dev = base + i * SIZE, t.data_ptr()
            out.append((host, dev, SIZE) if to_host else (dev, host, SIZE))
        return out

    def issue(parts: list[list[tuple[int, int, int]]], n_streams: int) -> list[torch.cuda.Stream]:
        used = streams[:n_streams]
        for s, part in zip(itertools.cycle(used), parts):
            d, s_, z = zip(*part)
            copy_engine.memcpy_raw(list(d), list(s_), list(z), s.cuda_stream)
        return used

    def case(to_host: bool, n_streams: int, cuts: tuple[int, ...]):
        parts = batches(runs(to_host), cuts)
        return lambda: issue(parts, n_streams)

    def halves(to_host: bool):
        half = N * SIZE // 2
        parts = [[(base + k * half, flat.data_ptr() + k * half, half)] if to_host
                 else [(flat.data_ptr() + k * half, base + k * half, half)] for k in range(2)]  # fmt: skip
        return lambda: issue(parts, 2)

    cases: dict[str, object] = {}
    for to_host, name in ((False, "h2d"), (True, "d2h")):
        cases[f"{name}: one 64 MiB copy"] = (
            (lambda: (pinned.copy_(flat, non_blocking=True), [])[1])
            if to_host
            else (lambda: (flat.copy_(pinned, non_blocking=True), [])[1])
        )
        cases[f"{name}: 64 runs, 1 stream"] = case(to_host, 1, CUTS)
        cases[f"{name}: 64 runs, 2 streams"] = case(to_host, 2, CUTS)
        cases[f"{name}: 64 runs, 3 streams"] = case(to_host, 3, CUTS)
        cases[f"{name}: 64 runs, 1 batch"] = case(to_host, 1, (64,))
        cases[f"{name}: 2 x 32 MiB, 2 streams"] = halves(to_host)
    spans: dict[str, list[float]] = {c: [] for c in cases}
    walls: dict[str, list[float]] = {c: [] for c in cases}
    for it in range(iters + 3):
        for name, fn in cases.items():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(caller)
            for s in streams:
                s.wait_event(start)
            t0 = time.perf_counter()
            used = fn()
            for s in used:
                caller.wait_stream(s)
            end.record(caller)
            end.synchronize()
            t1 = time.perf_counter()
            if it >= 3:
                spans[name].append(start.elapsed_time(end) * 1e3)
                walls[name].append((t1 - t0) * 1e6)
    for direction in ("h2d", "d2h"):
        ceiling = statistics.median(spans[f"{direction}: one 64 MiB copy"])
        for name in cases:
            if not name.startswith(direction):
                continue
            sp = sorted(spans[name])
            q = len(sp) // 10
            med, wall = statistics.median(sp), statistics.median(walls[name])
            print(f"{name:32s} span {med:7.1f} us (p10 {sp[q]:7.1f}, p90 {sp[-q - 1]:7.1f}; "
                  f"{ceiling / med:.3f} of the ceiling), wall {wall:7.1f}")  # fmt: skip
    unregister(base)


if __name__ == "__main__":
    main()

"""Would the store's device calls gain from staging? 64 x 1 MiB between registered 4 KiB-page host memory
(like a worker's shared segment as a client registers it) and 64 separately allocated CUDA tensors, timed
from an idle device, host issue included (median of 20):

* ``batched``: today's way, ``cudaMemcpyBatchAsync`` of one descriptor per tensor (2, then 16s);
* ``batched, one tensor``: the same into 64 slices of one allocation;
* ``staged``: one DMA of the contiguous host range into a device buffer, then one ``torch._foreach_copy_``
  scattering it into the tensors (H2D; gathering before the DMA for D2H);
* ``staged x4``: the same in 4 pieces of 16 MiB on two streams (DMA of piece k+1 beside the scatter of k);
* ``one copy``: one 64 MiB DMA between the host range and one tensor (the ceiling).

    PYTHONPATH=src python3 tools/probe_store_staging.py
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import statistics
import time

import torch

from kvstrata.client import device as D
from kvstrata.memory import register

N, SIZE, PIECES = 64, 1 << 20, 4


def wall(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    mm = mmap.mmap(-1, N * SIZE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    register(addr, N * SIZE)
    host = torch.frombuffer(mm, dtype=torch.uint8)
    host.copy_(torch.randint(0, 255, (N * SIZE,), dtype=torch.uint8))
    tensors = [torch.empty(SIZE, dtype=torch.uint8, device="cuda") for _ in range(N)]
    one = torch.empty(N * SIZE, dtype=torch.uint8, device="cuda")
    slices = list(one.view(N, SIZE))
    staging = torch.empty(N * SIZE, dtype=torch.uint8, device="cuda")
    views = list(staging.view(N, SIZE))
    s_copy, s_comp = torch.cuda.Stream(), torch.cuda.Stream()
    per = N // PIECES

    def batched(ts, to_host):
        runs = [
            ((addr + i * SIZE, t.data_ptr()) if to_host else (t.data_ptr(), addr + i * SIZE)) for i, t in enumerate(ts)
        ]
        D._copy_engine([(d, s, SIZE, None) for d, s in runs], s_copy, D.FIRST_BATCH_RUNS)
        s_copy.synchronize()

    def staged(to_host):
        with torch.cuda.stream(s_copy):
            if to_host:
                torch._foreach_copy_(views, tensors)
                host.copy_(staging, non_blocking=True)
            else:
                staging.copy_(host, non_blocking=True)
                torch._foreach_copy_(tensors, views)
        s_copy.synchronize()

    def staged_pieces(to_host):
        done = []
        for k in range(PIECES):
            lo, hi = k * per, (k + 1) * per
            h, st = host[lo * SIZE : hi * SIZE], staging[lo * SIZE : hi * SIZE]
            if to_host:
                with torch.cuda.stream(s_comp):
                    torch._foreach_copy_(views[lo:hi], tensors[lo:hi])
                    ev = torch.cuda.Event()
                    ev.record(s_comp)
                s_copy.wait_event(ev)
                with torch.cuda.stream(s_copy):
                    h.copy_(st, non_blocking=True)
            else:
                with torch.cuda.stream(s_copy):
                    st.copy_(h, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(s_copy)
                s_comp.wait_event(ev)
                with torch.cuda.stream(s_comp):
                    torch._foreach_copy_(tensors[lo:hi], views[lo:hi])
            done.append(ev)
        s_copy.synchronize()
        s_comp.synchronize()

    def one_copy(to_host):
        with torch.cuda.stream(s_copy):
            (host.copy_(one, non_blocking=True) if to_host else one.copy_(host, non_blocking=True))
        s_copy.synchronize()

    seg = _worker_segment(tensors)
    if seg is not None:
        kv, addrs, keys, proc = seg

        def batched_seg(to_host):
            runs = [((a, t.data_ptr()) if to_host else (t.data_ptr(), a)) for a, t in zip(addrs, tensors)]
            D._copy_engine([(d, s, SIZE, None) for d, s in runs], s_copy, D.FIRST_BATCH_RUNS)
            s_copy.synchronize()

        ceiling = wall(lambda: one_copy(False))
        contiguous = all(b - a == SIZE for a, b in itertools.pairwise(addrs))
        print(f"worker segment: objects side by side: {contiguous}")
        for label, fn in (
            ("h2d batched from the worker's segment", lambda: batched_seg(False)),
            ("mget_h2d (leases kept)", lambda: kv.mget_h2d(keys, [[t] for t in tensors])),
        ):
            t = wall(fn)
            print(f"{label:40s} {t * 1e6:8.1f} us  {ceiling / t:5.3f} of one copy")
        kv.close()
        proc.terminate()
    for to_host, name in ((False, "h2d"), (True, "d2h")):
        ceiling = wall(lambda: one_copy(to_host))
        rows = {
            "batched": wall(lambda: batched(tensors, to_host)),
            "batched, one tensor": wall(lambda: batched(slices, to_host)),
            "staged": wall(lambda: staged(to_host)),
            f"staged x{PIECES}": wall(lambda: staged_pieces(to_host)),
            "one copy": ceiling,
        }
        if not to_host:
            assert all(torch.equal(t, host[i * SIZE : (i + 1) * SIZE].cuda()) for i, t in enumerate(tensors))
        for k, t in rows.items():
            print(f"{name} {k:22s} {t * 1e6:8.1f} us  {ceiling / t:5.3f} of one copy")


def _worker_segment(tensors):
    """A real worker holding 64 objects written by one mset_d2h: (client, their addresses, keys, process)."""
    import tempfile
    from pathlib import Path

    import kvstrata
    from kvstrata.bench.store import _start_worker

    proc, address = _start_worker(Path(tempfile.mkdtemp()), 4 << 30)
    kv = kvstrata.connect(address)
    keys = [f"k/{i}" for i in range(N)]
    assert kv.mset_d2h(keys, [[t] for t in tensors]) == [None] * N
    b = kv._backend
    leases = b.acquire(keys, 0)
    addrs = [b.segment_address(x.location.segment) + x.location.offset for x in leases]
    return kv, addrs, keys, proc


if __name__ == "__main__":
    main()

"""Host cost of one small devobj copy (``kvstrata.devobj.ipc.copy_into``): in-process and from another
process's IPC-exported GPU0 buffer into GPU1, per call, with a cProfile of the IPC case.

    PYTHONPATH=src python3 tools/probe_copy_into.py
"""

import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.multiprocessing as mp

from kvstrata.devobj import ipc

N = 4096


def timed(label, fn, iters=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    host, total = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        host.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    print(f"{label}: queue {statistics.median(host) * 1e6:.1f} us, queue+sync {statistics.median(total) * 1e6:.1f} us")


def child(blob, q):
    torch.cuda.set_device(1)
    streams = ipc.StreamSet()
    base = ipc.import_storage(blob, 0)
    src = base[:N]
    dst = torch.zeros(N, dtype=torch.uint8, device=1)
    timed("ipc copy_into (push on GPU0 stream)", lambda: ipc.copy_into([dst], [src], streams, 0))
    timed("ipc copy_into (pull on GPU1 stream)", lambda: ipc.copy_into([dst], [src], streams, 1))
    timed("ipc torch copy_", lambda: dst.copy_(src, non_blocking=True))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        ipc.copy_into([dst], [src], streams, 0)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15)
    print(s.getvalue()[:3500])
    q.put(bool(torch.equal(dst.cpu(), src.cpu())))


def main():
    src = torch.randint(0, 255, (N,), dtype=torch.uint8, device=0)
    dst = torch.zeros(N, dtype=torch.uint8, device=1)
    streams = ipc.StreamSet()
    timed("in-process copy_into (push on GPU0 stream)", lambda: ipc.copy_into([dst], [src], streams, 0))
    timed("in-process torch copy_", lambda: dst.copy_(src, non_blocking=True))
    blob = ipc.export_tensor(src)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(blob, q))
    p.start()
    print("ipc bytes equal:", q.get(timeout=120))
    p.join(30)


if __name__ == "__main__":
    main()

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
    for dev in (0, 1):  # bytes checked per path first: the current thread's device is 1, the push stream's 0
        dst.fill_(7)
        ipc.copy_into([dst], [src], streams, dev)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        print(f"copy_into on device {dev}'s stream: bytes equal {torch.equal(dst.cpu(), src.cpu())}")
    timed("ipc copy_into (push on GPU0 stream)", lambda: ipc.copy_into([dst], [src], streams, 0))
    timed("ipc copy_into (pull on GPU1 stream)", lambda: ipc.copy_into([dst], [src], streams, 1))
    timed("ipc torch copy_", lambda: dst.copy_(src, non_blocking=True))
    from cuda.bindings import runtime as rt

    s0 = streams.get(0)
    kind = rt.cudaMemcpyKind.cudaMemcpyDefault
    timed(
        "raw cudaMemcpyAsync on the GPU0 stream handle",
        lambda: rt.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), N, kind, s0.cuda_stream),
    )
    timed(
        "raw cudaMemcpyPeerAsync on the GPU0 stream handle",
        lambda: rt.cudaMemcpyPeerAsync(dst.data_ptr(), 1, src.data_ptr(), 0, N, s0.cuda_stream),
    )
    timed("torch.cuda.stream(s0) enter+exit only", lambda: torch.cuda.stream(s0).__enter__() or None, iters=200)

    def ctx():
        with torch.cuda.stream(s0):
            pass

    timed("with torch.cuda.stream(s0): pass", ctx)
    from kvstrata.ops import copy_engine

    timed(
        "memcpy_batch one pair, no stream context",
        lambda: copy_engine.memcpy_batch([dst.data_ptr()], [src.data_ptr()], [N], device=s0.device),
    )
    import threading

    stop = []

    def spin():
        while not stop:
            pass

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    timed("ipc copy_into with a busy Python thread beside", lambda: ipc.copy_into([dst], [src], streams, 0), iters=50)
    timed(
        "raw cudaMemcpyAsync with a busy Python thread beside",
        lambda: rt.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), N, kind, s0.cuda_stream),
        iters=50,
    )
    stop.append(1)
    th.join()
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

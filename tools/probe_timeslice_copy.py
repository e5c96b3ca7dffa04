"""A 4 KiB copy between two processes' tensors on one GPU (CUDA IPC), and its wait: written into the other
process's tensor (a publisher pushing), read from it (a receiver pulling) and within one process, with the other
process idle or using its GPU every 0.5 ms (``--peer-busy``). Two processes on one GPU share it by time slices:
a copy from one process's context soon after the other's ran waits for its turn. Per variant: the host time of
the copy call plus the wait (no-sleep polling of the stream), warm (back to back) and isolated (1 ms sleep before
each), medians in microseconds. Session 19 measured with it why a publisher-side copy (the ``push-experiment``
branch) lost to the receiver's own on one GPU.

    PYTHONPATH=src python3 tools/probe_timeslice_copy.py [--devices 0,0] [--iters 300] [--peer-busy]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time


def peer(device: int, q, done, busy: bool) -> None:
    import torch

    from kvstrata.devobj.ipc import export_tensor, flat_bytes

    torch.cuda.set_device(device)
    pool = torch.zeros(1 << 20, dtype=torch.uint8, device=device)  # a block of the caching allocator
    d = flat_bytes(pool[4096 : 2 * 4096])
    q.put(export_tensor(d))
    if not busy:
        done.wait(600)
        return
    x = torch.zeros(1024, device=device)
    while not done.is_set():  # a process that uses its GPU now and then (a receiver between hand-offs)
        x.add_(1)
        torch.cuda.synchronize()
        time.sleep(0.0005)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="0,0", help="this process's GPU and the peer's (default 0,0)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--peer-busy", action="store_true", help="the peer runs a small kernel every 0.5 ms meanwhile")
    args = ap.parse_args()
    mine, theirs = (int(x) for x in args.devices.split(","))
    import torch

    from kvstrata.devobj.ipc import StreamSet, copy_into, import_storage, view_of
    from kvstrata.ops import copy_engine

    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=peer, args=(theirs, q, done, args.peer_busy), daemon=True)
    p.start()
    blob = q.get(timeout=120)
    torch.cuda.set_device(mine)
    base = import_storage(blob, theirs)
    remote = view_of(base, blob, {"dtype": "uint8", "nbytes": 4096})
    local = torch.arange(4096, device=mine).to(torch.uint8)
    other = torch.zeros(4096, dtype=torch.uint8, device=mine)
    streams = StreamSet()
    side = streams.get(mine)
    default = torch.cuda.default_stream(mine)
    nb = torch.cuda.Stream(mine)

    def spin(s) -> None:
        while not s.query():
            pass

    def raw(dst, src, s):
        def run():
            copy_engine.memcpy_raw([dst.data_ptr()], [src.data_ptr()], [4096], s.cuda_stream)
            spin(s)

        return run

    def via_copy_into(dst, src):
        def run():
            copy_into([dst], [src], streams, mine)
            spin(side)

        return run

    def torch_copy(dst, src):
        def run():
            dst.copy_(src, non_blocking=True)
            torch.cuda.current_stream(mine).synchronize()

        return run

    variants = {
        "push raw, side stream": raw(remote, local, side),
        "push raw, new stream": raw(remote, local, nb),
        "push raw, default stream": raw(remote, local, default),
        "push copy_into, side stream": via_copy_into(remote, local),
        "push torch copy_ + sync": torch_copy(remote, local),
        "pull raw, side stream": raw(local, remote, side),
        "pull torch copy_ + sync": torch_copy(local, remote),
        "local raw, side stream": raw(other, local, side),
        "local torch copy_ + sync": torch_copy(other, local),
    }
    for fn in variants.values():  # warm every path once
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    out: dict[str, dict[str, list[float]]] = {k: {"warm": [], "isolated": []} for k in variants}
    for mode in ("warm", "isolated"):
        for _ in range(args.iters):
            for name, fn in variants.items():
                if mode == "isolated":
                    time.sleep(0.001)
                t0 = time.perf_counter()
                fn()
                out[name][mode].append((time.perf_counter() - t0) * 1e6)
    if not torch.equal(remote, local):
        raise AssertionError("the pushes did not land")
    done.set()
    p.join(30)
    busy = ", the peer busy every 0.5 ms" if args.peer_busy else ""
    print(f"4 KiB copy + wait, GPU{mine} (this process), GPU{theirs} (the peer's tensor{busy}), {args.iters} each, us")
    print(f"{'variant':>30} {'warm p50':>9} {'p90':>7} {'isolated p50':>13} {'p90':>7}")
    for name, modes in out.items():
        w, i = modes["warm"], modes["isolated"]
        wq, iq = statistics.quantiles(w, n=10), statistics.quantiles(i, n=10)
        print(
            f"{name:>30} {statistics.median(w):9.1f} {wq[-1]:7.1f} {statistics.median(i):13.1f} {iq[-1]:7.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

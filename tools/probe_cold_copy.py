"""What each CUDA call of a 4 KiB device-object receive costs the host when the process sat idle a while.

The 4 KiB hand-off's traces show the reader's steps at tens of microseconds each when both sides idled 1 ms
(``tools/probe_handoff.py --trace``). This times, per call, after ``--idle`` seconds of sleep (cold) and back to
back (warm): a stream query, an event record and query, a 4 KiB ``cudaMemcpyAsync`` through cuda-bindings
(``kvstrata.ops.copy_engine.memcpy_raw``, what ``kvstrata.devobj.ipc.copy_into`` does), the same copy by torch's
``copy_`` and by the driver API (``cuMemcpyAsync``, ``cuMemcpyDtoDAsync``), a driver stream query, and a
stream-wait on an event; GPU ``--src`` to GPU ``--dst`` (0 -> 0 by default); ``--ipc``: from memory another process
exported (CUDA IPC), as in a hand-off.

    PYTHONPATH=src python3 tools/probe_cold_copy.py [--src 0] [--dst 1] [--idle 0.001] [--n 200] [--ipc]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvstrata.ops import copy_engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", type=int, default=0)
    ap.add_argument("--dst", type=int, default=0)
    ap.add_argument("--idle", type=float, default=0.001)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--ipc", action="store_true", help="the source exported by another process (CUDA IPC)")
    args = ap.parse_args()
    torch.cuda.set_device(args.dst)
    owner = None
    if args.ipc:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        q, done = ctx.Queue(), ctx.Event()
        owner = ctx.Process(target=_export, args=(args.src, q, done), daemon=True)
        owner.start()
        src = q.get(timeout=120)  # mapped here through CUDA IPC
    else:
        src = torch.arange(4096, dtype=torch.uint8, device=args.src)
    dst = torch.zeros(4096, dtype=torch.uint8, device=args.dst)
    stream = torch.cuda.Stream(args.dst)
    ev = torch.cuda.Event()
    if args.src != args.dst:
        torch.cuda.synchronize(args.src)
    handle = stream.cuda_stream

    def memcpy_raw():
        copy_engine.memcpy_raw([dst.data_ptr()], [src.data_ptr()], [4096], handle)

    from cuda.bindings import driver as cu

    cu_stream = cu.CUstream(handle)
    dptr, sptr = dst.data_ptr(), src.data_ptr()

    def cu_memcpy():  # the driver API straight (cuda-bindings' runtime module is a layer over it)
        cu.cuMemcpyAsync(dptr, sptr, 4096, cu_stream)

    def cu_dtod():
        cu.cuMemcpyDtoDAsync(dptr, sptr, 4096, cu_stream)

    def torch_copy():
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    import msgpack

    record = {"key": "k", "tensors": [{"shape": [4096], "dtype": "uint8", "nbytes": 4096}], "pid": 1, "local": "t1"}
    record["handles"] = [{"handle": bytes(64), "storage_offset": 0, "storage_bytes": 4096, "offset": 0, "size": [4096]}]

    def python_work():  # host work with no CUDA call: what idling does to plain Python
        msgpack.unpackb(msgpack.packb(record))

    steps = {
        "python: msgpack a record and back": python_work,
        "stream.query()": lambda: stream.query(),
        "event.record(stream)": lambda: ev.record(stream),
        "event.query()": lambda: ev.query(),
        "stream.wait_event(event)": lambda: stream.wait_event(ev),
        "memcpy_raw 4 KiB (cuda-bindings)": memcpy_raw,
        "torch copy_ 4 KiB (side stream)": torch_copy,
        "cuMemcpyAsync 4 KiB (driver)": cu_memcpy,
        "cuMemcpyDtoDAsync 4 KiB (driver)": cu_dtod,
        "cuStreamQuery (driver)": lambda: cu.cuStreamQuery(cu_stream),
    }
    for fn in steps.values():  # warm everything up once
        fn()
    torch.cuda.synchronize()
    print(f"GPU{args.src} -> GPU{args.dst}; median (p90) host us per call, {args.n} calls each")
    print(f"{'call':>36} {'after ' + format(args.idle * 1e3, 'g') + ' ms idle':>22} {'back to back':>18}")
    clock = time.perf_counter
    for name, fn in steps.items():
        cold, warm = [], []
        for _ in range(args.n):
            time.sleep(args.idle)
            t0 = clock()
            fn()
            t1 = clock()
            fn()
            t2 = clock()
            cold.append((t1 - t0) * 1e6)
            warm.append((t2 - t1) * 1e6)
            stream.synchronize()
        qc, qw = statistics.quantiles(cold, n=10), statistics.quantiles(warm, n=10)
        mc, mw = statistics.median(cold), statistics.median(warm)
        print(f"{name:>36} {mc:12.1f} ({qc[-1]:6.1f}) {mw:10.1f} ({qw[-1]:6.1f})")
    if owner is not None:
        assert torch.equal(dst.cpu(), torch.arange(4096, dtype=torch.uint8))
        done.set()
        owner.join(30)


def _export(device: int, q, done) -> None:
    t = torch.arange(4096, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    q.put(t)
    done.wait(600)


if __name__ == "__main__":
    main()

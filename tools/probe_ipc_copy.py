"""Which way of copying another process's GPU memory is fastest? (H200 pair, NVLink.)

The owner process allocates a buffer on GPU0 and exports a CUDA IPC handle; reader processes open it
and copy it into their own buffer, timing each variant with CUDA events (best and median of reps):

* ``ce-push``: cudaMemcpyAsync on a stream of the source GPU (what dev_mget does now), handle opened
  with the source GPU current
* ``ce-pull``: the same copy on a stream of the reading GPU
* ``ce-pull-xN`` / ``ce-push-xN``: the copy split over N streams (N copy engines)
* ``ce-pull-dst-open``: handle opened with the reading GPU current
* ``sm-pull-C``: a Triton copy kernel on the reading GPU with C CTAs, handle opened there
* ``sm-push-C``: the kernel on the source GPU writing into the reader's buffer

plus the in-process baselines (``torch copy_`` GPU0 -> GPU1, and the same-GPU copy). A reader on
GPU0 measures the same-GPU variants (another process's buffer on the same GPU).

    python3 tools/probe_ipc_copy.py [--sizes 64MiB,1GiB] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import traceback

REPS = 7


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src_addr, dst_addr, n_words, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        src = src_addr.to(tl.pointer_type(tl.int32))
        dst = dst_addr.to(tl.pointer_type(tl.int32))
        n_tiles = tl.cdiv(n_words, BLOCK)
        for t in range(pid, n_tiles, nprog):
            offs = t.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n_words
            x = tl.load(src + offs, mask=m, cache_modifier=".cg")
            tl.store(dst + offs, x, mask=m, cache_modifier=".cg")

    return copy_kernel


def _time(fn, streams, dev_for_events):
    """Median and best seconds of fn() (which queues work on ``streams``), CUDA-event timed."""
    import torch

    times = []
    for _ in range(REPS + 1):
        with torch.cuda.device(dev_for_events):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s0 = streams[0]
            torch.cuda.synchronize(dev_for_events)
            start.record(s0)
        for s in streams[1:]:
            s.wait_event(start)
        fn()
        for s in streams[1:]:
            ev = torch.cuda.Event()
            ev.record(s)
            s0.wait_event(ev)
        end.record(s0)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times = times[1:]
    return statistics.median(times), min(times)


def _rates(size: int, med: float, best: float) -> dict[str, float]:
    return {"GBps_median": round(size / med / 1e9, 1), "GBps_best": round(size / best / 1e9, 1)}


def reader(handle: bytes, n: int, src_dev: int, my_dev: int, q, sizes: list[int]) -> None:
    try:
        import cupy
        import torch
        from cuda.bindings import runtime as rt

        torch.cuda.init()
        for a in {src_dev, my_dev}:
            for b in {src_dev, my_dev}:
                if a != b:
                    with torch.cuda.device(a):
                        try:
                            torch.cuda.can_device_access_peer(a, b)
                            rt.cudaDeviceEnablePeerAccess(b, 0)
                            rt.cudaGetLastError()
                        except Exception:
                            pass
        flags = cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess
        with cupy.cuda.Device(src_dev):
            src_ptr_srcopen = cupy.cuda.runtime.ipcOpenMemHandle(handle, flags)
        with cupy.cuda.Device(my_dev):
            same = my_dev == src_dev
            src_ptr_dstopen = src_ptr_srcopen if same else cupy.cuda.runtime.ipcOpenMemHandle(handle, flags)
        dst = torch.empty(n, dtype=torch.uint8, device=my_dev)
        kern = _kernel()
        kind = rt.cudaMemcpyKind.cudaMemcpyDefault
        streams = {d: [torch.cuda.Stream(d) for _ in range(4)] for d in {src_dev, my_dev}}
        out = {}
        for size in sizes:
            res = {}

            def ce(src_ptr, dev, parts):
                ss = streams[dev][:parts]
                step = size // parts

                def run():
                    for i, s in enumerate(ss):
                        off = i * step
                        z = step if i < parts - 1 else size - off
                        rt.cudaMemcpyAsync(dst.data_ptr() + off, src_ptr + off, z, kind, s.cuda_stream)

                return run, ss, dev

            def batch(src_ptr, dev, pieces):
                s = streams[dev][0]
                step = size // pieces
                srcs = [src_ptr + i * step for i in range(pieces)]
                dsts = [dst.data_ptr() + i * step for i in range(pieces)]
                attr = rt.cudaMemcpyAttributes()
                attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream

                def run():
                    rt.cudaMemcpyBatchAsync(dsts, srcs, [step] * pieces, pieces, [attr], [0], 1, s.cuda_stream)

                return run, [s], dev

            def sm(src_ptr, dev, ctas):
                s = streams[dev][0]

                def run():
                    with torch.cuda.device(dev), torch.cuda.stream(s):
                        kern[(ctas,)](src_ptr, dst.data_ptr(), size // 4, BLOCK=4096, num_warps=8)

                return run, [s], dev

            variants = {
                "ce-push": ce(src_ptr_srcopen, src_dev, 1),
                "ce-pull": ce(src_ptr_srcopen, my_dev, 1),
                "ce-push-x2": ce(src_ptr_srcopen, src_dev, 2),
                "ce-push-x4": ce(src_ptr_srcopen, src_dev, 4),
                "ce-pull-x2": ce(src_ptr_srcopen, my_dev, 2),
                "ce-pull-x4": ce(src_ptr_srcopen, my_dev, 4),
                "ce-pull-dst-open": ce(src_ptr_dstopen, my_dev, 1),
                "ce-pull-dst-open-x4": ce(src_ptr_dstopen, my_dev, 4),
            }
            for pieces in (1, 2, 32):
                variants[f"batch-push-{pieces}"] = batch(src_ptr_srcopen, src_dev, pieces)
                variants[f"batch-pull-{pieces}"] = batch(src_ptr_dstopen, my_dev, pieces)
            for c in (132,) if "--quick" in sys.argv else (32, 66, 132, 264):
                variants[f"sm-pull-{c}"] = sm(src_ptr_dstopen, my_dev, c)
                if my_dev != src_dev:
                    variants[f"sm-push-{c}"] = sm(src_ptr_srcopen, src_dev, c)
            for name, (run, ss, dev) in variants.items():
                try:
                    med, best = _time(run, ss, dev)
                    res[name] = _rates(size, med, best)
                except Exception as exc:  # an illegal address ends the context: report and stop
                    res[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    out[size] = res
                    q.put({"dev": my_dev, "results": out, "fatal": name})
                    return
                print(f"reader GPU{my_dev} {size >> 20} MiB {name}: {res[name]}", flush=True)
            out[size] = res
        q.put({"dev": my_dev, "results": out})
    except Exception:
        q.put({"dev": my_dev, "error": traceback.format_exc()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64MiB,1GiB")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer kernel variants")
    args = ap.parse_args()
    units = {"MiB": 20, "GiB": 30}
    sizes = [int(s[:-3]) << units[s[-3:]] for s in args.sizes.split(",")]
    import cupy
    import torch

    n = max(sizes)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=0)
    handle = cupy.cuda.runtime.ipcGetMemHandle(src.data_ptr())
    base = {}
    d1 = torch.empty(n, dtype=torch.uint8, device=1)
    d0 = torch.empty(n, dtype=torch.uint8, device=0)
    for size in sizes:
        s0 = torch.cuda.current_stream(0)
        med, best = _time(lambda: d1[:size].copy_(src[:size], non_blocking=True), [s0], 0)
        med0, best0 = _time(lambda: d0[:size].copy_(src[:size], non_blocking=True), [s0], 0)
        base[size] = {
            "torch copy_ GPU0->GPU1 in-process": _rates(size, med, best),
            "torch copy_ same GPU in-process": _rates(size, med0, best0),
        }
        print(f"baseline {size >> 20} MiB: {base[size]}", flush=True)
    ctx = mp.get_context("spawn")
    results = {"baseline": base}
    for my_dev in (1, 0):
        q = ctx.Queue()
        p = ctx.Process(target=reader, args=(handle, n, 0, my_dev, q, sizes))
        p.start()
        r = q.get(timeout=300)
        p.join(60)
        results[f"reader_gpu{my_dev}"] = r
        print(json.dumps(r)[:3000], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())

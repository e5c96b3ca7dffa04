"""How should mget_h2d / mset_d2h issue 64 x 1 MiB of copies so they finish soonest? (GPU machine.)

Each variant is timed as the caller sees it: from an idle, synchronized device, host clock from the first
call to the end event's synchronize (host issue cost included), median of many rounds. Variants: one 64 MiB
``copy_`` (the ceiling), ``cudaMemcpyBatchAsync`` in batches of 4..64 descriptors, a small first batch then
16s, one ``cudaMemcpyAsync`` per descriptor, and descriptors merged where two destination tensors are
adjacent inside one CUDA allocation (``cuPointerGetAttribute`` range query).

    PYTHONPATH=src python3 tools/probe_dma_issue.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvstrata.ops import copy_engine

N, SIZE = 64, 1 << 20


def wall(fn, rounds: int = 60) -> float:
    for _ in range(5):
        fn()
        torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()  # the copies run on a side stream: wait for every stream
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def alloc_range(ptr: int) -> tuple[int, int]:
    from cuda.bindings import driver

    attrs = driver.CUpointer_attribute
    err, start = driver.cuPointerGetAttribute(attrs.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr)
    err2, size = driver.cuPointerGetAttribute(attrs.CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr)
    assert int(err) == 0 and int(err2) == 0, (err, err2)
    return int(start), int(size)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.cuda.init()
    stream = torch.cuda.Stream()
    host = torch.empty(N * SIZE, dtype=torch.uint8).pin_memory()
    big = torch.empty(N * SIZE, dtype=torch.uint8, device="cuda")
    dst = [torch.empty(SIZE // 4, dtype=torch.float32, device="cuda") for _ in range(N)]
    hp = host.data_ptr()
    hosts = [hp + i * SIZE for i in range(N)]
    devs = [d.data_ptr() for d in dst]
    # adjacency of the destination tensors inside one allocation
    t0 = time.perf_counter()
    ranges = [alloc_range(p) for p in devs]
    t_attr = (time.perf_counter() - t0) / N
    merged_d, merged_h, merged_n = [], [], []
    for p, h, (start, size) in zip(devs, hosts, ranges):
        if merged_d and merged_d[-1] + merged_n[-1] == p and merged_h[-1] + merged_n[-1] == h:
            last_start = alloc_range(merged_d[-1])[0]
            if last_start == start and p + SIZE <= start + size:
                merged_n[-1] += SIZE
                continue
        merged_d.append(p)
        merged_h.append(h)
        merged_n.append(SIZE)
    out: dict = {"pointer_attr_us": round(t_attr * 1e6, 2), "merged_descriptors": len(merged_d)}

    def batches(to_host: bool, sizes_of_batches: list[int]):
        def fn():
            with torch.cuda.stream(stream):
                k = 0
                for b in sizes_of_batches:
                    d, s = (hosts[k : k + b], devs[k : k + b]) if to_host else (devs[k : k + b], hosts[k : k + b])
                    copy_engine.memcpy_batch(d, s, [SIZE] * b)
                    k += b

        return fn

    def per_copy(to_host: bool):
        from cuda.bindings import runtime as rt

        kind = rt.cudaMemcpyKind.cudaMemcpyDefault

        def fn():
            h = stream.cuda_stream
            pairs = zip(hosts, devs) if to_host else zip(devs, hosts)
            for d, s in pairs:
                rt.cudaMemcpyAsync(d, s, SIZE, kind, h)

        return fn

    def merged(to_host: bool):
        def fn():
            with torch.cuda.stream(stream):
                d, s = (merged_h, merged_d) if to_host else (merged_d, merged_h)
                for k in range(0, len(d), 16):
                    copy_engine.memcpy_batch(d[k : k + 16], s[k : k + 16], merged_n[k : k + 16])

        return fn

    for direction, to_host in (("h2d", False), ("d2h", True)):
        rows = {}
        ceiling = wall(
            lambda: big.copy_(host, non_blocking=True) if not to_host else host.copy_(big, non_blocking=True)
        )
        rows["one 64 MiB copy_"] = ceiling
        for b in (4, 8, 16, 32, 64):
            rows[f"batches of {b}"] = wall(batches(to_host, [b] * (N // b)))
        rows["2 then 16s (+14)"] = wall(batches(to_host, [2, 14, 16, 16, 16]))
        rows["4, 12, 16, 16, 16"] = wall(batches(to_host, [4, 12, 16, 16, 16]))
        rows["per-copy cudaMemcpyAsync"] = wall(per_copy(to_host))
        rows[f"merged ({len(merged_d)} descriptors) in 16s"] = wall(merged(to_host))
        out[direction] = {k: {"ms": round(v * 1e3, 3), "of_ceiling": round(ceiling / v, 3)} for k, v in rows.items()}
        print(direction)
        for k, v in out[direction].items():
            print(f"  {k:40s} {v['ms']:7.3f} ms  {v['of_ceiling']:.3f}")
    print("pointer attribute query:", out["pointer_attr_us"], "us; merged descriptors:", out["merged_descriptors"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

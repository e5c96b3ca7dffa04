"""Sweep gather's tile parameters on the GPU; print the best per size (a tuning aid, not a benchmark)."""

import itertools
import json
import os
import sys
import time

import torch

from kvstrata.memory import alloc_pinned
from kvstrata.ops import gather as gather_op
from kvstrata.ops._common import TileConfig

gather_mod = sys.modules["kvstrata.ops.gather"]  # the package attribute `gather` is the function


def per_call(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        best.append(a.elapsed_time(b) / 1e3 / reps)
    best.sort()
    return best[len(best) // 2]


def main():
    dev = torch.device("cuda:0")
    rows_total, width = 1 << 20, 512  # 1 GiB of fp16 at 1 KiB rows
    host = alloc_pinned(rows_total * width * 2)
    table = host.view(torch.float16).view(rows_total, width)
    table.view(torch.int16).random_()
    res = {}
    for n in (1024, 16384, 131072):
        ids = torch.randint(0, rows_total, (n,), device=dev)
        out = torch.empty(n, width, dtype=torch.float16, device=dev)
        nbytes = n * width * 2
        view = table  # alias via the op
        alias = gather_mod.device_alias(table, dev)
        res[f"{n}_index_select_uva"] = nbytes / per_call(lambda: torch.index_select(alias, 0, ids, out=out)) / 1e9
        # host overhead of one call (no sync)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            gather_op(view, out, ids, check=False)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        res[f"{n}_host_us_per_call"] = (t1 - t0) / 50 * 1e6
        results = []
        for tile_bytes, warps, cps in itertools.product((4096, 8192, 16384, 32768, 65536), (2, 4, 8, 16), (1, 2, 4, 8)):
            if tile_bytes // (warps * 32) < 16:
                continue
            gather_mod.TILE = TileConfig(tile_bytes=tile_bytes, max_row_bytes=4096, num_warps=warps, ctas_per_sm=cps)
            try:
                t = per_call(lambda: gather_op(view, out, ids, check=False), reps=10)
            except Exception as e:
                print("fail", tile_bytes, warps, cps, repr(e)[:200])
                continue
            results.append((nbytes / t / 1e9, tile_bytes, warps, cps))
        results.sort(reverse=True)
        ref = table[ids.cpu()].to(dev)
        gather_op(view, out, ids, check=False)
        torch.cuda.synchronize()
        res[f"{n}_correct"] = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
        res[f"{n}_top"] = results[:6]
        res[f"{n}_worst"] = results[-3:]
        print(n, json.dumps({k: v for k, v in res.items() if k.startswith(str(n))}, default=str), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "tune_gather.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()

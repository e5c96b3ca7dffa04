"""Where the host time of one op call goes (cProfile over many calls), on the GPU machine."""

import cProfile
import io
import pstats
import sys
import time

import torch

from kvstrata.bench.transfer import Setup
from kvstrata.memory import alloc_pinned
from kvstrata.ops import gather, transfer_blocks


def profile(name, fn, n=200):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"== {name}: host {1e6 * (t1 - t0) / n:.1f} us/call, with drain {1e6 * (t2 - t0) / n:.1f} us/call")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print("\n".join(s.getvalue().splitlines()[6:32]))


def main():
    which = sys.argv[1:] or ["gather", "zero_copy", "staging", "copy_engine"]
    dev = torch.device("cuda:0")
    rows, width = 1 << 16, 512
    table = alloc_pinned(rows * width * 2).view(torch.float16).view(rows, width)
    ids = torch.randint(0, rows, (1024,), device=dev)
    out = torch.empty(1024, width, dtype=torch.float16, device=dev)
    if "gather" in which:
        profile("gather 1024x1KiB", lambda: gather(table, out, ids, check=False))
    s = Setup(32, 16 * 1024, 64 * 16 * 1024)
    for m in ("zero_copy", "staging", "copy_engine"):
        if m in which:
            for d in ("d2h", "h2d"):

                def call(m=m, d=d):
                    transfer_blocks(s.layout, s.pool, *s.ids(m), direction=d, method=m, check=False)

                profile(f"transfer_blocks {m} {d} 64x16KiB", call)
    # One request's blocks (the bench's request latency): 1 block id, 32 layers x K/V of 16 KiB
    for m in ("auto", "zero_copy", "staging", "copy_engine"):
        if f"request-{m}" in which or "request" in which:
            ids = tuple(x[:1] for x in s.ids("zero_copy" if m == "auto" else m))
            for d in ("d2h", "h2d"):

                def call(m=m, d=d, ids=ids):
                    transfer_blocks(s.layout, s.pool, *ids, direction=d, method=m, check=False)

                profile(f"transfer_blocks request {m} {d} 1 block x 64 x 16KiB", call)


if __name__ == "__main__":
    main()

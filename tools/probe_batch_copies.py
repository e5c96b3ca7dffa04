"""64 separate 1 MiB copies (one cudaMemcpyBatchAsync) vs one 64 MiB copy, pinned host <-> device, and the
host cost of mget_h2d's planning steps. Which part of mget_h2d / mset_d2h's gap is the DMA itself?

    PYTHONPATH=src python3 tools/probe_batch_copies.py
"""

import statistics
import time

import torch

from kvstrata.bench._common import device_time
from kvstrata.client import device as dv
from kvstrata.ops import copy_engine

n, size = 64, 1 << 20
host = torch.empty(n * size, dtype=torch.uint8).pin_memory()
big = torch.empty(n * size, dtype=torch.uint8, device="cuda")
dst = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(n)]
gbps = lambda t: round(n * size / t / 1e9, 1)
one_h2d = device_time(lambda: big.copy_(host, non_blocking=True))
one_d2h = device_time(lambda: host.copy_(big, non_blocking=True))
hp = host.data_ptr()
batch_h2d = device_time(
    lambda: copy_engine.memcpy_batch([d.data_ptr() for d in dst], [hp + i * size for i in range(n)], [size] * n)
)
batch_d2h = device_time(
    lambda: copy_engine.memcpy_batch([hp + i * size for i in range(n)], [d.data_ptr() for d in dst], [size] * n)
)
for groups in (2, 4, 8):
    g = n // groups

    def grouped(to_host: bool, g=g):
        for k in range(0, n, g):
            d = [hp + i * size for i in range(k, k + g)]
            s = [dst[i].data_ptr() for i in range(k, k + g)]
            copy_engine.memcpy_batch(*((d, s) if to_host else (s, d)), [size] * g)

    h2d, d2h = gbps(device_time(lambda: grouped(False))), gbps(device_time(lambda: grouped(True)))
    print(f"batch in {groups} groups: h2d {h2d} d2h {d2h} GB/s")
print(f"one 64 MiB copy: h2d {gbps(one_h2d)} d2h {gbps(one_d2h)} GB/s")
print(f"64 x 1 MiB batch: h2d {gbps(batch_h2d)} d2h {gbps(batch_d2h)} GB/s")
lists = [[d] for d in dst]
for name, fn in (
    ("check_tensor_lists", lambda: dv.check_tensor_lists(n, lists)),
    (
        "plan x64",
        lambda: [
            dv.plan(p, hp + i * size, False, dv.new_runs()) for i, p in enumerate(dv.check_tensor_lists(n, lists)[0])
        ],
    ),
):
    for _ in range(20):
        fn()
    ts = []
    for _ in range(200):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    print(f"{name}: {statistics.median(ts) * 1e6:.1f} us")

"""Where a packed PrefixKVCache load's time goes on a GPU: the unpack kernel alone (CUDA events), one mget_h2d of
the packed rows (kept leases), the whole load; and the same for a save (pack kernel, mset_d2h of the rows).

    PYTHONPATH=src python3 tools/probe_prefix_steps.py --blocks 32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import kvstrata
from kvstrata.bench.store import _start_worker, _stop
from kvstrata.integrations import PrefixKVCache
from kvstrata.ops.block_pack import pack_blocks, unpack_blocks


def wall(fn, iters=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e3, 3)


def events(fn, iters=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return round(statistics.median(ts), 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=32)
    args = ap.parse_args()
    n = args.blocks
    caches = [torch.randn(2, 2 * n, 16, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(32)]
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 16 * n * (2 << 20) + (256 << 20))
        try:
            with kvstrata.connect(address, timeout=30) as kv:
                cache = PrefixKVCache(kv, caches, model="probe")
                ids, dst = list(range(n)), list(range(n, 2 * n))
                tokens = np.arange(16 * n).tolist()
                cache.save(tokens, ids)
                keys = cache.block_keys(tokens)
                buf = torch.empty(n, cache.block_bytes, dtype=torch.uint8, device="cuda")
                rows = [[buf[i]] for i in range(n)]
                out = {
                    "pack kernel ms (events)": events(lambda: pack_blocks(cache.layout, ids, buf)),
                    "unpack kernel ms (events)": events(lambda: unpack_blocks(cache.layout, dst, buf)),
                    "pack call ms (wall)": wall(lambda: pack_blocks(cache.layout, ids, buf)),
                    "mget_h2d of the rows ms (wall, kept)": wall(lambda: kv.mget_h2d(keys, rows)),
                    "load ms (wall, kept)": wall(lambda: cache.load(tokens, dst)),
                    "block_keys ms": wall(lambda: cache.block_keys(tokens)),
                    "lookup ms": wall(lambda: cache.lookup(tokens)),
                }
                pinned = torch.empty(n * cache.block_bytes, dtype=torch.uint8, pin_memory=True)
                flat = buf.view(-1)
                out["dma h2d ms"] = wall(lambda: flat.copy_(pinned, non_blocking=True))
                i = [0]

                def save_new():
                    i[0] += 1
                    cache.save((np.arange(16 * n) + 1_000_000 * i[0]).tolist(), ids)

                out["save ms (wall, new keys)"] = wall(save_new, iters=8)
                for k, v in out.items():
                    print(f"{k:40s} {v}")
        finally:
            _stop(proc)


if __name__ == "__main__":
    main()

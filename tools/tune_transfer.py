"""Tune transfer_blocks on the GPU: staging ring geometry, zero_copy CTAs, and what a GEMM keeps beside each."""

import json
import os
import sys

import torch

from kvstrata.bench._common import device_time
from kvstrata.bench.transfer import Setup
from kvstrata.ops import staging, transfer_blocks

MIB = 1 << 20


def gbps(s, fn):
    return round(s.bytes / device_time(fn, warmup=2, iters=5) / 1e9, 2)


def main():
    res = {}
    chunks = [int(c) for c in sys.argv[1:]] or [2048, 32768, 2 * MIB]
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")

    def gemms(k=40):
        for _ in range(k):
            torch.mm(a, b)

    solo = device_time(gemms, warmup=1, iters=3)
    side = torch.cuda.Stream()

    def under_gemm(fn, bytes_per_call):
        # GEMMs first (their launches are not delayed by the transfer's host work), transfer beside them.
        reps = max(1, round(0.04 / (bytes_per_call / 50e9)))
        out = None
        for _ in range(2):
            torch.cuda.synchronize()
            e0, e1, t0, t1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
            e0.record()
            gemms()
            e1.record()
            side.wait_event(e0)
            with torch.cuda.stream(side):
                t0.record()
                for _ in range(reps):
                    fn()
                t1.record()
            torch.cuda.synchronize()
            kept = solo / (e0.elapsed_time(e1) / 1e3)
            out = (round(kept, 3), round(reps * bytes_per_call / (t0.elapsed_time(t1) / 1e3) / 1e9, 2))
        return out

    for chunk in chunks:
        s = Setup(32, chunk, 256 * MIB)
        r = {}
        for d in ("d2h", "h2d"):
            for slot_mb, nslots in ((8, 4), (32, 2), (32, 3), (64, 2), (64, 3)):
                staging.SLOT_BYTES, staging.NUM_SLOTS = slot_mb * MIB, nslots
                f = lambda d=d: transfer_blocks(s.layout, s.pool, *s.ids("staging"), direction=d, method="staging",
                                                check=False)  # fmt: skip
                r[f"{d}_staging_{slot_mb}x{nslots}"] = gbps(s, f)
                if d == "d2h" and (slot_mb, nslots) in ((32, 3), (64, 2)):
                    r[f"gemm_{d}_staging_{slot_mb}x{nslots}"] = under_gemm(f, s.bytes)
            for ctas in (16, 32, 66, 132, 264):
                f = lambda d=d, c=ctas: transfer_blocks(s.layout, s.pool, *s.ids("zero_copy"), direction=d,
                                                        method="zero_copy", num_ctas=c, check=False)  # fmt: skip
                r[f"{d}_zero_copy_{ctas}"] = gbps(s, f)
                if d == "d2h" and ctas in (16, 132):
                    r[f"gemm_{d}_zero_copy_{ctas}"] = under_gemm(f, s.bytes)
            f = lambda d=d: transfer_blocks(s.layout, s.pool, *s.ids("copy_engine"), direction=d,
                                            method="copy_engine", check=False)  # fmt: skip
            r[f"{d}_copy_engine"] = gbps(s, f)
        host, dev = s.pool.flat, torch.empty_like(s.pool.flat, device="cuda")
        r["d2h_plain_dma"] = gbps(s, lambda: host.copy_(dev, non_blocking=True))
        r["gemm_plain_dma"] = under_gemm(lambda: host.copy_(dev, non_blocking=True), s.bytes)
        res[chunk] = r
        print(chunk, json.dumps(r), flush=True)
        s = host = dev = None  # free before the next size
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "tune_transfer.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""Where one request's latency goes with host ids (bench transfer's ``auto_us``) against device ids
(``zero_copy_us``): 32 layers x 1 block x K/V at 16 and 32 KiB chunks, each direction, timed as the bench
times it (CUDA events around one isolated call: host issue + device work), plus the method ``auto`` chose,
the host time of the call alone, and a cProfile of the host-ids call.

    PYTHONPATH=src python3 tools/probe_request_ids.py
"""

from __future__ import annotations

import cProfile
import io
import pstats

import torch

from kvstrata.bench._common import device_time, host_time
from kvstrata.bench.transfer import Setup
from kvstrata.ops import _transfer_plan as P
from kvstrata.ops import transfer_blocks

KIB = 1 << 10


def main() -> None:
    for chunk in (16 * KIB, 32 * KIB):
        s = Setup(32, chunk, 64 * chunk)
        one = s.nseg * chunk
        host = s.pool.flat[:one]
        dev = torch.empty(one, dtype=torch.uint8, device="cuda")
        d_gpu, h_gpu = (x[:1] for x in s.ids("zero_copy"))
        d_cpu, h_cpu = (x[:1] for x in s.ids("auto"))
        variants = {
            "device ids": (d_gpu, h_gpu),
            "host tensor ids": (d_cpu, h_cpu),
            "host list ids": ([int(d_cpu[0])], [int(h_cpu[0])]),
            "dev ids on device, host ids on host": (d_gpu, h_cpu),
        }
        for direction in ("d2h", "h2d"):
            src, dst = (dev, host) if direction == "d2h" else (host, dev)
            dma = device_time(lambda src=src, dst=dst: dst.copy_(src, non_blocking=True), warmup=5, iters=50)
            print(f"--- {direction} {chunk // KIB} KiB x 64: plain DMA {dma * 1e6:.1f} us, "
                  f"target {(1.3 * dma + 15e-6) * 1e6:.1f} us")  # fmt: skip
            for method in ("zero_copy", "auto"):
                for name, ids in variants.items():
                    P.clear_plans()

                    def fn(ids=ids, method=method, direction=direction):
                        transfer_blocks(s.layout, s.pool, *ids, direction=direction, method=method, check=False)

                    t = device_time(fn, warmup=5, iters=50)
                    th = host_time(fn, warmup=5, iters=50)
                    chosen = sorted({p.method for p in P._plans.values()})
                    print(f"{method:10s} {name:36s} {t * 1e6:6.1f} us (host {th * 1e6:5.1f} us) ran {chosen}")
            fn = lambda direction=direction: transfer_blocks(
                s.layout, s.pool, d_cpu, h_cpu, direction=direction, method="auto", check=False
            )
            prof = cProfile.Profile()
            for _ in range(300):
                torch.cuda.synchronize()
                prof.enable()
                fn()
                prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
            print("\n".join(out.getvalue().splitlines()[6:20]))


if __name__ == "__main__":
    main()

"""Why was ``ratio="auto"`` (which chose the collective alone) 10x slower than plain NCCL at 4 MiB?

Two ranks, one size, a matmul running beside (as in ``kvstrata bench allgather``). Times, per rank
0's view of the slowest rank: plain ``all_gather_into_tensor``, the hybrid with ``ratio=0`` (the
collective through kvstrata) and ``ratio="auto"``, before and after the host path has been used,
with and without the matmul load, plus the host (Python) time per call.

    PYTHONPATH=src python3 tools/diag_allgather.py [MiB]
"""

import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvstrata.bench.allgather import _MatmulLoad, _time
from kvstrata.comm import HybridAllGather


def _worker(rank: int, store: str, mib: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    dev = torch.device("cuda", rank)
    ag = HybridAllGather(ratio="auto", timeout=60.0)
    count = mib * (1 << 20) // 2
    inp = torch.randn(count, device=dev).to(torch.bfloat16)
    out = torch.empty(2 * count, dtype=torch.bfloat16, device=dev)
    load = _MatmulLoad(dev)
    fns = {
        "nccl": lambda: dist.all_gather_into_tensor(out, inp),
        "ag r=0": lambda: ag.all_gather(out, inp, ratio=0),
        "ag auto": lambda: ag.all_gather(out, inp),
    }

    def report(phase: str, loaded: bool) -> None:
        res = {}
        for name, fn in fns.items():
            if loaded:
                load.start()
            try:
                res[name] = _time(fn, iters=20, device=dev) * 1e3
            finally:
                if loaded:
                    load.stop()
        # host time per call (CPU side only, no load)
        host = {}
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            host[name] = (time.perf_counter() - t0) / 20 * 1e6
            torch.cuda.synchronize()
        if rank == 0:
            ms = "  ".join(f"{k} {v:.3f} ms" for k, v in res.items())
            hs = "  ".join(f"{k} {v:.0f} us" for k, v in host.items())
            print(f"{phase:<28} load={loaded!s:<5} {ms} | issue time/call: {hs}", flush=True)

    fns["ag auto"]()  # runs the auto measurement
    torch.cuda.synchronize()
    if rank == 0:
        print(f"{mib} MiB/rank; auto chose {ag.auto_choices}", flush=True)
    report("before host path use", False)
    report("before host path use", True)
    for _ in range(5):
        ag.all_gather(out, inp, ratio=4)
    torch.cuda.synchronize()
    report("after host path use", True)
    report("after host path use", False)
    ag.close()
    load.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), mib), nprocs=2, join=True)

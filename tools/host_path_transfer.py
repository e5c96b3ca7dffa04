"""Host time of the eager Python path of ``transfer_blocks`` up to the launch, measured on CPU.

The kernel launch and the DMA are replaced by no-ops, so what is timed is kvstrata's own Python: argument
handling, plans, address arithmetic. Runs anywhere (Triton interpreter mode, CPU tensors)::

    PYTHONPATH=src python tools/host_path_transfer.py [calls]

One request's blocks: 32 layers x K/V (64 chunks of 16 KiB), one block, ids as Python lists and as tensors.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from kvstrata.bench.transfer import Setup
from kvstrata.ops import chunk_copy, copy_engine, transfer_blocks


def _noop(*args, **kwargs) -> None:
    return None


def main() -> None:
    torch.set_num_threads(1)
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    tbm = sys.modules["kvstrata.ops.transfer_blocks"]  # the package re-exports a function of the same name
    # Every launch site becomes a no-op: the kernel (zero_copy) and the per-run copies (copy_engine on CPU).
    for mod in (tbm, chunk_copy):
        if hasattr(mod, "launch_copy_chunks"):
            mod.launch_copy_chunks = _noop
    copy_engine.copy_runs_torch = _noop
    plan_mod = sys.modules.get("kvstrata.ops._transfer_plan")
    if plan_mod is not None:  # the launch-plan path: its kernel launch
        plan_mod.TransferPlan.launch = _noop
    s = Setup(32, 16 * 1024, 64 * 16 * 1024, device="cpu")
    cases = {
        "zero_copy, tensor ids": ("zero_copy", s.dev_ids[:1], s.host_ids[:1]),
        "zero_copy, list ids": ("zero_copy", [int(s.dev_ids[0])], [0]),
        "copy_engine, list ids": ("copy_engine", [int(s.dev_ids[0])], [0]),
    }
    for check in (False, True):
        for name, (method, d, h) in cases.items():
            for direction in ("d2h", "h2d"):

                def call(m=method, d=d, h=h, dr=direction, c=check) -> None:
                    transfer_blocks(s.layout, s.pool, d, h, direction=dr, method=m, check=c)

                for _ in range(200):
                    call()
                best = float("inf")  # the box may be shared: the best of 5 rounds is the path's own cost
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(calls // 5):
                        call()
                    best = min(best, (time.perf_counter() - t0) / (calls // 5) * 1e6)
                print(f"{name:24s} {direction} check={check!s:5s}: {best:6.1f} us/call", flush=True)


if __name__ == "__main__":
    main()

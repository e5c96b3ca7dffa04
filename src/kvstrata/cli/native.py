"""``kvstrata native``: build (or load) the native copy planner now, and say where it stands.

Device calls build it by themselves the first time a process needs it (``kvstrata.ops.tensor_runs``, in a background
thread, planning in Python meanwhile); this builds it ahead, for instance in a container image's build step, so that
no serving process spends those seconds, and shows why it cannot be built where it cannot.
"""

from __future__ import annotations

import argparse
import sys
import time


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("native", help="build (or load) the native copy planner now and show where it stands")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvstrata.ops import tensor_runs

    t0 = time.perf_counter()
    module = tensor_runs.native(wait=True)
    took = time.perf_counter() - t0
    got = tensor_runs.state()
    if module is None:
        print(f"kvstrata native: {got['error']}; device calls plan their copies in Python", file=sys.stderr)
        return 1
    print(f"kvstrata native: ready in {took:.1f} s: {got['path']}")
    entry = tensor_runs.batch_entry()
    import torch

    if entry is None and not torch.cuda.is_available():
        print("  no GPU here: its passes have no copies to queue (no driver with cuMemcpyBatchAsync)")
    elif entry is None:
        print("  its passes answer their runs (no GPU driver with cuMemcpyBatchAsync here): cuda-bindings queues them")
    else:
        print(f"  its passes queue their own copies: the driver's cuMemcpyBatchAsync (ABI {entry[1]}) at {entry[0]:#x}")
    return 0

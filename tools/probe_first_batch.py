"""Why a device call's first copy batch costs the host more than later ones (GPU machine): host time of
``copy_engine.memcpy_raw`` with 2 runs of 1 MiB from a cudaHostRegister'ed range (as the worker's segments are),
the copy stream idle for ``--idle-ms`` before each, with the stream's wait for the caller's stream queued just
before it (as ``device.start`` does) or not, and with a copy already queued before it. Medians of ``--iters``.

    PYTHONPATH=src python3 tools/probe_first_batch.py [--iters 200] [--idle-ms 1]
"""

from __future__ import annotations

import ctypes
import mmap
import statistics
import sys
import time

import torch

from kvstrata.client import device
from kvstrata.memory import register, unregister
from kvstrata.ops import copy_engine

SIZE = 1 << 20


def main() -> None:
    iters = int(sys.argv[sys.argv.index("--iters") + 1]) if "--iters" in sys.argv else 200
    idle = float(sys.argv[sys.argv.index("--idle-ms") + 1]) if "--idle-ms" in sys.argv else 1.0
    torch.cuda.init()
    region = mmap.mmap(-1, 64 * SIZE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    register(base, 64 * SIZE)
    dev = torch.empty(64 * SIZE, dtype=torch.uint8, device="cuda")
    dp = dev.data_ptr()
    side = device.start(dev.device)  # the client's copy stream for this device (and its wait event made)
    handle = side.cuda_stream
    caller = torch.cuda.current_stream()

    def two(k: int) -> None:
        copy_engine.memcpy_raw([dp + k * SIZE, dp + (k + 1) * SIZE], [base + k * SIZE, base + (k + 1) * SIZE],
                               [SIZE, SIZE], handle)  # fmt: skip

    cases = {
        "2 runs, stream idle": lambda: None,
        "2 runs right after device.start (its wait queued)": lambda: device.start(dev.device),
        "2 runs after 2 already queued": lambda: two(10),
        "2 runs after caller-stream query only": lambda: torch.cuda.current_stream().query(),
    }
    out: dict[str, list[tuple[float, float]]] = {c: [] for c in cases}
    for it in range(iters):
        for case, before in cases.items():
            side.synchronize()
            caller.synchronize()
            time.sleep(idle / 1e3)
            t0 = time.perf_counter()
            before()
            t1 = time.perf_counter()
            two(0)
            t2 = time.perf_counter()
            if it >= 10:
                out[case].append(((t1 - t0) * 1e6, (t2 - t1) * 1e6))
    side.synchronize()
    for case, ts in out.items():
        pre, batch = (statistics.median(c) for c in zip(*ts))
        print(f"{case}: before {pre:.1f} us, memcpy_raw {batch:.1f} us")
    unregister(base)


if __name__ == "__main__":
    main()

"""What each host call a device call makes before its first copy costs alone, on the GPU machine (one real worker, one
client, 64 x 1 MiB keys of CUDA tensors): torch's tensor and device lookups, the copy stream's native join, the
write reservation's take and give, the key check, ``device.native_copies`` and ``NativePasses.start``. Each call is
timed alone, ``--calls`` times in a row after a one-key request to the worker (what bench store's rows have before
each device call: the host's caches then hold the worker's and the socket's code, not these calls'), and again warm
(the same call just made). Printed per call: the median of the first call after the request, and of the warm calls.

    PYTHONPATH=src python3 tools/probe_host_calls.py [--rounds 300]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _copy_trace import kept_client

from kvstrata.bench._common import python_loop_us
from kvstrata.client import batching, device
from kvstrata.ops import tensor_runs
from kvstrata.server import protocol


def _arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main() -> None:
    rounds = int(_arg("--rounds", "300"))
    with kept_client("hc") as (kv, keys, src, _dst):
        backend, resv = kv._backend, kv._reservation
        t = src[0][0]
        fresh = [f"hc/fresh/{i}" for i in range(len(keys))]
        native = tensor_runs.native(wait=True)
        calls = tensor_runs.stream_calls()
        if native is None or calls is None or device.native_copies(src, 0) is None:
            raise SystemExit(f"no native passes here: {tensor_runs.state()}")
        side = device.native_copies(src, 0)[1]
        raw = torch._C._cuda_getCurrentRawStream
        device.SKIP_IDLE_JOIN = False  # one join that waits: this thread's event made
        device._join(0, side, None)
        device.SKIP_IDLE_JOIN = True
        event = device._wait_events.__dict__[0][1]

        def take_give() -> None:
            if resv.take(backend):
                resv.give(backend, resv.head if resv.end else None, 0)

        probes: dict[str, Callable[[], Any]] = {
            "t.is_cuda": lambda: t.is_cuda,
            "t.get_device()": lambda: t.get_device(),
            "torch._C._cuda_getDevice()": torch._C._cuda_getDevice,
            "raw current stream": lambda: raw(0),
            "tensor_runs.join (query)": lambda: native.join(calls, raw(0), side.cuda_stream, event, True),
            "tensor_runs.join (record+wait)": lambda: native.join(calls, raw(0), side.cuda_stream, event, False),
            "device._join": lambda: device._join(0, side, None),
            "device.native_copies": lambda: device.native_copies(src, 0),
            "NativePasses.start": lambda: batching.NativePasses.start(src, 0, None),
            "resv.take + give": take_give,
            "check_keys (64)": lambda: protocol.check_keys(fresh),
        }
        print(f"host_loop_us {python_loop_us():.1f}; {rounds} rounds; medians in us")
        print(f"  {'call':34s} {'after a request':>16s} {'warm':>8s}")
        for name, fn in probes.items():
            cold, warm = [], []
            for _ in range(rounds):
                kv.exists(keys[:1])
                for k in range(4):
                    t0 = time.perf_counter()
                    fn()
                    took = (time.perf_counter() - t0) * 1e6
                    (cold if k == 0 else warm).append(took)
            print(f"  {name:34s} {statistics.median(cold):16.2f} {statistics.median(warm):8.2f}")
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()

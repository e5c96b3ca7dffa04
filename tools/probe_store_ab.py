"""The store's device calls (64 x 1 MiB, one real worker, one client) under settings switched call by call, so
every setting sees the same host speed (the GPU host's Python speed drifts between and within runs): the
first stage's size (``device.FIRST_STAGE_BYTES``) for ``mget_h2d`` with kept leases, ``mget_h2d`` right after
a rewrite and ``mset_d2h``; ``mset_d2h`` with and without the write reservation, and without its lingering
hints to the worker (``device_calls._linger_us``), and with its last commit sent after the last copies landed
rather than ahead of them (``RemoteBackend.can_land`` off); a small ``mset_d2h`` (4 x 1 MiB, one stage) with
and without lingering hints, against one 4 MiB ``copy_``. Wall time of each call from an idle device and a
worker idle for 3 ms (as between an engine's steps), against one 64 MiB ``copy_``; median and quartiles over
``--iters`` rounds.

    PYTHONPATH=src python3 tools/probe_store_ab.py [--iters 100]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from _copy_trace import SIZE, N, kept_client

from kvstrata.client import device, device_calls
from kvstrata.client.remote import RemoteBackend

IDLE_S = 3e-3  # before each timed call: longer than the worker's polling after a request (200 us)


def main() -> None:
    iters = int(sys.argv[sys.argv.index("--iters") + 1]) if "--iters" in sys.argv else 100
    host = torch.empty(N * SIZE, dtype=torch.uint8).pin_memory()
    big = torch.empty(N * SIZE, dtype=torch.uint8, device="cuda")
    with kept_client("ab") as (kv, keys, src, dst):
        limit = kv._reservation.limit
        stage_sizes = {"1 MiB first stage": 1 << 20, "4 MiB first stage": 4 << 20}
        cases = {}
        for name, first in stage_sizes.items():
            cases[f"mget_h2d kept leases, {name}"] = ("get", first, limit)
            cases[f"mget_h2d after a rewrite, {name}"] = ("rewrite", first, limit)
            cases[f"mset_d2h reserved, {name}"] = ("set", first, limit)
        cases["mset_d2h created (no reservation), 1 MiB first stage"] = ("set", 1 << 20, 0)
        cases["mset_d2h reserved, 4 MiB first stage, no linger"] = ("set", 4 << 20, limit)
        cases["mset_d2h reserved, 4 MiB first stage, commit after landing"] = ("set", 4 << 20, limit)
        cases["one 64 MiB copy_"] = ("copy", 0, limit)
        cases["small: mset_d2h 4 x 1 MiB"] = ("small", 4 << 20, limit)
        cases["small: mset_d2h 4 x 1 MiB, no linger"] = ("small", 4 << 20, limit)
        cases["small: one 4 MiB copy_"] = ("small copy", 0, limit)
        times: dict[str, list[float]] = {c: [] for c in cases}
        linger_us, linger, can_land = device_calls._linger_us, kv._backend.linger, RemoteBackend.can_land
        for it in range(iters + 3):
            for case, (op, first, lim) in cases.items():
                device.FIRST_STAGE_BYTES = first or device.FIRST_STAGE_BYTES
                kv._reservation.limit = lim
                off = case.endswith("no linger")
                device_calls._linger_us = (lambda nbytes: 0) if off else linger_us
                kv._backend.linger = (lambda us: None) if off else linger
                after = case.endswith("after landing")
                RemoteBackend.can_land = property(lambda self: False) if after else can_land
                if op == "rewrite":
                    kv.delete(keys)
                    kv.mset_d2h(keys, src)
                elif op == "get":
                    kv.mget_h2d(keys, dst)  # leases kept from here on
                new = [f"ab/{case[:12]}/{it}/{i}" for i in range(N)]
                torch.cuda.synchronize()
                # An engine's device calls come a step apart (milliseconds), so the worker's thread for
                # the client sleeps when one starts: each call here starts from that state too.
                time.sleep(IDLE_S)
                t0 = time.perf_counter()
                if op == "copy":
                    big.copy_(host, non_blocking=True)
                    torch.cuda.synchronize()
                elif op == "small copy":
                    big[: 4 * SIZE].copy_(host[: 4 * SIZE], non_blocking=True)
                    torch.cuda.synchronize()
                elif op == "small":
                    assert kv.mset_d2h(new[:4], src[:4]) == [None] * 4
                elif op == "set":
                    assert kv.mset_d2h(new, src) == [None] * N
                else:
                    kv.mget_h2d(keys, dst)
                if it >= 3:
                    times[case].append(time.perf_counter() - t0)
                if op in ("set", "small"):
                    kv.delete(new)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
        ceiling = statistics.median(times["one 64 MiB copy_"])
        small = statistics.median(times["small: one 4 MiB copy_"])
        print(f"{iters} rounds, each case once per round in turn; one 64 MiB copy_ {ceiling * 1e6:.0f} us")
        for case, ts in times.items():
            q1, med, q3 = statistics.quantiles(ts, n=4)
            ref = small if case.startswith("small") else ceiling
            print(f"{case:55s} median {med * 1e6:6.0f} us ({q1 * 1e6:5.0f}..{q3 * 1e6:5.0f})  "
                  f"{ref / med:5.3f} of the copy")  # fmt: skip


if __name__ == "__main__":
    main()

"""A kept ``mget_h2d`` and a ``mset_d2h`` of 64 x 1 MiB under variants switched call by call (GPU machine, one real
worker, one client on the legacy default stream, idle between calls):

* ``join``: the copy stream waits for the caller's stream through an event recorded on it (two runtime calls before
  the first copy);
* ``idle check``: one ``cudaStreamQuery`` of the caller's stream; the join only where it has work pending
  (``kvstrata.client.device.SKIP_IDLE_JOIN``, the default since session 25);
* ``no holds`` (``mget_h2d``, with ``--holds``): the idle check, and the kept leases taken and given back without
  the call's own hold on each (the local-read cache's hold alone pins them: safe here, with one thread and no
  eviction). What a client-wide count of kept reads in flight, instead of 64 holds and 64 releases, would save.

Each call after either a one-key request or 2 ms asleep. Per case, the median call and its fraction of one 64 MiB
copy. Before the timing, both ways are checked for order: a kernel on the caller's stream changes the source (or
zeroes the destination) right before the call, and the copy must see its result.

Session 25 (``gpu_check_s25.log``) also measured two ways since removed: a blocking copy stream (which waits for the
legacy stream's earlier work with no call, but makes the legacy stream's later work wait for the copies) and no join
at all (unsafe): both as fast as the idle check.

    PYTHONPATH=src python3 tools/probe_call_variants.py [--rounds 100] [--holds]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from _copy_trace import N, ceilings, kept_client

from kvstrata.client import device


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 100
    ceiling = ceilings()
    with kept_client("lj") as (kv, keys, src, dst):
        for skip in (False, True):  # order check: the caller's last kernels before the copy
            device.SKIP_IDLE_JOIN = skip
            torch.cuda._sleep(2_000_000)  # ~1 ms: the stream is busy when the call starts
            for t in src:
                t[0].mul_(1.5)
            ks = [f"lj/order/{skip}/{i}" for i in range(N)]
            assert kv.mset_d2h(ks, src) == [None] * N
            torch.cuda._sleep(2_000_000)
            for t in dst:
                t[0].zero_()
            kv.mget_h2d(ks, dst)
            assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst)), f"SKIP_IDLE_JOIN={skip}: order broken"
            kv.delete(ks)
        kv.delete(keys)
        assert kv.mset_d2h(keys, src) == [None] * N
        kv.mget_h2d(keys, dst)
        preludes = {"request": lambda: kv.exists(keys[:1]), "sleep": lambda: time.sleep(2e-3)}
        ops, modes = ("mget_h2d", "mset_d2h"), ("join", "idle check")
        cases = [(op, mode, pre) for op in ops for mode in modes for pre in preludes]
        if "--holds" in sys.argv:
            cases += [("mget_h2d", "no holds", pre) for pre in preludes]
        backend, release = kv._backend, kv._release_leases

        def kept_without_holds(ks: list[str]) -> tuple[list[int], list] | None:
            with backend._lock:
                got = backend._local.entries_prefix(ks)
                if not got or not backend._worker_there():
                    return None
                return [e[0] for e in got], [e[1] for e in got]

        got: dict[tuple, list[float]] = {c: [] for c in cases}
        for it in range(rounds + 3):
            order = cases if it % 2 == 0 else cases[::-1]
            for op, mode, pre in order:
                device.SKIP_IDLE_JOIN = mode != "join"
                if mode == "no holds":
                    backend.kept_leases, kv._release_leases = kept_without_holds, lambda ids: release([])
                else:
                    backend.__dict__.pop("kept_leases", None)
                    kv.__dict__.pop("_release_leases", None)
                torch.cuda.synchronize()
                if op == "mset_d2h":
                    ks = [f"lj/w/{it}/{i}" for i in range(N)]
                preludes[pre]()
                t0 = time.perf_counter()
                if op == "mget_h2d":
                    kv.mget_h2d(keys, dst)
                else:
                    assert kv.mset_d2h(ks, src) == [None] * N
                t1 = time.perf_counter()
                if op == "mset_d2h":
                    kv.delete(ks)
                if it >= 3:
                    got[(op, mode, pre)].append(t1 - t0)
        device.SKIP_IDLE_JOIN = True
        assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
    h2d, d2h = ceiling["h2d"] * 1e6, ceiling["d2h"] * 1e6
    print(f"one 64 MiB copy: h2d {h2d:.0f} us, d2h {d2h:.0f} us; {rounds} calls per case")
    for (op, mode, pre), times in got.items():
        call = statistics.median(times)
        c = ceiling["h2d" if op == "mget_h2d" else "d2h"]
        print(f"{op:9s} {mode:10s} after {pre:8s} call {call * 1e6:5.0f} us ({c / call:.3f} of the ceiling)")


if __name__ == "__main__":
    main()

"""Where the host time of one ``mset_d2h`` / ``mget_h2d`` of 64 x 1 MiB goes (GPU machine, real worker).

Wraps the functions a device call goes through (key checks, tensor checks, the copy stream's start,
planning, enqueueing, events, the backend's requests) with time stamps, runs many calls, and prints
for each function the median time of its first entry and last exit (us from the call's start), how
many times it ran per call and its median total time per call, with the call's median wall time and
its end after the last stamp. The wrappers cost ~0.3 us each; the copies are not timed here (see
``tools/trace_store_device.py``). ``--linger 0`` sends no lingering hints (A/B). ``land`` is ``mset_d2h``
saying that a stage's copies landed (its last call: the last byte is in; the call then ends with no request).

    PYTHONPATH=src python3 tools/probe_call_phases.py [--iters 100] [--linger 0]
"""

from __future__ import annotations

import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvstrata
from kvstrata.bench.store import _start_worker
from kvstrata.client import device, device_calls
from kvstrata.server import protocol as P

N, SIZE = 64, 1 << 20
_clock = time.perf_counter
stamps: list[tuple[str, float, float]] = []


def wrap(owner: object, name: str, label: str | None = None) -> None:
    real = getattr(owner, name)
    label = label or name

    def timed(*args, **kwargs):
        t0 = _clock()
        try:
            return real(*args, **kwargs)
        finally:
            stamps.append((label, t0, _clock()))

    setattr(owner, name, timed)


def main() -> None:
    iters = int(sys.argv[sys.argv.index("--iters") + 1]) if "--iters" in sys.argv else 100
    no_linger = "--linger" in sys.argv and sys.argv[sys.argv.index("--linger") + 1] == "0"
    if no_linger:
        device_calls._linger_us = lambda nbytes: 0  # commits carry no hint
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 4 << 30)
        try:
            with kvstrata.connect(address) as kv:
                backend = kv._backend
                if no_linger:
                    backend.linger = lambda us: None  # nor is one sent at the start
                for name in ("check_key", "start", "enqueue", "mark"):
                    wrap(device, name)
                wrap(P, "check_keys")
                wrap(kv, "_plan")
                wrap(kv._reservation, "take", "reservation.take")
                wrap(kv._reservation, "give", "reservation.give")
                calls = ("commit_start", "commit_finish", "land", "linger", "acquire_start", "acquire_finish")
                for name in (*calls, "settle", "release"):
                    wrap(backend, name)
                wrap(kv, "_release_leases")
                src = [[torch.randn(SIZE // 4, device="cuda")] for _ in range(N)]
                dst = [[torch.empty_like(t[0])] for t in src]
                keys = [f"ph/{i}" for i in range(N)]
                kv.mset_d2h(keys, src)
                cases = {
                    "mset_d2h": lambda it: kv.mset_d2h([f"ph/s/{it}/{i}" for i in range(N)], src),
                    "mget_h2d kept leases": lambda it: kv.mget_h2d(keys, dst),
                    "mget_h2d after a rewrite": lambda it: kv.mget_h2d(keys, dst),
                }
                for label, fn in cases.items():
                    firsts, lasts, counts, totals = (collections.defaultdict(list) for _ in range(4))
                    walls, tails = [], []
                    for it in range(iters + 5):
                        if label.endswith("rewrite"):  # the keys changed: their kept leases are stale
                            kv.delete(keys)
                            kv.mset_d2h(keys, src)
                        torch.cuda.synchronize()
                        stamps.clear()
                        t0 = _clock()
                        fn(it)
                        t1 = _clock()
                        if label == "mset_d2h":
                            kv.delete([f"ph/s/{it}/{i}" for i in range(N)])
                        if it < 5:
                            continue
                        walls.append(t1 - t0)
                        tails.append(t1 - max(s[2] for s in stamps))
                        seen: dict[str, list] = {}
                        for name, a, b in stamps:
                            seen.setdefault(name, []).append((a - t0, b - t0))
                        for name, spans in seen.items():
                            firsts[name].append(min(a for a, _ in spans))
                            lasts[name].append(max(b for _, b in spans))
                            counts[name].append(len(spans))
                            totals[name].append(sum(b - a for a, b in spans))
                    med = statistics.median
                    print(f"== {label}: median wall {med(walls) * 1e6:.0f} us, after the last stamp "
                          f"{med(tails) * 1e6:.0f} us ({iters} calls)")  # fmt: skip
                    print(f"  {'function':22s} {'first in':>9s} {'last out':>9s} {'calls':>6s} {'total':>8s}  (us)")
                    for name in sorted(firsts, key=lambda n: med(firsts[n])):
                        print(f"  {name:22s} {med(firsts[name]) * 1e6:9.1f} {med(lasts[name]) * 1e6:9.1f} "
                              f"{med(counts[name]):6.0f} {med(totals[name]) * 1e6:8.1f}")  # fmt: skip
        finally:
            proc.terminate()


if __name__ == "__main__":
    main()

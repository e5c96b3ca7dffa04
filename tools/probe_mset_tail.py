"""``mset_d2h`` of 64 x 1 MiB (GPU machine, real worker) before and after the read rounds ``bench store`` runs
(cold reads of keys rewritten by this client and by another one), each call's wall time in order, with
whether it began by reading a new write reservation's reply (``R``): shows whether the worker's or the client's
state after those rounds, or the reservation's renewal, makes some calls slow. ``--burn``: also after three
processes spun the CPU (plain Python loops, no kvstrata) as long as the read rounds took, and after 0.5 s idle
again: whether the host itself slows down after a busy spell, whatever kept it busy.

    PYTHONPATH=src python3 tools/probe_mset_tail.py [--calls 30]
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvstrata
from kvstrata.bench.store import _start_worker

N, SIZE = 64, 1 << 20


def msets(kv, src, calls: int, tag: str) -> None:
    out = []
    for it in range(calls):
        ks = [f"{tag}/{it}/{i}" for i in range(N)]
        renew = kv._reservation._pending is not None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        assert kv.mset_d2h(ks, src) == [None] * N
        out.append(((time.perf_counter() - t0) * 1e6, renew))
        kv.delete(ks)
    body = " ".join(f"{t:.0f}{'R' if r else ''}" for t, r in out)
    print(f"{tag}: median {statistics.median(t for t, _ in out[3:]):.0f} us; in order: {body}")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def burn(seconds: float, procs: int = 3) -> None:
    """Keep ``procs`` processes busy for ``seconds`` (plain Python loops)."""
    ctx = multiprocessing.get_context("fork")  # the children touch no CUDA: plain loops
    ps = [ctx.Process(target=_spin, args=(seconds,)) for _ in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()


def main() -> None:
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 30
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 2 << 30)
        try:
            with kvstrata.connect(address) as kv, kvstrata.connect(address) as writer:
                src = [[torch.randn(SIZE // 4, device="cuda")] for _ in range(N)]
                dst = [[torch.empty_like(t[0])] for t in src]
                keys = [f"h2d/{i}" for i in range(N)]
                kv.mset_d2h(keys, src)
                msets(kv, src, calls, "before the read rounds")
                t0 = time.perf_counter()
                for _ in range(43):
                    kv.mget_h2d(keys, dst)
                    kv.delete(keys)
                    kv.mset_d2h(keys, src)
                    kv.mget_h2d(keys, dst)
                    writer.delete(keys)
                    writer.mset_d2h(keys, src)
                    writer.exists(keys[:1])
                    kv.mget_h2d(keys, dst)
                rounds_s = time.perf_counter() - t0
                msets(kv, src, calls, f"after the read rounds ({rounds_s:.2f} s)")
                time.sleep(0.5)
                msets(kv, src, calls, "after 0.5 s idle")
                if "--burn" in sys.argv[1:]:
                    burn(rounds_s)
                    msets(kv, src, calls, f"after 3 processes spun the CPU for {rounds_s:.2f} s")
                    time.sleep(0.5)
                    msets(kv, src, calls, "after 0.5 s idle")
        finally:
            proc.terminate()


if __name__ == "__main__":
    main()

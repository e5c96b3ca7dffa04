"""``mset_d2h`` of 64 x 1 MiB (GPU machine, real worker) before and after the read rounds ``bench store`` runs
first (cold reads of keys rewritten by this client and by another one), each call's wall time in order, with
whether it began by reading a new write reservation's reply (``R``): shows whether the worker's or the client's
state after those rounds, or the reservation's renewal, makes some calls slow.

    PYTHONPATH=src python3 tools/probe_mset_tail.py [--calls 30]
"""

from __future__ import annotations

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
                for _ in range(43):
                    kv.mget_h2d(keys, dst)
                    kv.delete(keys)
                    kv.mset_d2h(keys, src)
                    kv.mget_h2d(keys, dst)
                    writer.delete(keys)
                    writer.mset_d2h(keys, src)
                    writer.exists(keys[:1])
                    kv.mget_h2d(keys, dst)
                msets(kv, src, calls, "after the read rounds")
                time.sleep(0.5)
                msets(kv, src, calls, "after 0.5 s idle")
        finally:
            proc.terminate()


if __name__ == "__main__":
    main()

"""Per-key cost of ``mset`` and ``mget`` of many small values, through a real worker and embedded (CPU only): 1,000
keys of 64 B and of 4 KiB, written fresh, rewritten and read back, ``--rounds`` times each; the median and the best
round, in microseconds per key. The worker's ``mput`` handler and the embedded client both go through the store's
``put_many``, whose small values are written many per hold of the store's lock; through a worker, a call of many keys
writes and reads its values of 1 KiB or more through shared memory.

    PYTHONPATH=src python3 tools/probe_batch_writes.py [--rounds 25]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import kvstrata
from kvstrata.bench.store import _start_worker


def _rounds(kv: object, rounds: int, label: str) -> None:
    for n, size in ((1000, 64), (1000, 4096)):
        value = b"x" * size
        fresh, rewrite, read = [], [], []
        for it in range(rounds):
            keys = [f"bw/{it}/{i}" for i in range(n)]
            t = time.perf_counter()
            assert kv.mset([(k, value) for k in keys]) == [None] * n
            fresh.append((time.perf_counter() - t) / n * 1e6)
            t = time.perf_counter()
            kv.mset([(k, value) for k in keys])
            rewrite.append((time.perf_counter() - t) / n * 1e6)
            t = time.perf_counter()
            assert kv.mget(keys) == [value] * n
            read.append((time.perf_counter() - t) / n * 1e6)
            kv.delete(keys)
        print(
            f"{label:9s} {n} x {size:4d} B: fresh {statistics.median(fresh):5.1f} (best {min(fresh):5.1f}) us/key, "
            f"rewritten {statistics.median(rewrite):5.1f} (best {min(rewrite):5.1f}), "
            f"mget {statistics.median(read):5.1f} (best {min(read):5.1f})"
        )


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 25
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 1 << 30)
        try:
            with kvstrata.connect(address) as kv:
                _rounds(kv, rounds, "worker")
        finally:
            proc.terminate()
            proc.wait()
    with kvstrata.connect(embedded=True, memory_bytes=512 << 20) as kv:
        _rounds(kv, rounds, "embedded")


if __name__ == "__main__":
    main()

"""Microbenchmark of the in-process store engine's hot paths (no worker, no transport).

    PYTHONPATH=src python bench/store_engine_micro.py [--n 20000]

Prints microseconds per operation for 4 KiB put/get/acquire+release, the engine's share of a
client round trip, and the time of one 100,000-key ``exists``.
"""

from __future__ import annotations

import argparse
import time

from kvstrata.store import ObjectStore, StoreConfig


def _per_op(fn, n: int) -> float:
    t0 = time.perf_counter()
    fn(n)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    n = args.n
    value = bytes(4096)
    store = ObjectStore(StoreConfig(memory_bytes=1 << 30, numa_node=None, hugepages="off"))
    keys = [f"key-{i}" for i in range(n)]

    def puts(n):
        for k in keys[:n]:
            store.put(k, value)

    def gets(n):
        for k in keys[:n]:
            store.get_bytes(k)

    def leases(n):
        for k in keys[:n]:
            lease = store.acquire(k, owner=1)
            store.release(lease.lease_id)

    def creates(n):
        for k in keys[:n]:
            loc = store.create(k, 4096, owner=1)
            store.buffer(loc)[:] = value
            store.seal(k, owner=1)

    rows = [("put 4 KiB (new keys)", _per_op(puts, n)), ("put 4 KiB (replace)", _per_op(puts, n))]
    rows += [("get_bytes 4 KiB", _per_op(gets, n)), ("acquire+release", _per_op(leases, n))]
    rows += [("create+fill+seal 4 KiB", _per_op(creates, n))]
    many = [f"key-{i}" for i in range(100_000)]
    t0 = time.perf_counter()
    store.exists(many)
    rows.append(("exists x100,000 (one call, total)", (time.perf_counter() - t0) * 1e6))
    store.close()
    for name, us in rows:
        print(f"{name:40s} {us:10.2f} us")


if __name__ == "__main__":
    main()

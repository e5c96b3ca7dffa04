"""GPU benchmark of the store's HBM read cache: ``acquire_device`` loads beside the DMA ceiling.

    PYTHONPATH=src python bench/store_device_load.py [--keys 64] [--size-mib 1] [--out DIR]

Each timed round loads ``--keys`` objects of ``--size-mib`` MiB from the DRAM tier (shared memory,
page-locked by the store because an HBM tier is configured) into HBM, one synchronous H2D copy per
key, and releases the leases. In the same run: the ceiling (one pinned ``copy_`` of the same total
bytes, CUDA-event timed) and a pageable ``copy_`` of the same total. Writes JSON via write_result
and prints a table last. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvstrata.bench._common import device_time, gbps, print_table, write_result
from kvstrata.store import ObjectStore, StoreConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=64)
    ap.add_argument("--size-mib", type=int, default=1)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("store_device_load: needs a CUDA GPU; skipped")
        return 0
    size = args.size_mib << 20
    total = args.keys * size
    store = ObjectStore(
        StoreConfig(memory_bytes=max(4 * total, 256 << 20), gpu_bytes=2 * total + (64 << 20), gpu_device=0)
    )
    keys = [f"k{i}" for i in range(args.keys)]
    payloads = [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(2)]

    def reload() -> None:  # new versions: the next round must load every key again
        for i, k in enumerate(keys):
            store.put(k, payloads[i % 2])

    times = []
    for it in range(args.iters + 2):
        reload()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        leases = [store.acquire_device(k, owner="bench") for k in keys]
        t1 = time.perf_counter()
        for lease in leases:
            store.release(lease.lease_id)
        if it >= 2:  # warm-up rounds
            times.append(t1 - t0)
    store_s = statistics.median(times)
    check = store.acquire_device(keys[0], owner="check")
    assert torch.equal(store.device_tensor(check.location).cpu(), payloads[0]), "HBM copy differs from its source"
    store.release(check.lease_id)
    registered = store.stats()["tiers"]["gpu"]["host_registered"]

    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(total, dtype=torch.uint8)
    ceiling_s = device_time(lambda: dst.copy_(pinned, non_blocking=True))
    pageable_s = device_time(lambda: dst.copy_(pageable))
    store.close()

    rows = [
        {"path": "pinned copy_ (ceiling)", "GB/s": gbps(total, ceiling_s), "% of ceiling": 100.0},
        {
            "path": "pageable copy_",
            "GB/s": gbps(total, pageable_s),
            "% of ceiling": round(100 * ceiling_s / pageable_s, 1),
        },
        {
            "path": f"store.acquire_device x{args.keys}",
            "GB/s": gbps(total, store_s),
            "% of ceiling": round(100 * ceiling_s / store_s, 1),
        },
    ]
    path = write_result(
        "store_device_load",
        {"keys": args.keys, "size": size, "host_registered": registered, "rows": rows},
        args.out,
    )
    print(f"results: {path}; DRAM bytes page-locked for the HBM tier: {registered}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does the host get back the memory of the segments a worker retires while a GPU client had them page-locked?

A worker (4 GiB DRAM tier, 256 MiB segments) is filled with 15 values of 255 MiB, which a GPU client reads with
``mget_h2d`` (registering every segment with CUDA). A 2 GiB value then needs a segment of its own: the worker retires
eight emptied segments (``MADV_REMOVE``) and maps 2 GiB more. The host's ``MemAvailable`` is sampled before the
large value, after it, and after the client's next ``mget_h2d`` (which lets go of what it heard was retired). Where the
client keeps its registrations, the retired pages stay page-locked: the host is 2 GiB poorer for as long as the client
lives. The client then closes, and the host is sampled once more (every page it held goes back).

    PYTHONPATH=src python3 tools/probe_retired_pages.py [--out FILE.json]

The values are evictable: some may be evicted above the high watermark before the GPU read (its JSON says whether
every read found its key, and how many segments the client registered).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvstrata
from kvstrata.bench.store import _stop

MB = 1 << 20
SMALL = 255 * MB
BIG = 2048 * MB


def available() -> int:
    """The host's MemAvailable, in bytes (after a short settle: the kernel frees pages asynchronously)."""
    time.sleep(0.5)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def main() -> None:
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "w.sock"
        cmd = [sys.executable, "-m", "kvstrata.cli.main", "worker", "--socket", str(sock), "--memory", "4GiB"]
        cmd += ["--segment-size", "256MiB", "--disk-dir", "", "--log-level", "warning"]
        proc = subprocess.Popen(cmd)
        try:
            kv = kvstrata.connect(f"unix://{sock}", timeout=60)
            keys = [f"small/{i}" for i in range(15)]
            for i, key in enumerate(keys):
                kv.set(key, bytes([i + 1]) * SMALL, write_mode="evictable")
            dst = [[torch.empty(SMALL, dtype=torch.uint8, device="cuda")] for _ in keys]
            got = kv.mget_h2d(keys, dst)
            registered = len(kv._registrations.bases)
            mapped_before = kv.stats()["tiers"]["memory"]["mapped"]
            kv.delete(keys[:8])  # eight segments empty: what the large value's segment is made of
            start = available()
            kv.set("big", b"\x07" * BIG)
            after_put = available()
            retired = kv.stats()["tiers"]["memory"]["retired_segments"]
            out_t = [[torch.empty(SMALL, dtype=torch.uint8, device="cuda")]]
            kv.mget_h2d([keys[-1]], out_t)  # a cold read: lets go of the retired segments it heard of
            kv.mget_h2d([keys[-1]], out_t)
            after_read = available()
            still = kv._registrations.retiring if hasattr(kv._registrations, "retiring") else None
            kv.close()
            after_close = available()
        finally:
            _stop(proc)
    gib = float(1 << 30)
    result = {
        "registered_segments": registered,
        "mget_results_ok": all(r is None for r in got),
        "mapped_before_bytes": mapped_before,
        "retired_segments": retired,
        "available_drop_after_put_gib": round((start - after_put) / gib, 3),
        "available_drop_after_next_read_gib": round((start - after_read) / gib, 3),
        "available_drop_after_close_gib": round((start - after_close) / gib, 3),
        "retiring_left": still,
    }
    print(json.dumps(result, indent=1))
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""4 KiB ``set`` and cached ``get`` from one client of a real worker, one after another in a loop (any machine):
p50 per op and ops/s, for a few rounds. For A/B runs of two versions' ``src`` in turn (``PYTHONPATH``), where the
bench's rows (a fresh pool process per row) move with the host.

    PYTHONPATH=src python3 tools/probe_set_get.py [--ops 5000] [--rounds 3]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import kvstrata
from kvstrata.bench.store import _start_worker


def main() -> None:
    ops = int(sys.argv[sys.argv.index("--ops") + 1]) if "--ops" in sys.argv else 5000
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 1 << 30)
        try:
            with kvstrata.connect(address, timeout=30) as kv:
                value = os.urandom(4096)
                keys = [f"b/{i}" for i in range(256)]
                for k in keys:
                    kv.set(k, value)
                for r in range(rounds):
                    sets, gets = [], []
                    for i in range(ops):
                        t0 = time.perf_counter()
                        kv.set(keys[i % 256], value)
                        sets.append(time.perf_counter() - t0)
                    for i in range(ops):
                        t0 = time.perf_counter()
                        kv.get(keys[i % 256])
                        gets.append(time.perf_counter() - t0)
                    set_us, get_us = statistics.median(sets) * 1e6, statistics.median(gets) * 1e6
                    print(
                        f"round {r}: set p50 {set_us:.1f} us ({len(sets) / sum(sets):.0f} ops/s), "
                        f"get p50 {get_us:.2f} us ({len(gets) / sum(gets):.0f} ops/s)"
                    )
        finally:
            proc.terminate()


if __name__ == "__main__":
    main()

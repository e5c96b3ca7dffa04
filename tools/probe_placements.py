"""What the placement table (kvstrata.store.placements) costs on this host: the worker's ``publish`` of a
stage's entries and ``withdraw``, and a client's ``lookup`` of a stage's keys (medians of 2,000 calls).

    PYTHONPATH=src python3 tools/probe_placements.py
"""

from __future__ import annotations

import statistics
import time

from kvstrata.store.placements import PlacementHints, PlacementTable
from kvstrata.store.tiers.base import Location


class _Entry:
    __slots__ = ("key", "loc", "mutable", "placed")

    def __init__(self, i: int) -> None:
        self.key, self.loc, self.placed, self.mutable = f"h2d/{i}", Location(0, i << 20, 1 << 20), i + 1, False


def _median_us(fn, iters: int = 2000) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    table = PlacementTable()
    hints = PlacementHints(table.segment)
    entries = [_Entry(i) for i in range(64)]
    keys = [e.key for e in entries]
    table.publish(entries)
    for n in (1, 4, 16, 64):
        print(
            f"{n:3d} keys: publish {_median_us(lambda n=n: table.publish(entries[:n])):6.1f} us, "
            f"lookup {_median_us(lambda n=n: hints.lookup(keys[:n])):6.1f} us"
        )
    print(f"withdraw one: {_median_us(lambda: table.withdraw(entries[5])):.1f} us")
    table.close()


if __name__ == "__main__":
    main()

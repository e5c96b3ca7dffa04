"""What a short pause costs on this host: ``time.sleep`` of a few microseconds (with the thread's timer slack
lowered, as the device-object polling loops do), ``os.sched_yield`` and a zero-timeout ``select`` on a socket.

The polling loops (``kvstrata.devobj.futures``, ``kvstrata.devobj.lead``) sleep ``SPIN_PAUSE_S`` between polls;
where a sleep that short lasts tens of microseconds (a virtual machine's timers), a poll sees an event that late.

    python3 tools/probe_pause.py [--n 2000]
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import time

from kvstrata.devobj.futures import SPIN_PAUSE_S, SPIN_SLACK_NS, _slack_set


def _times(fn, n: int) -> list[float]:
    out = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    n = ap.parse_args().n
    a, b = socket.socketpair()
    old = _slack_set(SPIN_SLACK_NS)
    try:
        rows = {
            f"time.sleep({SPIN_PAUSE_S * 1e6:g} us), slack {SPIN_SLACK_NS} ns": _times(
                lambda: time.sleep(SPIN_PAUSE_S), n
            ),
            "time.sleep(0)": _times(lambda: time.sleep(0), n),
            "os.sched_yield()": _times(os.sched_yield, n),
            "select([socket], 0)": _times(lambda: select.select([a], (), (), 0), n),
            "time.monotonic()": _times(time.monotonic, n),
        }
    finally:
        if old is not None:
            _slack_set(old)
    print(f"{'pause':>42} {'median us':>10} {'p90':>8} {'p99':>8}  ({n} each)")
    for name, ts in rows.items():
        q = statistics.quantiles(ts, n=100)
        print(f"{name:>42} {statistics.median(ts):10.2f} {q[89]:8.2f} {q[98]:8.2f}")
    a.close()
    b.close()


if __name__ == "__main__":
    main()

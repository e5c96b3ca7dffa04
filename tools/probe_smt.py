"""Whether a busy-polling thread slows Python on another CPU of this machine (any machine): the CPU topology the
kernel shows, then a fixed plain-Python loop timed on each CPU in turn, with nothing else running and with a
process spinning (a Python busy loop, as the worker's polling threads are) pinned to CPU 0. A CPU that shares a
physical core with CPU 0 (SMT siblings), or a host that gives this guest less than its vCPUs, shows up as a
slower loop while the spinner runs.

    PYTHONPATH=src python3 tools/probe_smt.py [--spinner-cpu 0]
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

from kvstrata.bench._common import python_loop_us


def _topology() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    print(f"{len(cpus)} CPUs for this process: {cpus[0]}..{cpus[-1]}")
    sib = {}
    for c in cpus:
        base = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            sib[c] = (base / "thread_siblings_list").read_text().strip(), (base / "core_id").read_text().strip()
        except OSError:
            sib[c] = ("?", "?")
    print("cpu: siblings (core id): " + ", ".join(f"{c}: {s} ({k})" for c, (s, k) in sib.items()))
    try:
        model = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
        print(model)
    except (OSError, StopIteration):
        pass


def _spin(cpu: int, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    while not stop.is_set():
        for _ in range(10_000):
            pass


def main() -> None:
    spinner = int(sys.argv[sys.argv.index("--spinner-cpu") + 1]) if "--spinner-cpu" in sys.argv else 0
    _topology()
    cpus = sorted(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("spawn")
    rows = {}
    for label in ("idle", f"spinner on cpu {spinner}"):
        stop = ctx.Event()
        proc = None
        if label != "idle":
            proc = ctx.Process(target=_spin, args=(spinner, stop))
            proc.start()
            time.sleep(0.5)
        for c in cpus:
            if c == spinner and proc is not None:
                continue
            os.sched_setaffinity(0, {c})
            python_loop_us(20)
            rows.setdefault(c, {})[label] = python_loop_us(300)
        if proc is not None:
            stop.set()
            proc.join(5)
    os.sched_setaffinity(0, set(cpus))
    print("plain-Python loop of 1,000 adds, median us per CPU:")
    for c, r in rows.items():
        print(f"  cpu {c:3d}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))


if __name__ == "__main__":
    main()

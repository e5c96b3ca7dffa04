"""Small writes from several client processes through one worker: ops/s, p50 and the worker's CPU per op.

    PYTHONPATH=src python tools/probe_worker_clients.py [--clients 1,2,4,8] [--spin-us 200] [--size 4096] [--ops 20000]
        [--tick]

Starts a ``kvstrata worker`` (its own socket and disk folder), then for each client count runs that many
client processes, each doing ``--ops / clients`` ``set`` calls of ``--size`` bytes on 256 keys of its own,
all starting together once every one is connected and warmed up. Prints, per count: total ops/s (ops over
the slowest client's wall time), the median and 99th-percentile call, the worker process's CPU seconds
(user + system, all its threads) per op, what the worker's lane poller did (``kvstrata.server.lane_poller``:
requests served, polling spells, kicks) and how many lane requests a client had to wake the worker for (0 where
a worker older than the poller lacks the count). With ``--tick``, each client process also runs a thread that sleeps
1 ms at a time, standing for the application's other threads: how late its sleeps end, the wait for the GIL
included, says how much the client's waits for replies hold that thread up.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from typing import Any


def _client(address: str, me: int, n: int, ready: Any, size: int, op: str, tick: bool) -> tuple:
    import threading

    import kvstrata

    kv = kvstrata.connect(address, timeout=30)
    value = os.urandom(size)
    keys = [f"probe/{me}/{i}" for i in range(256)]
    for k in keys:
        kv.set(k, value)
    do = (lambda k: kv.set(k, value)) if op == "set" else kv.get
    ready.wait(120)  # every client of the row connected and warmed up (a fresh process imports kvstrata first)
    late: list[float] = []
    done = threading.Event()
    ticker = threading.Thread(target=_tick, args=(done, late), daemon=True) if tick else None
    if ticker is not None:
        ticker.start()
    times = []
    t_start = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        do(keys[i % 256])
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t_start
    done.set()
    if ticker is not None:
        ticker.join()
    kv.close()
    return times, wall, late


def _tick(done: Any, late: list[float]) -> None:
    """The application's other thread (``--tick``): asks for 1 ms sleeps; records how late each one ended,
    the wait for the GIL included (the client's thread holds it whenever it is not waiting without it)."""
    clock = time.perf_counter
    while not done.is_set():
        t0 = clock()
        time.sleep(1e-3)
        late.append(clock() - t0 - 1e-3)


#: the worker's lane counters shown per row (kvstrata.server.lane_poller)
_LANE_STATS = ("lane_requests_polled", "lane_poll_spells", "lane_poll_kicks", "lane_wakeups")


def _worker_stats(address: str) -> dict:
    import kvstrata

    with kvstrata.connect(address) as kv:
        return kv.stats()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--spin-us", default="200")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--ops", type=int, default=20000)
    ap.add_argument("--op", choices=("set", "get"), default="set")
    ap.add_argument("--tick", action="store_true", help="a thread in each client sleeps 1 ms in turn: its lateness")
    args = ap.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    tmp = tempfile.mkdtemp(prefix="kvstrata-probe-")
    sock = os.path.join(tmp, "worker.sock")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstrata.cli.main",
            "worker",
            "--socket",
            sock,
            "--memory",
            "1GiB",
            "--disk-dir",
            os.path.join(tmp, "disk"),
            "--spin-us",
            args.spin_us,
            "--log-level",
            "warning",
        ],
    )
    try:
        deadline = time.time() + 30
        while not os.path.exists(sock):
            if worker.poll() is not None or time.time() > deadline:
                raise SystemExit("the worker did not start")
            time.sleep(0.05)
        time.sleep(0.3)
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager, ctx.Pool(max(counts)) as pool:
            for c in counts:
                n = max(args.ops // c, 100)
                stats0 = _worker_stats(sock)
                cpu0 = _cpu_seconds(worker.pid)
                ready = manager.Barrier(c)
                res = pool.starmap(_client, [(sock, m, n, ready, args.size, args.op, args.tick) for m in range(c)])
                cpu1 = _cpu_seconds(worker.pid)
                stats1 = _worker_stats(sock)
                lanes = {k: stats1.get(k, 0) - stats0.get(k, 0) for k in _LANE_STATS}
                wall = max(r[1] for r in res)
                calls = sorted(x for r in res for x in r[0])
                p50, p99 = calls[len(calls) // 2] * 1e6, calls[int(len(calls) * 0.99)] * 1e6
                late = sorted(x for r in res for x in r[2])
                ticks = ""
                if late:
                    q50, q99 = late[len(late) // 2] * 1e6, late[int(len(late) * 0.99)] * 1e6
                    ticks = f", 1 ms ticks late p50 {q50:.0f} us p99 {q99:.0f} max {late[-1] * 1e6:.0f}"
                print(
                    f"{args.op} {args.size} B, spin {args.spin_us} us, {c} client(s): {n * c / wall:9.0f} ops/s,"
                    f" p50 {p50:6.1f} us p99 {p99:7.1f}, worker CPU {(cpu1 - cpu0) / (n * c) * 1e6:6.1f} us/op,"
                    f" polled {lanes['lane_requests_polled']} in {lanes['lane_poll_spells']} spells"
                    f" ({lanes['lane_poll_kicks']} kicks), lane wake-ups {lanes['lane_wakeups']}{ticks}",
                    flush=True,
                )
    finally:
        worker.terminate()
        worker.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

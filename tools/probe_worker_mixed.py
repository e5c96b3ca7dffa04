"""A socket request's latency while other clients keep the worker busy with small writes.

    PYTHONPATH=src python tools/probe_worker_mixed.py [--writers 2] [--seconds 6] [--calls 2000] [--connect]

Starts a ``kvstrata worker``, then ``--writers`` client processes that ``set`` 4 KiB values back to back for
``--seconds`` (with several clients connected, the worker's lane poller serves them:
kvstrata.server.lane_poller), and meanwhile times ``--calls`` ``exists`` calls from this process (a request
that always goes over the socket, served by its connection's thread), 0.5 ms apart. Prints their median,
p90, p99 and max, and how many sets the writers did: whether a busy poller delays the worker's other
threads (they share the GIL). ``--connect`` times a whole new client instead (connect, one ``exists``, close),
every 10 ms: beside one writer, between two such clients, that writer is the worker's only client, which its
own connection thread polls for, while the worker's accept thread must wake to take the next one.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time


def _writer(address: str, me: int, seconds: float) -> int:
    import kvstrata

    kv = kvstrata.connect(address, timeout=30)
    value = os.urandom(4096)
    end = time.time() + seconds
    n = 0
    while time.time() < end:
        kv.set(f"mixed/{me}/{n % 64}", value)
        n += 1
    kv.close()
    return n


def _exists_calls(sock: str, calls: int) -> list[float]:
    import kvstrata

    lat = []
    with kvstrata.connect(sock) as kv:
        kv.set("mixed/x", b"1")
        for i in range(calls):
            t0 = time.perf_counter()
            kv.exists(["mixed/x", f"mixed/none/{i}"])
            lat.append(time.perf_counter() - t0)
            time.sleep(0.0005)
    return lat


def _connects(sock: str, calls: int) -> list[float]:
    import kvstrata

    lat = []
    for i in range(calls):
        t0 = time.perf_counter()
        with kvstrata.connect(sock) as kv:
            kv.exists([f"mixed/none/{i}"])
        lat.append(time.perf_counter() - t0)
        time.sleep(0.01)
    return lat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--connect", action="store_true", help="time connect + exists + close, every 10 ms")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="kvstrata-probe-")
    sock = os.path.join(tmp, "worker.sock")
    cmd = [sys.executable, "-m", "kvstrata.cli.main", "worker", "--socket", sock, "--memory", "512MiB"]
    worker = subprocess.Popen([*cmd, "--disk-dir", os.path.join(tmp, "disk"), "--log-level", "warning"])
    try:
        while not os.path.exists(sock):
            if worker.poll() is not None:
                raise SystemExit("the worker did not start")
            time.sleep(0.05)
        time.sleep(0.3)
        with mp.get_context("spawn").Pool(max(1, args.writers)) as pool:
            jobs = [(sock, m, args.seconds) for m in range(args.writers)]
            writes = pool.starmap_async(_writer, jobs)
            time.sleep(min(2.0, args.seconds / 3))  # the writers connected and going
            lat = _connects(sock, args.calls) if args.connect else _exists_calls(sock, args.calls)
            n = writes.get()
        lat.sort()
        q = lambda f: lat[min(int(len(lat) * f), len(lat) - 1)] * 1e6
        what = "connect+exists+close" if args.connect else "exists"
        print(
            f"{what} beside {args.writers} writers ({sum(n)} sets): p50 {q(0.5):.0f} us, p90 {q(0.9):.0f},"
            f" p99 {q(0.99):.0f}, max {lat[-1] * 1e6:.0f}",
            flush=True,
        )
    finally:
        worker.terminate()
        worker.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

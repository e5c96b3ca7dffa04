"""Round trips to a real worker from one client process (GPU machine or any): ping, a 4 KiB set, leases
of 4 and 64 keys right after they were rewritten (4 keys also after an idle gap, when the worker's thread
sleeps: what the first stage of a device call pays), creating + sealing 4 and 64 keys; median and p90 of
each, in us. The worker inherits the environment: ``KVSTRATA_SPIN_US=2000`` tries a longer polling window.

    PYTHONPATH=src python3 tools/probe_worker_rt.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import kvstrata
from kvstrata.bench.store import _start_worker

#: an idle gap longer than the worker's polling (KVSTRATA_SPIN_US, 200 us by default), like a device call's copies
IDLE_S = 2e-3


def timed(label: str, fn, setup=None, iters: int = 300) -> None:
    ts = []
    for it in range(iters + 30):
        if setup is not None:
            setup(it)
        t0 = time.perf_counter()
        fn(it)
        if it >= 30:
            ts.append(time.perf_counter() - t0)
    ts.sort()
    print(f"{label:44s} p50 {statistics.median(ts) * 1e6:7.1f} us   p90 {ts[int(0.9 * len(ts))] * 1e6:7.1f} us")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 1 << 30)
        try:
            with kvstrata.connect(address) as kv:
                b = kv._backend
                value = b"x" * 4096
                keys = [f"rt/{i}" for i in range(64)]
                kv.mset({k: b"y" * 1024 for k in keys})
                timed("ping", lambda it: kv.ping())
                timed("set 4 KiB", lambda it: kv.set("rt/v", value))
                timed("exists 1 key (socket, no lane)", lambda it: kv.exists(["rt/v"]))
                timed("stats (socket, no lane)", lambda it: kv.stats())
                for n in (4, 64):
                    ks = keys[:n]

                    def lease(it, ks=ks):
                        ls = b.acquire(ks, 0, cache="fit")
                        kv._release_leases([x.lease_id for x in ls])

                    def rewrite(it, ks=ks):  # the keys changed: their kept leases are stale
                        kv.delete(ks)
                        kv.mset({k: b"y" * 1024 for k in ks})

                    timed(f"acquire+release {n} keys after a rewrite", lease, setup=rewrite)
                    if n == 4:  # the first stage of a device call that follows the last one's copies

                        def rewrite_idle(it, ks=ks):
                            rewrite(it)
                            time.sleep(IDLE_S)  # the worker's thread stops polling and sleeps

                        timed(f"  the same after {IDLE_S * 1e3:.0f} ms idle", lease, setup=rewrite_idle, iters=100)
                    timed(f"acquire+release {n} keys, cached", lease)
                    opts = {"ttl": None, "nx": True, "mode": "memory"}
                    timed(
                        f"mcreate {n} keys of 1 KiB",
                        lambda it, n=n: b.mcreate([(f"c/{it}/{i}", 1024) for i in range(n)], opts),
                    )
                    timed(f"mseal {n} keys", lambda it, n=n: b.mseal([f"c/{it}/{i}" for i in range(n)]))
        finally:
            proc.terminate()


if __name__ == "__main__":
    main()

"""Where one pipelined request's round trip goes, on both sides of a real worker (GPU machine or any).

For ``acquire`` (right after the keys were rewritten, as a device call's first stage sees it), ``mcreate``
and ``mseal`` of 4 and 64 keys: client encode + send, worker wake-up + decode, handler, reply encode +
send, client wake-up + decode, client finish; medians in us. Both processes stamp ``time.perf_counter``
(CLOCK_MONOTONIC, one clock for the machine). The worker runs this file with ``--worker``: the same
worker, its connection's recv/send and handler wrapped to record stamps, fetched with a ``ping``.

    PYTHONPATH=src python3 tools/probe_worker_phases.py [--iters 200]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _worker_main(argv: list[str]) -> int:
    from kvstrata.cli.main import main
    from kvstrata.server import worker as W
    from kvstrata.transport import stream as S

    log: list[tuple] = []
    cur: dict = {}
    recv, send, handle = S.StreamConnection.recv, S.StreamConnection.send, W.Session.handle

    def stamped_recv(self, timeout=None, *, spin=0.0):
        got = recv(self, timeout, spin=spin)
        cur["recv"] = time.perf_counter()
        return got

    def stamped_send(self, msg, fds=()):
        t = time.perf_counter()
        send(self, msg, fds)
        if "tag" in msg and "h1" in cur:
            log.append((msg["tag"], cur["recv"], cur["h0"], cur["h1"], t, time.perf_counter()))

    def stamped_handle(self, msg):
        if msg.get("op") == "ping" and msg.get("stamps"):
            out = list(log)
            log.clear()
            return {"stamps": out}
        cur["h0"] = time.perf_counter()
        reply = handle(self, msg)
        cur["h1"] = time.perf_counter()
        return reply

    S.StreamConnection.recv, S.StreamConnection.send, W.Session.handle = stamped_recv, stamped_send, stamped_handle
    return main(argv)


def main() -> None:
    import kvstrata
    from kvstrata.transport import stream as S

    iters = int(sys.argv[sys.argv.index("--iters") + 1]) if "--iters" in sys.argv else 200
    stamps: dict[int, dict] = {}
    send, recv = S.StreamConnection.send, S.StreamConnection.recv

    def stamped_send(self, msg, fds=()):
        t = time.perf_counter()
        send(self, msg, fds)
        if "tag" in msg:
            stamps[msg["tag"]] = {"sent": time.perf_counter(), "t_send": t}

    def stamped_recv(self, timeout=None, *, spin=0.0):
        got = recv(self, timeout, spin=spin)
        tag = got[0].get("tag")
        if tag in stamps:
            stamps[tag]["got"] = time.perf_counter()
        return got

    S.StreamConnection.send, S.StreamConnection.recv = stamped_send, stamped_recv
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "kvstrata.sock"
        cmd = [sys.executable, __file__, "--worker", "worker", "--socket", str(sock), "--memory", str(1 << 30)]
        proc = subprocess.Popen([*cmd, "--disk-dir", "", "--log-level", "warning"], env=dict(os.environ))
        try:
            kvstrata.connect(f"unix://{sock}", timeout=60).close()
            rows: dict[str, list[dict]] = {}
            with kvstrata.connect(f"unix://{sock}") as kv:
                b = kv._backend
                opts = {"ttl": None, "nx": True, "mode": "memory"}
                for n in (4, 64):
                    ks = [f"ph/{i}" for i in range(n)]
                    for it in range(iters + 20):
                        kv.delete(ks)  # the keys change: kept leases go stale, a lease round trip follows
                        kv.mset({k: b"y" * 1024 for k in ks})
                        b.request({"op": "ping", "stamps": True})
                        done = []
                        t0 = time.perf_counter()
                        token = b.acquire_start(ks, 0, cache="fit", carry=False)
                        leases = b.acquire_finish(token)
                        done.append((f"acquire {n}", token[3][0], t0, time.perf_counter()))
                        kv._release_leases([x.lease_id for x in leases])
                        items = [(f"ph/c/{it}/{i}", 1024) for i in range(n)]
                        t0 = time.perf_counter()
                        tag = b.mcreate_start(items, opts)
                        b.mcreate_finish(tag)
                        done.append((f"mcreate {n}", tag, t0, time.perf_counter()))
                        t0 = time.perf_counter()
                        token = b.mseal_start([k for k, _ in items])
                        b.mseal_finish(token)
                        done.append((f"mseal {n}", token[0], t0, time.perf_counter()))
                        worker = {s[0]: s for s in b.request({"op": "ping", "stamps": True})["stamps"]}
                        for name, tag, start, end in done:
                            c, w = stamps.pop(tag), worker.get(tag)
                            if it >= 20 and w is not None:
                                rows.setdefault(name, []).append({**c, "start": start, "end": end, "w": w})
        finally:
            proc.terminate()
            proc.wait()
    phases = (
        ("total", lambda r: r["end"] - r["start"]),
        ("cl enc+send", lambda r: r["sent"] - r["start"]),
        ("wk wake+dec", lambda r: r["w"][1] - r["sent"]),
        ("handler", lambda r: r["w"][3] - r["w"][2]),
        ("rep enc+send", lambda r: r["w"][5] - r["w"][3]),
        ("cl wake+dec", lambda r: r["got"] - r["w"][5]),
        ("cl finish", lambda r: r["end"] - r["got"]),
    )
    print(f"{'request':12s}" + "".join(f"{name:>14s}" for name, _ in phases) + "   (medians, us)")
    for name, rs in rows.items():
        print(f"{name:12s}" + "".join(f"{statistics.median(map(fn, rs)) * 1e6:14.1f}" for _, fn in phases))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.exit(_worker_main(sys.argv[sys.argv.index("--worker") + 1 :]))
    main()

"""Where the host time of one ``mset_d2h`` / ``mget_h2d`` of 64 x 1 MiB goes (GPU machine, real worker).

Wraps the functions a device call goes through (key checks, tensor checks, the copy stream's start,
planning, enqueueing, events, the backend's requests) with time stamps, runs many calls, and prints
for each function the median time of its first entry and last exit (us from the call's start), how
many times it ran per call and its median total time per call, with the call's median wall time and
its end after the last stamp. The wrappers cost ~0.3 us each; the copies are not timed here (see
``tools/trace_store_device.py``). ``--linger 0`` sends no lingering hints (A/B).

The worker runs this file too (``--worker``), with its handling of ``mset_d2h``'s last commit (held until
the client says its copies landed: kvstrata.server.lane) stamped: the table after the calls splits the time
from the client's last ``land()`` to the end of its last ``commit_finish`` into the worker seeing the word,
its handler, its reply's send and the client reading it, and says how often the worker was still busy with
an earlier request when the last word came.

    PYTHONPATH=src python3 tools/probe_call_phases.py [--iters 100] [--linger 0]
"""

from __future__ import annotations

import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvstrata
from kvstrata.client import device, device_calls
from kvstrata.server import protocol as P

N, SIZE = 64, 1 << 20
_clock = time.perf_counter
stamps: list[tuple[str, float, float]] = []


def wrap(owner: object, name: str, label: str | None = None) -> None:
    real = getattr(owner, name)
    label = label or name

    def timed(*args, **kwargs):
        t0 = _clock()
        try:
            return real(*args, **kwargs)
        finally:
            stamps.append((label, t0, _clock()))

    setattr(owner, name, timed)


def _worker_main(argv: list[str]) -> int:
    from kvstrata.cli.main import main as cli_main
    from kvstrata.server import worker as W

    log: list[tuple] = []
    handle, await_landing = W.Session.handle, W.Session.await_landing
    seen: dict = {}

    def stamped_await(self, tag):
        got = await_landing(self, tag)
        seen[tag] = _clock()
        return got

    def stamped_handle(self, msg):
        if msg.get("op") == "ping" and msg.get("stamps"):
            out = list(log)
            log.clear()
            return {"stamps": out}
        h0 = _clock()
        reply = handle(self, msg)
        if msg.get("landing"):
            log.append((msg["tag"], h0, seen.pop(msg["tag"], 0.0), _clock()))
        return reply

    W.Session.handle, W.Session.await_landing = stamped_handle, stamped_await
    return cli_main(argv)


def _start_worker(tmp: Path) -> tuple[subprocess.Popen, str]:
    sock = tmp / "kvstrata.sock"
    cmd = [sys.executable, __file__, "--worker", "worker", "--socket", str(sock), "--memory", str(4 << 30)]
    proc = subprocess.Popen([*cmd, "--disk-dir", "", "--log-level", "warning"], env=dict(os.environ))
    kvstrata.connect(f"unix://{sock}", timeout=60).close()
    return proc, f"unix://{sock}"


def main() -> None:
    iters = int(sys.argv[sys.argv.index("--iters") + 1]) if "--iters" in sys.argv else 100
    no_linger = "--linger" in sys.argv and sys.argv[sys.argv.index("--linger") + 1] == "0"
    if no_linger:
        device_calls._linger_us = lambda nbytes: 0  # commits carry no hint
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp))
        try:
            with kvstrata.connect(address) as kv:
                backend = kv._backend
                if no_linger:
                    backend.linger = lambda us: None  # nor is one sent at the start
                for name in ("check_key", "start", "enqueue", "mark"):
                    wrap(device, name)
                wrap(P, "check_keys")
                wrap(kv, "_plan")
                wrap(kv._reservation, "take", "reservation.take")
                wrap(kv._reservation, "give", "reservation.give")
                for name in ("commit_start", "commit_finish", "land", "linger", "acquire_start", "acquire_finish"):
                    wrap(backend, name)
                wrap(kv, "_release_leases")
                lands: dict[int, float] = {}  # tag -> when the client said it landed
                finished: dict[int, float] = {}  # tag -> when its commit_finish returned
                land_real, finish_real = backend.land, backend.commit_finish

                def land_stamped(token, ok=True):
                    land_real(token, ok)
                    lands[token[0]] = _clock()

                def finish_stamped(token):
                    try:
                        return finish_real(token)
                    finally:
                        finished[token[0]] = _clock()

                backend.land, backend.commit_finish = land_stamped, finish_stamped
                held_tails: list[tuple[float, ...]] = []
                src = [[torch.randn(SIZE // 4, device="cuda")] for _ in range(N)]
                dst = [[torch.empty_like(t[0])] for t in src]
                keys = [f"ph/{i}" for i in range(N)]
                kv.mset_d2h(keys, src)
                cases = {
                    "mset_d2h": lambda it: kv.mset_d2h([f"ph/s/{it}/{i}" for i in range(N)], src),
                    "mget_h2d kept leases": lambda it: kv.mget_h2d(keys, dst),
                }
                for label, fn in cases.items():
                    firsts, lasts, counts, totals = (collections.defaultdict(list) for _ in range(4))
                    walls, tails = [], []
                    for it in range(iters + 5):
                        torch.cuda.synchronize()
                        stamps.clear()
                        t0 = _clock()
                        fn(it)
                        t1 = _clock()
                        if label == "mset_d2h":
                            kv.delete([f"ph/s/{it}/{i}" for i in range(N)])
                            held = backend.request({"op": "ping", "stamps": True})["stamps"]
                            if held and it >= 5:
                                tag, h0, saw, h1 = held[-1]  # the call's last commit
                                if tag in lands and tag in finished:
                                    held_tails.append((lands[tag], h0, saw, h1, finished[tag]))
                            lands.clear()
                            finished.clear()
                        if it < 5:
                            continue
                        walls.append(t1 - t0)
                        tails.append(t1 - max(s[2] for s in stamps))
                        seen: dict[str, list] = {}
                        for name, a, b in stamps:
                            seen.setdefault(name, []).append((a - t0, b - t0))
                        for name, spans in seen.items():
                            firsts[name].append(min(a for a, _ in spans))
                            lasts[name].append(max(b for _, b in spans))
                            counts[name].append(len(spans))
                            totals[name].append(sum(b - a for a, b in spans))
                    med = statistics.median
                    print(f"== {label}: median wall {med(walls) * 1e6:.0f} us, after the last stamp "
                          f"{med(tails) * 1e6:.0f} us ({iters} calls)")  # fmt: skip
                    print(f"  {'function':22s} {'first in':>9s} {'last out':>9s} {'calls':>6s} {'total':>8s}  (us)")
                    for name in sorted(firsts, key=lambda n: med(firsts[n])):
                        print(f"  {name:22s} {med(firsts[name]) * 1e6:9.1f} {med(lasts[name]) * 1e6:9.1f} "
                              f"{med(counts[name]):6.0f} {med(totals[name]) * 1e6:8.1f}")  # fmt: skip
                if held_tails:
                    med = statistics.median
                    print(f"== mset_d2h's last commit after the client's last land() ({len(held_tails)} calls, us):")
                    print(f"  worker saw the word {med(t[2] - t[0] for t in held_tails) * 1e6:7.1f}   "
                          f"handler after it {med(t[3] - t[2] for t in held_tails) * 1e6:7.1f}   "
                          f"to the client's finish {med(t[4] - t[3] for t in held_tails) * 1e6:7.1f}   "
                          f"total {med(t[4] - t[0] for t in held_tails) * 1e6:7.1f}")  # fmt: skip
                    behind = sum(t[1] > t[0] for t in held_tails)
                    print(
                        f"  the worker started on it after the word came (busy with earlier ones) in {behind} "
                        f"of {len(held_tails)} calls (median start {med(t[1] - t[0] for t in held_tails) * 1e6:.1f} us)"
                    )
        finally:
            proc.terminate()


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.exit(_worker_main(sys.argv[sys.argv.index("--worker") + 1 :]))
    main()

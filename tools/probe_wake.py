"""What waking a thread that waits on a Unix socket costs on this host, after the machine sat idle a while.

A server process answers 64-byte pings on a socketpair; the client sends one after an idle gap and times the
round trip. The server waits for each ping in one of three ways:

* ``block``: one blocking ``recv`` (what a worker connection thread does when it does not poll);
* ``doze``: ``select`` with a 50 us timeout, again and again, then ``recv`` (a thread that wakes up every
  50 us: its core never goes into a deep idle, for a few percent of one core);
* ``spin``: non-blocking ``recv`` and ``sched_yield`` in a loop (a full core).

On a virtual machine a vCPU that idles more than the hypervisor's halt-polling window is descheduled, and
waking it costs far more than a thread wake-up on bare metal; idle gaps of 0, 0.2, 1 and 5 ms show where.

Run: ``python tools/probe_wake.py [--rounds 300]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import select
import socket
import statistics
import time

MODES = ("block", "doze", "spin")
GAPS_MS = (0.0, 0.2, 1.0, 5.0)


def _server(sock: socket.socket, mode: str) -> None:
    while True:
        if mode == "doze":
            while not select.select([sock], [], [], 50e-6)[0]:
                pass
            msg = sock.recv(64)
        elif mode == "spin":
            sock.setblocking(False)
            while True:
                try:
                    msg = sock.recv(64)
                    break
                except BlockingIOError:
                    os.sched_yield()
            sock.setblocking(True)
        else:
            msg = sock.recv(64)
        if not msg or msg == b"q" * 64:
            return
        sock.sendall(msg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    ctx = mp.get_context("fork")
    print(f"{os.cpu_count()} CPUs; median (p90) round trip in us, the client spinning for the reply")
    print(f"{'server waits by':<16}" + "".join(f"{f'idle {g:g} ms':>20}" for g in GAPS_MS))
    for mode in MODES:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        p = ctx.Process(target=_server, args=(b, mode))
        p.start()
        a.setblocking(False)
        row = f"{mode:<16}"
        for gap in GAPS_MS:
            rts = []
            for _ in range(args.rounds):
                if gap:
                    time.sleep(gap / 1e3)
                t0 = time.perf_counter()
                a.send(b"p" * 64)
                while True:
                    try:
                        a.recv(64)
                        break
                    except BlockingIOError:
                        pass
                rts.append(time.perf_counter() - t0)
            rts.sort()
            row += f"{statistics.median(rts) * 1e6:>11.1f} ({rts[int(0.9 * len(rts))] * 1e6:6.1f})"
        print(row, flush=True)
        a.setblocking(True)
        a.sendall(b"q" * 64)
        p.join(5)
        a.close()


if __name__ == "__main__":
    main()

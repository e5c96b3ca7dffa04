"""set / get throughput of large values through one worker process over TCP, beside raw loopback TCP from Python.

    python tools/probe_tcp_values.py [--sizes-kib 256,4096,65536] [--rounds 4]
    PYTHONPATH=/tmp/old_src/src python tools/probe_tcp_values.py   # another version's code, for an A/B

Each size: as many keys as make ~256 MiB (4 to 64), written then read back, best of ``--rounds`` rounds; the last
value read is checked. The ceiling row: one 64 MiB ``sendall`` a round between two threads of this process.
``get_buffers``: the values as the reply brought them, not copied into bytes (TCP views, session 43 on).
(Session 41 measured the TCP attachments with it: bench/results/README.md.)
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

WORKER = """
import sys, time
from kvstrata.server import Worker, WorkerConfig
w = Worker(WorkerConfig(socket="tcp://127.0.0.1:0", memory=2 << 30, disk_dir="")).start()
print(w.address, flush=True)
sys.stdin.read()  # (until the probe closes the pipe)
w.stop()
"""


def raw_loopback_gbps(nbytes: int = 64 << 20, rounds: int = 5) -> float:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def sink() -> None:
        peer, _ = server.accept()
        view = memoryview(bytearray(nbytes))
        for _ in range(rounds):
            got = 0
            while got < nbytes:
                got += peer.recv_into(view[got:], nbytes - got)
            peer.sendall(b"k")
        peer.close()

    threading.Thread(target=sink, daemon=True).start()
    client = socket.create_connection(server.getsockname())
    data = bytes(nbytes)
    start = time.perf_counter()
    for _ in range(rounds):
        client.sendall(data)
        client.recv(1)
    elapsed = time.perf_counter() - start
    client.close()
    server.close()
    return rounds * nbytes / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-kib", default="256,4096,65536")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    import kvstrata

    print(f"kvstrata from {os.path.dirname(kvstrata.__file__)}")
    print(f"raw loopback TCP (one 64 MiB sendall a round): {raw_loopback_gbps():.2f} GB/s")
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        worker = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            address = worker.stdout.readline().strip()
            with kvstrata.connect(address=address) as kv:
                for kib in map(int, args.sizes_kib.split(",")):
                    size = kib << 10
                    value = np.random.default_rng(kib).integers(0, 255, size, dtype=np.uint8).tobytes()
                    n = max(4, min(64, (256 << 20) // size))
                    best_set = best_get = best_views = float("inf")
                    views = hasattr(kv, "get_buffers") and "tcp" in address  # (TCP views: session 43 on)
                    for _ in range(args.rounds):
                        start = time.perf_counter()
                        for i in range(n):
                            kv.set(f"k{kib}-{i}", value)
                        best_set = min(best_set, (time.perf_counter() - start) / n)
                        start = time.perf_counter()
                        for i in range(n):
                            got = kv.get(f"k{kib}-{i}")
                        best_get = min(best_get, (time.perf_counter() - start) / n)
                        if views:
                            start = time.perf_counter()
                            for i in range(n):
                                try:
                                    buffer = kv.get_buffers([f"k{kib}-{i}"])[0]
                                except kvstrata.ServerError:  # (a version whose TCP clients have no views)
                                    views = False
                                    break
                                buffer.release()
                            else:
                                best_views = min(best_views, (time.perf_counter() - start) / n)
                    assert got == value, "a value came back different"
                    row = f"{kib:>8} KiB  set {size / best_set / 1e9:5.2f} GB/s  get {size / best_get / 1e9:5.2f} GB/s"
                    if views:
                        row += f"  get_buffers {size / best_views / 1e9:5.2f} GB/s"
                    print(row)
        finally:
            worker.stdin.close()
            worker.wait(30)


if __name__ == "__main__":
    main()

"""Host-side timeline of a cold ``mget_h2d`` of 64 x 1 MiB through a real worker, with no GPU: when each lease
request goes out, each stage's copies are queued and each answer is read, relative to the call's start (medians
over rounds). The copies themselves are skipped (CPU tensors would copy inline and hide the host's own work), and
the stages are cut as a GPU call's are (4, 6, 9, 14, 16, 15 keys). Cases: leases kept (cached), right after this
client rewrote the keys, right after another client did.

    PYTHONPATH=src python3 tools/probe_cold_read_cpu.py [--rounds 40]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvstrata
from kvstrata.bench.store import _start_worker
from kvstrata.client import device

CUTS = [4, 6, 9, 14, 16, 15]  # a GPU call's stages of 1 MiB keys (device.stages)


def gpu_like_stages(n_keys, tensor_lists):
    device.check_outer(n_keys, tensor_lists)
    lo = 0
    for cut in CUTS:
        hi = min(n_keys, lo + cut)
        checked = [device.check_key(tensor_lists[i], i) for i in range(lo, hi)]
        yield device.Stage(lo, hi, [c[0] for c in checked], [c[1] for c in checked], None)
        lo = hi
        if lo >= n_keys:
            return


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 40
    n, size = 64, 1 << 20
    events: list[tuple[float, str]] = []
    real_enqueue = device.enqueue

    def enqueue(runs, *a, **kw):  # recorded, not run: the host's own work is what is timed
        events.append((time.perf_counter(), f"copies ({len(runs.host)} runs)"))

    device.enqueue = enqueue
    device.stages = gpu_like_stages
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 2 << 30)
        try:
            kv, writer = kvstrata.connect(address), kvstrata.connect(address)
            backend = kv._backend
            real_send, real_finish = backend.send_tagged, backend.acquire_finish

            def send(msg, **kw):
                if msg.get("op") == "acquire":
                    events.append((time.perf_counter(), f"request ({len(msg['keys'])} keys)"))
                return real_send(msg, **kw)

            def finish(token):
                got = real_finish(token)
                events.append((time.perf_counter(), "answer read"))
                return got

            backend.send_tagged, backend.acquire_finish = send, finish
            src = [[torch.full((size,), i % 251, dtype=torch.uint8)] for i in range(n)]
            dst = [[torch.empty(size, dtype=torch.uint8)] for _ in range(n)]
            keys = [f"k/{i}" for i in range(n)]
            device.enqueue = real_enqueue
            kv.mset_d2h(keys, src)
            kv.mset_d2h(keys[:1], src[:1])  # a reservation for the rewrites
            device.enqueue = enqueue
            for label in ("cached", "after its own rewrite", "after another client's rewrite"):
                timelines, totals = [], []
                for _ in range(rounds):
                    if label.startswith("after its"):
                        kv.delete(keys)
                        device.enqueue = real_enqueue
                        kv.mset_d2h(keys, src)
                        device.enqueue = enqueue
                    elif label.startswith("after another"):
                        writer.delete(keys)
                        device.enqueue = real_enqueue
                        writer.mset_d2h(keys, src)
                        device.enqueue = enqueue
                        writer.exists(keys[:1])
                    events.clear()
                    t0 = time.perf_counter()
                    res = kv.mget_h2d(keys, dst)
                    totals.append(time.perf_counter() - t0)
                    assert res == [None] * n, res
                    timelines.append([(t - t0, what) for t, what in events])
                steps = [[(t, w) for t, w in tl] for tl in timelines]
                shape = [w for _, w in steps[-1]]
                same = [tl for tl in steps if [w for _, w in tl] == shape]
                print(f"== {label}: median {statistics.median(totals) * 1e6:.0f} us host "
                      f"({len(same)} of {rounds} rounds in the last one's order)")  # fmt: skip
                for j, what in enumerate(shape):
                    print(f"  {statistics.median(tl[j][0] for tl in same) * 1e6:7.1f} us  {what}")
            kv.close()
            writer.close()
        finally:
            proc.terminate()


if __name__ == "__main__":
    main()

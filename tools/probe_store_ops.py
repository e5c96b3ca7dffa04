"""The worker requests behind each of ``kvstrata bench store``'s device rows, and each row's time, on this client.

Runs the bench's round of five device cases (64 x 1 MiB ``mget_h2d`` with leases kept, after another key's write,
after the keys' own rewrite, after another client's rewrite; ``mset_d2h`` of fresh keys) against a worker process
started as the bench starts it, counting the requests the client sends in each call (tagged, i.e. pipelined, and
plain, by operation). Two code versions that send the same requests per case differ in host work only; a run
whose every case is slower, requests unchanged, drew a slower host (the H200 host drifts for minutes).

``--before sleep`` sleeps 2 ms before each timed call, ``--before request`` sends a one-key ``exists`` first (is a
case slower for what ran just before it: work left over in the client or worker, or a thread gone cold?).

    PYTHONPATH=src python3 tools/probe_store_ops.py [--rounds 23] [--before none|sleep|request]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
from pathlib import Path

CASES = ("kept", "other key", "own rewrite", "written", "write")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=23, help="rounds of the five cases (the first 3 untimed)")
    ap.add_argument("--before", choices=("none", "sleep", "request"), default="none", help="before each timed call")
    args = ap.parse_args()
    import torch

    import kvstrata
    from kvstrata.bench.store import _start_worker

    n, size = 64, 1 << 20
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 2 << 30)
        try:
            with kvstrata.connect(address) as kv, kvstrata.connect(address) as writer:
                backend = kv._backend
                sent: collections.Counter = collections.Counter()
                send_tagged, request = backend.send_tagged, backend.request

                def counted_tagged(msg: dict, **kw):
                    sent["tagged " + str(msg.get("op"))] += 1
                    return send_tagged(msg, **kw)

                def counted(msg: dict, *a, **kw):
                    sent[str(msg.get("op"))] += 1
                    return request(msg, *a, **kw)

                backend.send_tagged, backend.request = counted_tagged, counted
                src = [[torch.randn(size // 4, device="cuda")] for _ in range(n)]
                keys = [f"h2d/{i}" for i in range(n)]
                assert kv.mset_d2h(keys, src) == [None] * n
                dst = [[torch.empty_like(t[0])] for t in src]
                kv.mget_h2d(keys, dst)
                ops: dict[str, list] = collections.defaultdict(list)
                times: dict[str, list] = collections.defaultdict(list)
                for it in range(args.rounds):
                    for case in CASES:
                        if case == "other key":
                            kv.set(f"h2d/other/{it}", b"x")
                        elif case == "own rewrite":
                            kv.delete(keys)
                            assert kv.mset_d2h(keys, src) == [None] * n
                        elif case == "written":
                            writer.delete(keys)
                            assert writer.mset_d2h(keys, src) == [None] * n
                            writer.exists(keys[:1])
                        fresh = [f"d2h/{it}/{i}" for i in range(n)]
                        if args.before == "sleep":
                            time.sleep(0.002)
                        elif args.before == "request":
                            kv.exists(keys[:1])
                        sent.clear()
                        t0 = time.perf_counter()
                        if case == "write":
                            assert kv.mset_d2h(fresh, src) == [None] * n
                        else:
                            kv.mget_h2d(keys, dst)
                        times[case].append(time.perf_counter() - t0)
                        ops[case].append(dict(sent))
                        if case == "write":
                            kv.delete(fresh)
                print(f"before each timed call: {args.before}")
                for case in CASES:
                    med = statistics.median(times[case][3:]) * 1e6
                    print(f"{case:12} median {med:7.0f} us  requests of the last 3 calls: {ops[case][-3:]}")
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()

"""Where a device call's time goes beyond its DMA (GPU machine, real worker): a kept ``mget_h2d``, one right after
this client rewrote its keys (cold: the placement table's one pass) and a fresh ``mset_d2h`` of 64 x 1 MiB, each
after a one-key request as in bench store. Each call is split into the host's time to its first copy batch, to its
last batch, the copy stream's span from its first batch to its last byte (CUDA events: one recorded before the
first batch, one beside each of the call's marks), and the call's return. Medians over ``--calls`` calls, beside
one 64 MiB copy (the ceiling) and the host's loop speed (``python_loop_us``) before and after.

    PYTHONPATH=src python3 tools/probe_kept_split.py [--calls 100]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from _copy_trace import CopyTrace, ceilings, kept_client

from kvstrata.bench._common import python_loop_us

N = 64


def main() -> None:
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 100
    top = ceilings()
    h2d, d2h = top["h2d"], top["d2h"]
    print(f"one 64 MiB copy: host to device {h2d * 1e6:.0f} us, device to host {d2h * 1e6:.0f} us")
    trace = CopyTrace()
    with kept_client("ks") as (kv, keys, src, dst):
        loops = [python_loop_us()]
        rows: dict[str, list[tuple[float, ...]]] = {"mget_h2d kept": [], "mget_h2d cold": [], "mset_d2h": []}
        for it in range(calls + 3):
            for case, out in rows.items():
                fresh = [f"kw/{it}/{i}" for i in range(N)]
                if case == "mget_h2d cold":  # rewritten by this client: the placement table's one pass
                    kv.delete(keys)
                    assert kv.mset_d2h(keys, src) == [None] * N
                kv.exists(keys[:1])  # a request just before the call, as in bench store
                torch.cuda.synchronize()
                trace.clear()
                t0 = time.perf_counter()
                if case == "mset_d2h":
                    kv.mset_d2h(fresh, src)
                else:
                    kv.mget_h2d(keys, dst)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                span = trace.span() * 1e6
                if case == "mset_d2h":
                    kv.delete(fresh)
                if it >= 3:
                    batches = trace.batches
                    out.append(((batches[0] - t0) * 1e6, (batches[-1] - t0) * 1e6, span, (t1 - t0) * 1e6))
        loops.append(python_loop_us())
        print(f"python_loop_us before / after: {loops[0]:.1f} / {loops[1]:.1f}")
        for case, out in rows.items():
            first, last, span, total = (statistics.median(c) for c in zip(*out))
            ceiling = h2d if case.startswith("mget") else d2h
            print(
                f"{case}: first batch at {first:.0f} us, last batch at {last:.0f}, copy stream busy {span:.0f}"
                f" from the first batch, call {total:.0f} ({ceiling * 1e6 / total:.3f} of the ceiling;"
                f" the stream's span {ceiling * 1e6 / span:.3f})"
            )


if __name__ == "__main__":
    main()

"""Host issue time vs device time of the store+load pair (bench transfer's store_and_load: 32 layers, 32 KiB
chunks, 2 x 128 MiB) per method pair, and a cProfile of the staging pair's issue. If issuing a pair takes
about as long as the device needs to run it, the two directions stop overlapping. (GPU machine.)

"stepped": calibration.store_and_load (the two calls stepped piece by piece in turn); "one after the
other": two plain transfer_blocks calls on two streams, the store issued whole before the load (an engine's
order), which overlaps only as far as one call's host issue is short.

    PYTHONPATH=src python3 tools/probe_store_load_host.py
"""

import cProfile
import io
import pstats
import statistics
import time

import torch

from kvstrata.bench.transfer import Setup
from kvstrata.ops import calibration, transfer_blocks

a, b = Setup(32, 32 << 10, 128 << 20, seed=1), Setup(32, 32 << 10, 128 << 20, seed=2)
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()


def sequential(x: str, y: str) -> None:
    cur = torch.cuda.current_stream()
    s1.wait_stream(cur)
    s2.wait_stream(cur)
    with torch.cuda.stream(s1):
        transfer_blocks(a.layout, a.pool, *a.ids(x), direction="d2h", method=x, check=False, concurrent=True)
    with torch.cuda.stream(s2):
        transfer_blocks(b.layout, b.pool, *b.ids(y), direction="h2d", method=y, check=False, concurrent=True)
    cur.wait_stream(s1)
    cur.wait_stream(s2)


cases = [("stepped", x, y) for x, y in (("staging", "staging"), ("auto", "auto"), ("zero_copy", "zero_copy"))]
cases += [("one after the other", x, x) for x in ("staging", "auto")]
for how, x, y in cases:
    if how == "stepped":
        fn = lambda x=x, y=y: calibration.store_and_load(
            (a.layout, a.pool, *a.ids(x)), (b.layout, b.pool, *b.ids(y)), x, y
        )
    else:
        fn = lambda x=x, y=y: sequential(x, y)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    host, dev = [], []
    for _ in range(10):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        fn()
        e1.record()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        dev.append(e0.elapsed_time(e1) / 1e3)
    h, d = statistics.median(host), statistics.median(dev)
    print(f"{x}+{y} ({how}): host issue {h * 1e6:.0f} us, device {d * 1e6:.0f} us, {2 * a.bytes / d / 1e9:.1f} GB/s")
    if x == "staging" and how == "stepped":
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(10):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
        print("\n".join(s.getvalue().splitlines()[4:30]))

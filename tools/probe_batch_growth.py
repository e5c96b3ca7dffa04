"""How the one-pass device calls' copy batches should grow (GPU machine, one real worker, one client): a kept
``mget_h2d``, one right after this client rewrote its keys (cold: the placement table's one pass) and a reserved
``mset_d2h``, 64 x 1 MiB each, under batch growths switched call by call (``batching.next_cut``), so every
growth sees the same host speed (the GPU host's vCPUs drift between ~0.55 and full speed within seconds). Each call
follows a one-key request, as bench store's do. Per case and growth: the median call against one 64 MiB ``copy_``
(the ceiling) with quartiles, the host's time to its first batch, and the copy stream's span from that batch to its
last byte (CUDA events) as a fraction of the ceiling; the host's loop speed before and after.

``--first``: the first batch's size switched instead (``kept_reads.FIRST_RUNS`` and ``device.FIRST_BATCH_RUNS``: 2,
3 (the kept read's default) or 4 runs), batches doubling from it, for the three cases; untraced (the calls' times
only: the trace's events would delay the first batch, the very thing switched).

``--native``: the one-pass calls' copy planning switched instead, native (``kvstrata.ops.tensor_runs``, the default
where it is built) or the Python loop; untraced.

    PYTHONPATH=src python3 tools/probe_batch_growth.py [--rounds 100] [--first | --native]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from _copy_trace import CopyTrace, ceilings, kept_client

from kvstrata.bench._common import python_loop_us
from kvstrata.client import batching, device, kept_reads
from kvstrata.ops import tensor_runs

N = 64

GROWTHS = {
    "doubling (main)": batching.next_cut,
    "by half": lambda cut: min(cut + (cut + 1) // 2, device.BATCH_RUNS),
    "by a third": lambda cut: min(cut + (cut + 2) // 3, device.BATCH_RUNS),
}
CASES = ("mget_h2d kept", "mget_h2d cold", "mset_d2h")


def _first_batch(runs: int):
    """A variant whose calls start with a batch of ``runs`` runs, then double."""

    def doubling(cut: int) -> int:
        return min(2 * cut, device.BATCH_RUNS)

    doubling.first = runs
    return doubling


def _planning(planner: object):
    """A variant whose one-pass calls plan their copies with ``planner`` (None: the Python loop), batches doubling
    from the defaults."""

    def doubling(cut: int) -> int:
        return min(2 * cut, device.BATCH_RUNS)

    doubling.planner = planner
    return doubling


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 100
    global GROWTHS, CASES
    if "--first" in sys.argv:
        GROWTHS = {f"first {k} (main: 2)" if k == 2 else f"first {k}": _first_batch(k) for k in (2, 3, 4)}
        CASES = ("mget_h2d kept", "mget_h2d cold", "mset_d2h")
    if "--native" in sys.argv:
        if tensor_runs.native(wait=True) is None:
            raise SystemExit("the native planner did not build")
        GROWTHS = {"python loop": _planning(None), "native (main)": _planning(tensor_runs)}
    ceiling = ceilings()
    # the trace's CUDA events cost the host 5-35 us each: not before the first batch
    untraced = "--first" in sys.argv or "--native" in sys.argv
    trace = None if untraced else CopyTrace()
    with kept_client("bg") as (kv, keys, src, dst):
        loops = [python_loop_us()]
        got: dict[tuple[str, str], list[tuple[float, float, float]]] = {
            (case, name): [] for case in CASES for name in GROWTHS
        }
        for it in range(rounds + 3):
            order = list(GROWTHS.items())
            if it % 2:
                order.reverse()  # neither end of the round always first
            for case in CASES:
                for name, growth in order:
                    batching.next_cut = growth
                    if hasattr(growth, "first"):
                        kept_reads.FIRST_RUNS = device.FIRST_BATCH_RUNS = growth.first
                    if hasattr(growth, "planner"):
                        batching.planner = lambda planner=growth.planner: planner
                    fresh = [f"bgw/{it}/{name}/{i}" for i in range(N)]
                    if case == "mget_h2d cold":
                        kv.delete(keys)
                        assert kv.mset_d2h(keys, src) == [None] * N
                    kv.exists(keys[:1])
                    torch.cuda.synchronize()
                    if trace is not None:
                        trace.clear()
                    t0 = time.perf_counter()
                    res = kv.mset_d2h(fresh, src) if case == "mset_d2h" else kv.mget_h2d(keys, dst)
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    assert res == [None] * N, res
                    if case == "mset_d2h":
                        kv.delete(fresh)
                    if it >= 3:
                        if trace is None:
                            got[(case, name)].append((t1 - t0, float("nan"), float("nan")))
                        else:
                            got[(case, name)].append((t1 - t0, trace.batches[0] - t0, trace.span()))
        loops.append(python_loop_us())
        assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
        speeds = f"python_loop_us before / after {loops[0]:.1f} / {loops[1]:.1f}"
        print(f"one 64 MiB copy {ceiling['h2d'] * 1e6:.0f} / {ceiling['d2h'] * 1e6:.0f} us; {speeds}")
        for (case, name), rows in got.items():
            top = ceiling["d2h" if case == "mset_d2h" else "h2d"]
            call, first, span = (statistics.median(c) for c in zip(*rows))
            q1, _, q3 = statistics.quantiles([r[0] for r in rows], n=4)
            print(
                f"{case:14s} {name:15s} call {call * 1e6:5.0f} us ({top / call:.3f} of the ceiling;"
                f" quartiles {top / q3:.3f}-{top / q1:.3f}), first batch {first * 1e6:4.0f} us,"
                f" stream span {top / span:.3f}"
            )


if __name__ == "__main__":
    main()

"""Where a many-key cold ``mget_h2d`` (keys just rewritten: the placement table's one pass) and a ``mset_d2h`` of fresh
keys spend their time, phase by phase (one real worker, one client; a one-key request before each call, as bench
store's rows have). The client's steps are wrapped to note when they began and ended: for the read, the lease
request's send, its answer (``acquire_finish``: the wait for the worker and the reply's parsing, leases and the
local-read cache's judgement), the check of the early copies against it (``acquire_columns`` on), the local-read
cache's entries (``settle``); for the write, the commit's send and its answer (the worker's work on it) and the
landing word. Printed per shape and case: the median of each step's start and end (us after the call began) and of
the call, against one pinned copy of the same bytes (the ceiling, on a GPU). With ``--cpu`` (no GPU needed) the tensors
are CPU ones and there is no ceiling. ``--send-after 1,2``: the read's lease request goes once that many batches are
queued (``placed_reads.SEND_AFTER_BATCHES``), switched call by call, a row each.

    PYTHONPATH=src python3 tools/probe_cold_phases.py [--rounds 60] [--shapes 256x64,256x256,64x1024] [--cpu]
        [--send-after 2]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kvstrata
from kvstrata.bench._common import device_time, python_loop_us
from kvstrata.bench.store import _start_worker
from kvstrata.client import placed_reads

READ_STEPS = ("acquire_send", "acquire_finish", "acquire_columns", "settle")
WRITE_STEPS = ("commit_start", "commit_finish", "land")


def _wrap(backend: Any, names: tuple[str, ...], marks: list[tuple[str, float, float]]) -> None:
    """Wrap ``backend``'s methods ``names`` (on the instance) to append ``(name, began, ended)`` to ``marks``."""
    for name in names:
        real = getattr(backend, name)

        def timed(*args: Any, _real: Callable[..., Any] = real, _name: str = name, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                marks.append((_name, t, time.perf_counter()))

        setattr(backend, name, timed)


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 60
    shapes = sys.argv[sys.argv.index("--shapes") + 1] if "--shapes" in sys.argv else "256x64,256x256,64x1024"
    cpu = "--cpu" in sys.argv or not torch.cuda.is_available()
    send_after = (
        [int(x) for x in sys.argv[sys.argv.index("--send-after") + 1].split(",")] if "--send-after" in sys.argv else [2]
    )
    loops = [python_loop_us()]
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 4 << 30)
        try:
            with kvstrata.connect(address) as kv:
                backend = kv._b()
                marks: list[tuple[str, float, float]] = []
                _wrap(backend, READ_STEPS + WRITE_STEPS, marks)
                for shape in shapes.split(","):
                    n, kib = (int(x) for x in shape.split("x"))
                    size = kib << 10
                    where = "cpu" if cpu else "cuda"
                    ceiling = None
                    if not cpu:
                        host = torch.empty(n * size, dtype=torch.uint8).pin_memory()
                        big = torch.empty(n * size, dtype=torch.uint8, device="cuda")
                        ceiling = device_time(lambda: big.copy_(host, non_blocking=True), iters=30)
                    src = [[torch.randn(size // 4, device=where)] for _ in range(n)]
                    dst = [[torch.empty_like(t[0])] for t in src]
                    keys = [f"cp/{kib}/{i}" for i in range(n)]
                    assert kv.mset_d2h(keys, src) == [None] * n
                    kv.mget_h2d(keys, dst)
                    reads = [f"cold read, request after {k}" for k in send_after]
                    rows: dict[str, list[dict[str, float]]] = {**{r: [] for r in reads}, "write": []}
                    for it in range(rounds + 3):
                        for case, out in rows.items():
                            fresh = [f"cpw/{kib}/{it}/{i}" for i in range(n)]
                            if case != "write":
                                placed_reads.SEND_AFTER_BATCHES = send_after[reads.index(case)]
                                kv.delete(keys)
                                assert kv.mset_d2h(keys, src) == [None] * n
                            kv.exists(keys[:1])
                            if not cpu:
                                torch.cuda.synchronize()
                            marks.clear()
                            t0 = time.perf_counter()
                            res = kv.mset_d2h(fresh, src) if case == "write" else kv.mget_h2d(keys, dst)
                            t1 = time.perf_counter()
                            assert res == [None] * n, res
                            if case == "write":
                                kv.delete(fresh)
                            if it >= 3:
                                row = {"call": t1 - t0}
                                for name, began, ended in marks:  # the first of each step
                                    row.setdefault(name + " began", began - t0)
                                    row.setdefault(name + " ended", ended - t0)
                                out.append(row)
                    kv.delete(keys)
                    top = "" if ceiling is None else f", one {n * size >> 20} MiB pinned copy {ceiling * 1e6:.0f} us"
                    print(f"{n} x {kib} KiB ({where} tensors{top}); medians of {rounds} calls, us after the call began")
                    for case, got in rows.items():
                        call = statistics.median(r["call"] for r in got)
                        ratio = "" if ceiling is None else f" ({ceiling / call:.3f} of the ceiling)"
                        print(f"  {case} call {call * 1e6:7.0f}{ratio}")
                        for name in WRITE_STEPS if case == "write" else READ_STEPS:
                            have = [r for r in got if name + " began" in r]
                            if not have:
                                continue
                            began = statistics.median(r[name + " began"] for r in have)
                            ended = statistics.median(r[name + " ended"] for r in have)
                            print(f"    {name:16s} {began * 1e6:7.0f} -> {ended * 1e6:7.0f}  ({len(have)} calls)")
        finally:
            proc.terminate()
            proc.wait()
    loops.append(python_loop_us())
    print(f"python_loop_us before / after {loops[0]:.1f} / {loops[1]:.1f}")


if __name__ == "__main__":
    main()

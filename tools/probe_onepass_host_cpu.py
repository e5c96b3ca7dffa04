"""Host-side timeline of the one-pass device calls through a real worker, with no GPU: CUDA is faked (each tensor
passes as a device tensor, the copy stream and events are stand-ins, the copy engine's batch call only records when
it was made), so what is timed is kvstrata's host work alone. Per case, medians over rounds of: the call's start to
its first copy batch, to its last batch, and from the copies' end event (a no-op here) to the call's return.
Cases: ``mget_h2d`` of kept leases, right after this client rewrote the keys (placed), and ``mset_d2h`` of fresh
keys, each with a request (a one-key ``exists``) just before the call as in bench store.

``--native``: the copies planned by the native passes (``kvstrata.ops.tensor_runs``, CPU tensors standing in for
CUDA ones), not the Python loop; ``--copies``: those passes queue their own batches (a ctypes stand-in for the
driver's batch call notes when; the callback costs a few us of its own).

    PYTHONPATH=src python3 tools/probe_onepass_host_cpu.py [--rounds 200] [--keys 64] [--kib 1024] [--native | --copies]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import kvstrata
from kvstrata.bench.store import _start_worker
from kvstrata.client import device
from kvstrata.ops import copy_engine


class _FakeStream:
    cuda_stream = 1
    device_index = 0

    def synchronize(self) -> None:
        pass


class _FakeEvent:
    def __init__(self, log: list[float]) -> None:
        self._log = log

    def synchronize(self) -> None:
        self._log.append(time.perf_counter())  # the copies' end: the call's tail starts here

    def query(self) -> bool:
        return True


class _FakeDevice:
    index = 0
    type = "cuda"


def fake_cuda(batches: list[float], ends: list[float]) -> None:
    """Patch kvstrata's device layer so CPU tensors go the CUDA path (nothing is copied)."""
    real_check = device.check_key
    fake_dev = _FakeDevice()

    def check_key(ts: Any, i: int) -> tuple[list[tuple], int, Any]:
        pieces, total, _ = real_check(ts, i)
        return [(p[0], p[1], True, p[3], p[0]) for p in pieces], total, fake_dev

    def memcpy_raw(dsts, srcs, sizes, handle) -> None:
        batches.append(time.perf_counter())

    device.check_key = check_key
    if "--native" in sys.argv or "--copies" in sys.argv:
        from kvstrata.client import batching
        from kvstrata.ops import tensor_runs

        if tensor_runs.native(wait=True) is None:
            raise SystemExit("the native planner did not build")
        batching.NATIVE_CUDA = False  # CPU tensors stand in for CUDA ones, as check_key's above
        batching.planner = lambda: tensor_runs
        batching.NATIVE_COPIES = "--copies" in sys.argv
    if "--copies" in sys.argv:  # the native passes queue their own batches: a stand-in driver notes when
        import ctypes

        def driver(*args: Any) -> int:
            batches.append(time.perf_counter())
            return 0

        u64, size = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
        kind = ctypes.CFUNCTYPE(ctypes.c_int, u64, u64, size, ctypes.c_size_t, ctypes.c_void_p, size, ctypes.c_size_t,
                                ctypes.c_void_p)  # fmt: skip
        fn = fake_cuda.driver = kind(driver)
        address = ctypes.cast(fn, ctypes.c_void_p).value
        device.native_copies = lambda lists, i, stream=None: (fake_dev, _FakeStream(), (address, 13000, 1))
    device.start = lambda dev, stream=None: None if dev is None else _FakeStream()
    device.mark = lambda stream: None if stream is None else _FakeEvent(ends)
    copy_engine.memcpy_raw = memcpy_raw
    torch.cuda.current_device = lambda: 0


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 200
    n = int(sys.argv[sys.argv.index("--keys") + 1]) if "--keys" in sys.argv else 64
    size = (int(sys.argv[sys.argv.index("--kib") + 1]) if "--kib" in sys.argv else 1024) << 10
    batches: list[float] = []
    ends: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 1 << 30)
        try:
            with kvstrata.connect(address) as kv:
                fake_cuda(batches, ends)
                src = [[torch.zeros(size // 4)] for _ in range(n)]
                dst = [[torch.empty(size // 4)] for _ in range(n)]
                keys = [f"op/{i}" for i in range(n)]
                assert kv.mset_d2h(keys, src) == [None] * n
                kv.mget_h2d(keys, dst)
                rows: dict[str, list[tuple[float, float, float, float]]] = {"kept": [], "placed": [], "mset": []}
                for it in range(rounds + 5):
                    for case, out in rows.items():
                        fresh = [f"ow/{it}/{i}" for i in range(n)]
                        if case == "placed":
                            kv.delete(keys)
                            assert kv.mset_d2h(keys, src) == [None] * n
                        kv.exists(keys[:1])  # a request just before, as bench store's rows have
                        batches.clear()
                        ends.clear()
                        t0 = time.perf_counter()
                        got = kv.mset_d2h(fresh, src) if case == "mset" else kv.mget_h2d(keys, dst)
                        t1 = time.perf_counter()
                        assert got == [None] * n, got
                        if case == "mset":
                            kv.delete(fresh)
                        if it >= 5 and batches:
                            end = ends[-1] if ends else t1
                            out.append((batches[0] - t0, batches[-1] - t0, t1 - end, t1 - t0))
                print(f"{n} keys, medians of {rounds} calls (us): first batch, last batch, tail, call")
                for case, out in rows.items():
                    cols = [statistics.median(c) * 1e6 for c in zip(*out)] if out else []
                    print(f"  {case:7s} " + "  ".join(f"{c:7.1f}" for c in cols))
        finally:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
